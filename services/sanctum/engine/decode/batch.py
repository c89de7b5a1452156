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
from ..model.attention import SharedKV, attention_over, shared_kv
from ..model.drafter import ContextCache, DraftBody
from ..model.drafter.context import FetchedContext, padded_block_mask
from ..model.gdn import (
    GDNBatchTape,
    _math_for,
    batch_tape_entry,
    cache_states,
    restacked,
    tag_stacked,
)
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
    stacked = restacked(caches)  # the last shared pass's, where the caches still hold them
    if stacked is not None:
        conv_state, state_in = stacked
    else:
        convs, states = zip(*(cache_states(mod, c, 1, x.dtype) for c in caches))
        state_in = mx.concatenate(states, axis=0)  # [N, Hv, Dv, Dk]
        conv_state = mx.concatenate(convs, axis=0)  # [N, K-1, conv_dim]
    out, conv_input, state, extra = _math_for(mod, tapes is not None, S)(x, conv_state, state_in)
    conv_out = conv_input[:, -(mod.conv_kernel_size - 1) :, :]
    convs, rows = _rows(conv_out), _rows(state)
    for c, conv, row_state in zip(caches, convs, rows):
        c[0], c[1] = conv, row_state
        c.advance(S)
    tag_stacked(caches, conv_out, convs, state, rows)
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
    """`DraftBody.__call__` over N sequences at once: their new context rows go into their
    context caches, and the N blocks run the layers together over one stacked context per
    layer (each sequence's rows padded in front to a common length, the pad masked out), so
    the graph has the same ops for any N. Each block's rows compute as alone: rows of one
    batch never see each other, and masked pad rows weigh exactly zero."""
    contexts = _add_contexts(body, caches, new_taps, starts, block_embeds.shape[1])
    h = block_embeds
    if body.cfg.input_embedding_scale != 1.0:
        h = h * body.cfg.input_embedding_scale
    start = mx.array(starts)
    if all(body._compilable(cache) for cache in caches):
        flat = [t for ctx in contexts for t in (ctx.keys, ctx.values, ctx.mask)]
        return body._compiled_stack()(h, start, *flat)
    for layer, ctx in zip(body.layers, contexts):
        h = layer(h, start, ctx)
    return body.norm(h)


def _add_contexts(
    body: DraftBody, caches, new_taps: list, starts: list[int], block_rows: int
) -> list[FetchedContext]:
    """Each sequence's new context rows into its context caches, and each layer's context of
    all N as one FetchedContext ([N, n_kv, R, d], mask [N, 1, L, R + L]). The new rows of all
    go through fc, hidden_norm, the k/v projections and RoPE together (each row at its own
    position); per layer, one gather lays every sequence's kept rows (old then new, the last
    ones right-aligned) out in the stacked context, which one split hands back to the caches."""
    keep = body.context_rows_needed()
    counts, rows, positions = [], [], []
    for taps, start in zip(new_taps, starts):
        if taps is None or taps.shape[0] == 0:
            counts.append(0)
            continue
        if keep is not None and taps.shape[0] > keep:
            taps = taps[-keep:]
        counts.append(taps.shape[0])
        rows.append(taps)
        positions += range(start - taps.shape[0], start)
    new = None
    if rows:
        ctx = body.hidden_norm(body.fc(mx.concatenate(rows) if len(rows) > 1 else rows[0]))
        new = (ctx[:, None], mx.array(positions))  # [S, 1, H]: a row per batch entry
    masks = body.__dict__.setdefault("_masks", {})
    if len(masks) > 64:
        masks.clear()
    return [
        _restack(layer.self_attn, [c[i] for c in caches], new, counts, block_rows, masks)
        for i, layer in enumerate(body.layers)
    ]


def _restack(attn, caches: list[ContextCache], new, counts, block_rows, masks) -> FetchedContext:
    """One layer's part of `_add_contexts`."""
    N = len(caches)
    kept = [c.rows_after(n) for c, n in zip(caches, counts)]
    if all(c.window is not None for c in caches):
        R = max(c.bucket_of(k) for c, k in zip(caches, kept))  # the padded solo path's shape
    else:
        R = max(kept)
    sources, offset, firsts = [], 0, []  # firsts: each cache's first row in use in the source
    for c in caches:
        firsts.append(offset + c.begin)
        if c.num_rows:
            sources += [(c.keys, c.values)]
            offset += c.keys.shape[2]
    fresh = offset  # the new rows' first in the source
    if new is not None:
        k, v = attn._kv(*new)  # [S, n_kv, 1, d] each
        sources.append((k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)))
    idx = np.zeros((N, R), np.int32)  # pad rows read source row 0: finite, and masked out
    for n, (c, count, rows) in enumerate(zip(caches, counts, kept)):
        # the kept rows are the last `rows` of the cache's rows then its new ones
        t = np.arange(c.num_rows + count - rows, c.num_rows + count)
        idx[n, R - rows :] = np.where(t < c.num_rows, firsts[n] + t, fresh + t - c.num_rows)
        fresh += count
    if not sources:
        empty = mx.zeros((N, attn.n_kv_heads, 0, attn.head_dim))
        return FetchedContext(empty, empty, _stacked_mask(0, block_rows, [0] * N, attn, masks))
    # a gather of whole rows (contiguous d values) is much cheaper than one along axis 2: the
    # source is seen as [n_kv * S, d] and each head's rows indexed in it
    total = fresh  # the source's rows
    heads = np.arange(attn.n_kv_heads, dtype=np.int32)[None, :, None] * total
    idx = mx.array(idx[:, None, :] + heads)  # [N, n_kv, R]
    stacked = []
    for part in zip(*sources):
        src = mx.concatenate(part, axis=2) if len(part) > 1 else part[0]
        stacked.append(mx.take(src.reshape(-1, src.shape[-1]), idx, axis=0))  # [N, n_kv, R, d]
    keys, values = stacked
    if R:
        split_k = mx.split(keys, N, axis=0) if N > 1 else [keys]
        split_v = mx.split(values, N, axis=0) if N > 1 else [values]
        for c, ck, cv, rows in zip(caches, split_k, split_v, kept):
            c.adopt(ck, cv, rows)
    pads = [R - rows for rows in kept]
    return FetchedContext(keys, values, _stacked_mask(R, block_rows, pads, attn, masks))


def _stacked_mask(rows: int, block_rows: int, pads: list[int], attn, masks: dict) -> mx.array:
    """[N, 1, L, rows + L]: `padded_block_mask` of each sequence's pad, kept by shape and pads
    (once the windows are full every round has the same)."""
    key = ("stacked", rows, block_rows, tuple(pads), attn.causal, attn.window)
    if (mask := masks.get(key)) is None:
        base = padded_block_mask(rows, block_rows, 0, attn.causal, attn.window)
        if any(pads):
            seen = mx.arange(rows + block_rows)[None] >= mx.array(pads)[:, None]  # [N, R + L]
            mask = base & seen[:, None, None, :]
        else:
            mask = mx.broadcast_to(base, (len(pads), *base.shape[1:]))
        mask = masks[key] = mx.contiguous(mask)
    return mask
