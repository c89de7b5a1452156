"""A fused CUDA kernel for the gated delta rule over a short block (a verify block, a rollback
re-run), built by engine/kernels/build.py: one launch per layer instead of the chunked form's ~25
small kernels.

Contract: `gated_delta_cuda(q, k, v, g, beta, state)` computes what mlx-lm's `gated_delta_ops`
computes (y [B, T, Hv, Dv] in q's dtype, final state [B, Hv, Dv, Dk] in float32), with the
state in float32 registers: one warp per (batch, value head, value row), each lane holding
Dk / 32 state elements, rows in time order. Used only on CUDA and only after `check` compared it
with the MLX path on this GPU at load (engine/kernels/cuda.py); everywhere else the pure MLX path runs.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from . import build

# The row counts are a runtime input (steps: the rows the inputs hold, then the rows each
# sequence runs), so one compiled kernel serves every block and rollback length; the head
# shapes are template constants.
_SOURCE = """
    const int n_steps = steps[0];  // the rows q, k, v, ... hold (their stride)
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;  // b * Hv + hv
    const int b = n / Hv;
    const int run = steps[1 + b];  // the rows sequence b runs: all, or a rollback's kept ones
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    constexpr int NPT = Dk / 32;

    // q, k, v, beta and y in the activations' dtype (bf16, fp16 or float32), read into and
    // summed in float32: no cast kernels around the launch
    const auto* q_ = q + (size_t)b * n_steps * Hk * Dk + hk * Dk + NPT * lane;
    const auto* k_ = k + (size_t)b * n_steps * Hk * Dk + hk * Dk + NPT * lane;
    const auto* v_ = v + (size_t)b * n_steps * Hv * Dv + hv * Dv + dv;
    auto* y_ = y + (size_t)b * n_steps * Hv * Dv + hv * Dv + dv;
    const float* g_ = g + (size_t)b * n_steps * Hv + hv;
    const auto* beta_ = beta + (size_t)b * n_steps * Hv + hv;
    const float* s_in = state_in + ((size_t)n * Dv + dv) * Dk + NPT * lane;
    float* s_out = state_out + ((size_t)n * Dv + dv) * Dk + NPT * lane;

    float s[NPT];
    for (int i = 0; i < NPT; ++i) {
      s[i] = s_in[i];
    }
    for (int t = 0; t < run; ++t) {
      const float gt = *g_;
      float kv = 0.0f;
      for (int i = 0; i < NPT; ++i) {
        s[i] = s[i] * gt;
        kv += s[i] * static_cast<float>(k_[i]);
      }
      for (int off = 16; off > 0; off >>= 1) {
        kv += __shfl_xor_sync(0xffffffff, kv, off);
      }
      const float delta = (static_cast<float>(*v_) - kv) * static_cast<float>(*beta_);
      float out = 0.0f;
      for (int i = 0; i < NPT; ++i) {
        s[i] = s[i] + static_cast<float>(k_[i]) * delta;
        out += s[i] * static_cast<float>(q_[i]);
      }
      for (int off = 16; off > 0; off >>= 1) {
        out += __shfl_xor_sync(0xffffffff, out, off);
      }
      if (lane == 0) {
        *y_ = out;  // rounded to y's dtype as astype rounds (to nearest even)
      }
      SAVE_ROW
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    for (int i = 0; i < NPT; ++i) {
      s_out[i] = s[i];
    }
"""
# The taped variant also writes the state after every row ([B, T, Hv, Dv, Dk]): a rollback to
# `keep` rows is then a copy of row keep-1, not a re-run of the recurrence (memory written once,
# against a launch per layer at every rollback).
_SAVE_ROW = """{
        float* r_ = row_states + ((((size_t)b * n_steps + t) * Hv + hv) * Dv + dv) * Dk + NPT * lane;
        for (int i = 0; i < NPT; ++i) {
          r_[i] = s[i];
        }
      }"""
SOURCES = {False: _SOURCE.replace("SAVE_ROW", ""), True: _SOURCE.replace("SAVE_ROW", _SAVE_ROW)}
_kernels: dict = {}
ROWS_PER_BLOCK = 4  # value rows (warps) per thread block


def supported(Hk: int, Hv: int, Dk: int, Dv: int) -> bool:
    """Shapes the kernel handles: whole warps over Dk, whole blocks over Dv."""
    return Dk % 32 == 0 and Dv % ROWS_PER_BLOCK == 0 and Hv % Hk == 0


def gated_delta_cuda(
    q: mx.array,  # [B, T, Hk, Dk] (normalised, readout scale folded in)
    k: mx.array,  # [B, T, Hk, Dk]
    v: mx.array,  # [B, T, Hv, Dv]
    g: mx.array,  # [B, T, Hv] decay (linear space)
    beta: mx.array,  # [B, T, Hv]
    state: mx.array,  # [B, Hv, Dv, Dk]
    keep_rows: bool = False,
    rows: list[int] | None = None,
) -> tuple[mx.array, ...]:
    """(y [B, T, Hv, Dv], state [B, Hv, Dv, Dk] float32), and with `keep_rows` the state after
    every row (row_states [B, T, Hv, Dv, Dk] float32); CUDA only. With `rows` sequence b runs
    only its first rows[b] rows (0: its state comes back as it was; a shared rollback's re-run),
    and y past them is undefined."""
    kernel = _kernels.get(keep_rows)
    if kernel is None:
        kernel = _kernels[keep_rows] = build.cuda_kernel(
            "sanctum_gated_delta_rows" if keep_rows else "sanctum_gated_delta",
            ["q", "k", "v", "g", "beta", "state_in", "steps"],
            ["y", "state_out"] + (["row_states"] if keep_rows else []),
            SOURCES[keep_rows],
        )
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    f32 = mx.float32
    # q, k, v, beta as they come (their casts were a copy kernel each: q and k come from
    # rms_norm, which no cast fuses into), y in q's dtype; the decay and the state in float32
    dtype = q.dtype
    outs = kernel(
        inputs=[
            q,
            k.astype(dtype),
            v.astype(dtype),
            g.astype(f32),
            beta.astype(dtype),
            state.astype(f32),
            mx.array([T, *(rows if rows is not None else [T] * B)], dtype=mx.int32),
        ],
        template=[("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, ROWS_PER_BLOCK, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)]
        + ([(B, T, Hv, Dv, Dk)] if keep_rows else []),
        output_dtypes=[dtype] + [f32] * (2 if keep_rows else 1),
    )
    return tuple(outs)


def reference(
    q, k, v, g, beta, state, keep_rows: bool = False, rows: list[int] | None = None
) -> tuple[mx.array, ...]:
    """The kernel's contract in pure MLX (mlx-lm's `gated_delta_ops`; with `keep_rows` one row at
    a time, keeping each state; with `rows` each sequence's state after its first rows[b]
    rows, y over all of them): what `check` compares with, and the stand-in off CUDA."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    if rows is not None:  # the kept rows' states, picked
        y, _, kept = reference(q, k, v, g, beta, state, keep_rows=True)
        before = state.astype(mx.float32)
        picked = [kept[b, r - 1] if r else before[b] for b, r in enumerate(rows)]
        return y, mx.stack(picked)
    if not keep_rows:
        return gated_delta_ops(q, k, v, g, beta, state)
    ys, rows = [], []
    for t in range(q.shape[1]):
        y, state = gated_delta_ops(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), state)
        ys.append(y)
        rows.append(state)
    return mx.concatenate(ys, axis=1), state, mx.stack(rows, axis=1)


