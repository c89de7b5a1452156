"""`sanctum bench seed` and `sanctum bench cuda` end to end on the CPU (the GPU run:
deploy/gpu/run-seed-bench.sh), in a process that cannot import Ray or gRPC, as on the
GPU machine; and the seed checkpoints' shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

# run the CLI where `import ray` / `import grpc` fail, as on the GPU machine
NO_RAY = "import sys; sys.modules.update(ray=None, grpc=None); from sanctum.cli import main; "


def sanctum(*argv: str, timeout: int = 300, env: dict | None = None) -> dict:
    code = NO_RAY + f"sys.exit(main({list(argv)!r}))"
    env = {**os.environ, **env} if env else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, check=False, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_seed_config_is_qwen35_27b_and_the_seed_drafter():
    from sanctum.bench.seedbuild import SeedShape, drafter_config, target_config

    text = target_config(SeedShape())["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["intermediate_size"]) == (
        64, 5120, 17408)  # fmt: skip
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (16, 48)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (
        24, 4, 256)  # fmt: skip
    assert text["vocab_size"] == 248320 and not text["tie_word_embeddings"]
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    d = drafter_config(SeedShape())
    assert d["dflash_config"]["target_layer_ids"] == [5, 19, 33, 47, 61]
    assert d["dflash_config"]["block_size"] == 8 and "block_size" not in d
    assert d["is_causal"] is False and d["sliding_window"] == 2048
    assert d["layer_types"] == ["sliding_attention"] * 5 and d["hidden_size"] == 5120
    assert replace(SeedShape(), layers=4).tap_ids == [0, 1, 2, 2, 3]


@pytest.mark.slow
def test_bench_seed_layers_4_json_runs_on_the_cpu(tmp_path):
    # drafting ahead forced on (a GPU's default), so that its before/after is reported too
    r = sanctum("bench", "seed", "--layers", "4", "--json", "--dir", str(tmp_path),
                "--max-tokens", "16", "--repeats", "1", "--reps", "1", "--prompt-tokens", "32",
                env={"SANCTUM_DRAFT_AHEAD": "on"})  # fmt: skip
    for key in ("plain_tok_s", "mlx_lm_tok_s", "verify_ratio", "round_ms", "break_even_tau",
                "projected_speedup"):  # fmt: skip
        assert key in r, key
    assert r["shape"].startswith("L4-") and r["plain_tok_s"] > 0 and r["mlx_lm_tok_s"] > 0
    assert set(r["verify_ratio"]) == {"4", "8", "16"} and all(
        v > 0 for v in r["verify_ratio"].values()
    )
    assert set(r["projected_speedup"]) == {"4", "5", "6", "8"}
    split = r["round_ms"]
    assert set(split) == {"draft", "verify", "rollback", "other", "total"}
    assert split["total"] == pytest.approx(sum(v for k, v in split.items() if k != "total"), 0.01)
    assert set(r["round_ms_median"]) == set(split) and r["round_ms_median"]["verify"] > 0
    assert r["break_even_tau"] > 0
    pieces = r["draft_pieces_ms"]  # the draft phase's synced pieces: within the phase
    assert set(pieces) == {"inputs", "body_build", "body", "head", "select"}
    assert 0 < sum(pieces.values()) <= split["draft"] * 1.5
    tau5 = r["projected_speedup"]["5"]
    assert tau5 == pytest.approx(5 / r["break_even_tau"], rel=0.01)
    assert r["unsynced_round_ms_without_drafting"] > 0 and 0 <= r["unsynced_draft_share"] < 1
    for unsynced in (r, r["without_draft_ahead"]):  # rounds as the engine runs them
        assert set(unsynced["measured_speedup"]) == {"4", "5", "6", "8"}
        assert unsynced["unsynced_round_ms"] > 0 and unsynced["unsynced_break_even_tau"] > 0
    # exactness at seed shapes (CPU: float32): plain == mlx-lm, speculative == plain
    assert r["plain_equals_mlx_lm_tokens_same_prefill"] == "16/16"
    assert r["speculative_equals_plain_tokens"] == "16/16"
    assert r["kv_q8"]["plain_tok_s"] > 0 and "phases" in r
    # the fused-decode experiment compares one step's logits both ways (0.0: equal to the bit)
    assert r["fused_decode_logits_max_abs_diff"] >= 0.0
    again = sanctum("bench", "seed", "--layers", "4", "--json", "--dir", str(tmp_path),
                    "--max-tokens", "8", "--repeats", "1", "--reps", "1", "--no-phases",
                    "--kv", "fp16")  # fmt: skip
    assert again["build_s"] < r["build_s"] + 1  # reused, not rebuilt


@pytest.mark.slow
def test_bench_cuda_standin_runs_every_check():
    r = sanctum("bench", "cuda", "--standin", "--json")
    assert r["ok"], r
    assert all(v == "ok" for v in r["gdn_kernel_checks"].values())
    assert r["end_to_end"]["speculative_equals_plain_q8"]


@pytest.mark.slow
def test_gpu_script_runs_end_to_end_on_the_cpu(tmp_path):
    """deploy/gpu/run-seed-bench.sh with small settings: every step passes, the summary has
    its rows."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               SEED_DIR=str(tmp_path / "seed"), SPEC_ARGS="--max-tokens 12 --repeats 1",
               SEED_ARGS="--layers 2 --max-tokens 8 --repeats 1 --reps 1 --prompt-tokens 16",
               VARIANT_ARGS="--layers 2 --max-tokens 8 --repeats 1 --reps 1 --prompt-tokens 16",
               TRACE_ARGS="--small --layers 2 --calls 1", DEADLINE="1200")  # fmt: skip
    run = subprocess.run(["bash", "deploy/gpu/run-seed-bench.sh"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    for row in ("plain / mlx-lm", "verify(8) / decode(1)", "break-even tau",
                "projected speed-up at tau 5", "default pair b16 q8"):  # fmt: skip
        assert row in summary
    assert json.loads((tmp_path / "out" / "seed.json").read_text())["shape"].startswith("L2-")
    trace = json.loads((tmp_path / "out" / "kernels.json").read_text())
    assert not trace["kernels_counted"]  # no CUPTI on a CPU: wall times only
    assert all(trace[p]["wall_ms"] > 0 for p in ("decode", "verify8_and_rollback", "draft_body"))
    assert "| draft_body |" in summary


def test_first_divergence_tells_a_near_tie_from_a_clear_margin(make_pair, monkeypatch):
    """bench cuda's end-to-end check lets speculative part from plain only at a near-tie: the
    margin it reports is the two tokens' logit gap in a fresh forward over the plain run's
    tokens, and a token far below the argmax is no tie."""
    import mlx.core as mx
    from sanctum.bench import decode as bench_decode
    from sanctum.engine.model.target import load_target

    target_dir, _ = make_pair("hybrid", "dflash")
    target = load_target(target_dir)
    ids = target.tokenizer.encode("def add(a, b):")
    logits, _ = target.forward(mx.array(ids), target.make_cache())
    order = mx.argsort(-logits[-1]).tolist()
    best, second, worst = order[0], order[1], order[-1]
    row = logits[-1]
    far = bench_decode.first_divergence(target, ids, [best, 5], [worst, 5], "fp16")
    assert far["at"] == 0 and not far["near_tie"]
    assert far["margin"] == pytest.approx((row[best] - row[worst]).item(), rel=1e-4, abs=2e-6)
    monkeypatch.setattr(bench_decode, "NEAR_TIE", 2.0)  # a gap of at most twice the largest |logit|
    close = bench_decode.first_divergence(target, ids, [best], [second], "fp16")
    assert close["near_tie"] and close["margin"] == pytest.approx(
        (row[best] - row[second]).item(), rel=1e-4, abs=2e-6
    )


def test_logit_step_is_one_unit_in_the_last_place():
    """The near-tie rule's floor: bf16 logits near 6 are 1/32 apart, fp16 1/256, fp32 2^-21."""
    import mlx.core as mx
    from sanctum.bench.decode import logit_step

    assert logit_step(6.0, mx.bfloat16) == 1 / 32
    assert logit_step(6.0, mx.float16) == 1 / 256
    assert logit_step(6.0, mx.float32) == 2.0**-21
    # 6 and 6 + 1/32 are neighbours in bf16: half a step rounds to one of them
    assert mx.array(6.0 + 1 / 32, mx.bfloat16).item() == 6.0 + 1 / 32
    assert mx.array(6.0 + 1 / 64, mx.bfloat16).item() in (6.0, 6.0 + 1 / 32)
    assert logit_step(0.0, mx.bfloat16) == 0.0


def test_bench_speculative_reports_the_split_and_no_divergence_on_the_cpu(make_pair):
    """bench speculative on a tiny pair: the figures, the round split, greedy speculative ==
    plain (the CPU computes a verify row as a decode step does), so no divergence to report."""
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    r = sanctum("bench", "speculative", "--model", str(target_dir), "--drafter", str(drafter_dir),
                "--max-tokens", "24", "--repeats", "1", "--json")  # fmt: skip
    assert r["plain_tok_s"] > 0 and r["speculative_tok_s"] > 0 and r["tau"] >= 1
    assert set(r["round_ms"]) == {"draft", "verify", "rollback", "other"}
    assert r["greedy_outputs_identical"] is True and r["first_divergence"] is None


def test_qmm_timings_cover_every_shape_and_row_count():
    """bench cuda's few-row matmul table (run on the GPU): per shape, MLX's one-row call and,
    per row count, both kernels' ms per dependent call and the error; here with MLX's own
    matmul as the kernel, at a small shape."""
    from sanctum.bench.cuda import qmm_timings
    from sanctum.engine.kernels import qmm_cuda

    t = qmm_timings(qmm_cuda.reference, {"small": (256, 512)}, rows=(2, 8), chain=False)
    assert set(t) == {"small"} and set(t["small"]) == {"mlx_1_row", 2, 8}
    assert t["small"][8]["rel_err"] == 0.0 and t["small"][8]["kernel"] > 0
