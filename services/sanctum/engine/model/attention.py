"""Attention as the engine runs it: mlx-lm's attention modules with their cache part split off,
and, for few-row passes on the CPU, a grouped-query attention of its own.

The split (`attention_over`): mlx-lm's module takes one cache, so the projections and the
output gate run once over all rows of N sequences, and only the cache part (RoPE at each
sequence's offset, its KV update, the attention over its own length) runs per sequence. A
shared verify (engine/batch.py) needs it; on the CPU a solo verify takes it too, for the
attention below (Target.forward).

The attention (`grouped_attention`), for verify and draft blocks on the CPU (2 to MAX_ROWS
rows): MLX has no CPU kernel for `scaled_dot_product_attention`. Its fallback repeats the keys
and values for each query head of a group (copies of the whole cache in every layer of every
pass) and takes MLX's softmax, whose exp runs one element at a time. Here each group's query
heads are folded into rows (one product per KV head, no copies), and the softmax's exp runs in
a compiled kernel, which the CPU JIT vectorizes (engine/cpu.py). Same formula and dtype; the
values differ from MLX's in the last bits (the products' tiling), as a verify's rows already
differ from a decode step's. Prefill (untaped passes, of any length) and decode steps keep
mlx-lm's attention, so plain decoding stays mlx-lm's to the bit. On a GPU, MLX's own kernels
run everywhere.

Measured on this project's 2-core CPU with the default pair's shapes (6 query heads on 2 KV
heads of 64, 2,304 keys; a timing script, 200 calls each, five runs): an 8-row attention
2.1-3.1 ms with MLX's fallback against 0.9-1.3 ms. End to end: the README, "On the CPU".
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import qwen3, qwen3_moe
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from ..kernels import cpu
from . import fused

MAX_ROWS = 32  # the few-row passes (verify and draft blocks, up to gdn.COMPILE_MAX_ROWS)
ENABLED = True  # False: MLX's attention everywhere (a before/after)


def grouped_rows(rows: int) -> bool:
    """Whether a pass of `rows` query rows takes `grouped_attention` on this device."""
    return ENABLED and 1 < rows <= MAX_ROWS and mx.default_device() == mx.cpu


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


def attention_over(attn, x: mx.array, masks: list, caches: list) -> mx.array:
    """An mlx-lm attention module over N sequences ([N, L, H]), each on its own KV cache: the
    projections (q/k/v as one product when fused: engine/fused.py; the target's are not fused
    at load, since a decode step runs mlx-lm's module on its own layers) and the output gate
    once over all N * L rows, the cache part per sequence. A module type not split here runs
    whole, once per sequence."""
    split = _SPLIT_ATTENTION.get(type(attn))
    if split is None:
        rows = [attn(x[n : n + 1], mask, c) for n, (mask, c) in enumerate(zip(masks, caches))]
        return mx.concatenate(rows, axis=0)
    return split(attn, x, lambda q, k, v: _attend_each(attn, q, k, v, masks, caches))


def _attend_each(attn, q, k, v, masks: list, caches: list) -> mx.array:
    """The cache part of mlx-lm's attention, per sequence: RoPE at its own offset, its KV update,
    the attention over its own length. q, k, v: [N, L, heads, head_dim]; returns
    [N, L, heads * head_dim]."""
    N, L = q.shape[:2]
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    outs = []
    for n, (mask, c) in enumerate(zip(masks, caches)):
        row, offset = slice(n, n + 1), c.offset
        keys, values = c.update_and_fetch(attn.rope(k[row], offset=offset), v[row])
        queries = attn.rope(q[row], offset=offset)
        outs.append(scaled_dot_product_attention(queries, keys, values, c, attn.scale, mask))
    out = outs[0] if N == 1 else mx.concatenate(outs, axis=0)  # a solo verify: no copy
    return out.transpose(0, 2, 1, 3).reshape(N, L, -1)


def _gated_attention(attn: Qwen3NextAttention, x: mx.array, attend) -> mx.array:
    """`Qwen3NextAttention.__call__` (Qwen3.5, Qwen3-Next) with its cache part as `attend`: q_proj
    gives the queries and a sigmoid output gate, both per head."""
    N, L, _ = x.shape
    q, k, v = fused.project(attn, fused.QKV, x)
    queries, gate = mx.split(q.reshape(N, L, attn.num_attention_heads, -1), 2, axis=-1)
    keys = attn.k_norm(k.reshape(N, L, attn.num_key_value_heads, -1))
    values = v.reshape(N, L, attn.num_key_value_heads, -1)
    out = attend(attn.q_norm(queries), keys, values)  # [N, L, heads * head_dim]
    return attn.o_proj(out * mx.sigmoid(gate.reshape(N, L, -1)))


def _plain_attention(attn, x: mx.array, attend) -> mx.array:
    """`Attention.__call__` of mlx-lm's qwen3 and qwen3_moe (the same body) with its cache part as
    `attend`."""
    N, L, _ = x.shape
    q, k, v = fused.project(attn, fused.QKV, x)
    queries = attn.q_norm(q.reshape(N, L, attn.n_heads, -1))
    keys = attn.k_norm(k.reshape(N, L, attn.n_kv_heads, -1))
    values = v.reshape(N, L, attn.n_kv_heads, -1)
    return attn.o_proj(attend(queries, keys, values))


_SPLIT_ATTENTION = {
    Qwen3NextAttention: _gated_attention,
    qwen3.Attention: _plain_attention,
    qwen3_moe.Attention: _plain_attention,
}
