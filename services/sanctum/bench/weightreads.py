"""`sanctum bench weight-reads`: how fast a GPU streams 4-bit weights in the tiled kernel's
access pattern, against the same bytes laid out for it.

The tiled 4-bit kernel (engine/kernels/qmm_cuda.py) reads a weight matrix [N, K/8] (uint32) as
its warps' tiles: each warp owns 16 feature rows and fetches, per 128-wide K tile, 64 bytes
of each of them, rows K/2 bytes apart (2.5 or 8.5 KB at the seed's shapes). At 64 rows that
kernel runs at ~0.3 TB/s of weights where the card streams ~3. Whether the pattern itself
(many short pieces of far-apart rows) caps what DRAM gives is what this measures, with a
kernel that only reads (an XOR of every word, so nothing is optimized away):

- `rows`: the tiled kernel's pattern, a tile's loads issued together, one tile at a time;
- `rows-run4`: the same rows, four tiles (256 contiguous bytes a row) issued together;
- `tile-major`: the same bytes as if repacked so that each warp's tile is 1 KB contiguous
  (what a kernel could read if the weights were laid out for it at load).

Each reads every word of the matrices once (the XOR of each kernel's outputs is the matrices'
XOR, checked), with the tiled kernel's grid (128 features a block, K split as it splits it).
Timed over a chain of the seed's MLP shapes (8 pairs of 17408 x 5120 and 5120 x 17408:
0.71 GB, far more than L2); MLX's own reduction over the same words for the card's streaming
rate. CUDA only: on a CPU machine `--arch` compiles the kernels and reads ptxas's report.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..engine.kernels import build, qmm_cuda

PATTERNS = {"rows": (0, 1), "rows-run4": (0, 4), "tile-major": (1, 1)}  # (layout, tiles a load)

SOURCE = """
    constexpr int TILES = K / 128;
    constexpr int PER = (TILES + S - 1) / S;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int group = blockIdx.y * blockDim.y + warp;  // this warp's 16 feature rows
    const int first = blockIdx.z * PER;
    const int last = min(TILES, first + PER);
    uint32_t acc = 0u;
    if (group * 16 < N) {
      if (TILE_MAJOR) {  // (group, tile) is 1 KB contiguous: 64 16-byte chunks
        const uint4* base = reinterpret_cast<const uint4*>(w) + (size_t)group * TILES * 64;
        #pragma unroll 1
        for (int tile = first; tile < last; ++tile) {
          const uint4 a = base[tile * 64 + lane], b = base[tile * 64 + 32 + lane];
          acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        }
      } else {  // lane: rows g and g + 8 of the group, 16-byte chunk t of a tile's 64 bytes
        const int g = lane >> 2, t = lane & 3;
        const uint4* ra = reinterpret_cast<const uint4*>(w + (size_t)(group * 16 + g) * (K / 8));
        const uint4* rb = reinterpret_cast<const uint4*>(w + (size_t)(group * 16 + g + 8) * (K / 8));
        #pragma unroll 1
        for (int tile = first; tile < last; tile += RUN) {
          uint4 a[RUN], b[RUN];
          #pragma unroll
          for (int r = 0; r < RUN; ++r) {
            const bool in = tile + r < last;
            a[r] = in ? ra[(tile + r) * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
            b[r] = in ? rb[(tile + r) * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
          }
          #pragma unroll
          for (int r = 0; r < RUN; ++r) {
            acc ^= a[r].x ^ a[r].y ^ a[r].z ^ a[r].w ^ b[r].x ^ b[r].y ^ b[r].z ^ b[r].w;
          }
        }
      }
    }
    out[(((size_t)blockIdx.z * gridDim.y + blockIdx.y) * blockDim.y + warp) * 32 + lane] = acc;
"""
_kernel = []


def read_kernel():
    if not _kernel:
        _kernel.append(build.cuda_kernel("sanctum_weight_reads", ["w"], ["out"], SOURCE))
    return _kernel[0]


def read_all(w: mx.array, pattern: str) -> mx.array:
    """Every word of w [N, K/8] uint32 read once in `pattern`: each thread's XOR (uint32)."""
    N, K = w.shape[0], w.shape[1] * 8
    if N % 16 or K % 128:
        raise ValueError(f"weights {N} x {K}: N a multiple of 16 and K of 128")
    tile_major, run = PATTERNS[pattern]
    splits = qmm_cuda.tiled_splits(K, N)
    warps = qmm_cuda.WARPS
    blocks = -(-N // (16 * warps))
    (out,) = read_kernel()(
        inputs=[w],
        template=[("K", K), ("N", N), ("S", splits), ("TILE_MAJOR", tile_major), ("RUN", run)],
        grid=(32, warps * blocks, splits),
        threadgroup=(32, warps, 1),
        output_shapes=[(splits * blocks * warps * 32,)],
        output_dtypes=[mx.uint32],
    )
    return out


def _xor(a: mx.array) -> int:
    return int(np.bitwise_xor.reduce(np.array(a).ravel()))


def run(args) -> dict:
    if args.arch != "this-gpu":  # compiled only, on any machine with NVRTC
        return compiled(args.arch)
    from ..engine.kernels.cuda import is_cuda

    if not is_cuda():  # (a result, not an error: the GPU script runs on CPUs too)
        return {"skipped": "not on CUDA (--arch sm_90 compiles the kernels only)"}
    pairs, reps = args.pairs, args.reps
    mats = []
    for _ in range(pairs):  # random words: as good as weights for reading them
        for n, k in ((17408, 5120), (5120, 17408)):
            mats.append(mx.random.randint(0, 2**31 - 1, (n, k // 8)).astype(mx.uint32))
    mx.eval(mats)
    total = sum(m.nbytes for m in mats)
    result = {"gb": round(total / 1e9, 3), "pairs": pairs}
    for name in PATTERNS:  # the check: each pattern's outputs XOR to the matrix's words'
        result[f"{name}_checked"] = all(_xor(read_all(m, name)) == _xor(m) for m in mats[:2])

    def timed(fn) -> float:
        mx.eval(fn())
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    runs = {name: (lambda name=name: [read_all(m, name) for m in mats]) for name in PATTERNS}
    runs["mlx-sum"] = lambda: [m.sum() for m in mats]  # MLX's reduction reads every word
    for name, fn in runs.items():
        s = timed(fn)
        result[f"{name}_ms"] = round(1000 * s, 3)
        result[f"{name}_tb_s"] = round(total / s / 1e12, 3)
    return result


def compiled(arch: str) -> dict:
    """Each pattern's kernel compiled for `arch` at the seed's shapes, ptxas's report."""
    compiler = build.Compiler.from_wheels(arch)
    if compiler is None:
        raise SystemExit("no NVRTC: install the dev extras (nvidia-cuda-nvrtc-cu12)")
    kernel = read_kernel()
    out = {}
    for name, (tile_major, run) in PATTERNS.items():
        for n, k in ((17408, 5120), (5120, 17408)):
            splits = qmm_cuda.tiled_splits(k, n)
            template = [("K", k), ("N", n), ("S", splits), ("TILE_MAJOR", tile_major), ("RUN", run)]
            entry = kernel.entry(template, [mx.uint32], [mx.uint32])
            text = kernel.text(entry, template, [mx.uint32], [mx.uint32])
            out[f"{name} {n}x{k}"] = compiler.resources(text, entry)
    return out


def add_parser(bsub) -> None:
    p = bsub.add_parser(
        "weight-reads",
        help="4-bit weights streamed in the tiled kernel's pattern against a tile-major layout",
    )
    p.add_argument("--pairs", type=int, default=8, help="MLP-shaped pairs of matrices read")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--arch", default="this-gpu", help="sm_XY: compile for it only (no GPU needed)")
    p.add_argument("--json", action="store_true")
