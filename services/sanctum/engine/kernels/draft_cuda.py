"""Fused CUDA kernels for a draft layer (built by engine/kernels/build.py): a draft on a GPU is bound
by its kernel launches, and these take a layer's many small kernels down to two.

- `block_attention`: a draft block's whole attention after the fused q/k/v product. From that
  product it norms and rotates the block's queries and keys, reads the layer's context keys and
  values straight from the ContextCache buffer (rows begin..end, given as an array, so one
  compiled graph serves every round), applies the reference's rules (docs/design/drafter.md: the window
  counted per block row, causal or not), and writes the output in o_proj's layout. It stands for
  the q/k/v split copies, two RMSNorms, two RoPEs, the K/V concatenations, the block mask and
  MLX's masked attention fallback: one kernel a layer instead of many.
- `dynamic_conv`: DFlash 2's grouped dynamic convolution over the block rows (kernel size K), with
  the residual add after it: the shift-matrix product and the fused elementwise kernel become
  one, with the same roundings (each product and sum rounded to bfloat16 as MLX's ops round).

Both take and give bfloat16 (seen as uint16: the kernels convert bits themselves). A thread block
of `block_attention` owns one (sequence, KV head, block row) and all the query heads of that KV
head's group, so each context key is read once per row for the whole group; its warps take 32
keys at a time (a lane a key for the scores, then a lane a slice of the head for the values) and
merge their online softmaxes at the end, all in float32.

Contract: equal to `reference_attention` / `reference_conv` (the MLX path of engine/model/drafter/)
within bfloat16 rounding. Used only on CUDA and only after `check` agreed on this GPU at load
(engine/kernels/cuda.py, `prepare_drafter`); everywhere else the MLX path runs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import build
from .draft_reference import check_attention, check_conv
from .draft_reference import reference_attention as reference_attention  # callers' stand-ins
from .draft_reference import reference_conv as reference_conv

WARPS = 8  # warps per thread block of block_attention
SHARED_BYTES = 40 * 1024  # what block_attention's static shared arrays may take

HEADER = """
__device__ __forceinline__ float sanctum_bf(uint16_t u) {
  return __uint_as_float(((uint32_t)u) << 16);
}

