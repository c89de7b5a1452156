"""`sanctum train drafter`: a DFlash or DFlash 2 drafter for any mlx-lm target
(docs/design/drafter.md; the batched block forward and the losses are in blocks.py).

The target is frozen and runs online over each batch of sequences for its taps and its logits
(the labels: its distribution, and its argmax or the data's token). Batches mix corpus windows
and the target's regenerated sequences (`sanctum train regen`), whose anchors lean towards the
tokens the target wrote itself. Long windows (4,096 tokens and more) with anchors over their whole
length train the drafter where conversations go; a sliding window (`--sliding-window`) bounds
what it attends to, as the published DFlash 2 drafters do.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from ..engine.kernels import fused
from ..engine.model.drafter import CandidateSelector, DraftBody
from ..engine.model.drafter.config import DrafterConfig, default_tap_ids
from ..engine.model.target import Target
from ..tokenizer import MASK
from .blocks import draft_loss, position_weights, sample_anchors, target_pass
from .data import Corpus, sample_windows
from .gdn import chunked_gdn
from .loop import LossLog, Schedule, cast_weights, fit_budget, make_step, parse_dtype, save_sharded
from .regen import Regen


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's size and kind; hidden size and vocabulary are the target's."""

    kind: str = "dflash"  # or "dflash2": dynamic convolutions and a candidate selector
    layers: int = 3
    heads: int | None = None  # default: hidden // head_dim
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int | None = None  # default: the target's MLP width
    tap_ids: tuple[int, ...] | None = None  # default: evenly spaced over the target's layers
    block_size: int = 8  # what config.json says; inference may pick another
    mask_token_id: int | None = None  # default: the tokenizer's <|mask|>
    sliding_window: int | None = None  # every layer slides over this many rows; None: full
    is_causal: bool | None = None  # written to the config when given
    selector_rank: int = 64  # DFlash 2
    selector_top_k: int = 16
    conv_kernel_size: int = 2
    conv_group_size: int = 16


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
    # every `short_every`-th step trains on `short_batch` short regenerated sequences instead
    # (`train drafter --short-data`: a prompt near the row's start, then the target's own
    # reply), where a request with little context sits; 0: never
    short_every: int = 0
    short_batch: int = 64
    short_rows_per_seq: int = 256
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
    """config.json of a drafter for `target`, in the published layout of its kind (DFlash 2:
    block size inside dflash_config)."""
    if shape.kind not in ("dflash", "dflash2"):
        raise ValueError(f"drafter kind must be dflash or dflash2, got {shape.kind!r}")
    hidden = target.hidden_size
    text = target.config.get("text_config", target.config)
    taps = shape.tap_ids or default_tap_ids(
        target.num_layers, min(5, max(1, target.num_layers - 3))
    )
    mask_id = shape.mask_token_id if shape.mask_token_id is not None else mask_token_id(target)
    if mask_id is None:
        raise ValueError(f"the target's tokenizer has no {MASK} token: pass --mask-token-id "
                         "(a reserved token of its vocabulary)")  # fmt: skip
    kind = "sliding_attention" if shape.sliding_window else "full_attention"
    raw = {
        "architectures": ["DFlash2DraftModel" if shape.kind == "dflash2" else "DFlashDraftModel"],
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
        "num_target_layers": target.num_layers,
        "layer_types": [kind] * shape.layers,
        "torch_dtype": dtype,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": int(mask_id)},
    }
    if shape.sliding_window:
        raw["sliding_window"] = shape.sliding_window
    if shape.is_causal is not None:
        raw["is_causal"] = shape.is_causal
    if shape.kind == "dflash2":
        raw["dflash_config"].update(
            block_size=shape.block_size, conv_kernel_size=shape.conv_kernel_size,
            conv_group_size=shape.conv_group_size, selector_rank=shape.selector_rank,
            selector_top_k=shape.selector_top_k,
        )  # fmt: skip
    else:
        raw["block_size"] = shape.block_size
    return raw


# ---- the modules -------------------------------------------------------------------------


