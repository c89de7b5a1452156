"""Kernels launched by each piece of a seed-scale round, and the GPU's busy time against the wall
time: whether a piece is bound by the host (launching kernels) or by the device.

    python3 deploy/gpu/kernel_trace.py [--layers 16] [--dir SEED_DIR] [--out trace.json] [--wall-only]

Pieces, each run alone and synced: one decode step, a verify of 8 rows and its rollback, a
draft (body, head, selection), the draft's body, its head and selection, its head; then four
forced rounds (acceptance forced to 5, as `bench seed` does) and eight plain steps, pipelined as
they serve. The checkpoints are `bench seed`'s (built under --dir when missing; 16 target
layers by default: the drafter and the per-layer figures are the seed's, in a fraction of the
load time).

Counting kernels needs CUPTI, read here through PyTorch's profiler (`torch.profiler`), which
sees every CUDA kernel of the process, MLX's too. Where torch does not import (this project
does not depend on it), or on the CPU, only wall times are given; `--wall-only` gives them
without the profiler's own cost (to compare MLX's settings, e.g. MLX_CUDA_GRAPH_CACHE_SIZE, run
by run). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services"))
from sanctum.bench import seed as seed_bench
from sanctum.bench.seedbuild import SMALL, SeedShape, ensure
from sanctum.engine.decode.decoder import Decoder
from sanctum.engine.decode.generate import make_key
from sanctum.engine.decode.sampling import SamplingParams
from sanctum.engine.kernels import cuda
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import cache_offset, load_target
from sanctum.settings import sanctum_home


def _profiler():
    if mx.default_device() != mx.gpu:
        return None
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    return torch, ProfilerActivity, profile


def measure(fn, calls: int, warm: int, prof) -> dict:
    """fn run `warm` times, then `calls` times timed (and traced where `prof`)."""
    for _ in range(warm):
        fn()
    mx.synchronize()

    def timed():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        mx.synchronize()
        return round(1000 * (time.perf_counter() - t0) / calls, 3)

    if prof is None:
        return {"wall_ms": timed()}
    torch, activity, profile = prof
    with profile(activities=[activity.CUDA]) as trace:
        wall = timed()
    kernels: dict = {}
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count_us = kernels.setdefault(event.name[:100], [0, 0.0])
            count_us[0] += 1
            count_us[1] += event.device_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    by_count = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "wall_ms": wall,
        "gpu_busy_ms": round(sum(us for _, us in kernels.values()) / calls / 1000, 3),
        "kernels_per_call": round(sum(n for n, _ in kernels.values()) / calls, 1),
        "top": [[name, round(n / calls, 1), round(us / calls / 1000, 3)] for name, (n, us) in top],
        # every kernel a call launches, most launched first: what a fusion would remove
        "counts": {name[:80]: round(n / calls, 1) for name, (n, _) in by_count},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dir", help="bench seed's checkpoints (default: its own, under SANCTUM_HOME)")
    ap.add_argument("--small", action="store_true", help="bench seed's small shapes (a CPU)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--wall-only", action="store_true", help="no profiler: wall times only")
    args = ap.parse_args()
    shape = replace(SMALL if args.small else SeedShape(), layers=args.layers)
    root = Path(args.dir).expanduser() if args.dir else sanctum_home() / "seed"
    target_dir, drafter_dir, _ = ensure(root, shape, lambda msg: None)
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target, block_size=8)
    prof = None if args.wall_only else _profiler()
    prompt = np.random.default_rng(0).integers(10, shape.vocab - 10, 128).tolist()
    tap_ids = tuple(shape.tap_ids)
    rng = np.random.default_rng(1)
    out: dict = {"shape": shape.key(), "kernels_counted": prof is not None}

    cache = target.make_cache("fp16")
    target.prefill(prompt, cache)
    states = target.recurrent_state(cache)

    def undo():
        target.truncate(cache, len(prompt), states)

    def decode():
        logits, _ = target.forward(mx.array([7]), cache)
        mx.eval(logits, [c.state for c in cache])
        undo()

    def verify_rollback():
        block = mx.array(rng.integers(10, shape.vocab - 10, size=8).tolist())
        logits, taps, tape = target.verify(block, cache, tap_ids)
        mx.eval(logits, taps, [c.state for c in cache])
        mx.eval(target.rollback(cache, tape, 3))
        undo()

    # a sequence a few forced rounds in: its draft's context is a real one
    forced = seed_bench.ForcedDecoder(target, drafter, 8, 5)
    seq = forced.new_sequence("trace", "fp16", SamplingParams(), 10_000)
    key = make_key(0)
    forced.start(seq, forced.prefill(seq, prompt), key)
    for _ in range(4):
        forced.step(seq, key)
    greedy = SamplingParams()
    hidden = []

    def draft():
        mx.eval(forced._draft(seq, greedy, key)[0])

    def body():
        embeds = forced._block_embeds(seq.anchor, 8)
        hidden[:] = [forced.peer.draft(seq.seq_id, None, embeds, cache_offset(seq.cache))]
        mx.eval(hidden[0])

    def head(select: bool):
        logits = forced.head.logits(cuda.pad_rows(hidden[0]))[: hidden[0].shape[0]]
        mx.eval(forced._propose(seq, hidden[0], logits, greedy, key)[0] if select else logits)

    plain = Decoder(target)
    plain_seq = plain.new_sequence("plain", "fp16", SamplingParams(), 10_000)
    plain.start(plain_seq, plain.prefill(plain_seq, prompt), key)

    pieces = {
        "decode": (decode, args.calls, 3),
        "verify8_and_rollback": (verify_rollback, args.calls, 3),
        "draft": (draft, args.calls, 3),
        "draft_body": (body, args.calls, 3),
        "draft_head_and_selection": (lambda: head(True), args.calls, 3),
        "draft_head": (lambda: head(False), args.calls, 3),
        "forced_rounds_x4": (lambda: [forced.step(seq, key) for _ in range(4)], 3, 1),
        "plain_steps_x8": (lambda: [plain.step(plain_seq, key) for _ in range(8)], 3, 1),
    }
    for name, (fn, calls, warm) in pieces.items():
        out[name] = measure(fn, calls, warm, prof)
        brief = {k: v for k, v in out[name].items() if k != "top"}
        print(f"[trace] {name}: {json.dumps(brief)}", file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
