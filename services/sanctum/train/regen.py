"""`sanctum train regen`: the target's own continuations (regenerated data, docs/design/drafter.md),
written once to an .npz that `sanctum train drafter --regen-data` reads.

A regenerated sequence is a window of the training stream, `seq_len` tokens long, in which `spans`
stretches of `new_tokens` tokens are the target's own continuation of everything before them, at
short, middle and long context alike, the way a conversation interleaves the user's text with the
model's replies. Right before a span, two rows in three carry a function stub from a training
file in place of the stream's tokens (signature + docstring, as raw code or as a chat user turn
followed by `<|im_start|>assistant\n`), as `bench tau`'s prompts end. With `review`, every row is
instead a review chat shaped like `bench multiturn`'s: each span is the assistant's reply to a
"Review this code" turn whose code is a slice of a file, so later turns see the target's own
earlier replies, as a served conversation does. Rows continue greedily or
sampled, at temperatures cycled over the rows: the drafter's labels stay the target's
distribution (computed online while it trains), so sampled rows show it the contexts that sampled
decoding produces. All rows of a batch share span positions, so a batch runs as one mlx-lm forward
per token, without padding. Held-out sequences (held-out windows, continued the same way) are
written apart, for evaluation only. Stubs come from training files only (never `is_holdout` ones).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..engine.model.target import Target
from .data import (
    REVIEW_SYSTEM,
    Corpus,
    TextTokenizer,
    corpus_files,
    function_pairs,
    is_holdout,
    render_chat,
    review_request,
)

KINDS = ("window", "code", "chat", "review")
REVIEW = KINDS.index("review")
MIN_SNIPPET = 32  # a review turn's code, tokens at least (else the gap keeps the stream's text)
FIRST_SNIPPET = 400  # the first turn's code at most: the stream before it stays as context
PREFILL_CHUNK = 512  # rows per prefill forward: keeps a batch's activations small


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


def span_starts(seq_len: int, spans: int, new_tokens: int, rng: np.random.Generator,
                first: int | None = None) -> list[int]:  # fmt: skip
    """Where the generated spans start: one inside each of `spans` equal stretches of the window
    (so at every context length), the first at 16 or later, or at `first` when given."""
    bounds = np.linspace(0, seq_len, spans + 1).astype(int)
    starts = []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        lo = max(lo, 16) if n == 0 else lo + 1  # a gap after the previous span
        if n == 0 and first is not None:
            if not 0 < first <= hi - new_tokens:
                raise ValueError(f"--prompt-len {first} and {new_tokens} new tokens do not fit "
                                 f"the first {hi} tokens")  # fmt: skip
            starts.append(int(first))
            continue
        if hi - new_tokens < lo:
            raise ValueError(f"{spans} spans of {new_tokens} tokens do not fit {seq_len} tokens")
        starts.append(int(rng.integers(lo, hi - new_tokens + 1)))
    return starts


def place_stubs(rows: np.ndarray, starts: list[int], rng: np.random.Generator,
                stubs: list[dict] | None, eot_id: int) -> np.ndarray:  # fmt: skip
    """Kinds per row (indices into KINDS); rows of kind code/chat get, right before each span, a
    stub of that kind (after an end-of-text token) in place of the stream's tokens."""
    kinds = np.zeros(rows.shape[0], np.int8)
    if not stubs:
        return kinds
    gaps = np.diff([0, *starts])  # tokens of room before each span (after the previous one)
    for i in range(rows.shape[0]):
        kinds[i] = kind = i % REVIEW  # window, code, chat in turn (review rows: place_reviews)
        if not kind:
            continue
        pick = [s for s in stubs if s["chat"] == (kind == 2)] or stubs
        for start, room in zip(starts, gaps):
            ids = np.concatenate([[eot_id], pick[rng.integers(len(pick))]["ids"]])
            if len(ids) + 8 <= room:
                rows[i, start - len(ids) : start] = ids
    return kinds