class Trainee(nn.Module):
    """What a drafter's training updates: the body, and DFlash 2's candidate selector."""

    def __init__(self, body: DraftBody, selector: CandidateSelector | None):
        super().__init__()
        self.body = body
        if selector is not None:
            self.candidate_selector = selector

    @property
    def selector(self) -> CandidateSelector | None:
        return self.get("candidate_selector")

    def weights(self) -> dict[str, mx.array]:
        """The checkpoint's names: the body's at the top, the selector's under its own."""
        out = dict(tree_flatten(self.body.parameters()))
        if self.selector is not None:
            sel = tree_flatten(self.selector.parameters())
            out.update((f"candidate_selector.{k}", v) for k, v in sel)
        return out


def new_trainee(cfg: DrafterConfig) -> Trainee:
    """Fresh modules. DFlash 2's convolutions start as the identity (offset 0 weight 1, small
    dynamic part), so a new DFlash 2 drafter starts as a DFlash one; codebooks start small."""
    body = DraftBody(cfg, len(cfg.target_layer_ids) * cfg.hidden_size)
    selector = None
    if cfg.is_v2:
        for layer in body.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = mx.zeros(conv.base_kernel.shape).at[:, 0, :].add(1.0)
                conv.kernel_projection.weight = conv.kernel_projection.weight * 0.1
        selector = CandidateSelector(cfg)
        for name in ("predecessor_codebook", "successor_codebook"):
            setattr(selector, name, mx.random.normal(getattr(selector, name).shape) * 0.02)
    return Trainee(body, selector)


def init_trainee(path: str | Path, target: Target) -> tuple[Trainee, dict]:
    """A trained drafter (packed or not: quantized weights come back dequantized) in float32,
    and its config without the storage `quantization` entry, to fine-tune from."""
    from ..engine.model.drafter import load_drafter

    drafter = load_drafter(path, target)
    fused.unfuse(drafter.body)  # trained: every layer computes from its own parameters
    drafter.body.use_kernels(attention=False, conv=False)  # and by MLX's ops (gradients)
    raw = json.loads((Path(drafter.path) / "config.json").read_text())
    raw.pop("quantization", None)
    trainee = Trainee(drafter.body, drafter.head.get("candidate_selector"))
    trainee.set_dtype(mx.float32)
    trainee.unfreeze()
    mx.eval(trainee.parameters())
    return trainee, raw


def upgrade_to_dflash2(trainee: Trainee, raw: dict, shape: DrafterShape) -> tuple[Trainee, dict]:
    """A DFlash drafter's layers inside a new DFlash 2 drafter: the convolutions start as the
    identity and the selector small (`new_trainee`), so it drafts as the DFlash one did until
    training moves them."""
    raw = json.loads(json.dumps(raw))
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"].update(
        block_size=raw.pop("block_size", raw["dflash_config"].get("block_size", 8)),
        conv_kernel_size=shape.conv_kernel_size, conv_group_size=shape.conv_group_size,
        selector_rank=shape.selector_rank, selector_top_k=shape.selector_top_k,
    )  # fmt: skip
    upgraded = new_trainee(DrafterConfig.from_dict(raw))
    kept = dict(tree_flatten(trainee.body.parameters()))
    fresh = dict(tree_flatten(upgraded.body.parameters()))
    fresh.update({k: v for k, v in kept.items() if k in fresh and v.shape == fresh[k].shape})
    upgraded.body.load_weights(list(fresh.items()))
    return upgraded, raw


def relayer_attention(trainee: Trainee, raw: dict, shape: DrafterShape) -> tuple[Trainee, dict]:
    """The same weights under other attention rules: every layer sliding over
    `shape.sliding_window` rows, and `is_causal` when given. Attention has no weights of its own
    for either rule, so a drafter trained with full attention drafts the same over short contexts
    and stops attending to what it never saw in training over long ones."""
    raw = json.loads(json.dumps(raw))
    if shape.sliding_window:
        raw["layer_types"] = ["sliding_attention"] * raw["num_hidden_layers"]
        raw["sliding_window"] = shape.sliding_window
    if shape.is_causal is not None:
        raw["is_causal"] = shape.is_causal
    rebuilt = new_trainee(DrafterConfig.from_dict(raw))
    rebuilt.body.load_weights(list(tree_flatten(trainee.body.parameters())))
    if trainee.selector is not None:
        rebuilt.selector.load_weights(list(tree_flatten(trainee.selector.parameters())))
    return rebuilt, raw


def write_checkpoint(out: Path, raw_config: dict, trainee: Trainee, dtype) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_sharded(out, cast_weights(trainee.weights(), dtype))
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))
    return out


