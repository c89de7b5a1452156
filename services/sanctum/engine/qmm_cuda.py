"""A CUDA kernel for 4-bit matmuls over a few rows (a verify block, a draft head), through
`mx.fast.cuda_kernel`.

Why: on the H200, MLX CUDA's quantized matmul at 8 rows costs ~2.6x its one-row kernel when the
layers run one after the other (measured in place at the seed's shapes: the 64 MLPs of a verify
take 22.4 ms at 8 rows against 8.5 ms at one), so an 8-row verify paid for its rows in every
projection although a few rows should cost what one does (the weights are read once).

The kernel reads each weight once for all rows: a warp per four output features, each lane
eight packed values of each at a time, the rows' inputs staged in shared memory a tile at a time; per group
of 64 it adds scale * sum(x * q) and bias * sum(x) (MLX's affine 4-bit layout: w = scale * q +
bias). bfloat16 activations, scales and biases (read as their bits), float32 sums, the output
rounded to bfloat16 as `astype` rounds. One-row calls (decode) keep MLX's own kernel, so plain
decoding stays bit for bit mlx-lm's.

Contract: `small_qmm(x [M, K], w, scales, biases)` == `mx.quantized_matmul(x, w, scales,
biases, transpose=True, group_size=64, bits=4)` within bfloat16 rounding, for 2 <= M <= 16,
K % 512 == 0, N % 32 == 0. Used only after `check` agreed on this GPU at load (engine/cuda.py).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 16
TILE = 512  # K values staged per pass
WARPS = 8  # warps per thread block
BLOCK_FEATURES = 32  # output features per thread block, at most (8 warps x 4)


def features_per_warp(rows: int) -> int:
    """Four output features a warp up to 8 rows; two above (registers: 4 x 16 sums spill)."""
    return 4 if rows <= 8 else 2


SOURCE = """
    constexpr int TILE = 512;
    constexpr int WARPS = 8;
    constexpr int STEPS = TILE / 256;
    __shared__ float xs[M][TILE];
    __shared__ float sx[M][TILE / 64];
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid = warp * 32 + lane;
    const int n0 = (blockIdx.y * WARPS + warp) * F;
    float acc[F][M];
    #pragma unroll
    for (int f = 0; f < F; ++f) {
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[f][m] = 0.0f;
      }
    }
    for (int k0 = 0; k0 < K; k0 += TILE) {
      __syncthreads();
      for (int i = tid; i < M * TILE; i += WARPS * 32) {
        const int m = i / TILE;
        const int kk = i - m * TILE;
        xs[m][kk] = __uint_as_float(((uint32_t)x[(size_t)m * K + k0 + kk]) << 16);
      }
      __syncthreads();
      for (int i = tid; i < M * (TILE / 64); i += WARPS * 32) {
        const int m = i / (TILE / 64);
        const int g = i - m * (TILE / 64);
        float s = 0.0f;
        for (int j = 0; j < 64; ++j) {
          s += xs[m][g * 64 + j];
        }
        sx[m][g] = s;
      }
      __syncthreads();
      if (lane < TILE / 64) {
        #pragma unroll
        for (int f = 0; f < F; ++f) {
          const uint16_t b16 = biases[(size_t)(n0 + f) * (K / 64) + k0 / 64 + lane];
          const float bias = __uint_as_float(((uint32_t)b16) << 16);
          #pragma unroll
          for (int m = 0; m < M; ++m) {
            acc[f][m] += bias * sx[m][lane];
          }
        }
      }
      uint32_t packed[F][STEPS];
      float scale[F][STEPS];
      #pragma unroll
      for (int f = 0; f < F; ++f) {
        #pragma unroll
        for (int step = 0; step < STEPS; ++step) {
          const int k = k0 + step * 256 + lane * 8;
          packed[f][step] = w[(size_t)(n0 + f) * (K / 8) + k / 8];
          const uint16_t s16 = scales[(size_t)(n0 + f) * (K / 64) + k / 64];
          scale[f][step] = __uint_as_float(((uint32_t)s16) << 16);
        }
      }
      #pragma unroll
      for (int step = 0; step < STEPS; ++step) {
        const int kk = step * 256 + lane * 8;
        float q[F][8];
        #pragma unroll
        for (int f = 0; f < F; ++f) {
          #pragma unroll
          for (int j = 0; j < 8; ++j) {
            q[f][j] = (float)((packed[f][step] >> (4 * j)) & 0xFu);
          }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          float xv[8];
          #pragma unroll
          for (int j = 0; j < 8; ++j) {
            xv[j] = xs[m][kk + j];
          }
          #pragma unroll
          for (int f = 0; f < F; ++f) {
            float d = 0.0f;
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
              d += xv[j] * q[f][j];
            }
            acc[f][m] += scale[f][step] * d;
          }
        }
      }
    }
    #pragma unroll
    for (int f = 0; f < F; ++f) {
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = acc[f][m];
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          v += __shfl_xor_sync(0xffffffff, v, off);
        }
        if (lane == 0) {
          uint32_t u = __float_as_uint(v);
          u += 0x7FFFu + ((u >> 16) & 1u);
          y[(size_t)m * N + n0 + f] = (uint16_t)(u >> 16);
        }
      }
    }
