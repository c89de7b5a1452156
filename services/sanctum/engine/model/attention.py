"""Attention as the engine runs it: mlx-lm's attention modules with their cache part split off.

The split (`attention_over`): mlx-lm's module takes one cache, so the projections and the
output gate run once over all rows of N sequences. The cache part runs either per sequence
(RoPE at its offset, its KV update, the attention over its own length), or, for a shared verify
over fp16 KV (`SharedKV`), once for all N: their KV buffers stacked, the new rows written at
each sequence's offset by one scatter, one attention under a mask made once a round, the
buffers handed back by one split. A shared verify (decode/batch.py) needs it; on the CPU a
solo verify takes it too, for the grouped attention of kernels/sdpa.py (Target.forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen3, qwen3_moe
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE

from ..kernels import fused
from ..kernels.sdpa import scaled_dot_product_attention
from . import stacks

# RoPE classes that take an array of offsets (one per sequence) as mx.fast.rope does
_ARRAY_OFFSET_ROPES = (nn.RoPE, Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE)
KV_STEP = 256  # a stacked buffer's capacity grows in these steps, as mlx-lm's KVCache


@dataclass
class SharedKV:
    """The attention layers of a shared verify in common (every attention layer of a sequence
    holds the same number of tokens): the offsets, and the mask, made once a round."""

    offsets: list[int]  # per sequence, tokens in its caches before the pass
    rows: int  # L, each block's rows
    mask: mx.array  # [N, 1, L, T] bool: row i of sequence n sees keys 0 .. offsets[n] + i
    positions: mx.array  # [N, 1, L, 1] int32: where sequence n's new rows go in its buffer
    offset_array: mx.array  # [N] int32, for RoPE

    @property
    def length(self) -> int:  # T: keys the attention reads, the longest sequence's
        return max(self.offsets) + self.rows


def shared_kv(attn, caches: list, rows: int) -> SharedKV | None:
    """The SharedKV of N sequences' first attention layer caches, or None where the cache part
    must run per sequence (8-bit KV, a module or RoPE not split here, a single sequence)."""
    if (
        len(caches) < 2
        or type(attn) not in _SPLIT_ATTENTION
        or not isinstance(getattr(attn, "rope", None), _ARRAY_OFFSET_ROPES)
        or any(type(c) is not KVCache or c.keys is None for c in caches)
    ):
        return None
    offsets = [c.offset for c in caches]
    length = max(offsets) + rows
    ends = np.array(offsets)[:, None] + np.arange(rows)[None]  # [N, L]: each row's last key
    mask = np.arange(length)[None, None] <= ends[:, :, None]  # [N, L, T]
    return SharedKV(
        offsets,
        rows,
        mx.array(mask[:, None]),
        mx.array(ends[:, None, :, None].astype(np.int32)),
        mx.array(np.array(offsets, np.int32)),
    )


def attention_over(attn, x: mx.array, masks, caches: list) -> mx.array:
    """An mlx-lm attention module over N sequences ([N, L, H]), each on its own KV cache: the
    projections (q/k/v as one product when fused: engine/kernels/fused.py; the target's are not fused
    at load, since a decode step runs mlx-lm's module on its own layers) and the output gate
    once over all N * L rows; the cache part once for all N when `masks` is a SharedKV, else
    per sequence (`masks`: one mask each). A module type not split here runs whole, once per
    sequence."""
    split = _SPLIT_ATTENTION.get(type(attn))
    if isinstance(masks, SharedKV):
        return split(attn, x, lambda q, k, v: _attend_shared(attn, q, k, v, masks, caches))
    if split is None:
        stacks.release(caches)  # the module writes them in place
        rows = [attn(x[n : n + 1], mask, c) for n, (mask, c) in enumerate(zip(masks, caches))]
        return mx.concatenate(rows, axis=0)
    return split(attn, x, lambda q, k, v: _attend_each(attn, q, k, v, masks, caches))


def _attend_shared(attn, q, k, v, shared: SharedKV, caches: list) -> mx.array:
    """`_attend_each` for N fp16 KV caches in one set of ops: RoPE at each sequence's offset,
    the new rows scattered into the stacked buffers, one attention over the longest sequence's
    keys (a shorter one's padding masked: each row sees what it sees alone; its products, over
    more keys, may round a last bit differently), each cache handed its row of the buffers
    back. q, k, v: [N, L, heads, head_dim]."""
    N, L = q.shape[:2]
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    queries = attn.rope(q, offset=shared.offset_array)
    keys, values = _stacked(caches, shared.length)  # [N, kv_heads, capacity, head_dim]
    keys = mx.put_along_axis(keys, shared.positions, attn.rope(k, offset=shared.offset_array), 2)
    values = mx.put_along_axis(values, shared.positions, v, 2)
    rows = list(zip(mx.split(keys, N, axis=0), mx.split(values, N, axis=0)))
    for c, (kc, vc) in zip(caches, rows):
        c.keys, c.values = kc, vc
        c.offset += L
    stacks.tag(caches, (keys, values), rows)
    T = shared.length
    out = scaled_dot_product_attention(
        queries, keys[:, :, :T], values[:, :, :T], None, attn.scale, shared.mask
    )
    return out.transpose(0, 2, 1, 3).reshape(N, L, -1)


def _restack(caches: list, capacity: int) -> tuple[mx.array, mx.array] | None:
    """The last shared pass's buffers of `caches` where they still hold exactly what the
    caches hold and `capacity` rows, else None. Taken buffers are let go by the stack and
    the caches (the pass hands the caches new rows), so that the pass's write of the new
    rows may reuse them in place (a buffer no other array shares)."""
    stack = stacks.held(caches, lambda c: (c.keys, c.values))
    if stack is None or stack.whole[0].shape[2] < capacity:
        return None
    keys, values = stack.whole
    stack.whole, stack.rows = None, []
    for c in caches:
        c.keys = c.values = None
    return keys, values


def _stacked(caches: list, length: int) -> tuple[mx.array, mx.array]:
    """The caches' key and value buffers stacked on the batch axis, at one capacity that holds
    `length` rows: the last shared pass's as they are where `_restack` finds them, else a
    copy, a buffer below that capacity widened (zeros after its rows), which happens once each
    time the longest sequence crosses a KV_STEP."""
    capacity = max(length, *(c.keys.shape[2] for c in caches))
    capacity = -(-capacity // KV_STEP) * KV_STEP
    reused = _restack(caches, capacity)
    if reused is not None:
        return reused
    keys, values = [], []
    for c in caches:
        k, v = c.keys, c.values
        if k.shape[2] < capacity:
            pad = [(0, 0), (0, 0), (0, capacity - k.shape[2]), (0, 0)]
            k, v = mx.pad(k, pad), mx.pad(v, pad)
        keys.append(k)
        values.append(v)
    return mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0)


def _attend_each(attn, q, k, v, masks: list, caches: list) -> mx.array:
    """The cache part of mlx-lm's attention, per sequence: RoPE at its own offset, its KV update,
    the attention over its own length. q, k, v: [N, L, heads, head_dim]; returns
    [N, L, heads * head_dim]."""
    N, L = q.shape[:2]
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    # mlx-lm's update writes a cache's arrays in place (the same array objects, new contents):
    # they are no longer rows of a shared pass's stack
    stacks.release(caches)
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