def target_for_training(target: Target, dtype: str | None = "float32") -> Target:
    """The target as the CPU engine runs it: a packed checkpoint (`dequantize_on_cpu`, quantized
    only to stay small) dequantized on every device, and its weights cast to `dtype` (None: as
    loaded), so that a drafter trained on the GPU learns the numbers it will be served with."""
    from mlx_lm.utils import dequantize_model

    fused.unfuse(target.model)  # its layers are replaced or re-cast below
    if target.config.get("dequantize_on_cpu") and mx.default_device() != mx.cpu:
        dequantize_model(target.model)
    if dtype:
        target.model.set_dtype(parse_dtype(dtype))
    mx.eval(target.model.parameters())
    return target


# ---- the loop -----------------------------------------------------------------------------


class _Batches:
    """Training windows from the corpus and (optionally) the target's regenerated sequences,
    each with the mask of the tokens the target wrote (None: no regenerated rows)."""

    def __init__(self, corpus: Corpus, regen: Regen | None, s: DrafterTraining, rng):
        self.corpus, self.regen, self.s, self.rng = corpus, regen, s, rng

    def __call__(self) -> tuple[mx.array, np.ndarray | None]:
        s = self.s
        n_regen = round(s.batch * s.regen_frac) if self.regen is not None else 0
        rows = sample_windows(self.corpus.train, s.batch - n_regen, s.seq_len, self.rng)
        if not n_regen:
            return mx.array(rows), None
        picked, generated = crop(self.regen.train, self.regen.train_generated, n_regen,
                                 s.seq_len, self.rng)  # fmt: skip
        prefer = np.concatenate([np.zeros(rows.shape, bool), generated])
        return mx.array(np.concatenate([rows, picked]).astype(np.int32)), prefer