"""
_kernel = None


def supported(module: nn.Module) -> bool:
    """A 4-bit, group-64 affine QuantizedLinear in bfloat16 whose shape the kernel tiles."""
    if not isinstance(module, nn.QuantizedLinear):
        return False
    w, scales = module["weight"], module["scales"]
    N, K = w.shape[0], w.shape[1] * 8
    return (
        module.bits == 4
        and module.group_size == 64
        and getattr(module, "mode", "affine") == "affine"
        and "biases" in module
        and scales.dtype == mx.bfloat16
        and K % TILE == 0
        and N % BLOCK_FEATURES == 0
        and N // BLOCK_FEATURES < 65536
    )


def reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """What `small_qmm` computes, by MLX's own quantized matmul (the check's reference, the
    speed gate's rival, the stand-in off CUDA)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=4)


def small_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """x [M, K] bfloat16 (2 <= M <= MAX_ROWS) @ the 4-bit weight's transpose -> [M, N] bf16."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="sanctum_small_qmm",
            input_names=["x", "w", "scales", "biases"],
            output_names=["y"],
            source=SOURCE,
        )
    M, K = x.shape
    N = w.shape[0]
    (y,) = _kernel(
        inputs=[
            mx.view(x, mx.uint16),
            w,
            mx.view(scales, mx.uint16),
            mx.view(biases, mx.uint16),
        ],
        template=[("M", M), ("K", K), ("N", N), ("F", features_per_warp(M))],
        grid=(32, N // features_per_warp(M), 1),
        threadgroup=(32, WARPS, 1),
        output_shapes=[(M, N)],
        output_dtypes=[mx.uint16],
    )
    return mx.view(y, mx.bfloat16)


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """mlx's QuantizedLinear with calls of 2..MAX_ROWS bfloat16 rows sent to `small_qmm`
    (`install` swaps a checked module's class to this one); one row and many rows as before."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not (1 < rows <= MAX_ROWS and x.dtype == mx.bfloat16):
            return super().__call__(x)
        y = small_qmm(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self["biases"])
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if "bias" in self:
            y = y + self["bias"]
        return y


def install(model: nn.Module) -> int:
    """Route the few-row calls of every supported 4-bit linear layer of `model` through the
    kernel; returns how many layers."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and supported(module):
            module.__class__ = FewRowsQuantizedLinear
            count += 1
    return count


@contextmanager
def disabled(model: nn.Module):
    """MLX's own kernel for every call inside the block (a benchmark's before/after)."""
    swapped = [(m, type(m)) for _, m in model.named_modules() if type(m) is FewRowsQuantizedLinear]
    for m, _ in swapped:
        m.__class__ = nn.QuantizedLinear
    try:
        yield len(swapped)
    finally:
        for m, kind in swapped:
            m.__class__ = kind


def check(fn=None, shapes=((256, 512), (1024, 1536)), rows=(2, 7, 8, 16)) -> str | None:
    """Compare `fn` (default `small_qmm`) with mx.quantized_matmul on random 4-bit weights:
    None when they agree within bfloat16 rounding, else why not."""
    fn = fn or small_qmm
    key = mx.random.key(3)
    for N, K in shapes:
        k1, k2, key = mx.random.split(key, 3)
        w = (mx.random.normal((N, K), key=k1) * K**-0.5).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        for M in rows:
            x = mx.random.normal((M, K), key=k2).astype(mx.bfloat16)
            want = reference(x, wq, scales, biases)
            try:
                results = {"eager": fn(x, wq, scales, biases)}
                results["compiled"] = mx.compile(fn)(x, wq, scales, biases)
                mx.eval(want, results)
            except Exception as exc:  # a kernel that does not build or run on this GPU
                return f"M={M} N={N} K={K}: {exc.__class__.__name__}: {str(exc)[:300]}"
            scale = mx.abs(want.astype(mx.float32)).max().item() + 1e-6
            for name, got in results.items():
                if got.shape != want.shape or got.dtype != want.dtype:
                    return f"M={M} {name}: {got.shape} {got.dtype}"
                err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
                if not err <= 2e-2 * scale:  # also false for NaN
                    return f"M={M} N={N} K={K} {name}: max error {err:.3g} (scale {scale:.3g})"
    return None


def median_ms(run, reps: int) -> float:
    """Median wall ms of `run()` (which evaluates what it builds) over `reps` calls, after one
    (this module's speed gate, and `bench seed`'s synced timings)."""
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


def verdict() -> str | None:
    """`check`, then the speed gate: the kernel is used only where it beats MLX's own matmul
    at 8 rows on this GPU (a kernel that agrees but is slower would only cost time)."""
    if (result := check()) is not None:
        return result
    ours, theirs = chain_ms(small_qmm), chain_ms(reference)
    if not ours < 0.9 * theirs:
        return f"slower than MLX's at 8 rows: {ours:.2f} ms against {theirs:.2f} ms"
    return None


if __name__ == "__main__":  # engine/cuda.py runs the checks here, in a child process
    print(json.dumps({"verdict": verdict()}))
    sys.exit(0)
