"""`sanctum train drafter`: a DFlash drafter for any mlx-lm target (DFLASH.md, "Training recipe").

The target is frozen and runs online over each batch of sequences for its taps (and its logits,
which the drafter is distilled towards). Many anchors are drawn per sequence; each gets one block
`[x_p, MASK, ...]` at positions p..p+L-1 whose rows see the context (the taps' K/V) strictly
before p and every row of their own block, never another block. Row k predicts token p+k with
weight exp(-(k-1)/gamma). The block forward reuses `DraftBody`'s own modules, so the weights load
with `load_drafter` unchanged; tests pin it to the inference forward.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..engine.drafter import DraftBody, DrafterConfig, default_tap_ids
from ..engine.target import Target
from ..tokenizer import MASK
from .data import Corpus, sample_windows
from .gdn import chunked_gdn
from .loop import (
    LossLog,
    Schedule,
    cast_weights,
    fit_budget,
    make_step,
    parse_dtype,
    save_sharded,
)

GAMMA = {8: 4.0, 16: 7.0}  # position-weight decay per block size (DFLASH.md)


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's size; hidden size and vocabulary are the target's."""

    layers: int = 3
    heads: int | None = None  # default: hidden // head_dim
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int | None = None  # default: the target's MLP width
    tap_ids: tuple[int, ...] | None = None  # default: DFLASH.md's evenly spaced ids
    block_size: int = 8  # what config.json says; inference may pick another
    mask_token_id: int | None = None  # default: the tokenizer's <|mask|>


@dataclass(frozen=True)
class DrafterTraining:
    steps: int = 2000
    batch: int = 32
    seq_len: int = 512
    rows_per_seq: int = 512  # anchors per sequence = rows_per_seq // block size
    block_sizes: tuple[int, ...] = (8, 16)  # alternated step by step
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    distill: float = 1.0  # weight of the target's distribution vs the data's token in the labels
    regen: int = 0  # sequences the target writes itself (greedy) to train on, besides the corpus
    regen_prompt: int = 32
    regen_batch: int = 512
    regen_frac: float = 0.5  # share of each batch drawn from the regenerated sequences
    hard_labels: str = "data"  # hard labels (weight 1 - distill): "data" or "target" (argmax)
    select: str = "loss"  # checkpoint kept: lowest held-out "loss" or highest held-out "tau"
    seed: int = 0
    time_budget_s: float | None = None
    save_every_s: float = 120.0
    eval_every: int = 250
    log_every: int = 10
    dtype: str = "bfloat16"
    compile: bool = False


def mask_token_id(target: Target) -> int | None:
    vocab = target.tokenizer.get_vocab() if hasattr(target.tokenizer, "get_vocab") else {}
    return vocab.get(MASK)


def drafter_config(target: Target, shape: DrafterShape, dtype: str = "float32") -> dict:
    """config.json of a DFlash drafter for `target` (all layers full attention, non-causal)."""
    hidden = target.hidden_size
    text = target.config.get("text_config", target.config)
    taps = shape.tap_ids or default_tap_ids(
        target.num_layers, min(5, max(1, target.num_layers - 3))
    )
    mask_id = shape.mask_token_id if shape.mask_token_id is not None else mask_token_id(target)
    if mask_id is None:
        raise ValueError(f"the target's tokenizer has no {MASK} token: pass --mask-token-id "
                         "(a reserved token of its vocabulary)")  # fmt: skip
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads or max(1, hidden // shape.head_dim),
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate or int(text.get("intermediate_size", 3 * hidden)),
        "vocab_size": target.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": target.max_context,
        "block_size": shape.block_size,
        "num_target_layers": target.num_layers,
        "layer_types": ["full_attention"] * shape.layers,
        "torch_dtype": dtype,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": int(mask_id)},
    }


# ---- the training forward ---------------------------------------------------------------


def block_masks(
    cfg: DrafterConfig, anchors: mx.array, seq_len: int, block: int
) -> dict[str, mx.array]:
    """Boolean masks [B, 1, N*L, S + N*L] per layer type, by the inference rules
    (`engine.drafter.block_attention_mask`): context keys strictly before the anchor, in sliding
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
        h = layer.run(h, lambda y: _attend(layer.self_attn, y, ctx, pos, masks[kind], B, N))  # noqa: B023
    return body.norm(h).reshape(B, N, L, H)


# ---- the frozen target ------------------------------------------------------------------


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


def regenerate(target: Target, tokens: np.ndarray, count: int, prompt_len: int, total_len: int,
               batch: int, rng: np.random.Generator) -> np.ndarray:  # fmt: skip
    """[count, total_len] sequences: corpus prompts continued greedily by the target itself, so
    that the drafter learns the target's own outputs (the recipe's regenerated data)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for start in range(0, count, batch):
        n = min(batch, count - start)
        prompts = mx.array(sample_windows(tokens, n, prompt_len, rng))
        cache = make_prompt_cache(target.model)
        logits = target.model(prompts, cache=cache)[:, -1]
        pieces = [prompts]
        for _ in range(total_len - prompt_len):
            nxt = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
            pieces.append(nxt)
            logits = target.model(nxt, cache=cache)[:, -1]
            mx.async_eval(logits)
        out.append(np.array(mx.concatenate(pieces, axis=1)))
    return np.concatenate(out).astype(np.int32)


