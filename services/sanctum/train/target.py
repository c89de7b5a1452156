"""`sanctum train target`: a small Qwen3.5 hybrid language model (Gated DeltaNet + attention, 3:1)
trained from scratch on a token corpus, written in the Hugging Face layout `load_target` reads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from ..tiny import copy_tokenizer, target_config, to_hf_weights
from ..tokenizer import EOT, IM_END
from .data import Corpus, sample_windows
from .gdn import chunked_gdn
from .loop import LossLog, Schedule, cast_weights, fit_budget, make_step, save_sharded


@dataclass(frozen=True)
class TargetShape:
    """The model's size. The defaults are the shipped pair's target (about 18 M parameters)."""

    hidden: int = 384
    layers: int = 8  # every 4th is full attention, the rest Gated DeltaNet
    intermediate: int = 1024
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64  # 8-bit KV quantizes head_dim in groups of 64
    gdn_key_heads: int = 4
    gdn_value_heads: int = 8
    gdn_head_dim: int = 64


@dataclass(frozen=True)
class TargetTraining:
    steps: int = 3000
    batch: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 150
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None  # stop (and fit the schedule) within this wall-clock time
    save_every_s: float = 120.0
    eval_every: int = 250
    log_every: int = 10
    dtype: str = "bfloat16"  # storage dtype of the written checkpoint
    compile: bool = False


def special_ids(tokenizer_dir: Path) -> dict[str, int]:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    ids.update({k: v for k, v in tok["model"]["vocab"].items() if k.startswith("<|")})
    return ids


def model_config(tokenizer_dir: Path, shape: TargetShape = TargetShape()) -> dict:
    """An HF config.json for a Qwen3.5 hybrid of `shape`, with the tokenizer's vocabulary."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    specials = special_ids(tokenizer_dir)
    vocab = max(max(tok["model"]["vocab"].values()), max(specials.values(), default=0)) + 1
    eos = [specials[t] for t in (IM_END, EOT) if t in specials]
    cfg = target_config(
        "hybrid", vocab, eos[0] if eos else 0, hidden=shape.hidden, layers=shape.layers
    )
    cfg["text_config"].update(
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.gdn_key_heads,
        linear_num_value_heads=shape.gdn_value_heads,
        linear_key_head_dim=shape.gdn_head_dim,
        linear_value_head_dim=shape.gdn_head_dim,
        tie_word_embeddings=True,
        eos_token_id=eos,
    )
    cfg.update(tie_word_embeddings=True, eos_token_id=eos)
    return cfg


def build_model(config: dict, seed: int = 0) -> nn.Module:
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    return model