def crop(rows: np.ndarray, generated: np.ndarray, count: int, seq_len: int, rng,
         pick: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`count` random rows (or the rows `pick`), each cut to a random `seq_len` window."""
    if pick is None:
        pick = rng.integers(0, rows.shape[0], size=count)
    offsets = rng.integers(0, rows.shape[1] - seq_len + 1, size=len(pick))
    take = pick[:, None], offsets[:, None] + np.arange(seq_len)
    return rows[take], generated[take]


def train_drafter(
    target: Target,
    corpus: Corpus,
    out: str | Path,
    shape: DrafterShape = DrafterShape(),
    settings: DrafterTraining = DrafterTraining(),
    log=print,
    init: str | Path | None = None,
    regen_data: Regen | None = None,
    short_data: Regen | None = None,
) -> dict:
    """Train a drafter against the frozen `target`; writes checkpoints to `out`.

    `init`: a drafter checkpoint to start from (its config replaces `shape`). `regen_data`:
    regenerated sequences from `sanctum train regen`, used instead of regenerating here; the
    held-out ones are evaluated, never trained on. `short_data`: short regenerated sequences
    for every `settings.short_every`-th step (their held-out ones evaluated too).
    """
    out, s = Path(out), settings
    mx.random.seed(s.seed)
    if init:
        trainee, raw = init_trainee(init, target)
        raw["torch_dtype"] = s.dtype
        log(f"fine-tuning {init}")
        if shape.sliding_window or shape.is_causal is not None:
            trainee, raw = relayer_attention(trainee, raw, shape)
            log(
                f"with sliding window {raw.get('sliding_window')}, is_causal {raw.get('is_causal')}"
            )
        if shape.kind == "dflash2" and not trainee.body.cfg.is_v2:
            trainee, raw = upgrade_to_dflash2(trainee, raw, shape)
            log("as a DFlash 2 drafter: its layers kept, new convolutions and selector")
    else:
        raw = drafter_config(target, shape, s.dtype)
        trainee = new_trainee(DrafterConfig.from_dict(raw))
    cfg = trainee.body.cfg
    mx.eval(trainee.parameters())
    n_params = sum(v.size for _, v in tree_flatten(trainee.parameters()))
    log(f"drafter ({cfg.architecture}): {n_params / 1e6:.2f} M parameters, taps "
        f"{cfg.target_layer_ids}, blocks {s.block_sizes}, device {mx.default_device()}")  # fmt: skip
    target.model.eval()
    target.model.freeze()
    rng = np.random.default_rng(s.seed)
    mask_embed = mx.stop_gradient(target.embed_tokens(mx.array([cfg.mask_token_id])))  # [1, H]
    taps_ids = tuple(cfg.target_layer_ids)
    history = LossLog()
    dtype = parse_dtype(s.dtype)
    t_start = time.perf_counter()
    with chunked_gdn():
        regen = regen_data
        if regen is not None and regen.train.shape[1] < s.seq_len:
            raise ValueError(f"regenerated sequences have {regen.train.shape[1]} tokens, "
                             f"--seq-len is {s.seq_len}: use --seq-len {regen.train.shape[1]} or less")  # fmt: skip
        if regen is not None:
            held = regen.holdout.shape[0] if regen.holdout is not None else 0
            log(f"regenerated data: {regen.train.shape[0]} x {regen.train.shape[1]} tokens, "
                f"held out {held}")  # fmt: skip
        elif s.regen > 0:
            from .regen import regenerate_rows

            windows = sample_windows(corpus.train, s.regen, s.seq_len, rng)
            rows, gen, _, _ = regenerate_rows(target, windows, 1, s.seq_len - s.regen_prompt,
                                              s.regen_batch, rng, first=s.regen_prompt)  # fmt: skip
            regen = Regen(rows, gen)
            log(f"regenerated {rows.shape[0]} x {rows.shape[1]} tokens in "
                f"{time.perf_counter() - t_start:.1f} s")  # fmt: skip
        batches = _Batches(corpus, regen, s, rng)
        short_every = s.short_every if short_data is not None else 0
        if short_every:
            log(f"short sequences: {short_data.train.shape[0]} x {short_data.train.shape[1]} "
                f"tokens, every {short_every}th step, {s.short_batch} a step")  # fmt: skip

        def loss_fn(tokens, taps, t_logits, anchors, weights):
            embeds = mx.stop_gradient(target.embed_tokens(tokens))
            return draft_loss(trainee.body, target.lm_head, mask_embed, embeds, tokens, taps,
                              t_logits, anchors, weights, s.distill, s.hard_labels,
                              trainee.selector)  # fmt: skip

        sched = Schedule(s.lr, s.steps, min(s.warmup, max(1, s.steps // 10)))
        opt = optim.AdamW(learning_rate=sched(0), weight_decay=s.weight_decay, betas=(0.9, 0.95))
        opt.init(trainee.trainable_parameters())
        step_fn = make_step(trainee, loss_fn, opt, s.clip, s.compile)
        total, step, timed_from, last_save = s.steps, 0, None, time.perf_counter()
        t_train = time.perf_counter()
        summary, best, saved_step, last_log = {}, float("inf"), 0, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        # steps taken of each kind (long, short): block sizes alternate within a kind (by the
        # step alone, short steps of an even short_every would all get one size)
        taken = {False: 0, True: 0}
        while step < total:
            short = bool(short_every) and step % short_every == short_every - 1
            block = s.block_sizes[taken[short] % len(s.block_sizes)]
            taken[short] += 1
            opt.learning_rate = sched(step)
            if short:
                tokens, prefer = crop(short_data.train, short_data.train_generated,
                                      s.short_batch, short_data.train.shape[1], rng)  # fmt: skip
                tokens, rows_per_seq = mx.array(tokens.astype(np.int32)), s.short_rows_per_seq
            else:
                (tokens, prefer), rows_per_seq = batches(), s.rows_per_seq
            taps, t_logits = target_pass(target, tokens, taps_ids)
            anchors = sample_anchors(tokens.shape[0], tokens.shape[1], block, rows_per_seq, rng,
                                     prefer)  # fmt: skip
            loss, metrics, norm = step_fn(tokens, taps, t_logits, anchors, position_weights(block))
            mx.eval(loss, metrics, norm, trainee.state, opt.state)
            step += 1
            if not math.isfinite(loss.item()):  # fail fast: a budgeted run has no time to waste
                raise FloatingPointError(f"drafter loss is {loss.item()} at step {step}")
            now = time.perf_counter()
            if step == 2 * len(s.block_sizes) + 1:
                timed_from = now
            elif timed_from is not None and step in (30, 100, 300, 1000):
                per = (now - timed_from) / (step - 2 * len(s.block_sizes) - 1)
                total = fit_budget(per, step, s.steps, s.time_budget_s, now - t_start)
                sched.total = total
            if step % s.log_every == 0 or step == total:
                row = history.add(step, loss=loss.item(), grad_norm=norm.item(), lr=sched(step),
                                  block=block, short=short,
                                  **{k: v.item() for k, v in metrics.items()})  # fmt: skip
                log(json.dumps(row))
            improved = False
            if s.eval_every and (step % s.eval_every == 0 or step == total):
                ev = evaluate(trainee, target, corpus, s, mask_embed, regen_data, short_data)
                log(json.dumps(history.add_eval(step, **ev)))
                if s.select == "tau":
                    score = -sum(v for k, v in ev.items() if "_tau_b" in k)
                else:
                    score = sum(v for k, v in ev.items() if "loss" in k)
                improved, best = score < best, min(score, best)
            if improved or (
                not s.eval_every and (step == total or now - last_save > s.save_every_s)
            ):
                write_checkpoint(out, raw, trainee, dtype)
                last_save, saved_step = time.perf_counter(), step
            if step == total or time.perf_counter() - last_log > s.save_every_s:
                summary = {"params": n_params, "steps": step, "planned_steps": total,
                           "saved_step": saved_step, "seconds": round(time.perf_counter() - t_train, 1),
                           "regen_sequences": int(regen.train.shape[0]) if regen is not None else 0,
                           "short_sequences": int(short_data.train.shape[0]) if short_every else 0,
                           "short_every": short_every,
                           "init": str(init) if init else None, "hard_labels": s.hard_labels,
                           "best_score": best, "select": s.select, "block_sizes": list(s.block_sizes),
                           "batch": s.batch, "seq_len": s.seq_len, "lr": s.lr, "distill": s.distill,
                           "architecture": cfg.architecture, "sliding_window": cfg.sliding_window,
                           "tap_ids": list(cfg.target_layer_ids), "device": str(mx.default_device())}  # fmt: skip
                history.save(out / "train_log.json", summary=summary)
                last_log = time.perf_counter()
    log(f"wrote {out} after {step} steps")
    return summary


def evaluate(trainee: Trainee, target: Target, corpus: Corpus, s: DrafterTraining, mask_embed,
             regen: Regen | None = None, short: Regen | None = None) -> dict:  # fmt: skip
    """Held-out loss and teacher-forced tau (greedy, and sampled at temperature 1) per block
    size, on fixed windows and anchors: held-out corpus windows, and held-out regenerated
    sequences (`regen_*`, anchors leaning to the target's own tokens) and short ones (`short_*`)
    when given."""
    tokens_np = corpus.holdout if corpus.holdout.size > s.seq_len + 1 else corpus.train
    rng = np.random.default_rng(4321)
    rows = min(s.batch, 16)
    sets = {"holdout": (sample_windows(tokens_np, rows, s.seq_len, rng), None)}
    if regen is not None and regen.holdout is not None:
        n = min(2 * rows, regen.holdout.shape[0])
        sets["regen"] = crop(regen.holdout, regen.holdout_generated, n, s.seq_len, rng,
                             pick=np.arange(n))  # fmt: skip
    if short is not None and short.holdout is not None:
        n = min(4 * rows, short.holdout.shape[0])
        sets["short"] = short.holdout[:n], short.holdout_generated[:n]
    out = {}
    body = trainee.body
    for name, (rows_np, prefer) in sets.items():
        tokens = mx.array(rows_np.astype(np.int32))
        taps, t_logits = target_pass(target, tokens, tuple(body.cfg.target_layer_ids))
        embeds = target.embed_tokens(tokens)
        for block in sorted(set(s.block_sizes)):
            per_seq = s.short_rows_per_seq if name == "short" else s.rows_per_seq
            anchors = sample_anchors(tokens.shape[0], tokens.shape[1], block, per_seq, rng, prefer)
            loss, m = draft_loss(body, target.lm_head, mask_embed, embeds, tokens, taps, t_logits,
                                 anchors, position_weights(block), s.distill, s.hard_labels,
                                 trainee.selector)  # fmt: skip
            out[f"{name}_loss_b{block}"] = loss.item()
            out[f"{name}_tau_b{block}"] = m["tau"].item()
            out[f"{name}_tau_t1_b{block}"] = m["tau_t1"].item()
    return out
