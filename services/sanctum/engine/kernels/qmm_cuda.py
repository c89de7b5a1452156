"""A CUDA kernel for 4-bit matmuls over a few rows (a verify block's projections, the fused
sibling products of engine/kernels/fused.py among them; a draft head; a shared verify's blocks, 16
rows a call: `rows_qmm`), built by engine/kernels/build.py.

Why: MLX CUDA's quantized matmul at 8 rows costs several times its one-row kernel when the
layers run one after the other (docs/performance.md), so an 8-row verify paid for its rows in
every projection although a few rows should cost what one does (the weights are read once).

How: the tensor cores' bf16 mma (m16n8k16, float32 sums), the x rows as its n (8 rows a tile,
two tiles up to 16 rows, absent rows zero). A thread block owns 16 output features; its warps
split K in 128-wide tiles and add their sums at the end. Each lane reads 16 bytes of packed
weights per feature row and tile (32 values of one group), turns them into bf16 as
scale * q + bias (one rounding, MLX's affine 4-bit layout), and reads the 32 x values it pairs
them with as they lie in memory (bf16 already: the mma takes them as is); the next tile's loads
are issued before the current tile's mmas. The output is rounded to bfloat16 as `astype`
rounds. One-row calls (decode) keep MLX's own kernel, so plain decoding stays bit for bit
mlx-lm's.

Contract: `small_qmm(x [M, K], w, scales, biases)` == `mx.quantized_matmul(x, w, scales,
biases, transpose=True, group_size=64, bits=4)` within bfloat16 rounding, for 2 <= M <= 16,
K % 128 == 0, N % 16 == 0; `wide_qmm` the same for 16 < M <= 64, in one call, and
`tiled_qmm` for 2 <= M <= 64. Each used only
after its check agreed on this GPU at load and it was faster than what it replaces there
(engine/kernels/cuda.py runs engine/kernels/qmm_checks.py in a child process).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from . import build, fused

MAX_ROWS = 16
WARPS = 8  # warps per thread block, splitting K
FEATURES = 16  # output features per thread block (the mma's m)

# float32 -> the bits of bfloat16, rounded to nearest even as astype rounds (every kernel's store)
ROUND_HEADER = """
__device__ __forceinline__ uint16_t sanctum_bf16(float v) {
  uint32_t u = __float_as_uint(v);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
"""

HEADER = (
    ROUND_HEADER
    + """
// A tile's weights in registers: the two feature rows' 32 packed values (one uint4 each) and
// their group's scale and bias as bf16 pairs.
struct SanctumWeights {
  uint4 qa, qb;
  uint32_t sa, sb, ba, bb;
};

// A tile's operands: its weights and 32 x values of each row tile (4 uint4).
template <int NT>
struct SanctumTile {
  SanctumWeights w;
  uint4 x[NT][4];
};

__device__ __forceinline__ uint32_t sanctum_pair(uint16_t v) {
  return (uint32_t)v | ((uint32_t)v << 16);
}

__device__ __forceinline__ void sanctum_load_weights(
    SanctumWeights& q, int k, const uint4* wa, const uint4* wb, const uint16_t* sa,
    const uint16_t* sb, const uint16_t* ba, const uint16_t* bb) {
  q.qa = wa[k / 32];
  q.qb = wb[k / 32];
  q.sa = sanctum_pair(sa[k / 64]);
  q.sb = sanctum_pair(sb[k / 64]);
  q.ba = sanctum_pair(ba[k / 64]);
  q.bb = sanctum_pair(bb[k / 64]);
}

template <int M, int K, int NT>
__device__ __forceinline__ void sanctum_load_tile(
    SanctumTile<NT>& q, int k, int g, const uint4* wa, const uint4* wb, const uint16_t* sa,
    const uint16_t* sb, const uint16_t* ba, const uint16_t* bb, const uint16_t* x) {
  sanctum_load_weights(q.w, k, wa, wb, sa, sb, ba, bb);
  #pragma unroll
  for (int h = 0; h < NT; ++h) {
    const int m = g + 8 * h;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      q.x[h][i] = m < M ? reinterpret_cast<const uint4*>(x + (size_t)m * K + k)[i]
                        : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Two packed 4-bit values (bits 0-3 and 16-19 of u >> shift) as the bf16 pair scale * q + bias:
// 0x4300 | q is the bfloat16 128 + q, so q itself comes out exactly, then one rounding.
__device__ __forceinline__ uint32_t sanctum_dequant(uint32_t u, int shift, uint32_t s, uint32_t b) {
  const uint32_t v = ((u >> shift) & 0x000F000Fu) | 0x43004300u;
  uint32_t q, r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(q) : "r"(v), "r"(0x3F803F80u), "r"(0xC300C300u));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q), "r"(s), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t sanctum_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The mmas of word i of a lane's 32 values (both halves): mma half takes, from the words `ua`
// and `ub` of the two feature rows, nibbles r, r + 4 (A's and B's first register) and r + 1,
// r + 5 (their second), r = 2 * half (k is permuted: a sum does not care); the x word `xs[h]` of
// each row tile is paired the same way by prmt, or (PAIRED) was paired so when it was staged
// (`sanctum_pair_x`): its 32-bit words are then (x0, x4), (x1, x5), (x2, x6), (x3, x7).
template <int NT, bool PAIRED = false>
__device__ __forceinline__ void sanctum_mma_word(
    uint32_t ua, uint32_t ub, uint32_t sa, uint32_t sb, uint32_t ba, uint32_t bb,
    const uint4 (&xs)[NT], float (&c)[NT][4]) {
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 2 * half;
    const uint32_t a0 = sanctum_dequant(ua, 4 * r, sa, ba);
    const uint32_t a1 = sanctum_dequant(ub, 4 * r, sb, bb);
    const uint32_t a2 = sanctum_dequant(ua, 4 * r + 4, sa, ba);
    const uint32_t a3 = sanctum_dequant(ub, 4 * r + 4, sb, bb);
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      const uint32_t lo = sanctum_word(xs[h], PAIRED ? 2 * half : half);  // x_r, x_r+1
      const uint32_t hi = sanctum_word(xs[h], PAIRED ? 2 * half + 1 : half + 2);  // x_r+4, x_r+5
      const uint32_t b0 = PAIRED ? lo : __byte_perm(lo, hi, 0x5410);  // (x_r, x_r+4)
      const uint32_t b1 = PAIRED ? hi : __byte_perm(lo, hi, 0x7632);  // (x_r+1, x_r+5)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
          : "+f"(c[h][0]), "+f"(c[h][1]), "+f"(c[h][2]), "+f"(c[h][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
}

// One group of 16 features' sums into y: each warp's partial sums (its share of K) through
// `red`, added up by warp 0 and rounded to bfloat16 as astype rounds.
template <int M, int N, int NT, int WARPS, typename YP>
__device__ __forceinline__ void sanctum_reduce_store(
    const float (&c)[NT][4], float (&red)[WARPS][NT * 4][32], int warp, int lane, int n0, YP y) {
  const int g = lane >> 2;
  const int t = lane & 3;
  #pragma unroll
  for (int h = 0; h < NT; ++h) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      red[warp][h * 4 + e][lane] = c[h][e];
    }
  }
  __syncthreads();
  if (warp == 0) {
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = 0.0f;
        #pragma unroll
        for (int i = 0; i < WARPS; ++i) {
          v += red[i][h * 4 + e][lane];
        }
        const int m = 8 * h + 2 * t + (e & 1);  // the mma's C: row g (+8), columns 2t, 2t + 1
        const int n = n0 + g + 8 * (e >> 1);
        if (m < M) {
          y[(size_t)m * N + n] = sanctum_bf16(v);
        }
      }
    }
  }
}