// float -> bfloat16 bits, rounded to nearest even (as astype rounds); NaN stays NaN
__device__ __forceinline__ uint16_t sanctum_to_bf(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return (uint16_t)((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float sanctum_round(float f) {
  return sanctum_bf(sanctum_to_bf(f));
}

__device__ __forceinline__ float sanctum_warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) {
    v += __shfl_xor_sync(0xffffffff, v, off);
  }
  return v;
}

__device__ __forceinline__ float sanctum_warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, off));
  }
  return v;
}
"""

ATTENTION_SOURCE = """
    constexpr int G = Hq / Hk;          // query heads of one KV head
    constexpr int NPL = D / 32;         // a lane's elements of a head
    constexpr int QKV = (Hq + 2 * Hk) * D;
    const float NEG = -INFINITY;
    __shared__ __align__(16) float sq[G][D];  // the group's queries at row i (normed, rotated)
    __shared__ float sk[L][D];          // the block's keys (normed, rotated) and values
    __shared__ float sv[L][D];
    __shared__ float wm[WARPS][G];      // each warp's running max, sum and output
    __shared__ float wl[WARPS][G];
    __shared__ float wacc[WARPS][G][D];

    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int n = blockIdx.z;           // (b * Hk + hk) * L + i
    const int i = n % L;
    const int hk = (n / L) % Hk;
    const int b = n / (L * Hk);
    const int pos0 = start[0];
    const int begin = bounds[0];
    const int end = bounds[1];
    const int cap = bounds[2];
    const float eps = consts[0];
    const float scale = consts[1];
    const float rope_scale = consts[2];
    const uint16_t* rows = qkv + (size_t)b * L * QKV;

    // 1. the vectors this block needs, a warp a vector: the G queries of row i, then the keys
    // of rows 0..L-1 (RMSNorm, then RoPE at the row's position, each rounded to bf16 as MLX's
    // rms_norm and rope round), then the values of rows 0..L-1 (as they are)
    for (int vec = warp; vec < G + 2 * L; vec += WARPS) {
      const bool is_q = vec < G;
      const bool is_v = vec >= G + L;
      const int row = is_q ? i : (is_v ? vec - G - L : vec - G);
      const int col = is_q ? (hk * G + vec) * D : (is_v ? (Hq + Hk + hk) * D : (Hq + hk) * D);
      const uint16_t* src = rows + (size_t)row * QKV + col;
      float x[NPL];
      for (int t = 0; t < NPL; ++t) {
        x[t] = sanctum_bf(src[lane + 32 * t]);
      }
      float* dst = is_q ? sq[vec] : (is_v ? sv[row] : sk[row]);
      if (!is_v) {
        const uint16_t* w = is_q ? q_norm : k_norm;
        float ss = 0.0f;
        for (int t = 0; t < NPL; ++t) {
          ss += x[t] * x[t];
        }
        const float r = rsqrtf(sanctum_warp_sum(ss) / D + eps);
        for (int t = 0; t < NPL; ++t) {
          x[t] = sanctum_round(sanctum_bf(w[lane + 32 * t]) * sanctum_round(x[t] * r));
        }
        // rotate-half RoPE: element d pairs with d + D/2, held by the same lane
        const float p = (float)(pos0 + row) * rope_scale;
        for (int t = 0; t < NPL / 2; ++t) {
          float s, c;
          sincosf(p * inv_freq[lane + 32 * t], &s, &c);
          const float a = x[t], e = x[t + NPL / 2];
          x[t] = sanctum_round(a * c - e * s);
          x[t + NPL / 2] = sanctum_round(a * s + e * c);
        }
      }
      for (int t = 0; t < NPL; ++t) {
        dst[lane + 32 * t] = x[t];
      }
    }
    __syncthreads();

    // 2. the keys row i sees: context rows c_lo..end-1 (row end-1 right before the anchor;
    // a sliding layer's row i sees a key at distance < WINDOW), then block rows 0..last-1
    const int c_lo = WINDOW > 0 ? max(begin, end + i - WINDOW + 1) : begin;
    const int n_ctx = end - c_lo;
    const int n_keys = n_ctx + (CAUSAL ? i + 1 : L);
    const size_t head = (size_t)(b * Hk + hk) * cap;
    const uint16_t* kbase = ctx_keys + (head + c_lo) * D;
    const uint16_t* vbase = ctx_values + (head + c_lo) * D;

    float m[G], l[G], acc[G][NPL];
    for (int g = 0; g < G; ++g) {
      m[g] = NEG;
      l[g] = 0.0f;
      for (int t = 0; t < NPL; ++t) {
        acc[g][t] = 0.0f;
      }
    }
    for (int base = 32 * warp; base < n_keys; base += 32 * WARPS) {
      // scores: lane j takes key base + j
      const int key = base + lane;
      float s[G];
      for (int g = 0; g < G; ++g) {
        s[g] = 0.0f;
      }
      if (key < n_ctx) {
        const uint4* kr = reinterpret_cast<const uint4*>(kbase + (size_t)key * D);
        for (int c8 = 0; c8 < D / 8; ++c8) {
          const uint4 u = kr[c8];
          const uint32_t w4[4] = {u.x, u.y, u.z, u.w};
          float kf[8];
          for (int h = 0; h < 4; ++h) {
            kf[2 * h] = __uint_as_float(w4[h] << 16);
            kf[2 * h + 1] = __uint_as_float(w4[h] & 0xffff0000u);
          }
          for (int g = 0; g < G; ++g) {
            const float4 a = reinterpret_cast<const float4*>(sq[g])[2 * c8];
            const float4 c = reinterpret_cast<const float4*>(sq[g])[2 * c8 + 1];
            s[g] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + c.x * kf[4] +
                    c.y * kf[5] + c.z * kf[6] + c.w * kf[7];
          }
        }
      } else if (key < n_keys) {
        const float* kr = sk[key - n_ctx];
        for (int d = 0; d < D; ++d) {
          for (int g = 0; g < G; ++g) {
            s[g] += sq[g][d] * kr[d];
          }
        }
      }
      float p[G];
      for (int g = 0; g < G; ++g) {
        const float sg = key < n_keys ? s[g] * scale : NEG;
        const float m_new = fmaxf(m[g], sanctum_warp_max(sg));
        const float corr = __expf(m[g] - m_new);
        p[g] = __expf(sg - m_new);
        l[g] = l[g] * corr + sanctum_warp_sum(p[g]);
        m[g] = m_new;
        for (int t = 0; t < NPL; ++t) {
          acc[g][t] *= corr;
        }
      }
      // values: key base + j's weight from lane j; this lane's NPL elements of each value row
      const int in_chunk = min(32, n_keys - base);
      for (int j = 0; j < in_chunk; ++j) {
        const int kj = base + j;
        float v[NPL];
        if (kj < n_ctx) {
          const uint16_t* vr = vbase + (size_t)kj * D + NPL * lane;
          for (int t = 0; t < NPL; ++t) {
            v[t] = sanctum_bf(vr[t]);
          }
        } else {
          const float* vr = sv[kj - n_ctx] + NPL * lane;
          for (int t = 0; t < NPL; ++t) {
            v[t] = vr[t];
          }
        }
        for (int g = 0; g < G; ++g) {
          const float pj = __shfl_sync(0xffffffff, p[g], j);
          for (int t = 0; t < NPL; ++t) {
            acc[g][t] += pj * v[t];
          }
        }
      }
    }

    // 3. the warps' partial softmaxes merged; out [B, L, Hq * D], o_proj's input
    for (int g = 0; g < G; ++g) {
      if (lane == 0) {
        wm[warp][g] = m[g];
        wl[warp][g] = l[g];
      }
      for (int t = 0; t < NPL; ++t) {
        wacc[warp][g][NPL * lane + t] = acc[g][t];
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += 32 * WARPS) {
      const int g = e / D, d = e % D;
      float mx_ = NEG;
      for (int w = 0; w < WARPS; ++w) {
        mx_ = fmaxf(mx_, wm[w][g]);
      }
      float num = 0.0f, den = 0.0f;
      for (int w = 0; w < WARPS; ++w) {
        const float f = wm[w][g] == NEG ? 0.0f : __expf(wm[w][g] - mx_);
        num += wacc[w][g][d] * f;
        den += wl[w][g] * f;
      }
      out[((size_t)b * L + i) * (Hq * D) + (hk * G + g) * D + d] = sanctum_to_bf(num / den);
    }
"""

CONV_SOURCE = """
    // out[b, l, h] = sum over o < K, o <= l of bf16(bf16(base[which, o, h] + dyn[...]) *
    // x[b, l - o, h]), summed in order with a rounding after each sum, then + residual
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (size_t)B * L * H) {
      return;
    }
    const int h = e % H;
    const int l = (e / H) % L;
    const int b = e / ((size_t)H * L);
    constexpr int HG = H / GROUP;
    float total = 0.0f;
    for (int o = 0; o < K && o <= l; ++o) {
      const float w = sanctum_round(
          sanctum_bf(base[(WHICH * K + o) * H + h]) +
          sanctum_bf(dyn[(((size_t)(b * L + l) * 2 + WHICH) * K + o) * HG + h / GROUP]));
      const float term = sanctum_round(w * sanctum_bf(x[((size_t)b * L + l - o) * H + h]));
      total = o == 0 ? term : sanctum_round(total + term);
    }
    if (RESIDUAL) {
      total = sanctum_round(sanctum_bf(residual[e]) + total);
    }
    out[e] = sanctum_to_bf(total);