def review_starts(seq_len: int, spans: int, new_tokens: int,
                  rng: np.random.Generator) -> list[int]:  # fmt: skip
    """Span starts for review rows: each in the second half of its stretch's free room, so
    every reply follows a user turn of a few hundred tokens, as bench multiturn's do."""
    bounds = np.linspace(0, seq_len, spans + 1).astype(int)
    starts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        free = hi - new_tokens - lo
        if free < 2 * MIN_SNIPPET:
            raise ValueError(f"{spans} review turns of {new_tokens} tokens do not fit {seq_len}")
        starts.append(int(rng.integers(lo + free // 2, hi - new_tokens + 1)))
    return starts


@dataclass
class ReviewPieces:
    """The review chat's fixed token pieces (chat template, bench multiturn's wording) and the
    code its user turns show: each file's tokens, files of at least a few hundred tokens."""

    system: np.ndarray  # "<|im_start|>system\n<REVIEW_SYSTEM><|im_end|>\n"
    head: np.ndarray  # "<|im_start|>user\nReview this code:\n```python\n"
    foot: np.ndarray  # "\n```<|im_end|>\n<|im_start|>assistant\n"
    close: np.ndarray  # "<|im_end|>\n" after a reply
    code: list[np.ndarray]


def review_pieces(tok: TextTokenizer, paths=None, holdout: bool = False) -> ReviewPieces:
    """Pieces from the training files (or, `holdout`, from the held-out ones only)."""
    user = render_chat([{"role": "user", "content": review_request("\0")}])
    head, tail = user.split("\0")
    texts = [render_chat([{"role": "system", "content": REVIEW_SYSTEM}]), head,
             tail + "<|im_start|>assistant\n", "<|im_end|>\n"]  # fmt: skip
    files = [p.read_text(encoding="utf-8", errors="replace")
             for n, p in corpus_files(paths) if p.suffix == ".py" and is_holdout(n) == holdout]  # fmt: skip
    code = [np.array(ids, np.int32) for ids in tok.encode_batch(files)]
    ids = [np.array(i, np.int32) for i in tok.encode_batch(texts)]
    code = [c for c in code if c.size >= 4 * MIN_SNIPPET]
    if not code:
        split = "held-out" if holdout else "training"
        raise ValueError(f"--review needs {split} .py files of {4 * MIN_SNIPPET}+ tokens")
    return ReviewPieces(*ids, code)


def place_reviews(rows: np.ndarray, starts: list[int], new_tokens: int,
                  rng: np.random.Generator, pieces: ReviewPieces, eot_id: int) -> None:  # fmt: skip
    """Turn each row into a review chat around its spans: before the first span the stream's
    text, then the reviewer's system turn and a user turn; before each later one the previous
    reply's end and a user turn filling the gap. A turn's code is a slice of one file (its own
    tokens, so a slice starts and ends where the file's tokenization does)."""
    sizes = np.array([c.size for c in pieces.code])
    for i in range(rows.shape[0]):
        prev_end = 0
        for n, start in enumerate(starts):
            first = n == 0
            before = [[eot_id], pieces.system] if first else [pieces.close]
            before = np.concatenate([*before, pieces.head])
            room = start - prev_end - len(before) - len(pieces.foot)
            room = min(room, FIRST_SNIPPET, sizes.max()) if first else room
            if MIN_SNIPPET <= room <= sizes.max():
                fits = np.flatnonzero(sizes >= room)
                code = pieces.code[fits[rng.integers(len(fits))]]
                at = int(rng.integers(0, code.size - room + 1))
                turn = np.concatenate([before, code[at : at + room], pieces.foot])
                rows[i, start - len(turn) : start] = turn
            prev_end = start + new_tokens


def _text_model(target: Target):
    """mlx-lm's text model (embedding, layers, final norm) inside the target's checkpoint."""
    return (
        target.model.language_model.model
        if "language_model" in target.model
        else target.model.model
    )


def _feed(target: Target, tokens: mx.array, cache: list) -> mx.array:
    """Run [B, P] tokens on the mlx-lm caches in chunks; the last row's logits [B, V]."""
    text = _text_model(target)
    for i in range(0, tokens.shape[1], PREFILL_CHUNK):
        h = text(tokens[:, i : i + PREFILL_CHUNK], cache=cache)
        mx.eval(h)
    return target.lm_head(h[:, -1]).astype(mx.float32)


def continue_spans(target: Target, rows: np.ndarray, starts: list[int], new_tokens: int,
                   temperatures: np.ndarray, key: mx.array) -> np.ndarray:  # fmt: skip
    """One batch: [B, T] rows with each span [start, start + new_tokens) replaced by the target's
    continuation of the row so far (greedy where the row's temperature is 0, else sampled)."""
    from mlx_lm.models.cache import make_prompt_cache

    from .gdn import chunked_gdn

    out = rows.copy()
    cache = make_prompt_cache(target.model)
    temps = mx.array(temperatures.astype(np.float32))[:, None]  # [B, 1]
    pos, logits = 0, None
    with chunked_gdn():  # prefill in chunks; one-token steps keep mlx-lm's path
        for start in starts:
            if start > pos:  # else the last step's logits continue right away
                logits = _feed(target, mx.array(out[:, pos:start].astype(np.int32)), cache)
            picked = []
            for _ in range(new_tokens):
                key, sub = mx.random.split(key)
                sampled = mx.random.categorical(logits / mx.maximum(temps, 1e-6), key=sub)
                nxt = mx.where(temps[:, 0] > 0, sampled, mx.argmax(logits, axis=-1))
                picked.append(nxt.astype(mx.int32))
                logits = target.lm_head(_text_model(target)(picked[-1][:, None], cache=cache))
                logits = logits[:, -1].astype(mx.float32)
                mx.async_eval(picked[-1], logits)
            out[:, start : start + new_tokens] = np.array(mx.stack(picked, axis=1))
            pos = start + new_tokens
    return out


@dataclass
class Regen:
    """Regenerated sequences: rows [N, T] and which of their tokens the target wrote."""

    train: np.ndarray  # [N, T] int32
    train_generated: np.ndarray  # [N, T] bool
    holdout: np.ndarray | None = None  # [M, T]
    holdout_generated: np.ndarray | None = None
    info: dict | None = None


def regenerate_rows(target: Target, windows: np.ndarray, spans: int, new_tokens: int,
                    batch: int, rng: np.random.Generator, temperatures=(0.0,), stubs=None,
                    eot_id: int = 0, first: int | None = None, log=None,
                    review: ReviewPieces | None = None):  # fmt: skip
    """[N, T] windows -> (rows with generated spans, generated mask, kinds, temperature per row);
    `review`: every row a review chat (`place_reviews`) instead of stubs."""
    rows, gen = windows.astype(np.int32).copy(), np.zeros(windows.shape, bool)
    kinds = np.zeros(rows.shape[0], np.int8)
    temps = np.array([temperatures[i % len(temperatures)] for i in range(rows.shape[0])])
    key = mx.random.key(int(rng.integers(2**31)))
    t0 = time.perf_counter()
    for b in range(0, rows.shape[0], batch):
        sl = slice(b, b + batch)
        if review is None:
            starts = span_starts(rows.shape[1], spans, new_tokens, rng, first)
            kinds[sl] = place_stubs(rows[sl], starts, rng, stubs, eot_id)
        else:
            starts = review_starts(rows.shape[1], spans, new_tokens, rng)
            place_reviews(rows[sl], starts, new_tokens, rng, review, eot_id)
            kinds[sl] = REVIEW
        key, sub = mx.random.split(key)
        rows[sl] = continue_spans(target, rows[sl], starts, new_tokens, temps[sl], sub)
        for s in starts:
            gen[sl, s : s + new_tokens] = True
        if log:
            log(f"regen: {min(b + batch, rows.shape[0])}/{rows.shape[0]} sequences, "
                f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return rows, gen, kinds, temps


def _stub_ids(tok: TextTokenizer, paths, seed: int) -> list[dict]:
    """The training functions' stubs as token ids, every other one as a chat turn."""
    texts = training_stubs(paths, seed)
    chats = [i % 2 == 1 for i in range(len(texts))]
    ids = tok.encode_batch([stub_prompt(t, c) for t, c in zip(texts, chats)])
    return [{"ids": np.array(i, np.int32), "chat": c} for i, c in zip(ids, chats)]


def build_regen(target: Target, corpus: Corpus, count: int, seq_len: int, spans: int,
                new_tokens: int, batch: int = 64, holdout: int = 0, seed: int = 0, paths=None,
                temperatures=(0.0,), first: int | None = None, log=None,
                review: bool = False) -> dict:  # fmt: skip
    """Regenerated training sequences (and held-out ones for evaluation) as arrays to save;
    `review`: review chats (held-out ones from held-out files)."""
    from .data import sample_windows

    if review and first is not None:
        raise ValueError("--prompt-len does not apply with --review (its turns set the spans)")
    rng = np.random.default_rng(seed)
    tok = TextTokenizer(target.path)
    stubs = None if review else _stub_ids(tok, paths, seed)  # review rows place their own turns
    windows = sample_windows(corpus.train, count, seq_len, rng)
    pieces = review_pieces(tok, paths) if review else None
    train, gen, kinds, temps = regenerate_rows(target, windows, spans, new_tokens, batch, rng,
                                               temperatures, stubs, tok.eot_id, first, log,
                                               pieces)  # fmt: skip
    result = {"train": train, "train_generated": gen, "kinds": kinds, "temperatures": temps}
    if holdout and corpus.holdout.size > seq_len + 1:
        held = sample_windows(corpus.holdout, holdout, seq_len, rng)
        pieces = review_pieces(tok, paths, holdout=True) if review else None
        held, held_gen, _, _ = regenerate_rows(target, held, spans, new_tokens, batch, rng,
                                               temperatures, None, tok.eot_id, first, log,
                                               pieces)  # fmt: skip
        result.update(holdout=held, holdout_generated=held_gen)
    result["info"] = np.array(json.dumps({
        "seq_len": seq_len, "spans": spans, "new_tokens": new_tokens, "first": first,
        "review": review,
        "temperatures": list(temperatures), "target": str(target.path), "seed": seed,
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


def load_regen(path: str | Path) -> Regen:
    """`save_regen`'s file. Files written before spans existed (one continuation at the end of
    each row) get their generated mask from `prompt_len`."""
    with np.load(path) as z:
        info = json.loads(str(z["info"])) if "info" in z else {}
        train = z["train"].astype(np.int32)
        held = z["holdout"].astype(np.int32) if "holdout" in z else None

        def generated(name: str, rows: np.ndarray | None) -> np.ndarray | None:
            if rows is None:
                return None
            if name in z:
                return z[name].astype(bool)
            mask = np.zeros(rows.shape, bool)
            mask[:, info.get("prompt_len", 0) :] = True
            return mask

        return Regen(train, generated("train_generated", train), held,
                     generated("holdout_generated", held), info)  # fmt: skip