// The 8 mmas (m16n8k16) of a 128-wide tile, its x words loaded ahead.
template <int NT>
__device__ __forceinline__ void sanctum_mma_tile(const SanctumTile<NT>& q, float (&c)[NT][4]) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint4 xs[NT];
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      xs[h] = q.x[h][i];
    }
    const SanctumWeights& w = q.w;
    sanctum_mma_word<NT>(
        sanctum_word(w.qa, i), sanctum_word(w.qb, i), w.sa, w.sb, w.ba, w.bb, xs, c);
  }
}
"""
)

# The kernel in three parts: its set-up, its loop over K tiles, and the reduction across warps
# and the rounded store; the wide variant (below) has set-up and a loop of its own. Both start
# from the tiles' and the lane's indices (a lane: g = lane / 4, t = lane % 4).
SOURCE_LANES = """
    constexpr int TILES = K / 128;
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g = lane >> 2;
    const int t = lane & 3;
"""
SOURCE_INDICES = (
    """
    constexpr int NT = (M + 7) / 8;  // 8-row tiles of x (the mma's n)"""
    + SOURCE_LANES
)
SOURCE_HEAD = (
    """
    // One thread block per 16 output features; its warps split K in 128-wide tiles and
    // add their partial sums at the end. A lane holds features n0 + g and n0 + g + 8 and the
    // x row g (+ 8 h): 32 consecutive k of each per tile.
"""
    + SOURCE_INDICES
    + """
    const int n0 = blockIdx.y * 16;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g) * (K / 8));
    const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g + 8) * (K / 8));
    const uint16_t* sa = scales + (size_t)(n0 + g) * (K / 64);
    const uint16_t* sb = scales + (size_t)(n0 + g + 8) * (K / 64);
    const uint16_t* ba = biases + (size_t)(n0 + g) * (K / 64);
    const uint16_t* bb = biases + (size_t)(n0 + g + 8) * (K / 64);
    float c[NT][4];
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      c[h][0] = c[h][1] = c[h][2] = c[h][3] = 0.0f;
    }
"""
)
SOURCE_LOOP = """
    SanctumTile<NT> cur, nxt;
    int tile = warp;
    if (tile < TILES) {
      sanctum_load_tile<M, K, NT>(cur, tile * 128 + 32 * t, g, wa, wb, sa, sb, ba, bb, x);
    }
    for (; tile < TILES; tile += WARPS) {
      if (tile + WARPS < TILES) {
        sanctum_load_tile<M, K, NT>(
            nxt, (tile + WARPS) * 128 + 32 * t, g, wa, wb, sa, sb, ba, bb, x);
      }
      sanctum_mma_tile<NT>(cur, c);
      cur = nxt;
    }
"""
SOURCE_TAIL = """
    __shared__ float red[WARPS][NT * 4][32];
    sanctum_reduce_store<M, N, NT, WARPS>(c, red, warp, lane, n0, y);
"""
SOURCE = SOURCE_HEAD + SOURCE_LOOP + SOURCE_TAIL
_kernels: dict[str, object] = {}  # name -> its build.Kernel