"""

_kernels: dict = {}


@dataclass(frozen=True)
class AttentionSpec:
    """One draft attention layer's shape and rules, as the kernel takes them."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # sliding window counted per block row; None: full attention
    causal: bool
    eps: float
    scale: float  # the scores' scale (head_dim ** -0.5)
    rope_base: float
    rope_scale: float = 1.0

    def inv_freq(self) -> mx.array:
        """RoPE's inverse frequencies (rotate-half over the whole head), in float32."""
        d = self.head_dim
        return mx.array((self.rope_base ** (-np.arange(0, d, 2) / d)).astype(np.float32))


def attention_supported(spec: AttentionSpec, rows: int) -> bool:
    """Shapes the kernel handles: whole warps over a head with its RoPE pairs in one lane, rows
    of 16-byte loads, and its shared arrays within SHARED_BYTES."""
    G = spec.heads // spec.kv_heads
    D = spec.head_dim
    shared = 4 * (G * D + 2 * rows * D + WARPS * G * (D + 2))
    return (
        spec.heads % spec.kv_heads == 0
        and D % 64 == 0
        and 1 <= rows <= 32
        and shared <= SHARED_BYTES
    )


def block_attention(
    qkv: mx.array,  # [B, L, (Hq + 2 Hk) D] bf16: the fused q/k/v product of the block rows
    q_norm: mx.array,  # [D] bf16
    k_norm: mx.array,  # [D] bf16
    ctx_keys: mx.array,  # [B, Hk, capacity, D] bf16: the context cache's buffer (normed, rotated)
    ctx_values: mx.array,  # [B, Hk, capacity, D] bf16
    start: mx.array,  # int32 [] or [1]: the anchor's position
    bounds: mx.array,  # int32 [3]: the context rows in use (begin, end) and the capacity
    spec: AttentionSpec,
    inv_freq: mx.array,  # spec.inv_freq()
) -> mx.array:
    """The draft block's attention output [B, L, Hq * D] bf16 (before o_proj); CUDA only."""
    kernel = _kernels.get("attention")
    if kernel is None:
        kernel = _kernels["attention"] = build.cuda_kernel(
            "sanctum_draft_attention",
            [
                "qkv",
                "q_norm",
                "k_norm",
                "ctx_keys",
                "ctx_values",
                "start",
                "bounds",
                "inv_freq",
                "consts",
            ],
            ["out"],
            ATTENTION_SOURCE,
            HEADER,
        )
    B, L, _ = qkv.shape
    Hq, Hk, D = spec.heads, spec.kv_heads, spec.head_dim
    u16 = mx.uint16
    consts = mx.array([spec.eps, spec.scale, spec.rope_scale], mx.float32)
    (out,) = kernel(
        inputs=[
            mx.view(qkv, u16),
            mx.view(q_norm, u16),
            mx.view(k_norm, u16),
            mx.view(ctx_keys, u16),
            mx.view(ctx_values, u16),
            start.astype(mx.int32).reshape(1),
            bounds.astype(mx.int32),
            inv_freq,
            consts,
        ],
        template=[
            ("Hq", Hq),
            ("Hk", Hk),
            ("D", D),
            ("L", L),
            ("WINDOW", spec.window or 0),
            ("CAUSAL", int(spec.causal)),
            ("WARPS", WARPS),
        ],
        grid=(32 * WARPS, 1, B * Hk * L),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, L, Hq * D)],
        output_dtypes=[u16],
    )
    return mx.view(out, mx.bfloat16)


