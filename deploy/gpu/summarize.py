"""The summary table of deploy/gpu/run-seed-bench.sh: python3 summarize.py OUT_DIR.

Reads the steps' JSON files and prints one markdown table with the seed benchmark's figures
next to their targets (missing or failed steps show as "-"), one of the MLX-setting variants,
then the step times."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(out: Path, name: str) -> dict:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def get(d: dict, *path, fmt="{}"):
    for key in path:
        if not isinstance(d, dict) or str(key) not in d:
            return "-"
        d = d[str(key)]
    return fmt.format(d) if not isinstance(d, dict) else json.dumps(d)


def main(out: Path) -> None:
    seed, cuda = load(out, "seed"), load(out, "cuda")
    rows = [
        ("seed: plain / mlx-lm", get(seed, "plain_vs_mlx_lm"), ">= 1.0 (was 0.49-0.63)"),
        (
            "seed: plain, mlx-lm, one-sync-a-token tok/s",
            f"{get(seed, 'plain_tok_s')}, {get(seed, 'mlx_lm_tok_s')}, "
            f"{get(seed, 'plain_unqueued_tok_s')}",
            "",
        ),
        (
            "seed: plain == mlx-lm tokens (same prefill / default)",
            f"{get(seed, 'plain_equals_mlx_lm_tokens_same_prefill')} / "
            f"{get(seed, 'plain_equals_mlx_lm_tokens')}",
            "all",
        ),
        ("seed: verify(8) / decode(1)", get(seed, "verify_ratio", 8), "<= 1.3 (was 2.28)"),
        (
            "seed: verify(4), verify(16) / decode(1)",
            f"{get(seed, 'verify_ratio', 4)}, {get(seed, 'verify_ratio', 16)}",
            "",
        ),
        (
            "seed: decode(1), verify(8) ms",
            f"{get(seed, 'decode_ms')}, {get(seed, 'verify_ms', 8)}",
            "(was 43.8, 100)",
        ),
        (
            "seed: verify(8) / decode(1) without the GDN kernel",
            get(seed, "without_gdn_kernel", "verify_ratio", 8),
            "(before/after)",
        ),
        ("seed: round ms (draft, verify, rollback, other)", get(seed, "round_ms"), "(was 135)"),
        (
            "seed: round ms, median rounds",
            get(seed, "round_ms_median"),
            "a mean above: slow rounds",
        ),
        ("seed: round shares", get(seed, "round_share"), "draft <= 0.15, rollback <= 0.05"),
        ("seed: draft pieces ms (synced)", get(seed, "draft_pieces_ms"), "where the draft goes"),
        ("seed: draft kernels", get(seed, "policy", "draft_kernels"), "checked at load"),
        (
            "seed: round ms, shares without the draft kernels",
            f"{get(seed, 'without_draft_kernels', 'round_ms')}; "
            f"{get(seed, 'without_draft_kernels', 'round_share')}",
            "(before/after)",
        ),
        (
            "seed: round ms, shares with the rollback copying rows",
            f"{get(seed, 'with_rollback_copies', 'round_ms')}; "
            f"{get(seed, 'with_rollback_copies', 'round_share')}",
            "(before/after the views)",
        ),
        ("seed: break-even tau", get(seed, "break_even_tau"), "<= 1.6 (was 2.8)"),
        (
            "seed: projected speed-up at tau 5",
            get(seed, "projected_speedup", 5),
            ">= 3.5 (was 1.8)",
        ),
        ("seed: projected at tau 4/5/6/8", get(seed, "projected_speedup"), ""),
        ("seed: measured at forced tau 4/5/6/8", get(seed, "measured_speedup"), ""),
        (
            "seed: unsynced round ms, break-even tau (drafting ahead)",
            f"{get(seed, 'unsynced_round_ms')}, {get(seed, 'unsynced_break_even_tau')}",
            "<= 1.6",
        ),
        (
            "seed: unsynced round ms without drafting, drafting's share of the round",
            f"{get(seed, 'unsynced_round_ms_without_drafting')}, "
            f"{get(seed, 'unsynced_draft_share')}",
            "<= 0.15",
        ),
        (
            "seed: the same without drafting ahead; measured at forced tau",
            f"{get(seed, 'without_draft_ahead', 'unsynced_round_ms')}, "
            f"{get(seed, 'without_draft_ahead', 'unsynced_break_even_tau')}; "
            f"{get(seed, 'without_draft_ahead', 'measured_speedup')}",
            "(before/after)",
        ),
        ("seed: speculative == plain tokens", get(seed, "speculative_equals_plain_tokens"), ""),
        (
            "seed: q8 plain, speculative(tau 5) tok/s",
            f"{get(seed, 'kv_q8', 'plain_tok_s')}, {get(seed, 'kv_q8', 'speculative_tau5_tok_s')}",
            "runs on CUDA",
        ),
        ("seed: build s, load s", f"{get(seed, 'build_s')}, {get(seed, 'load_s')}", ""),
        ("GDN kernel in use (seed target)", get(seed, "policy", "gdn_block_kernel"), "true"),
        ("bench cuda ok", get(cuda, "ok"), "true"),
    ]
    for kv in ("fp16", "q8"):
        for block in (8, 16):
            d = load(out, f"default-b{block}-{kv}")
            rows.append(
                (
                    f"default pair b{block} {kv}: spec/plain (tau; plain, spec tok/s)",
                    f"{get(d, 'ratio')} ({get(d, 'tau')}; {get(d, 'plain_tok_s')}, "
                    f"{get(d, 'speculative_tok_s')})",
                    "(was 1.57x at b8, 2.0x at b16)" if kv == "fp16" else "runs on CUDA",
                )
            )
    print("| figure | this run | target |")
    print("|---|---|---|")
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")
    variants = [(n, load(out, n)) for n in ("mlx-default", "mlx-big-buffers", "mlx-no-cuda-graphs")]
    if any(d for _, d in variants):
        print(
            "\n| MLX setting (16-layer target) | plain / mlx-lm | plain tok/s | decode ms "
            "| verify(8) / decode |"
        )
        print("|---|---|---|---|---|")
        for name, d in variants:
            print(
                f"| {name} | {get(d, 'plain_vs_mlx_lm')} | {get(d, 'plain_tok_s')} "
                f"| {get(d, 'decode_ms')} | {get(d, 'verify_ratio', 8)} |"
            )
    trace = load(out, "kernels")
    pieces = [(k, v) for k, v in trace.items() if isinstance(v, dict) and "wall_ms" in v]
    if pieces:
        print(f"\n| piece ({get(trace, 'shape')}) | wall ms | GPU busy ms | kernels |")
        print("|---|---|---|---|")
        for name, d in pieces:
            print(
                f"| {name} | {get(d, 'wall_ms')} | {get(d, 'gpu_busy_ms')} "
                f"| {get(d, 'kernels_per_call')} |"
            )
    steps = out / "steps.txt"
    if steps.is_file():
        print("\nsteps: " + "; ".join(steps.read_text().split("\n")).strip("; "))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