def num_params(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def write_checkpoint(out: Path, config: dict, model: nn.Module, tokenizer_dir: Path, dtype) -> Path:
    """HF layout: config.json, sharded safetensors (A_log kept in float32), tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    text = config.get("text_config", config)
    weights = dict(tree_flatten(model.parameters()))
    hf = to_hf_weights(config["model_type"], weights, text["num_hidden_layers"])
    save_sharded(out, cast_weights(hf, dtype, keep=("A_log",)))
    dtype_name = str(dtype).split(".")[-1]
    if "text_config" in config:
        config = {**config, "text_config": {**config["text_config"], "torch_dtype": dtype_name}}
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype_name}, indent=2))
    copy_tokenizer(tokenizer_dir, out)
    return out


def lm_loss(model: nn.Module, x: mx.array, y: mx.array):
    logits = model(x).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, y, reduction="mean")
    return loss, {}


def evaluate(
    model: nn.Module, tokens: np.ndarray, batch: int, seq_len: int, batches: int = 4
) -> float:
    """Mean next-token loss on fixed windows of `tokens` (the held-out files)."""
    if tokens.size < seq_len + 2:
        return float("nan")
    rng = np.random.default_rng(1234)
    total = 0.0
    for _ in range(batches):
        w = mx.array(sample_windows(tokens, batch, seq_len + 1, rng))
        loss, _ = lm_loss(model, w[:, :-1], w[:, 1:])
        total += loss.item()
    return total / batches


def position_loss(target_dir: str | Path, tokens: np.ndarray, seq_len: int = 8192,
                  windows: int = 8, edges=(0, 256, 512, 1024, 2048, 4096, 8192, 16384)) -> dict:  # fmt: skip
    """Held-out next-token loss by position: mean loss of the tokens at positions [a, b) of
    `windows` fixed windows of `seq_len` tokens (the held-out files joined), per bucket. Shows
    whether a model holds up past the length it was trained on."""
    from ..engine.model.target import load_target

    target = load_target(target_dir)
    rng = np.random.default_rng(1234)
    rows = sample_windows(tokens, windows, seq_len + 1, rng)
    sums = np.zeros(seq_len)
    with chunked_gdn():
        for row in rows:
            w = mx.array(row[None].astype(np.int32))
            logits = target.model(w[:, :-1]).astype(mx.float32)
            loss = nn.losses.cross_entropy(logits, w[:, 1:], reduction="none")[0]
            sums += np.array(loss)
    per_pos = sums / len(rows)
    out = {}
    for a, b in zip(edges[:-1], edges[1:]):
        if a < seq_len:
            out[f"{a}-{min(b, seq_len)}"] = round(float(per_pos[a : min(b, seq_len)].mean()), 4)
    return out


def train_target(
    corpus: Corpus,
    tokenizer_dir: str | Path,
    out: str | Path,
    shape: TargetShape = TargetShape(),
    settings: TargetTraining = TargetTraining(),
    log=print,
) -> dict:
    """Train from scratch; writes checkpoints to `out` as it goes. Returns the summary."""
    tokenizer_dir, out = Path(tokenizer_dir), Path(out)
    s = settings
    config = model_config(tokenizer_dir, shape)
    model = build_model(config, s.seed)
    n_params = num_params(model)
    log(f"target: {n_params / 1e6:.2f} M parameters, {corpus.train.size / 1e6:.2f} M training tokens, "
        f"device {mx.default_device()}")  # fmt: skip
    sched = Schedule(s.lr, s.steps, min(s.warmup, max(1, s.steps // 10)))
    opt = optim.AdamW(learning_rate=sched(0), weight_decay=s.weight_decay, betas=(0.9, 0.95))
    rng = np.random.default_rng(s.seed)
    history = LossLog()
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[s.dtype]
    model.train()
    opt.init(model.trainable_parameters())
    with chunked_gdn():
        step_fn = make_step(model, partial(lm_loss, model), opt, s.clip, s.compile)
        t_start = last_save = time.perf_counter()
        total, step, timed_from = s.steps, 0, None
        best, saved_step, last_log = float("inf"), 0, t_start
        out.mkdir(parents=True, exist_ok=True)
        while step < total:
            opt.learning_rate = sched(step)
            w = mx.array(sample_windows(corpus.train, s.batch, s.seq_len + 1, rng))
            loss, _, norm = step_fn(w[:, :-1], w[:, 1:])
            mx.eval(loss, norm, model.state, opt.state)
            step += 1
            if not math.isfinite(loss.item()):  # fail fast: a budgeted run has no time to waste
                raise FloatingPointError(f"target loss is {loss.item()} at step {step}")
            now = time.perf_counter()
            if step == 5:
                timed_from = now  # after compilation and warm-up
            elif timed_from is not None and step in (25, 100, 300, 1000):
                total = fit_budget((now - timed_from) / (step - 5), step, s.steps, s.time_budget_s,
                                   now - t_start)  # fmt: skip
                sched.total = total
            if step % s.log_every == 0 or step == total:
                row = history.add(step, loss=loss.item(), grad_norm=norm.item(), lr=sched(step))
                log(json.dumps(row))
            improved = False
            if s.eval_every and (step % s.eval_every == 0 or step == total):
                model.eval()
                ev = evaluate(model, corpus.holdout, s.batch, s.seq_len)
                model.train()
                log(json.dumps(history.add_eval(step, holdout_loss=ev)))
                improved = math.isnan(ev) or ev < best  # NaN: no held-out text to judge by
                best = min(best, ev) if not math.isnan(ev) else best
            # keep the checkpoint with the best held-out loss (a small corpus overfits)
            if improved or (
                not s.eval_every and (step == total or now - last_save > s.save_every_s)
            ):
                write_checkpoint(out, config, model, tokenizer_dir, dtype)
                last_save, saved_step = time.perf_counter(), step
            if step == total or time.perf_counter() - last_log > s.save_every_s:
                summary = _summary(n_params, step, total, time.perf_counter() - t_start, s, corpus)
                summary.update(
                    saved_step=saved_step, best_holdout_loss=best if best < float("inf") else None
                )
                history.save(out / "train_log.json", summary=summary)
                last_log = time.perf_counter()
    model.eval()
    log(f"wrote {out} after {step} steps")
    return summary


def _summary(n_params, step, total, seconds, s: TargetTraining, corpus: Corpus) -> dict:
    return {"params": n_params, "steps": step, "planned_steps": total, "seconds": round(seconds, 1),
            "tokens_seen": step * s.batch * s.seq_len, "batch": s.batch, "seq_len": s.seq_len,
            "lr": s.lr, "device": str(mx.default_device()), "corpus": corpus.meta}  # fmt: skip
