"""Attention as the engine runs it: mlx-lm's attention modules with their cache part split off.

The split (`attention_over`): mlx-lm's module takes one cache, so the projections and the
output gate run once over all rows of N sequences, and only the cache part (RoPE at each
sequence's offset, its KV update, the attention over its own length) runs per sequence. A
shared verify (decode/batch.py) needs it; on the CPU a solo verify takes it too, for the
grouped attention of kernels/sdpa.py (Target.forward).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import qwen3, qwen3_moe
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from ..kernels import fused
from ..kernels.sdpa import scaled_dot_product_attention


def attention_over(attn, x: mx.array, masks: list, caches: list) -> mx.array:
    """An mlx-lm attention module over N sequences ([N, L, H]), each on its own KV cache: the
    projections (q/k/v as one product when fused: engine/kernels/fused.py; the target's are not fused
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