# ---- loss ---------------------------------------------------------------------------------


def draft_loss(body: DraftBody, lm_head, mask_embed: mx.array, embeds: mx.array, tokens: mx.array,
               taps: mx.array, t_logits: mx.array, anchors: mx.array, weights: mx.array,
               distill: float, hard_labels: str = "data"):  # fmt: skip
    """Weighted block cross-entropy; metrics: per-row agreement with the target's argmax and the
    expected acceptance length (teacher-forced tau) of these blocks.

    embeds [B, S, H] target input embeddings of `tokens` [B, S]; anchors [B, N]; weights [L-1].
    The hard part of the labels (weight 1 - distill) is the data's next token, or with
    hard_labels="target" the target's argmax there (what greedy acceptance checks).
    """
    B, N = anchors.shape
    L = weights.shape[0] + 1
    anchor_embeds = mx.take_along_axis(embeds, anchors[..., None], axis=1)  # [B, N, H]
    masks = mx.broadcast_to(mask_embed, (B, N, L - 1, mask_embed.shape[-1]))
    block = mx.concatenate([anchor_embeds[:, :, None], masks], axis=2)  # [B, N, L, H]
    hidden = block_forward(body, taps, block, anchors)[:, :, 1:]  # [B, N, L-1, H]
    logits = lm_head(hidden).astype(mx.float32)  # [B, N, L-1, V]
    idx = anchors[..., None] + mx.arange(1, L)  # [B, N, L-1]: positions predicted
    labels = mx.take_along_axis(tokens, idx.reshape(B, -1), axis=1).reshape(B, N, L - 1)
    prev = (idx - 1).reshape(B, -1)
    t_rows = mx.take_along_axis(t_logits, prev[..., None], axis=1).reshape(B, N, L - 1, -1)
    if hard_labels == "target":
        labels = mx.argmax(t_rows, axis=-1)
    logz = mx.logsumexp(logits, axis=-1)
    hard = logz - mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    loss_rows = (1 - distill) * hard
    if distill > 0:
        soft = logz - (mx.softmax(t_rows, axis=-1) * logits).sum(-1)
        loss_rows = loss_rows + distill * soft
    loss = (loss_rows * weights).sum() / (B * N * weights.sum())
    agree = (mx.argmax(logits, -1) == mx.argmax(t_rows, -1)).astype(mx.float32)  # [B, N, L-1]
    tau = 1 + mx.cumprod(agree, axis=-1).sum(-1).mean()
    return loss, {"tau": mx.stop_gradient(tau), "row1_acc": mx.stop_gradient(agree[..., 0].mean())}


def position_weights(block: int) -> mx.array:
    gamma = GAMMA.get(block, block * 7 / 16)
    return mx.exp(-mx.arange(block - 1, dtype=mx.float32) / gamma)


def sample_anchors(batch: int, seq_len: int, block: int, rows_per_seq: int, rng) -> mx.array:
    """[B, N] distinct anchors per sequence in 1..S-L (so that every label is in the window)."""
    n = max(1, min(rows_per_seq // block, seq_len - block))
    order = np.argsort(rng.random((batch, seq_len - block)), axis=1)[:, :n] + 1
    return mx.array(np.sort(order, axis=1).astype(np.int32))


# ---- the loop -----------------------------------------------------------------------------


def write_checkpoint(out: Path, raw_config: dict, body: DraftBody, dtype) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_sharded(out, cast_weights(dict(tree_flatten(body.parameters())), dtype))
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))
    return out


def target_for_training(target: Target, dtype: str | None = "float32") -> Target:
    """The target as the CPU engine runs it: a packed checkpoint (`dequantize_on_cpu`, quantized
    only to stay small) dequantized on every device, and its weights cast to `dtype` (None: as
    loaded), so that a drafter trained on the GPU learns the numbers it will be served with."""
    from mlx_lm.utils import dequantize_model

    if target.config.get("dequantize_on_cpu") and mx.default_device() != mx.cpu:
        dequantize_model(target.model)
    if dtype:
        target.model.set_dtype(parse_dtype(dtype))
    mx.eval(target.model.parameters())
    return target


