"""The MLX path of a draft layer's block attention and DFlash 2 convolution (the math the drafter
runs everywhere), and the checks that hold draft_cuda.py's kernels to it.

Contract: `reference_attention` / `reference_conv` are what `draft_cuda.block_attention` /
`draft_cuda.dynamic_conv` must equal within bfloat16 rounding; `check_attention` /
`check_conv` say whether a function does (None) or why not.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .agreement import compare
from .sdpa import scaled_dot_product_attention


def block_attention_mask(
    num_ctx: int, num_rows: int, causal: bool, window: int | None
) -> mx.array | None:
    """[L, C + L] boolean mask of a block over its C context keys (the C rows right before the
    anchor, in time order) and its own L rows, or None when every key is visible.

    The reference rules (docs/design/drafter.md): block rows see each other causally when `causal`; in a
    sliding layer the block row at absolute position p sees a context key at position q only
    when p - q < window, so later rows see fewer context rows than the anchor does."""
    clipped = window is not None and num_ctx + num_rows > window
    if not causal and not clipped:
        return None
    rows = mx.arange(num_rows)[:, None]
    ctx = mx.arange(num_ctx)[None, :]
    # context key j sits at position start - C + j; row i at start + i
    ctx_ok = (rows + num_ctx - ctx < window) if clipped else mx.ones((num_rows, num_ctx), mx.bool_)
    own = mx.arange(num_rows)[None, :] <= rows if causal else mx.ones((num_rows,) * 2, mx.bool_)
    return mx.concatenate([mx.broadcast_to(ctx_ok, (num_rows, num_ctx)), own], axis=1)


def grouped_dynamic_conv(x, dyn, base_kernel, which: int, kernel: int, group: int) -> mx.array:
    """out[l] = sum over o of (base[o] + dyn[l, o]) * x[l - o], zero before the block: DFlash 2's
    grouped dynamic convolution by MLX's ops (x [B, L, H], dyn [B, L, 2, K, H / group, 1]).
    Every group of `group` channels shares one dynamic weight: x is seen as
    [B, L, H / group, group] and the weights broadcast over the last axis; a row's predecessors
    come from a 0/1 shift matrix. Both keep a draft's kernel count down on a GPU, where a draft
    layer is bound by kernel launches: no copy for a repeat, none for a shift. The values are
    bit for bit those of a repeat and zero-padded shifts."""
    B, L, H = x.shape
    grouped = (B, L, H // group, group)
    base = base_kernel.reshape(2, kernel, *grouped[2:])
    out = (base[which, 0] + dyn[:, :, which, 0]) * x.reshape(grouped)
    for o in range(1, min(kernel, L)):
        shifted = shift_rows(L, o, x.dtype) @ x  # row l holds x[l - o]; the first o zero
        out = out + (base[which, o] + dyn[:, :, which, o]) * shifted.reshape(grouped)
    return out.reshape(B, L, H)


_SHIFTS: dict = {}


def shift_rows(rows: int, by: int, dtype) -> mx.array:
    """[rows, rows] 0/1 matrix S with (S @ x)[l] = x[l - by] (zero for l < by): exact for
    finite x, since each output sums one product by 1 and zeros. Made from numpy and kept, so
    that a compiled graph holds it as a constant and does not build it again every call."""
    key = (rows, by, dtype)
    if (s := _SHIFTS.get(key)) is None:
        s = _SHIFTS[key] = mx.array(np.eye(rows, k=-by, dtype=np.float32), dtype=dtype)
    return s


# ---- the MLX path of a draft layer (model/drafter/body.py runs it) -----------------------------


def reference_attention(qkv, q_norm, k_norm, ctx_keys, ctx_values, start, bounds, spec, inv_freq):
    """What `block_attention` computes, by MLX's ops as DraftAttention runs them (the split, the
    norms, RoPE, the context rows begin..end, the reference's mask, MLX's attention)."""
    B, L, _ = qkv.shape
    Hq, Hk, D = spec.heads, spec.kv_heads, spec.head_dim
    q, k, v = mx.split(qkv, [Hq * D, (Hq + Hk) * D], axis=-1)
    pos = int(start.reshape(-1)[0].item())
    begin, end = (int(t) for t in bounds.tolist()[:2])

    def norm_rope(t, heads, weight):
        t = mx.fast.rms_norm(t.reshape(B, L, heads, D), weight, spec.eps).transpose(0, 2, 1, 3)
        return mx.fast.rope(
            t, D, traditional=False, base=spec.rope_base, scale=spec.rope_scale, offset=pos
        )

    q, k = norm_rope(q, Hq, q_norm), norm_rope(k, Hk, k_norm)
    v = v.reshape(B, L, Hk, D).transpose(0, 2, 1, 3)
    if end > begin:
        k = mx.concatenate([ctx_keys[:, :, begin:end], k], axis=2)
        v = mx.concatenate([ctx_values[:, :, begin:end], v], axis=2)
    mask = block_attention_mask(end - begin, L, spec.causal, spec.window)
    out = scaled_dot_product_attention(q, k, v, None, spec.scale, mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, Hq * D)


def reference_conv(x, dyn, base, which: int, group: int, residual=None):
    """What `dynamic_conv` computes, by DynamicConv.apply's ops (engine/model/drafter/)."""
    B, L, H = x.shape
    K = base.shape[1]
    out = grouped_dynamic_conv(x, dyn.reshape(B, L, 2, K, H // group, 1), base, which, K, group)
    return out if residual is None else residual + out


# ---- the check at load ---------------------------------------------------------------------


def _bf16(shape, key, scale=1.0):
    return (scale * mx.random.normal(shape, key=key)).astype(mx.bfloat16)


def check_attention(fn, spec, rows=(8, 16), contexts=None, compiled=True):
    """Compare `fn` (the kernel, or a stand-in) with `reference_attention` over contexts shorter
    than, equal to and (for a sliding layer) clipped by the window, at the block widths `rows`:
    None when they agree within bfloat16 rounding, else why not."""
    D, Hk = spec.head_dim, spec.kv_heads
    w = spec.window
    if contexts is None:
        contexts = (0, 37, 300) if w is None else (0, 37, w - 1, max(1, w - 5))
    key = mx.random.key(7)
    inv_freq = spec.inv_freq()
    for L in rows:
        for C in contexts:
            ks = mx.random.split(key, 6)
            key = ks[0]
            front, cap = 11, 11 + C + 40  # rows outside begin..end hold junk the kernel must skip
            qkv = _bf16((1, L, (spec.heads + 2 * Hk) * D), ks[1], 2.0)
            q_norm = (1 + 0.1 * mx.random.normal((D,), key=ks[2])).astype(mx.bfloat16)
            k_norm = (1 - 0.1 * mx.random.normal((D,), key=ks[3])).astype(mx.bfloat16)
            keys, values = _bf16((1, Hk, cap, D), ks[4]), _bf16((1, Hk, cap, D), ks[5])
            start = mx.array(C + 1234, mx.int32)
            bounds = mx.array([front, front + C, cap], mx.int32)
            args = (qkv, q_norm, k_norm, keys, values, start, bounds)
            want = reference_attention(*args, spec, inv_freq)
            run = lambda *a: fn(*a, spec, inv_freq)  # (the arrays only: compile takes them)
            if (why := compare(f"L={L} C={C}", run, args, want, 2e-2, compiled)) is not None:
                return why
    return None


def check_conv(fn, hidden: int, kernel: int, group: int, rows=(1, 2, 8, 16), compiled=True):
    """Compare `fn` with `reference_conv` (both kinds, with and without the residual): None when
    equal (the same roundings in the same order: a bfloat16 ulp at most), else why not."""
    key = mx.random.key(5)
    for L in rows:
        ks = mx.random.split(key, 5)
        key = ks[0]
        x, res = _bf16((1, L, hidden), ks[1]), _bf16((1, L, hidden), ks[2])
        dyn = _bf16((1, L, 2 * kernel * (hidden // group)), ks[3], 0.5)
        base = _bf16((2, kernel, hidden), ks[4], 0.5)
        for which in (0, 1):
            for r in (None, res):
                want = reference_conv(x, dyn, base, which, group, r)
                run = lambda a, b, c, r_=r, w_=which: fn(a, b, c, w_, group, r_)
                where = f"L={L} which={which}"
                if (why := compare(where, run, (x, dyn, base), want, 1e-2, compiled)) is not None:
                    return why
    return None
