"""`sanctum bench weight-reads`: how fast a GPU streams 4-bit weights in the tiled kernel's
access pattern, against the same bytes laid out for it.

The tiled 4-bit kernel (engine/kernels/qmm_cuda.py) reads a weight matrix [N, K/8] (uint32) as
its warps' tiles: each warp owns 16 feature rows and fetches, per 128-wide K tile, 64 bytes
of each of them, rows K/2 bytes apart (2.5 or 8.5 KB at the seed's shapes). At 64 rows that
kernel runs at ~0.3 TB/s of weights where the card streams ~3. Whether the pattern itself
(many short pieces of far-apart rows) caps what DRAM gives is what this measures, with a
kernel that only reads (an XOR of every word, so nothing is optimized away):

- `rows`: the tiled kernel's loads (a lane's 16 bytes of two rows, and the scale and bias of
  their group, 2 bytes each from rows K / 32 bytes apart), one tile at a time;
- `rows-run4`: the same loads, four tiles (256 contiguous bytes a row) issued together;
- `tile-major`: the same bytes as if repacked so that each warp's tile is 1 KB of weights then
  128 bytes of scales and biases, contiguous (what a kernel could read if the weights were
  laid out for it at load).

Each reads every word of the weights, scales and biases (the XOR of what it read is theirs,
checked), with the tiled kernel's grid (128 features a block, K split as it splits it).
Timed over a chain of the seed's MLP shapes (8 pairs of 17408 x 5120 and 5120 x 17408:
0.76 GB with scales and biases, far more than L2); MLX's own reduction over the same words
gives the card's streaming rate. CUDA only: on a CPU machine `--arch` compiles the kernels
and reads ptxas's report.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..engine.kernels import build, qmm_cuda
from ..engine.kernels.qmm_checks import median_ms

PATTERNS = {"rows": (0, 1), "rows-run4": (0, 4), "tile-major": (1, 1)}  # (layout, tiles a load)

SOURCE = """
    constexpr int TILES = K / 128;
    constexpr int PER = (TILES + S - 1) / S;
    constexpr int GROUPS = K / 64;  // scales (and biases) a row
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int group = blockIdx.y * blockDim.y + warp;  // this warp's 16 feature rows
    const int first = blockIdx.z * PER;
    const int last = min(TILES, first + PER);
    uint32_t acc = 0u, acc_s = 0u, sink = 0u;  // weights' words, scales' and biases' halves
    if (group * 16 < N) {
      if (TILE_MAJOR) {  // (group, tile): 1 KB of weights, 128 bytes of scales and biases
        const uint4* base = reinterpret_cast<const uint4*>(w) + (size_t)group * TILES * 64;
        const uint4* sbase = reinterpret_cast<const uint4*>(sb) + (size_t)group * TILES * 8;
        #pragma unroll 1
        for (int tile = first; tile < last; ++tile) {
          const uint4 a = base[tile * 64 + lane], b = base[tile * 64 + 32 + lane];
          acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
          if (lane < 8) {
            const uint4 v = sbase[tile * 8 + lane];
            const uint32_t x = v.x ^ v.y ^ v.z ^ v.w;
            acc_s ^= (x & 0xFFFFu) ^ (x >> 16);
          }
        }
      } else {  // lane: rows g and g + 8 of the group, 16-byte chunk t of a tile's 64 bytes,
        // and (as the tiled kernel) the scale and bias of that chunk's group of 64 values
        const int g = lane >> 2, t = lane & 3;
        const size_t row_a = (size_t)group * 16 + g, row_b = row_a + 8;
        const uint4* ra = reinterpret_cast<const uint4*>(w + row_a * (K / 8));
        const uint4* rb = reinterpret_cast<const uint4*>(w + row_b * (K / 8));
        const uint16_t* s_a = sb + row_a * GROUPS;
        const uint16_t* s_b = sb + row_b * GROUPS;
        const uint16_t* b_a = sb + (N + row_a) * GROUPS;
        const uint16_t* b_b = sb + (N + row_b) * GROUPS;
        #pragma unroll 1
        for (int tile = first; tile < last; tile += RUN) {
          uint4 a[RUN], b[RUN];
          uint32_t q[RUN];
          #pragma unroll
          for (int r = 0; r < RUN; ++r) {
            const bool in = tile + r < last;
            const int j = (tile + r) * 2 + (t >> 1);
            a[r] = in ? ra[(tile + r) * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
            b[r] = in ? rb[(tile + r) * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
            q[r] = in ? (uint32_t)(s_a[j] ^ s_b[j] ^ b_a[j] ^ b_b[j]) : 0u;
          }
          #pragma unroll
          for (int r = 0; r < RUN; ++r) {
            acc ^= a[r].x ^ a[r].y ^ a[r].z ^ a[r].w ^ b[r].x ^ b[r].y ^ b[r].z ^ b[r].w;
            if ((t & 1) == 0) {  // lanes t and t + 1 read the same group's: count it once
              acc_s ^= q[r];
            } else {
              sink += q[r];
            }
          }
        }
      }
    }
    const size_t i = (((size_t)blockIdx.z * gridDim.y + blockIdx.y) * blockDim.y + warp) * 32 + lane;
    out[2 * i] = acc;
    out[2 * i + 1] = acc_s;
    dup[i] = sink;
"""
_kernel = []


def read_kernel():
    if not _kernel:
        _kernel.append(
            build.cuda_kernel("sanctum_weight_reads", ["w", "sb"], ["out", "dup"], SOURCE)
        )
    return _kernel[0]


def read_all(w: mx.array, sb: mx.array, pattern: str) -> mx.array:
    """Every word of w [N, K/8] uint32 and sb [2N, K/64] uint16 (scales, then biases) read
    once in `pattern` (the tiled kernel's loads, or the same bytes as if tile-major): each
    thread's XOR of the weights' words and of the scales' and biases' values, [threads, 2]."""
    N, K = w.shape[0], w.shape[1] * 8
    if N % 16 or K % 128 or sb.shape != (2 * N, K // 64):
        raise ValueError(f"weights {N} x {K}, scales and biases {sb.shape}")
    tile_major, run = PATTERNS[pattern]
    splits = qmm_cuda.tiled_splits(K, N)
    warps = qmm_cuda.WARPS
    blocks = -(-N // (16 * warps))
    threads = splits * blocks * warps * 32
    out, _ = read_kernel()(
        inputs=[w, sb],
        template=[("K", K), ("N", N), ("S", splits), ("TILE_MAJOR", tile_major), ("RUN", run)],
        grid=(32, warps * blocks, splits),
        threadgroup=(32, warps, 1),
        output_shapes=[(threads, 2), (threads,)],
        output_dtypes=[mx.uint32, mx.uint32],
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
    mats = []  # (weights, scales and biases): random bits read as weights are
    for _ in range(pairs):
        for n, k in ((17408, 5120), (5120, 17408)):
            w = mx.random.randint(0, 2**31 - 1, (n, k // 8)).astype(mx.uint32)
            sb = mx.random.randint(0, 2**16, (2 * n, k // 64)).astype(mx.uint16)
            mats.append((w, sb))
    mx.eval(mats)
    total = sum(w.nbytes + sb.nbytes for w, sb in mats)
    result = {"gb": round(total / 1e9, 3), "pairs": pairs}
    for name in PATTERNS:  # the check: what each pattern read XORs to the arrays' own words
        result[f"{name}_checked"] = all(
            _xor(read_all(w, sb, name)[:, 0]) == _xor(w)
            and _xor(read_all(w, sb, name)[:, 1]) == _xor(sb)
            for w, sb in mats[:2]
        )

    runs = {name: (lambda name=name: [read_all(*m, name) for m in mats]) for name in PATTERNS}
    runs["mlx-sum"] = lambda: [(w.sum(), sb.sum()) for w, sb in mats]  # MLX reads every word
    for name, fn in runs.items():
        ms = median_ms(lambda fn=fn: mx.eval(fn()), reps)
        result[f"{name}_ms"] = round(ms, 3)
        result[f"{name}_tb_s"] = round(total / ms / 1e9, 3)
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
            ins, outs = [mx.uint32, mx.uint16], [mx.uint32, mx.uint32]
            entry = kernel.entry(template, ins, outs)
            text = kernel.text(entry, template, ins, outs)
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
