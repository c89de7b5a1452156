"""Scaled dot-product attention over a few query rows: on the CPU a grouped-query attention of
its own (`grouped_attention`), MLX's (through mlx-lm) elsewhere and for every other pass.

MLX has no CPU kernel for `scaled_dot_product_attention`. Its fallback repeats the keys and
values for each query head of a group (copies of the whole cache in every layer of every pass)
and takes MLX's softmax, whose exp runs one element at a time. Here each group's query heads
are folded into rows (one product per KV head, no copies), and the softmax's exp runs in a
compiled kernel, which the CPU JIT vectorizes (cpu.py). Same formula and dtype; the values
differ from MLX's in the last bits (the products' tiling), as a verify's rows already differ
from a decode step's. Prefill and decode steps keep mlx-lm's attention, so plain decoding
stays mlx-lm's to the bit. Timings: docs/performance.md.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

from . import cpu, platform

MAX_ROWS = 32  # the few-row passes (verify and draft blocks, up to gdn.COMPILE_MAX_ROWS)
ENABLED = True  # False: MLX's attention everywhere (a before/after)


def grouped_rows(rows: int) -> bool:
    """Whether a pass of `rows` query rows takes `grouped_attention` on this device."""
    return ENABLED and 1 < rows <= MAX_ROWS and platform.current().is_cpu


def grouped_attention(
    q: mx.array,  # [B, Hq, L, D]
    k: mx.array,  # [B, Hk, S, D]
    v: mx.array,  # [B, Hk, S, D]
    scale: float,
    mask: mx.array | str | None = None,  # "causal", bool [.., L, S] (True: attend), or additive
) -> mx.array:
    """softmax(q k^T * scale + mask) v for Hq = r * Hk query heads: [B, Hq, L, D]."""
    B, Hq, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    r = Hq // Hk
    q = (q * mx.array(scale, q.dtype)).reshape(B, Hk, r * L, D)  # a group's heads as rows
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, Hk, r, L, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be 'causal', an array or None, got {mask!r}")
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if mask.ndim not in (2, 4):
            raise ValueError(f"mask must be [L, S] or [B, heads, L, S], got {mask.shape}")
        if mask.ndim == 4:  # [B or 1, Hq or 1, L, S]: per query head
            mask = mask.reshape(mask.shape[0], -1, r if mask.shape[1] > 1 else 1, L, S)
        if mask.dtype == mx.bool_:
            low = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
            scores = mx.where(mask, scores, low)
        else:
            scores = scores + mask
    probs = cpu.softmax(scores.astype(mx.float32)).astype(v.dtype).reshape(B, Hk, r * L, S)
    return (probs @ v).reshape(B, Hq, L, D)


def scaled_dot_product_attention(q, k, v, cache, scale: float, mask) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, or `grouped_attention` for a few-row pass on
    the CPU over a plain (not 8-bit) KV cache. Callers pass verify and draft blocks only: a
    prefill keeps mlx-lm's whole module (Target.forward)."""
    if grouped_rows(q.shape[2]) and not hasattr(cache, "bits"):
        return grouped_attention(q, k, v, scale, mask)
    return mlx_lm_attention(q, k, v, cache=cache, scale=scale, mask=mask)