def init_body(path: str | Path, target: Target) -> tuple[DraftBody, dict]:
    """A trained drafter's body (packed or not: quantized weights come back dequantized) in
    float32, and its config without the storage `quantization` entry, to fine-tune from."""
    from ..engine.drafter import load_drafter

    drafter = load_drafter(path, target, parts="body")
    raw = json.loads((Path(drafter.path) / "config.json").read_text())
    raw.pop("quantization", None)
    body = drafter.body
    body.set_dtype(mx.float32)
    body.unfreeze()
    mx.eval(body.parameters())
    return body, raw


class _Batches:
    """Training windows from the corpus and (optionally) the target's regenerated sequences."""

    def __init__(self, corpus: Corpus, regen: np.ndarray | None, s: DrafterTraining, rng):
        self.corpus, self.regen, self.s, self.rng = corpus, regen, s, rng

    def __call__(self) -> mx.array:
        s = self.s
        n_regen = round(s.batch * s.regen_frac) if self.regen is not None else 0
        rows = [sample_windows(self.corpus.train, s.batch - n_regen, s.seq_len, self.rng)]
        if n_regen:
            pick = self.rng.integers(0, self.regen.shape[0], size=n_regen)
            rows.append(self.regen[pick, : s.seq_len])
        return mx.array(np.concatenate(rows).astype(np.int32))