# The wide variant (`wide_qmm`, 17..WIDE_ROWS rows in one call: a shared verify's 24-64 rows):
# the same mmas, but the x rows are read inside a tile's loop, one 16-byte word of each 8-row
# tile at a time, instead of all of them ahead (8 row tiles of prefetched x would not fit a
# thread's registers); the weights, prefetched a tile ahead, are read once for all the rows.
WIDE_HEADER = (
    HEADER
    + """
// The tile's weights of the block's 16 features (rows n0 + g and n0 + g + 8), addressed at
// each load (not once ahead, as the few-row kernel is): the PTX the wide kernel was timed with.
template <int K, typename WP, typename SP>
__device__ __forceinline__ void sanctum_load_wide(
    SanctumWeights& q, int k, int n0, int g, WP w, SP scales, SP biases) {
  const size_t na = n0 + g, nb = na + 8;
  sanctum_load_weights(
      q, k, reinterpret_cast<const uint4*>(w + na * (K / 8)),
      reinterpret_cast<const uint4*>(w + nb * (K / 8)),
      reinterpret_cast<const uint16_t*>(scales + na * (K / 64)),
      reinterpret_cast<const uint16_t*>(scales + nb * (K / 64)),
      reinterpret_cast<const uint16_t*>(biases + na * (K / 64)),
      reinterpret_cast<const uint16_t*>(biases + nb * (K / 64)));
}

// sanctum_mma_tile's mmas with x read here: for each of the lane's 4 words of 8 k, the word of
// every row tile, then their mmas.
template <int M, int K, int NT, typename XP>
__device__ __forceinline__ void sanctum_mma_wide(
    const SanctumWeights& q, int k, int g, XP x, float (&c)[NT][4]) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint4 xs[NT];
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      const int m = g + 8 * h;
      xs[h] = m < M ? reinterpret_cast<const uint4*>(x + (size_t)m * K + k)[i]
                    : make_uint4(0u, 0u, 0u, 0u);
    }
    sanctum_mma_word<NT>(
        sanctum_word(q.qa, i), sanctum_word(q.qb, i), q.sa, q.sb, q.ba, q.bb, xs, c);
  }
}
"""
)

