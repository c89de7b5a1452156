"""The 4-bit kernels' checks against MLX's quantized matmul and their speed gates
(engine/kernels/qmm_cuda.py): `python -m sanctum.engine.kernels.qmm_checks KIND ...` prints the
verdict that engine/kernels/cuda.py reads at load, in a child process; the tests and the
benchmarks call the same checks and timings."""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from . import qmm_cuda
from .agreement import compare


def check(fn=None, shapes=((256, 512), (1024, 1536)), rows=(2, 7, 8, 16, 17, 40, 64)) -> str | None:
    """Compare `fn` (default `rows_qmm`: the kernel, split past MAX_ROWS rows) with
    mx.quantized_matmul on random 4-bit weights: None when they agree within bfloat16
    rounding, else why not."""
    fn = fn or qmm_cuda.rows_qmm
    key = mx.random.key(3)
    for N, K in shapes:
        k1, k2, key = mx.random.split(key, 3)
        w = (mx.random.normal((N, K), key=k1) * K**-0.5).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        for M in rows:
            x = mx.random.normal((M, K), key=k2).astype(mx.bfloat16)
            want = qmm_cuda.reference(x, wq, scales, biases)
            args = (x, wq, scales, biases)
            if (why := compare(f"M={M} N={N} K={K}", fn, args, want, 2e-2)) is not None:
                return why
    return None


def median_ms(run, reps: int) -> float:
    """Median wall ms of `run()` (which evaluates what it builds) over `reps` calls, after one
    (the speed gates here, and the benchmarks' synced timings)."""
    import statistics
    import time

    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def chain_ms(fn, rows: int = 8, pairs: int = 8, reps: int = 5) -> float:
    """ms of `pairs` MLP-shaped products (5120 -> 17408 -> 5120) one after the other, each on
    the last one's output, as a verify's layers run them (not overlapped)."""

    def quantized(n_out, n_in):
        w = (mx.random.normal((n_out, n_in)) * n_in**-0.5).astype(mx.bfloat16)
        return mx.quantize(w, group_size=64, bits=4)

    up, down = quantized(17408, 5120), quantized(5120, 17408)
    x = mx.random.normal((rows, 5120)).astype(mx.bfloat16)
    mx.eval(up, down, x)

    def run():
        h = x
        for _ in range(pairs):
            h = fn(fn(h, *up), *down)
        mx.eval(h)

    return median_ms(run, reps)


def wide_rows_qmm(x: mx.array, w, scales, biases) -> mx.array:
    """`rows_qmm` with the wide kernel on (its check's and speed gate's subject)."""
    return qmm_cuda.rows_qmm(x, w, scales, biases, wide=True)


def wide_verdict() -> str | None:
    """`check` of the wide kernel at 17..WIDE_ROWS rows, then its speed gate: used only where
    WIDE_ROWS rows in one call beat MAX_ROWS rows a call (a chain of MLP-shaped products)."""
    if (result := check(wide_rows_qmm, rows=(17, 24, 33, 40, 57, 64))) is not None:
        return result
    ours = chain_ms(wide_rows_qmm, rows=qmm_cuda.WIDE_ROWS)
    split = chain_ms(lambda x, *wq: qmm_cuda.rows_qmm(x, *wq, wide=False), rows=qmm_cuda.WIDE_ROWS)
    if not ours < 0.95 * split:
        return f"not faster than {qmm_cuda.MAX_ROWS} rows a call at {qmm_cuda.WIDE_ROWS}: {ours:.2f} against {split:.2f} ms"
    return None


TILED_SHAPES = ((256, 512), (1024, 1536), (272, 640))  # N not a multiple of 128, K of 5 tiles


def tiled_blocks_qmm(blocks: int | None, ahead: int | None = None, resident: int | None = None):
    """`tiled_qmm` aiming at `blocks` thread blocks (1: K in one split), the weights `ahead`
    tiles ahead, `resident` blocks an SM (a check's, a benchmark's)."""
    return lambda x, w, scales, biases: qmm_cuda.tiled_qmm(
        x, w, scales, biases, blocks, ahead, resident
    )


def tiled_verdict() -> str | None:
    """`check` of the tiled kernel (the weights TILED_AHEAD tiles ahead) at 2..WIDE_ROWS rows,
    K whole and split, then its speed gate: used only where it beats both the wide kernel and
    MAX_ROWS rows a call at WIDE_ROWS rows."""
    for blocks in (1, 24, None):
        fn = tiled_blocks_qmm(blocks)
        if (result := check(fn, TILED_SHAPES, rows=(2, 17, 24, 33, 40, 57, 64))) is not None:
            return f"blocks={blocks or qmm_cuda.TILED_BLOCKS}: {result}"
    ours = chain_ms(tiled_blocks_qmm(None), rows=qmm_cuda.WIDE_ROWS)
    wide = chain_ms(wide_rows_qmm, rows=qmm_cuda.WIDE_ROWS)
    split = chain_ms(lambda x, *wq: qmm_cuda.rows_qmm(x, *wq, wide=False), rows=qmm_cuda.WIDE_ROWS)
    if not ours < 0.95 * min(wide, split):
        return (
            f"not faster at {qmm_cuda.WIDE_ROWS} rows: {ours:.2f} ms against the wide kernel's {wide:.2f}"
            f" and {qmm_cuda.MAX_ROWS} rows a call's {split:.2f}"
        )
    return None


def tiled_few_verdict() -> str | None:
    """`check` of the tiled kernel at 2..MAX_ROWS rows, then its gate there: used for them
    only where it beats the few-row kernel at 8 rows (a chain of MLP-shaped products)."""
    if (result := check(tiled_blocks_qmm(None), rows=(2, 7, 8, 16))) is not None:
        return result
    ours, few = chain_ms(tiled_blocks_qmm(None)), chain_ms(qmm_cuda.small_qmm)
    if not ours < 0.95 * few:
        return f"not faster at 8 rows: {ours:.2f} ms against the few-row kernel's {few:.2f}"
    return None


def verdict() -> str | None:
    """`check`, then the speed gate: the kernel is used only where it beats MLX's own matmul
    at 8 rows on this GPU (a kernel that agrees but is slower would only cost time)."""
    if (result := check()) is not None:
        return result
    ours, theirs = chain_ms(qmm_cuda.small_qmm), chain_ms(qmm_cuda.reference)
    if not ours < 0.9 * theirs:
        return f"slower than MLX's at 8 rows: {ours:.2f} ms against {theirs:.2f} ms"
    return None


if __name__ == "__main__":  # engine/kernels/cuda.py runs the checks here, in a child process
    kind = sys.argv[1] if len(sys.argv) > 1 else "few"  # few | wide | tiled(-few) A R
    if kind.startswith("tiled"):  # the weights as far ahead, as many blocks an SM as the parent's
        qmm_cuda.TILED_AHEAD = int(sys.argv[2]) if len(sys.argv) > 2 else 1
        qmm_cuda.TILED_RESIDENT = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    verdicts = {
        "few": verdict,
        "wide": wide_verdict,
        "tiled": tiled_verdict,
        "tiled-few": tiled_few_verdict,
    }
    print(json.dumps({"verdict": verdicts[kind]()}))
    sys.exit(0)