def train_drafter(
    target: Target,
    corpus: Corpus,
    out: str | Path,
    shape: DrafterShape = DrafterShape(),
    settings: DrafterTraining = DrafterTraining(),
    log=print,
    init: str | Path | None = None,
    regen_data: tuple[np.ndarray, np.ndarray | None] | None = None,
) -> dict:
    """Train a DFlash drafter against the frozen `target`; writes checkpoints to `out`.

    `init`: a drafter checkpoint to start from (its config replaces `shape`). `regen_data`:
    (train [N, T], held-out [M, T] or None) regenerated sequences from `sanctum train regen`, used
    instead of regenerating here; the held-out ones are evaluated, never trained on.
    """
    out, s = Path(out), settings
    mx.random.seed(s.seed)
    if init:
        body, raw = init_body(init, target)
        raw["torch_dtype"] = s.dtype
        cfg = body.cfg
        log(f"fine-tuning {init}")
    else:
        raw = drafter_config(target, shape, s.dtype)
        cfg = DrafterConfig.from_dict(raw)
        body = DraftBody(cfg, len(cfg.target_layer_ids) * cfg.hidden_size)
    mx.eval(body.parameters())
    n_params = sum(v.size for _, v in tree_flatten(body.parameters()))
    log(f"drafter: {n_params / 1e6:.2f} M parameters, taps {cfg.target_layer_ids}, "
        f"blocks {s.block_sizes}, device {mx.default_device()}")  # fmt: skip
    target.model.eval()
    target.model.freeze()
    rng = np.random.default_rng(s.seed)
    mask_embed = mx.stop_gradient(target.embed_tokens(mx.array([cfg.mask_token_id])))  # [1, H]
    lm_head = target.lm_head
    taps_ids = tuple(cfg.target_layer_ids)
    history = LossLog()
    dtype = parse_dtype(s.dtype)
    t_start = time.perf_counter()
    with chunked_gdn():
        regen, held_regen = regen_data if regen_data is not None else (None, None)
        if regen is not None and regen.shape[1] < s.seq_len:
            raise ValueError(f"regenerated sequences have {regen.shape[1]} tokens, "
                             f"--seq-len is {s.seq_len}: use --seq-len {regen.shape[1]} or less")  # fmt: skip
        if regen is not None:
            log(f"regenerated data: {regen.shape[0]} x {regen.shape[1]} tokens"
                + (f", held out {held_regen.shape[0]}" if held_regen is not None else ""))  # fmt: skip
        elif s.regen > 0:
            regen = regenerate(target, corpus.train, s.regen, s.regen_prompt, s.seq_len,
                               s.regen_batch, rng)  # fmt: skip
            log(f"regenerated {regen.shape[0]} x {regen.shape[1]} tokens in "
                f"{time.perf_counter() - t_start:.1f} s")  # fmt: skip
        batches = _Batches(corpus, regen, s, rng)

        def loss_fn(tokens, taps, t_logits, anchors, weights):
            embeds = mx.stop_gradient(target.embed_tokens(tokens))
            return draft_loss(body, lm_head, mask_embed, embeds, tokens, taps, t_logits, anchors,
                              weights, s.distill, s.hard_labels)  # fmt: skip

        sched = Schedule(s.lr, s.steps, min(s.warmup, max(1, s.steps // 10)))
        opt = optim.AdamW(learning_rate=sched(0), weight_decay=s.weight_decay, betas=(0.9, 0.95))
        opt.init(body.trainable_parameters())
        step_fn = make_step(body, loss_fn, opt, s.clip, s.compile)
        total, step, timed_from, last_save = s.steps, 0, None, time.perf_counter()
        t_train = time.perf_counter()
        summary, best, saved_step, last_log = {}, float("inf"), 0, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        while step < total:
            block = s.block_sizes[step % len(s.block_sizes)]
            opt.learning_rate = sched(step)
            tokens = batches()
            taps, t_logits = target_pass(target, tokens, taps_ids)
            anchors = sample_anchors(s.batch, s.seq_len, block, s.rows_per_seq, rng)
            loss, metrics, norm = step_fn(tokens, taps, t_logits, anchors, position_weights(block))
            mx.eval(loss, metrics, norm, body.state, opt.state)
            step += 1
            now = time.perf_counter()
            if step == 2 * len(s.block_sizes) + 1:
                timed_from = now
            elif timed_from is not None and step in (30, 100, 300, 1000):
                per = (now - timed_from) / (step - 2 * len(s.block_sizes) - 1)
                total = fit_budget(per, step, s.steps, s.time_budget_s, now - t_start)
                sched.total = total
            if step % s.log_every == 0 or step == total:
                row = history.add(step, loss=loss.item(), grad_norm=norm.item(), lr=sched(step),
                                  block=block, tau=metrics["tau"].item(),
                                  row1_acc=metrics["row1_acc"].item())  # fmt: skip
                log(json.dumps(row))
            improved = False
            if s.eval_every and (step % s.eval_every == 0 or step == total):
                ev = evaluate(body, target, corpus, s, mask_embed, held_regen)
                log(json.dumps(history.add_eval(step, **ev)))
                if s.select == "tau":
                    score = -sum(v for k, v in ev.items() if "tau" in k)
                else:
                    score = sum(v for k, v in ev.items() if "loss" in k)
                improved, best = score < best, min(score, best)
            if improved or (
                not s.eval_every and (step == total or now - last_save > s.save_every_s)
            ):
                write_checkpoint(out, raw, body, dtype)
                last_save, saved_step = time.perf_counter(), step
            if step == total or time.perf_counter() - last_log > s.save_every_s:
                summary = {"params": n_params, "steps": step, "planned_steps": total,
                           "saved_step": saved_step, "seconds": round(time.perf_counter() - t_train, 1),
                           "regen_sequences": s.regen if regen_data is None else int(regen.shape[0]),
                           "init": str(init) if init else None, "hard_labels": s.hard_labels,
                           "best_score": best, "select": s.select, "block_sizes": list(s.block_sizes),
                           "batch": s.batch, "seq_len": s.seq_len, "lr": s.lr, "distill": s.distill,
                           "tap_ids": list(cfg.target_layer_ids), "device": str(mx.default_device())}  # fmt: skip
                history.save(out / "train_log.json", summary=summary)
                last_log = time.perf_counter()
    log(f"wrote {out} after {step} steps")
    return summary


def evaluate(body: DraftBody, target: Target, corpus: Corpus, s: DrafterTraining, mask_embed,
             held_regen: np.ndarray | None = None) -> dict:  # fmt: skip
    """Held-out loss and teacher-forced tau per block size, on fixed windows and anchors (and on
    held-out regenerated sequences, `regen_*`, when given)."""
    tokens_np = corpus.holdout if corpus.holdout.size > s.seq_len + 1 else corpus.train
    rng = np.random.default_rng(4321)
    sets = {"holdout": sample_windows(tokens_np, min(s.batch, 16), s.seq_len, rng)}
    if held_regen is not None:
        sets["regen"] = held_regen[:32, : s.seq_len]
    out = {}
    for name, rows in sets.items():
        tokens = mx.array(rows.astype(np.int32))
        taps, t_logits = target_pass(target, tokens, tuple(body.cfg.target_layer_ids))
        embeds = target.embed_tokens(tokens)
        for block in sorted(set(s.block_sizes)):
            anchors = sample_anchors(tokens.shape[0], tokens.shape[1], block, s.rows_per_seq, rng)
            loss, m = draft_loss(body, target.lm_head, mask_embed, embeds, tokens, taps, t_logits,
                                 anchors, position_weights(block), s.distill, s.hard_labels)  # fmt: skip
            out[f"{name}_loss_b{block}"] = loss.item()
            out[f"{name}_tau_b{block}"] = m["tau"].item()
    return out