WIDE_SOURCE = (
    SOURCE_INDICES
    + """
    const int n0 = blockIdx.y * 16;
    float c[NT][4];
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      c[h][0] = c[h][1] = c[h][2] = c[h][3] = 0.0f;
    }
    SanctumWeights cur, nxt;
    int tile = warp;
    if (tile < TILES) {
      sanctum_load_wide<K>(cur, tile * 128 + 32 * t, n0, g, w, scales, biases);
    }
    for (; tile < TILES; tile += WARPS) {
      if (tile + WARPS < TILES) {
        sanctum_load_wide<K>(nxt, (tile + WARPS) * 128 + 32 * t, n0, g, w, scales, biases);
      }
      sanctum_mma_wide<M, K, NT>(cur, tile * 128 + 32 * t, g, x, c);
      cur = nxt;
    }
"""
    + SOURCE_TAIL
)


# The tiled variant (`tiled_qmm`, SANCTUM_QMM_WIDE=auto where it passes its check and beats the
# wide one): the wide kernel's x traffic is its cost at 64 rows (every 16-feature block reads
# all of x, which there is 16 times the bytes of the weights it meets), so here a thread
# block's 8 warps each own 16 features (128 a block) and walk the same 128-wide K tiles, and the
# block stages each tile's x rows once in shared memory (double buffered, the next tile's words
# loaded into registers while the current one's mmas run, paired for the mma as they are
# stored); x is read N / 128 times. Each warp has its weights AHEAD tiles ahead in flight
# (TILED_AHEAD). The blocks split K S ways (grid z) where N / 128 blocks would leave the GPU's
# SMs idle; each split writes its float32 sums and `sum_splits` adds them in order, then
# rounds once, as astype rounds.
TILED_HEADER = (
    HEADER
    + """
// Shared-memory slot of 16-byte chunk c (0..15, 8 k each) of staged row r: a quarter warp's
// reads (rows g and g + 1, chunks 4 t + i for t = 0..3) and stores (8 consecutive chunks of a
// row) fall on 8 different 16-byte bank groups.
__device__ __forceinline__ int sanctum_slot(int r, int c) {
  return r * 16 + (c ^ ((c >> 3) << 1) ^ (r & 1));
}

// 8 x values (x0, x1), (x2, x3), (x4, x5), (x6, x7) as the mma's B pairs (x0, x4), (x1, x5),
// (x2, x6), (x3, x7): done once when a block stages a chunk, not by each warp at each mma.
__device__ __forceinline__ uint4 sanctum_pair_x(const uint4& v) {
  return make_uint4(
      __byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
      __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}
"""
)