def dynamic_conv(
    x: mx.array,  # [B, L, H] bf16
    dyn: mx.array,  # [B, L, 2 K (H / group)] bf16: the kernel projection of the layer's input
    base: mx.array,  # [2, K, H] bf16
    which: int,  # 0: before the mixer, 1: after it
    group: int,
    residual: mx.array | None = None,  # [B, L, H] bf16, added after
) -> mx.array:
    """DFlash 2's dynamic convolution of `x` (+ `residual`): [B, L, H] bf16; CUDA only."""
    kernel = _kernels.get("conv")
    if kernel is None:
        kernel = _kernels["conv"] = build.cuda_kernel(
            "sanctum_dynamic_conv", ["x", "dyn", "base", "residual"], ["out"], CONV_SOURCE, HEADER
        )
    B, L, H = x.shape
    K = base.shape[1]
    u16 = mx.uint16
    total = B * L * H
    (out,) = kernel(
        inputs=[
            mx.view(x, u16),
            mx.view(dyn, u16),
            mx.view(base, u16),
            mx.view(residual if residual is not None else x, u16),
        ],
        template=[
            ("B", B),
            ("L", L),
            ("H", H),
            ("K", K),
            ("GROUP", group),
            ("WHICH", which),
            ("RESIDUAL", int(residual is not None)),
        ],
        grid=(256 * -(-total // 256), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, L, H)],
        output_dtypes=[u16],
    )
    return mx.view(out, mx.bfloat16)


def verdict(specs: list[dict], convs: list[list[int]], rows: list[int]) -> dict:
    """The checks for these attention specs and conv shapes at these block widths: {"attention":
    None or why not, "conv": None or why not}."""
    result: dict = {"attention": None, "conv": None}
    for s in specs:
        spec = AttentionSpec(**s)
        if (why := check_attention(block_attention, spec, rows=tuple(rows))) is not None:
            result["attention"] = f"{s}: {why}"
            break
    for hidden, kernel, group in convs:
        if (why := check_conv(dynamic_conv, hidden, kernel, group)) is not None:
            result["conv"] = f"{[hidden, kernel, group]}: {why}"
            break
    return result


if __name__ == "__main__":  # engine/kernels/cuda.py runs the checks here, in a child process
    args = json.loads(sys.argv[1])
    print(json.dumps({"verdict": verdict(args["specs"], args["convs"], args["rows"])}))
