"""`sanctum train regen`: the target's own greedy continuations of training prompts (DFLASH.md's
"regenerated data"), written once to an .npz that `sanctum train drafter --regen-data` reads.

Prompts are equal-length token windows, so a whole batch runs as one mlx-lm forward per token
with no padding: a third are plain windows of the training stream, a third end in a function's
signature + docstring (raw code, as `bench tau` prompts do), a third in the same stub asked for as
a chat user turn followed by `<|im_start|>assistant\\n`. The stubs come from training files only
(never `is_holdout` ones); the text before a stub is the training stream up to an end-of-text
token, as in the corpus. Held-out sequences (random held-out windows, continued the same way) are
written apart, for evaluation only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..engine.target import Target
from .data import Corpus, TextTokenizer, corpus_files, function_pairs, is_holdout, render_chat

KINDS = ("window", "code", "chat")


def training_stubs(paths=None, seed: int = 0) -> list[str]:
    """Function stubs (signature + docstring) of the training files' documented functions."""
    stubs = []
    for name, path in corpus_files(paths):
        if path.suffix == ".py" and not is_holdout(name):
            stubs += [
                s for s, _ in function_pairs(path.read_text(encoding="utf-8", errors="replace"))
            ]
    np.random.default_rng(seed).shuffle(stubs)
    return stubs


def stub_prompt(stub: str, chat: bool) -> str:
    """The text a stub prompt ends with: raw code to continue, or a chat turn to answer."""
    if chat:
        return render_chat([{"role": "user", "content": stub}]) + "<|im_start|>assistant\n"
    return stub + "\n"


def make_prompts(tokens: np.ndarray, count: int, length: int, rng: np.random.Generator,
                 stubs: list[dict] | None = None, eot_id: int = 0) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """[count, length] prompts and their kinds (indices into KINDS). A stub prompt is the last
    `length` tokens of (stream text, end-of-text, stub ids); stubs longer than length - 8 are
    skipped. Without stubs every prompt is a window."""
    fits = [s for s in (stubs or []) if 0 < len(s["ids"]) <= length - 8] if stubs else []
    out = np.zeros((count, length), np.int32)
    kinds = np.zeros(count, np.int8)
    starts = rng.integers(0, tokens.size - length, size=count)
    for i, s in enumerate(starts):
        window = tokens[s : s + length].astype(np.int32)
        kind = i % len(KINDS) if fits else 0
        if kind:
            pick = [f for f in fits if f["chat"] == (kind == 2)] or fits
            ids = pick[rng.integers(len(pick))]["ids"]
            window = np.concatenate([window, [eot_id], ids])[-length:]
        out[i], kinds[i] = window, kind
    return out, kinds


def continue_greedy(target: Target, prompts: np.ndarray, new_tokens: int, batch: int = 128,
                    log=None) -> np.ndarray:  # fmt: skip
    """[N, P] equal-length prompts -> [N, P + new_tokens]: each continued greedily by the target,
    `batch` sequences per forward (mlx-lm's own caches; EOS does not stop a row)."""
    from mlx_lm.models.cache import make_prompt_cache

    from .gdn import chunked_gdn

    out, t0 = [], time.perf_counter()
    for start in range(0, prompts.shape[0], batch):
        rows = mx.array(prompts[start : start + batch].astype(np.int32))
        cache = make_prompt_cache(target.model)
        with chunked_gdn():  # the prompt in chunks; one-token steps keep mlx-lm's path
            logits = target.model(rows, cache=cache)[:, -1]
        pieces = [rows]
        for _ in range(new_tokens):
            nxt = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
            pieces.append(nxt)
            logits = target.model(nxt, cache=cache)[:, -1]
            mx.async_eval(pieces[-1], logits)
        out.append(np.array(mx.concatenate(pieces, axis=1)))
        if log:
            done = start + rows.shape[0]
            log(f"regen: {done}/{prompts.shape[0]} sequences, {time.perf_counter() - t0:.0f} s")
    return np.concatenate(out).astype(np.int32)


def build_regen(target: Target, corpus: Corpus, count: int, prompt_len: int, new_tokens: int,
                batch: int = 128, holdout: int = 0, seed: int = 0, paths=None, log=None) -> dict:  # fmt: skip
    """Regenerated training sequences (and held-out ones for evaluation) as arrays to save."""
    rng = np.random.default_rng(seed)
    tok = TextTokenizer(target.path)
    texts = training_stubs(paths, seed)
    chats = [i % 2 == 1 for i in range(len(texts))]
    ids = tok.encode_batch([stub_prompt(t, c) for t, c in zip(texts, chats)])
    stubs = [{"ids": np.array(i, np.int32), "chat": c} for i, c in zip(ids, chats)]
    prompts, kinds = make_prompts(corpus.train, count, prompt_len, rng, stubs, tok.eot_id)
    train = continue_greedy(target, prompts, new_tokens, batch, log)
    result = {"train": train, "kinds": kinds}
    if holdout and corpus.holdout.size > prompt_len + 1:
        held, _ = make_prompts(corpus.holdout, holdout, prompt_len, rng)
        result["holdout"] = continue_greedy(target, held, new_tokens, batch, log)
    result["info"] = np.array(json.dumps({"prompt_len": prompt_len, "new_tokens": new_tokens,
                                          "target": str(target.path), "seed": seed,
                                          "kinds": {k: int((kinds == i).sum()) for i, k in enumerate(KINDS)}}))  # fmt: skip
    return result


def save_regen(path: str | Path, arrays: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    small = {k: v.astype(np.uint16) if k in ("train", "holdout") and v.max() < 65536 else v
             for k, v in arrays.items()}  # fmt: skip
    with open(path, "wb") as f:
        np.savez_compressed(f, **small)
    return path


def load_regen(path: str | Path) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """(train [N, T], holdout [M, T] or None, info) from `save_regen`'s file."""
    with np.load(path) as z:
        info = json.loads(str(z["info"])) if "info" in z else {}
        held = z["holdout"].astype(np.int32) if "holdout" in z else None
        return z["train"].astype(np.int32), held, info