TILED_SOURCE = (
    SOURCE_LANES
    + """
    // the rows are a run-time count (dims[0]) and only their 8-row tiles NT a template
    // constant: one build serves 8 row counts
    const int M = dims[0];
    constexpr int NT_ROWS = 8 * NT;  // staged rows (those from M on are zero)
    constexpr int CHUNKS = NT_ROWS * 16;  // 16-byte chunks of a staged 128-wide tile
    constexpr int PER = (CHUNKS + 32 * WARPS - 1) / (32 * WARPS);  // a thread's chunks
    constexpr int PER_SPLIT = (TILES + S - 1) / S;
    __shared__ uint4 stage[2][CHUNKS];
    const int tid = warp * 32 + lane;
    const int n0 = (blockIdx.y * WARPS + warp) * 16;  // this warp's 16 features
    const bool active = n0 < N;
    const int first = blockIdx.z * PER_SPLIT;
    const int last = min(TILES, first + PER_SPLIT);
    const int na = active ? n0 + g : 0, nb = active ? n0 + g + 8 : 0;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)na * (K / 8));
    const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)nb * (K / 8));
    const uint16_t* sa = scales + (size_t)na * (K / 64);
    const uint16_t* sb = scales + (size_t)nb * (K / 64);
    const uint16_t* ba = biases + (size_t)na * (K / 64);
    const uint16_t* bb = biases + (size_t)nb * (K / 64);
    float c[NT][4];
    #pragma unroll
    for (int h = 0; h < NT; ++h) {
      c[h][0] = c[h][1] = c[h][2] = c[h][3] = 0.0f;
    }
    uint4 xr[PER];  // this thread's chunks of the next tile, on their way to shared memory
    // the weights of this tile and the AHEAD after it, loaded AHEAD tiles before their mmas;
    // the loop is unrolled AHEAD + 1 times, so that a slot's index is a constant (registers)
    SanctumWeights ring[AHEAD + 1];
    auto load_x = [&](int tile) {
      #pragma unroll
      for (int p = 0; p < PER; ++p) {
        const int j = tid + p * 32 * WARPS, r = j >> 4;
        xr[p] = (j < CHUNKS && r < M)
                    ? reinterpret_cast<const uint4*>(x + (size_t)r * K + tile * 128)[j & 15]
                    : make_uint4(0u, 0u, 0u, 0u);
      }
    };
    auto store_x = [&](int buf) {
      #pragma unroll
      for (int p = 0; p < PER; ++p) {
        const int j = tid + p * 32 * WARPS;
        if (j < CHUNKS) {
          stage[buf][sanctum_slot(j >> 4, j & 15)] = sanctum_pair_x(xr[p]);
        }
      }
    };
    if (first < last) {
      load_x(first);
      store_x(0);
      #pragma unroll
      for (int a = 0; a < AHEAD; ++a) {
        if (active && first + a < last) {
          sanctum_load_weights(ring[a], (first + a) * 128 + 32 * t, wa, wb, sa, sb, ba, bb);
        }
      }
    }
    __syncthreads();
    for (int base = first; base < last; base += AHEAD + 1) {
      #pragma unroll
      for (int step = 0; step <= AHEAD; ++step) {
        const int tile = base + step;
        if (tile < last) {  // the same for every thread of the block (its barrier below)
          const int buf = (tile - first) & 1;
          const bool more = tile + 1 < last;
          if (more) {
            load_x(tile + 1);
          }
          if (active && tile + AHEAD < last) {
            sanctum_load_weights(
                ring[(step + AHEAD) % (AHEAD + 1)], (tile + AHEAD) * 128 + 32 * t, wa, wb, sa,
                sb, ba, bb);
          }
          if (active) {
            const SanctumWeights& cur = ring[step];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              uint4 xs[NT];
              #pragma unroll
              for (int h = 0; h < NT; ++h) {
                xs[h] = stage[buf][sanctum_slot(g + 8 * h, 4 * t + i)];
              }
              sanctum_mma_word<NT, true>(
                  sanctum_word(cur.qa, i), sanctum_word(cur.qb, i), cur.sa, cur.sb, cur.ba,
                  cur.bb, xs, c);
            }
          }
          if (more) {
            store_x(buf ^ 1);
          }
          __syncthreads();  // the other buffer is whole, and every warp is done with this one
        }
      }
    }
    if (active) {
      #pragma unroll
      for (int h = 0; h < NT; ++h) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 8 * h + 2 * t + (e & 1);  // the mma's C: row g (+8), columns 2t, 2t + 1
          const int n = n0 + g + 8 * (e >> 1);
          if (m < M) {
            if (S == 1) {  // y is bfloat16
              y[(size_t)m * N + n] = sanctum_bf16(c[h][e]);
            } else {  // y is float32 [S, M, N]: this split's sums
              y[((size_t)blockIdx.z * M + m) * N + n] = c[h][e];
            }
          }
        }
      }
    }
"""
)


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
        and K % 128 == 0
        and N % FEATURES == 0
        and N // FEATURES < 65536
    )


def reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """What `small_qmm` computes, by MLX's own quantized matmul (the check's reference, the
    speed gate's rival, the stand-in off CUDA)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=4)


def small_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """x [M, K] bfloat16 (2 <= M <= MAX_ROWS) @ the 4-bit weight's transpose -> [M, N] bf16."""
    return _launch("sanctum_small_qmm", SOURCE, HEADER, x, w, scales, biases)


OPERANDS = ["x", "w", "scales", "biases"]  # every 4-bit kernel's inputs, as `_operands` gives them


def _kernel(name: str, source: str, header: str, inputs: list[str]):
    """The kernel `name` (one output, y; build.py), built at its first use."""
    kernel = _kernels.get(name)
    if kernel is None:
        kernel = _kernels[name] = build.cuda_kernel(name, inputs, ["y"], source, header)
    return kernel


def _operands(x: mx.array, w, scales, biases) -> list[mx.array]:
    """x, w, scales and biases as the kernels read them (bfloat16 as its 16-bit patterns)."""
    return [mx.view(x, mx.uint16), w, mx.view(scales, mx.uint16), mx.view(biases, mx.uint16)]


def _launch(name: str, source: str, header: str, x: mx.array, w, scales, biases) -> mx.array:
    """Run kernel `name` (built from `source` and `header` at its first call) on x [M, K]:
    a thread block per FEATURES output features, WARPS warps splitting K."""
    kernel = _kernel(name, source, header, OPERANDS)
    M, K = x.shape
    N = w.shape[0]
    (y,) = kernel(
        inputs=_operands(x, w, scales, biases),
        template=[("M", M), ("K", K), ("N", N), ("WARPS", WARPS)],
        grid=(32, WARPS * (N // FEATURES), 1),
        threadgroup=(32, WARPS, 1),
        output_shapes=[(M, N)],
        output_dtypes=[mx.uint16],
    )
    return mx.view(y, mx.bfloat16)


WIDE_ROWS = 64  # the most rows `wide_qmm` (and `tiled_qmm`) takes in one call
WIDE = False  # rows_qmm sends 17..WIDE_ROWS rows to wide_qmm: set by cuda.prepare_linear
TILED = False  # ... to tiled_qmm instead: set by cuda.prepare_linear
# 2..MAX_ROWS rows (a verify block of one sequence, a draft head) to tiled_qmm too: set where it
# beat the few-row kernel at 8 rows (then a row's result is the same bits in a block of one
# sequence and in a shared verify's rows)
TILED_FEW = False
# the fewest thread blocks a tiled call aims at, splitting K to reach them (two an SM of an
# H100 or H200: fewer leave SMs idle, more add float32 sums to write and add)
TILED_BLOCKS = 264
TILED_AHEAD = 1  # tiles of weights a tiled warp has in flight ahead of its mmas (1, 2 or 3)
# thread blocks of the tiled kernel an SM holds at once: with 2 the compiler keeps a thread to
# 128 registers (`__launch_bounds__`), so that twice the warps have weights in flight
TILED_RESIDENT = 1


def tiled_header(resident: int) -> str:
    """TILED_HEADER for `resident` thread blocks an SM. The kernel's signature is written for
    it (build.py, or mx.fast.cuda_kernel where that builds), so the bound comes in through the
    `__global__` spelled there (the header is the last text before it)."""
    if resident == 1:
        return TILED_HEADER
    return TILED_HEADER + (
        "\n#undef __global__\n"
        f"#define __global__ __location__(global) __launch_bounds__({32 * WARPS}, {resident})\n"
    )


def wide_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """`small_qmm` for x [M, K] of MAX_ROWS < M <= WIDE_ROWS rows, in one call (the weights
    read once for all of them)."""
    return _launch("sanctum_wide_qmm", WIDE_SOURCE, WIDE_HEADER, x, w, scales, biases)


def tiled_splits(K: int, N: int, blocks: int | None = None) -> int:
    """The ways `tiled_qmm` splits K: enough for `blocks` (default TILED_BLOCKS) thread blocks
    where N / 128 are fewer, at most one 128-wide tile a split, none empty."""
    tiles = K // 128
    per_row = -(-N // (FEATURES * WARPS))
    splits = max(1, min(tiles, -(-(blocks or TILED_BLOCKS) // per_row)))
    per = -(-tiles // splits)
    return -(-tiles // per)


def tiled_build(
    M: int,
    K: int,
    N: int,
    blocks: int | None = None,
    ahead: int | None = None,
    resident: int | None = None,
) -> tuple[build.Kernel, list, int]:
    """The tiled kernel for x [M, K] and N features (`tiled_qmm`'s arguments): the kernel,
    its template, and the ways K is split."""
    resident = resident or TILED_RESIDENT
    name = "sanctum_tiled_qmm" + ("" if resident == 1 else f"_r{resident}")
    kernel = _kernel(name, TILED_SOURCE, tiled_header(resident), [*OPERANDS, "dims"])
    splits = tiled_splits(K, N, blocks)
    template = [
        ("NT", -(-M // 8)),
        ("K", K),
        ("N", N),
        ("WARPS", WARPS),
        ("S", splits),
        ("AHEAD", ahead or TILED_AHEAD),
    ]
    return kernel, template, splits


def tiled_resources(compiler: build.Compiler, M: int, K: int, N: int, **variant) -> dict:
    """What ptxas gives the tiled kernel of these shapes and `variant` (tiled_build's blocks,
    ahead, resident) a thread and a block (build.Compiler.resources): compiled, not run."""
    kernel, template, splits = tiled_build(M, K, N, **variant)
    ins = [mx.uint16, mx.uint32, mx.uint16, mx.uint16, mx.int32]  # as tiled_qmm passes them
    outs = [mx.uint16 if splits == 1 else mx.float32]
    entry = kernel.entry(template, ins, outs)
    return compiler.resources(kernel.text(entry, template, ins, outs), entry)


def tiled_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    blocks: int | None = None,
    ahead: int | None = None,
    resident: int | None = None,
) -> mx.array:
    """`wide_qmm` by the tiled kernel: x [M, K] (2 <= M <= WIDE_ROWS) staged in shared
    memory, 128 features a thread block, K split for `blocks` thread blocks (`tiled_splits`),
    the weights `ahead` (default TILED_AHEAD) tiles ahead, `resident` (default TILED_RESIDENT)
    blocks an SM; the splits' float32 sums added in order by `sum_splits`."""
    M, K = x.shape
    N = w.shape[0]
    kernel, template, splits = tiled_build(M, K, N, blocks, ahead, resident)
    (y,) = kernel(
        inputs=[*_operands(x, w, scales, biases), mx.array([M], dtype=mx.int32)],
        template=template,
        grid=(32, WARPS * -(-N // (FEATURES * WARPS)), splits),
        threadgroup=(32, WARPS, 1),
        output_shapes=[(M, N) if splits == 1 else (splits, M, N)],
        output_dtypes=[mx.uint16 if splits == 1 else mx.float32],
    )
    if splits == 1:
        return mx.view(y, mx.bfloat16)
    return sum_splits(y)


# The splits' sums added in order and rounded once, element by element: a row's result then
# does not depend on how many rows share the call (MLX's reduction may order its adds by the
# array's shape), and it is one launch where sum and astype were two. Sizes at run time: one
# build for every shape.
SUM_SOURCE = """
    const int splits = sizes[0];
    const size_t count = (size_t)sizes[1];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
      float v = p[i];
      for (int s = 1; s < splits; ++s) {
        v += p[(size_t)s * count + i];
      }
      y[i] = sanctum_bf16(v);
    }
"""


def sum_splits(p: mx.array) -> mx.array:
    """p [S, M, N] float32 -> sum over S in order, rounded to bfloat16 [M, N]."""
    kernel = _kernel("sanctum_sum_splits", SUM_SOURCE, ROUND_HEADER, ["p", "sizes"])
    S, M, N = p.shape
    (y,) = kernel(
        inputs=[p, mx.array([S, M * N], dtype=mx.int32)],
        grid=(-(-(M * N) // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[mx.uint16],
    )
    return mx.view(y, mx.bfloat16)


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """mlx's QuantizedLinear with calls of 2..SPLIT_ROWS bfloat16 rows sent to the kernel
    (`rows_qmm`; `install` swaps a checked module's class to this one); one row and many rows
    as before."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _through_kernel(x, self["weight"], self["scales"], self["biases"])
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


def install(model: nn.Module) -> int:
    """Route the few-row calls of every supported 4-bit linear layer of `model` through the
    kernel, and those of the fused sibling products over them (engine/kernels/fused.py: a verify's
    MLP gate+up and GDN input projections); returns how many layers."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and supported(module):
            module.__class__ = FewRowsQuantizedLinear
            count += 1
    for product in fused.products(model):
        if type(product.layers[0]) is FewRowsQuantizedLinear:  # their concatenation tiles too
            product.kernel = _through_kernel
    return count


def _through_kernel(x: mx.array, w, scales, biases) -> mx.array | None:
    """`x` [..., K] through the kernel when it has 2..SPLIT_ROWS bfloat16 rows; else None (the
    caller runs MLX's matmul)."""
    rows = x.size // x.shape[-1]
    if not (1 < rows <= max(SPLIT_ROWS, MAX_ROWS) and x.dtype == mx.bfloat16):
        return None
    y = rows_qmm(x.reshape(rows, x.shape[-1]), w, scales, biases)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# A shared verify's products (N blocks of 8 rows: 32, 64) go through the kernel MAX_ROWS rows
# a call, reading the weights once a call, instead of MLX's 4-bit matrix kernel (faster there:
# docs/performance.md). Longer passes (prefill chunks) keep MLX's. SANCTUM_QMM_SPLIT_ROWS=16:
# one call's rows only.
SPLIT_ROWS = 64  # SANCTUM_QMM_SPLIT_ROWS, set by cuda.prepare_linear


def rows_qmm(x: mx.array, w, scales, biases, wide: bool | None = None) -> mx.array:
    """`small_qmm` for x [M, K] of 2..SPLIT_ROWS rows: MAX_ROWS rows a call (a last call of one
    row borrows one from the call before: the kernel takes 2 or more), or with `wide` (default
    WIDE) up to WIDE_ROWS rows in one call: `tiled_qmm`'s where TILED (and up to MAX_ROWS too
    where TILED_FEW), else `wide_qmm`'s. A caller that names `wide` (a check, a benchmark) gets
    the kernel it names: True the wide one past MAX_ROWS rows, False MAX_ROWS rows a call."""
    rows = x.shape[0]
    if rows <= MAX_ROWS:
        if TILED_FEW and wide is None:
            return tiled_qmm(x, w, scales, biases)
        return small_qmm(x, w, scales, biases)
    if (WIDE if wide is None else wide) and rows <= WIDE_ROWS:
        if TILED and wide is None:
            return tiled_qmm(x, w, scales, biases)
        return wide_qmm(x, w, scales, biases)
    cuts = list(range(0, rows, MAX_ROWS)) + [rows]
    if cuts[-1] - cuts[-2] == 1:
        cuts[-2] -= 1
    return mx.concatenate([small_qmm(x[a:b], w, scales, biases) for a, b in zip(cuts, cuts[1:])])


@contextmanager
def disabled(model: nn.Module):
    """MLX's own kernel for every call inside the block (a benchmark's before/after)."""
    swapped = [(m, type(m)) for _, m in model.named_modules() if type(m) is FewRowsQuantizedLinear]
    products = [p for p in fused.products(model) if p.kernel is not None]
    for m, _ in swapped:
        m.__class__ = nn.QuantizedLinear
    for p in products:
        p.kernel = None
    try:
        yield len(swapped)
    finally:
        for m, kind in swapped:
            m.__class__ = kind
        for p in products:
            p.kernel = _through_kernel
