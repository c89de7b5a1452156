"""The drafter's training forward and loss (docs/design/drafter.md): many blocks per
sequence in one batched, masked pass, and their losses against the frozen target.

Many anchors are drawn per sequence; each gets one block `[x_p, MASK, ...]` at positions
p..p+L-1 whose rows see the context (the taps' K/V) strictly before p, by the same rules as
inference (`engine.kernels.draft_reference.block_attention_mask`: per-row sliding windows, is_causal), and the
rows of their own block, never another block. Row k predicts token p+k with weight
exp(-(k-1)/gamma). The layers are `DraftBody`'s own (`DraftLayer.run`), so the weights load with
`load_drafter` unchanged; tests pin this forward to the inference one.

DFlash 2's candidate selector trains beside the body: each row's top-k candidates (by the
drafter's logits) are re-scored with the low-rank (previous token, candidate) term, the previous
token being the sequence's own (what the accepted drafts are), and the scores learn the target's
distribution over the candidates (soft part) and its argmax or the data's token (hard part).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..engine.model.drafter import CandidateSelector, DraftBody
from ..engine.model.drafter.config import DrafterConfig
from ..engine.model.target import Target

GAMMA = {8: 4.0, 16: 7.0}  # position-weight decay per block size (docs/design/drafter.md)


def block_masks(
    cfg: DrafterConfig, anchors: mx.array, seq_len: int, block: int
) -> dict[str, mx.array]:
    """Boolean masks [B, 1, N*L, S + N*L] per layer type, by the inference rules
    (`engine.kernels.draft_reference.block_attention_mask`): context keys strictly before the anchor, in sliding
    layers only those less than sliding_window before each row's own position; the block's own
    rows, causally when the config says so (is_causal; when absent, in sliding layers)."""
    B, N = anchors.shape
    s = mx.arange(seq_len)[None, None, None, :]  # [1, 1, 1, S]
    a = anchors[:, :, None, None]  # [B, N, 1, 1]
    row = mx.arange(block)[None, None, :, None]  # [1, 1, L, 1]
    j = mx.arange(N * block)
    same_block = (j[:, None] // block) == (j[None, :] // block)  # [NL, NL]
    out = {}
    for kind in set(cfg.layer_types):
        sliding = kind == "sliding_attention"
        ctx = s < a
        if sliding:
            ctx = ctx & (a + row - s < cfg.sliding_window)  # [B, N, L, S]
        own = same_block
        if cfg.is_causal if cfg.is_causal is not None else sliding:
            own = own & ((j[None, :] % block) <= (j[:, None] % block))
        ctx = mx.broadcast_to(ctx, (B, N, block, seq_len)).reshape(B, N * block, seq_len)
        own = mx.broadcast_to(own[None], (B, N * block, N * block))
        out[kind] = mx.concatenate([ctx, own], axis=-1)[:, None]
    return out


def _attend(attn, x: mx.array, ctx: mx.array, pos: mx.array, mask: mx.array, B: int, N: int):
    """A DraftAttention over many blocks at once. x [B*N, L, H] block rows, ctx [B, S, H]."""
    BN, L, _ = x.shape
    nh, nkv = attn.n_heads, attn.n_kv_heads

    def group(t, heads):  # [B*N, heads, L, d] -> [B, heads, N*L, d]
        return t.reshape(B, N, heads, L, -1).transpose(0, 2, 1, 3, 4).reshape(B, heads, N * L, -1)

    q = attn.q_norm(attn.q_proj(x).reshape(BN, L, nh, -1)).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=pos)
    kb, vb = attn._kv(x, pos)  # block rows at positions p..p+L-1
    kc, vc = attn._kv(ctx, 0)  # [B, nkv, S, d] at positions 0..S-1
    k = mx.concatenate([kc, group(kb, nkv)], axis=2)
    v = mx.concatenate([vc, group(vb, nkv)], axis=2)
    out = mx.fast.scaled_dot_product_attention(group(q, nh), k, v, scale=attn.scale, mask=mask)
    out = out.reshape(B, nh, N, L, -1).transpose(0, 2, 3, 1, 4).reshape(BN, L, -1)
    return attn.o_proj(out)


def block_forward(
    body: DraftBody, taps: mx.array, block_embeds: mx.array, anchors: mx.array
) -> mx.array:
    """taps [B, S, W] of every row, block_embeds [B, N, L, H] of [x_p, MASK, ...], anchors [B, N]
    -> final hidden states [B, N, L, H] (after the body's norm)."""
    cfg = body.cfg
    B, N, L, H = block_embeds.shape
    ctx = body.hidden_norm(body.fc(taps))  # [B, S, H]
    masks = block_masks(cfg, anchors, taps.shape[1], L)
    pos = anchors.reshape(B * N)
    h = block_embeds.reshape(B * N, L, H)
    if cfg.input_embedding_scale != 1.0:
        h = h * cfg.input_embedding_scale
    for layer, kind in zip(body.layers, cfg.layer_types):
        attend = lambda y, layer=layer, kind=kind: _attend(
            layer.self_attn, y, ctx, pos, masks[kind], B, N
        )
        h = layer.run(h, attend)
    return body.norm(h).reshape(B, N, L, H)


def target_pass(
    target: Target, tokens: mx.array, tap_ids: tuple[int, ...]
) -> tuple[mx.array, mx.array]:
    """tokens [B, S] -> (taps [B, S, n_taps * H], logits [B, S, V]), no gradient."""
    h = target.embed_tokens(tokens)
    wanted = {}
    for i, layer in enumerate(target.layers):
        h = layer(h, mask=None if target.is_gdn[i] else "causal", cache=None)
        if i in tap_ids:
            wanted[i] = h
    taps = mx.concatenate([wanted[i] for i in tap_ids], axis=-1)
    logits = target.lm_head(target.norm(h)).astype(mx.float32)
    return mx.stop_gradient(taps), mx.stop_gradient(logits)


def output_logits(cfg: DrafterConfig, lm_head, hidden: mx.array) -> mx.array:
    """The head's logits (`DraftHead.logits`: multiplier, soft-cap) of [..., H] rows."""
    logits = lm_head(hidden).astype(mx.float32)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cap := cfg.final_logit_softcapping:
        logits = mx.tanh(logits / cap) * cap
    return logits


def selector_scores(sel: CandidateSelector, top_k: int, hidden, logits, prev, label=None):
    """DFlash 2's scores of each row's top-k candidates with `prev` [...] as the previous token
    (`DraftHead.select`'s score, teacher-forced): (candidates [..., k], scores [..., k]). With
    `label` [...], a row whose top-k misses it has it in place of its weakest candidate, so that
    every row teaches the selector (a reranker's positive)."""
    k = min(top_k, logits.shape[-1])
    cand = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    if label is not None:
        weakest = mx.argmin(mx.take_along_axis(logits, cand, axis=-1), axis=-1, keepdims=True)
        missing = ~(cand == label[..., None]).any(-1, keepdims=True)
        slot = (mx.arange(k) == weakest) & missing
        cand = mx.where(slot, label[..., None], cand)
    cand = mx.stop_gradient(cand)
    unary = mx.take_along_axis(logits, cand, axis=-1)
    ctx = sel.context(prev, sel.project(hidden))  # [..., rank]
    return cand, sel.scores(ctx[..., None, :], cand, unary)[..., 0, :]


def block_rows(body: DraftBody, lm_head, mask_embed: mx.array, embeds: mx.array,
               tokens: mx.array, taps: mx.array, t_logits: mx.array, anchors: mx.array,
               block: int) -> dict:  # fmt: skip
    """Teacher-forced block rows: for each anchor [B, N] a block `[x_p, MASK, ...]` of `block`
    rows through the body; per predicted row k = 1..L-1 its hidden state and logits, the true
    previous token (what DFlash 2's selector conditions on), the target's logits there and the
    data's token: `hidden` [B, N, L-1, H], `logits` / `target` [B, N, L-1, V], `prev` / `labels`
    [B, N, L-1]."""
    B, N = anchors.shape
    L = block
    anchor_embeds = mx.take_along_axis(embeds, anchors[..., None], axis=1)  # [B, N, H]
    masks = mx.broadcast_to(mask_embed, (B, N, L - 1, mask_embed.shape[-1]))
    blocks = mx.concatenate([anchor_embeds[:, :, None], masks], axis=2)  # [B, N, L, H]
    hidden = block_forward(body, taps, blocks, anchors)[:, :, 1:]  # [B, N, L-1, H]
    idx = anchors[..., None] + mx.arange(1, L)  # [B, N, L-1]: positions predicted
    prev_pos = (idx - 1).reshape(B, -1)
    return {
        "hidden": hidden,
        "logits": output_logits(body.cfg, lm_head, hidden),
        "prev": mx.take_along_axis(tokens, prev_pos, axis=1).reshape(B, N, L - 1),
        "target": mx.take_along_axis(t_logits, prev_pos[..., None], axis=1).reshape(
            B, N, L - 1, -1
        ),
        "labels": mx.take_along_axis(tokens, idx.reshape(B, -1), axis=1).reshape(B, N, L - 1),
    }


def draft_loss(body: DraftBody, lm_head, mask_embed: mx.array, embeds: mx.array, tokens: mx.array,
               taps: mx.array, t_logits: mx.array, anchors: mx.array, weights: mx.array,
               distill: float, hard_labels: str = "data",
               selector: CandidateSelector | None = None):  # fmt: skip
    """Weighted block cross-entropy (+ DFlash 2's selector loss); metrics: the expected
    acceptance length of these blocks, teacher-forced, greedy (`tau`: drafts equal the target's
    argmax) and sampled at temperature 1 (`tau_t1`: each row accepted with probability
    sum min(p, q), the rejection rule's), and row 1's greedy agreement.

    embeds [B, S, H] target input embeddings of `tokens` [B, S]; anchors [B, N]; weights [L-1].
    The hard part of the labels (weight 1 - distill) is the data's next token, or with
    hard_labels="target" the target's argmax there (what greedy acceptance checks).
    """
    cfg = body.cfg
    B, N = anchors.shape
    L = weights.shape[0] + 1
    rows = block_rows(body, lm_head, mask_embed, embeds, tokens, taps, t_logits, anchors, L)
    hidden, logits, prev, t_rows, labels = (
        rows[k] for k in ("hidden", "logits", "prev", "target", "labels")
    )
    t_argmax = mx.argmax(t_rows, axis=-1)
    if hard_labels == "target":
        labels = t_argmax
    p = mx.softmax(t_rows, axis=-1)  # the target's distribution, [B, N, L-1, V]
    loss_rows = (1 - distill) * _cross_entropy(logits, labels)
    if distill > 0:
        loss_rows = loss_rows + distill * (mx.logsumexp(logits, -1) - (p * logits).sum(-1))
    sel_rows = mx.zeros_like(loss_rows)
    if selector is None:
        picks = mx.argmax(logits, -1)
        accept_t1 = mx.minimum(p, mx.softmax(logits, axis=-1)).sum(-1)
    else:
        cand, scores = selector_scores(selector, cfg.selector_top_k, hidden, logits, prev, labels)
        logq = scores - mx.logsumexp(scores, axis=-1, keepdims=True)  # [B, N, L-1, k]
        p_cand = mx.take_along_axis(p, cand, axis=-1)
        soft = -(p_cand / mx.maximum(p_cand.sum(-1, keepdims=True), 1e-9) * logq).sum(-1)
        hard = -(mx.where(cand == labels[..., None], logq, 0.0)).sum(-1)  # the label is there
        sel_rows = distill * soft + (1 - distill) * hard
        # greedy picks and acceptance as served: among the drafter's own top-k
        cand, scores = selector_scores(selector, cfg.selector_top_k, hidden, logits, prev)
        picks = mx.take_along_axis(cand, mx.argmax(scores, -1)[..., None], axis=-1)[..., 0]
        q = mx.softmax(scores, axis=-1)
        accept_t1 = mx.minimum(mx.take_along_axis(p, cand, axis=-1), q).sum(-1)
    norm = B * N * weights.sum()
    draft = (loss_rows * weights).sum() / norm
    select = (sel_rows * weights).sum() / norm
    agree = (picks == t_argmax).astype(mx.float32)  # [B, N, L-1]
    tau = 1 + mx.cumprod(agree, axis=-1).sum(-1).mean()
    tau_t1 = 1 + mx.cumprod(accept_t1, axis=-1).sum(-1).mean()
    metrics = {"tau": tau, "tau_t1": tau_t1, "row1_acc": agree[..., 0].mean(),
               "draft_loss": draft, "select_loss": select}  # fmt: skip
    loss = draft + select
    return loss, {k: mx.stop_gradient(v) for k, v in metrics.items()}


def _cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    return mx.logsumexp(logits, -1) - mx.take_along_axis(logits, labels[..., None], -1)[..., 0]


def position_weights(block: int) -> mx.array:
    gamma = GAMMA.get(block, block * 7 / 16)
    return mx.exp(-mx.arange(block - 1, dtype=mx.float32) / gamma)


def sample_anchors(batch: int, seq_len: int, block: int, rows_per_seq: int, rng,
                   prefer: np.ndarray | None = None) -> mx.array:  # fmt: skip
    """[B, N] distinct anchors per sequence in 1..S-L (so that every label is in the window).
    With `prefer` ([B, S] bool: the tokens the target wrote itself), up to half of a row's anchors
    sit where the anchor and every label are the target's own (where a drafter serves)."""
    n = max(1, min(rows_per_seq // block, seq_len - block))
    positions = np.arange(1, seq_len - block + 1)
    if prefer is not None:  # inside[b, i]: prefer[b, p : p + L] all true, p = positions[i]
        inside = np.lib.stride_tricks.sliding_window_view(prefer, block, axis=1)[:, 1:].all(-1)
    out = np.zeros((batch, n), np.int32)
    for b in range(batch):
        picked = np.zeros(0, np.int64)
        if prefer is not None and inside[b].any():
            own = positions[inside[b]]
            picked = rng.choice(own, size=min(n // 2, own.size), replace=False)
        rest = np.setdiff1d(positions, picked)
        picked = np.concatenate([picked, rng.choice(rest, size=n - picked.size, replace=False)])
        out[b] = np.sort(picked)
    return mx.array(out)