def check(
    fn,
    Hk: int,
    Hv: int,
    Dk: int,
    Dv: int,
    dtype: mx.Dtype,
    rows=(1, 3, 8, 16),
    compiled: bool = True,
    keep_rows: bool = True,
) -> str | None:
    """Compare `fn` (the kernel, or a stand-in) with mlx-lm's `gated_delta_ops` on random inputs
    of these head shapes, eagerly (and inside mx.compile with `compiled`); with `keep_rows`
    also `fn(..., keep_rows=True)`, whose state after each row must be mlx-lm's after that
    prefix, and always `fn(..., rows=[r])` (a re-run of the first r rows), whose state must be
    too. None when they agree, else why not."""
    from mlx_lm.models.gated_delta import normalize_qk

    key = mx.random.key(16)
    for T in rows:
        ks = mx.random.split(key, 7)
        key = ks[0]
        q = mx.random.normal((1, T, Hk, Dk), key=ks[1])
        k = mx.random.normal((1, T, Hk, Dk), key=ks[2])
        q, k = normalize_qk(q.astype(dtype), k.astype(dtype), inv_scale=Dk**-0.5, eps=1e-6)
        v = mx.random.normal((1, T, Hv, Dv), key=ks[3]).astype(dtype)
        g = mx.exp(-mx.random.uniform(0.01, 2.0, (1, T, Hv), key=ks[4]))
        beta = mx.sigmoid(mx.random.normal((1, T, Hv), key=ks[5])).astype(dtype)
        state = 0.3 * mx.random.normal((1, Hv, Dv, Dk), key=ks[6])
        want_y, want_s, want_rows = reference(q, k, v, g, beta, state, keep_rows=True)
        args = (q, k, v, g, beta, state)
        try:
            results = {"eager": fn(*args)}
            if compiled:
                results["compiled"] = mx.compile(fn)(*args)
            # a rollback's re-run over the first r rows: the state mlx-lm's has after them
            reruns = {r: fn(*args, rows=[r])[1] for r in sorted({0, T // 2, T})}
            if keep_rows:
                results["rows"] = fn(*args, keep_rows=True)
                if compiled:
                    results["rows compiled"] = mx.compile(lambda *a: fn(*a, keep_rows=True))(*args)
            mx.eval(want_y, want_s, want_rows, results, reruns)
        except Exception as exc:  # a kernel that does not build or run on this GPU
            return f"T={T}: {exc.__class__.__name__}: {str(exc)[:300]}"
        for r, got in reruns.items():
            want = want_rows[:, r - 1] if r else state
            if not (got.shape == want.shape and mx.abs(got - want).max().item() <= 1e-3):
                return f"T={T} re-run of {r} rows: {got.shape}, max |dstate| too large or NaN"
        tol = 2e-2 if dtype != mx.float32 else 1e-4
        for name, (y, s, *row_states) in results.items():
            if y.dtype != want_y.dtype or s.dtype != mx.float32:
                return f"T={T} {name}: dtypes {y.dtype}, {s.dtype}"
            dy = mx.abs(y.astype(mx.float32) - want_y.astype(mx.float32)).max().item()
            ds = mx.abs(s - want_s).max().item()
            if row_states:
                r = row_states[0]
                if r.shape != (1, T, *state.shape[1:]) or r.dtype != mx.float32:
                    return f"T={T} {name}: row states {r.shape} {r.dtype}"
                ds = max(ds, mx.abs(r - want_rows).max().item())
            if not (dy <= tol and ds <= 1e-3):  # also false for NaN
                return f"T={T} {name}: max |dy|={dy:.3g}, max |dstate|={ds:.3g}"
    return None


def verdict(Hk: int, Hv: int, Dk: int, Dv: int, dtype: mx.Dtype) -> str | None:
    """`check` of the kernel inside mx.compile and, failing that, eagerly: None (it agrees),
    "eager only", or why it does not."""
    result = check(gated_delta_cuda, Hk, Hv, Dk, Dv, dtype)
    if (
        result is not None
        and check(gated_delta_cuda, Hk, Hv, Dk, Dv, dtype, compiled=False) is None
    ):
        return "eager only"
    return result


if __name__ == "__main__":  # engine/kernels/cuda.py runs the check here, in a child process
    shape, dtype_name = json.loads(sys.argv[1]), sys.argv[2]
    print(json.dumps({"verdict": verdict(*shape, getattr(mx, dtype_name))}))
