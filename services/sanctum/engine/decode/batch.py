"""One target forward over several sequences' blocks (the verify of a batched round), and one
drafter body forward over their draft blocks.

Each sequence keeps its own caches (attention KV of its own length and format, GDN state of
batch 1), so nothing about a sequence changes when it joins or leaves a batch. For the forward,
the rows of every sequence's block go through the dense parts of the model together ([N, L, H]:
projections, MLPs, norms, the LM head, the GDN math with the states stacked on the batch axis,
the attention projections and output gate). Over fp16 KV the attention's cache part runs once
for all N too (model/attention.py, SharedKV: stacked buffers, each row masked to its own
sequence's keys); over 8-bit KV it runs per sequence, as a solo verify runs it. The caches are
written back, and the outputs handed out, by one split per array. Every row then computes what
it computes alone: the batch axis only adds independent rows to the same kernels (the shared
attention's products span the longest sequence's keys, which can round a last bit otherwise;
tests/engine/test_batch_rounds.py checks outputs token for token).

Knows nothing about drafters, scheduling, Ray or gRPC.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from ..kernels import cuda
from ..kernels.draft_reference import block_attention_mask
from ..model.attention import (
    SharedKV,
    attention_over,
    scaled_dot_product_attention,
    shared_kv,
)
from ..model.drafter import ContextCache, DraftBody
from ..model.gdn import GDNBatchTape, _math_for, batch_tape_entry, cache_states
from ..model.target import BatchTape, DequantizedView, Target, VerifyTape, cache_offset


def verify_batch(
    target: Target,
    blocks: mx.array,  # [N, L] ints: each an anchor + drafts, padded at its end
    caches: list[list],
    tap_ids: tuple[int, ...],
    widths: list[int] | None = None,  # each block's real rows; None: all L
    taped: bool = True,
) -> tuple[list[tuple[mx.array, mx.array, VerifyTape]], BatchTape]:
    """Run N draft blocks on their N caches in one forward; returns per sequence what
    `Target.verify` returns for its block alone, and the pass's BatchTape (to roll all N back
    together: `Target.rollback_batch`). The target is causal, so rows padded after a block's
    `widths[n]` real rows leave those rows' results as they are; its tape's rollback
    (keep <= widths[n]) discards the padded rows' KV and states. `taped=False`: rows that
    stay (plain steps of several sequences, [N, 1]): the GDN layers run as `Target.forward`
    runs them, keep no tape, and the tapes returned are None."""
    N, L = blocks.shape
    widths = widths or [L] * N
    starts = [cache_offset(c) for c in caches]
    gdn_tapes: list[GDNBatchTape] = []
    h = target.embed_tokens(blocks)  # [N, L, H]
    masks = _attention_masks(target, h, caches)
    wanted: dict[int, mx.array | None] = {layer_id: None for layer_id in tap_ids}
    for i, layer in enumerate(target.layers):
        x = layer.input_layernorm(h)
        layer_caches = [c[i] for c in caches]
        if target.is_gdn[i]:
            r = _gdn_batch(layer.linear_attn, x, layer_caches, gdn_tapes if taped else None)
        else:
            if target.dequantize_q8:
                layer_caches = [
                    DequantizedView(c) if isinstance(c, QuantizedKVCache) else c
                    for c in layer_caches
                ]
            r = attention_over(layer.self_attn, x, masks, layer_caches)
        h = target._residual_mlp(layer, h, r)
        if i in wanted:
            wanted[i] = h
        target.hand_on(i, h)
    logits = target.lm_head(target.norm(h))  # [N, L, V]
    taps = mx.concatenate([wanted[i] for i in tap_ids], axis=-1) if tap_ids else None
    tapes = [
        VerifyTape(starts[n], w, [layer.entries[n] for layer in gdn_tapes]) if taped else None
        for n, w in enumerate(widths)
    ]
    logits = _real_rows(logits, widths)
    taps = _real_rows(taps, widths) if taps is not None else [None] * N
    outs = list(zip(logits, taps, tapes))
    return outs, BatchTape(tapes, gdn_tapes) if taped else None


def _attention_masks(target: Target, h: mx.array, caches: list[list]) -> SharedKV | list:
    """What the attention layers of a shared verify take: a SharedKV (their cache part once
    for all N sequences) where `shared_kv` allows it, else one mask per sequence."""
    first = target._first_attn
    if first is None:
        return [None] * len(caches)
    firsts = [c[first] for c in caches]
    shared = shared_kv(target.layers[first].self_attn, firsts, h.shape[1])
    return shared if shared is not None else [cuda.attention_mask(h[:1], c) for c in firsts]


def _rows(x: mx.array) -> list[mx.array]:
    """x [N, ...] as N arrays [1, ...], by one op."""
    return mx.split(x, x.shape[0], axis=0) if x.shape[0] > 1 else [x]


def _real_rows(x: mx.array, widths: list[int]) -> list[mx.array]:
    """x [N, L, ...] as N arrays [widths[n], ...] (each block's real rows), by two ops."""
    N, L = x.shape[:2]
    if N == 1:
        return [x[0, : widths[0]]]
    cuts, firsts = [], []  # where pieces end; each sequence's piece
    for n, w in enumerate(widths):
        firsts.append(len(cuts))
        cuts += [n * L + w, (n + 1) * L] if w < L else [(n + 1) * L]
    pieces = mx.split(x.reshape(N * L, *x.shape[2:]), cuts[:-1], axis=0)
    return [pieces[i] for i in firsts]


def _gdn_batch(mod, x: mx.array, caches: list, tapes: list[GDNBatchTape] | None) -> mx.array:
    """`gdn.gdn_forward` over N sequences whose batch-1 states are stacked; with `tapes`,
    taped, appending the layer's GDNBatchTape."""
    N, S, _ = x.shape
    convs, states = zip(*(cache_states(mod, c, 1, x.dtype) for c in caches))
    state_in = mx.concatenate(states, axis=0)  # [N, Hv, Dv, Dk]
    conv_state = mx.concatenate(convs, axis=0)  # [N, K-1, conv_dim]
    out, conv_input, state, extra = _math_for(mod, tapes is not None, S)(x, conv_state, state_in)
    convs = _rows(conv_input[:, -(mod.conv_kernel_size - 1) :, :])
    for c, conv, row_state in zip(caches, convs, _rows(state)):
        c[0], c[1] = conv, row_state
        c.advance(S)
    if tapes is not None:
        tapes.append(batch_tape_entry(mod, caches, conv_input, state_in, S, extra))
    return out


def draft_batch(
    body: DraftBody,
    caches: list[list[ContextCache]],
    new_taps: list[mx.array | None],  # each [C_n, n_taps * H_target] or None
    block_embeds: mx.array,  # [N, L, H]
    starts: list[int],  # each sequence's anchor position
) -> mx.array:  # [N, L, H]
    """`DraftBody.__call__` over N sequences at once: their new context rows go into each
    sequence's own context cache, then the N blocks run the layers together (attention per
    sequence on its own context, as `verify_batch` does for the target)."""
    _add_contexts(body, caches, new_taps, starts)
    h = block_embeds
    if body.cfg.input_embedding_scale != 1.0:
        h = h * body.cfg.input_embedding_scale
    if all(body._compilable(cache) for cache in caches):
        # the solo compiled stack over each group of sequences whose contexts pad to the same
        # buckets: their context rows and masks stack, and each block's rows compute as alone
        # (rows of one batch never see each other); once every window is full, one group
        groups: dict[tuple[int, ...], list[int]] = {}
        for n, cache in enumerate(caches):
            groups.setdefault(tuple(c.bucket() for c in cache), []).append(n)
        outs, order = [], []
        for members in groups.values():
            parts = [body.padded_context(caches[n], h.shape[1]) for n in members]
            ctx = [mx.concatenate(column, axis=0) for column in zip(*parts)]
            rows = h if len(members) == len(caches) else h[mx.array(members)]
            start = mx.array([starts[n] for n in members])
            outs.append(body._compiled_stack()(rows, start, *ctx))
            order += members
        if len(outs) == 1:
            return outs[0]
        # back to the callers' order: row n of the result is sequence n's
        return mx.concatenate(outs, axis=0)[mx.argsort(mx.array(order))]
    for i, layer in enumerate(body.layers):
        layer_caches = [c[i] for c in caches]
        h = layer.run(h, lambda y, a=layer.self_attn, cs=layer_caches: _attend(a, y, starts, cs))
    return body.norm(h)


def _add_contexts(body: DraftBody, caches, new_taps: list, starts: list[int]) -> None:
    """Each sequence's new context rows into its own context caches, their products made once
    for all: fc and hidden_norm over every new row, each layer's k and v projections too; RoPE
    at each sequence's positions and the appends per sequence. (A sequence at a time paid the
    products' fixed cost once per sequence.)"""
    keep = body.context_rows_needed()
    parts = []  # (cache, taps, position of the first new row)
    for taps, start, cache in zip(new_taps, starts, caches):
        if taps is None or taps.shape[0] == 0:
            continue
        if keep is not None:
            taps = taps[-keep:]
        parts.append((cache, taps, start - taps.shape[0]))
    if not parts:
        return
    ctx = body.hidden_norm(body.fc(mx.concatenate([t for _, t, _ in parts])[None]))
    bounds = np.cumsum([0] + [t.shape[0] for _, t, _ in parts]).tolist()
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        k, v = (attn.k_proj(ctx), attn.v_proj(ctx)) if len(parts) > 1 else (None, None)
        for (cache, _, first), a, b in zip(parts, bounds, bounds[1:]):
            rows = ctx[:, a:b]
            projected = (k[:, a:b], v[:, a:b]) if k is not None else None
            attn.add_context(rows, first, cache[i], projected)


def _attend(attn, x: mx.array, starts: list[int], caches: list[ContextCache]) -> mx.array:
    """`DraftAttention.__call__` for N blocks: projections batched, the rest per sequence."""
    N, L, _ = x.shape
    q_all = attn.q_norm(attn.q_proj(x).reshape(N, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    k_all = attn.k_norm(attn.k_proj(x).reshape(N, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v_all = attn.v_proj(x).reshape(N, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    outs = []
    for n, (start, cache) in enumerate(zip(starts, caches)):
        q = attn.rope(q_all[n : n + 1], offset=start)
        k, v = attn.rope(k_all[n : n + 1], offset=start), v_all[n : n + 1]
        num_ctx = cache.num_rows
        if num_ctx:
            ck, cv = cache.fetch()
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
        mask = block_attention_mask(num_ctx, L, attn.causal, attn.window)
        outs.append(scaled_dot_product_attention(q, k, v, None, attn.scale, mask))
    out = mx.concatenate(outs, axis=0)  # [N, heads, L, d]
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))
