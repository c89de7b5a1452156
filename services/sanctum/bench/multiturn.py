"""`sanctum bench multiturn` (the prompt cache across the turns of a chat) and `sanctum bench
reencode` (the re-encoding watch's cost a round)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..train.data import REVIEW_CHARS, REVIEW_SYSTEM, review_request


def _code_snippets(count: int, chars: int = REVIEW_CHARS) -> list[str]:
    """Deterministic user material: slices of the standard library's own source."""
    from ..tokenizer import python_stdlib_files

    out = []
    for path in python_stdlib_files():
        text = path.read_text(errors="ignore")
        if len(text) > chars * 2:
            out.append(text[chars : 2 * chars])
        if len(out) == count:
            break
    return out


def decode_rate(usage) -> float:
    """Tokens a second of a reply after its first token (0.0 for a reply of one token)."""
    seconds = usage.elapsed_s - usage.ttft_s
    return round((usage.completion_tokens - 1) / seconds, 1) if seconds > 0 else 0.0


def cache_bytes(store) -> dict:
    """The prompt cache's bytes now: all entries together, and its longest entry alone."""
    entries = store.listing()
    alone = max(entries, key=lambda e: e["num_tokens"])["nbytes"] if entries else 0
    return {
        "entries": len(entries),
        "cache_MiB": round(store.nbytes / 2**20, 3),
        "longest_MiB": round(alone / 2**20, 3),
        "ratio": round(store.nbytes / alone, 3) if alone else 0.0,
        **{k: round(v / 2**20, 3) for k, v in _by_kind(store).items()},
    }


def _by_kind(store) -> dict:
    """KV, taps and rung MiB, and of those the bytes more than one entry shares."""
    a = store.accounting()
    return {
        f"{k}_MiB": a[f"{k}_bytes"] for k in ("kv", "taps", "rung", "shared") if f"{k}_bytes" in a
    }


def multiturn(args) -> list[dict]:
    """A chat whose history grows turn by turn; per turn the prompt cache's resume figures and
    time to first token warm (cache as the conversation left it) and cold (same prompt, no
    cache). Assistant replies go back into the history as generated, so the template's own
    rewriting (dropped <think> blocks) decides where the next prefix really ends."""
    from ..cache.store import PromptStore
    from ..engine.decode.peer import LocalDraftPeer
    from ..serving.inline import load_models
    from ..serving.requests import GenerateRequest
    from ..serving.verifier import Verifier
    from ..settings import cache_settings, engine_settings, model_flags

    settings = engine_settings(**model_flags(args))
    target, drafter = load_models(settings)
    cache = cache_settings(ladder=args.ladder)
    store = PromptStore(cache.max_bytes, ladder_bytes=cache.ladder_bytes)
    verifier = Verifier(
        target,
        drafter,
        LocalDraftPeer(drafter) if drafter else None,
        store,
        cache.ladder_depth,
        settings.kv_mode,
        settings.block_size,
        ladder_bytes=cache.ladder_bytes,
    )
    messages = [{"role": "system", "content": REVIEW_SYSTEM}]

    def ask(msgs, use_cache, seed):
        req = GenerateRequest(
            messages=tuple(msgs), max_tokens=args.max_tokens, use_cache=use_cache, seed=seed
        )
        chunks = list(verifier.generate(req))
        return "".join(c.text for c in chunks), chunks[-1].usage

    def row(turn, msgs, seed) -> tuple[str, dict]:
        cold_text, cold = ask(msgs, False, seed)
        text, warm = ask(msgs, True, seed)
        assert text == cold_text, "a resumed request must equal the cold one"
        out = {
            "turn": turn,
            "prompt_tokens": warm.prompt_tokens,
            "requested_lcp": warm.requested_lcp,
            "resumed_at": warm.resumed_at,
            "prefix_cached": warm.cached_tokens,
            "cache_hit_ratio": warm.cache_hit_ratio,
            "tau": round(warm.tau, 3),
            "lookup_rounds": warm.lookup_rounds,  # of `rounds`: drafts read from the chat itself
            "rounds": warm.rounds,
            "decode_tok_s": decode_rate(warm),
            "ttft_warm_s": warm.ttft_s,
            "ttft_cold_s": cold.ttft_s,
            "kv": warm.kv,
        }
        return text, {**out, **cache_bytes(store)}

    rows = []
    for turn, snippet in enumerate(_code_snippets(args.turns), start=1):
        messages.append({"role": "user", "content": review_request(snippet)})
        text, r = row(turn, messages, turn)
        rows.append(r)
        messages.append({"role": "assistant", "content": text})
    if getattr(args, "branch", False):
        rows.append(branch(args, verifier, store, messages, row))
    return rows


def branch(args, verifier, store, messages: list[dict], row) -> dict:
    """Edit an earlier turn's user message (the middle one) and ask again: the resume must
    start at the deepest rung at or before the edit that the cache still holds."""
    from ..serving.requests import GenerateRequest

    edited = max(1, args.turns // 2)
    index = 2 * edited - 1  # [system, user 1, assistant 1, user 2, ...]
    msgs = [dict(m) for m in messages[: index + 1]]
    msgs[index]["content"] = msgs[index]["content"].replace("Review this code", "Explain this code")
    prompt, _ = verifier.tokenize(GenerateRequest(messages=tuple(msgs)))
    key = verifier.model_key(verifier.kv_mode)
    deepest = 0  # what the cache offers at or before the edit, looked at before asking
    for e in store.entries(key):
        n = min(len(e.tokens), len(prompt))
        same = np.flatnonzero(e.tokens[:n] != np.asarray(prompt[:n], dtype=np.int32))
        edit = int(same[0]) if same.size else n
        deepest = max([deepest, *(p for p in e.rungs if p <= min(edit, len(prompt) - 1))])
    _, r = row(f"edit{edited}", msgs, 1000 + edited)
    assert r["resumed_at"] == deepest, (r["resumed_at"], deepest)
    return {**r, "turn": f"edit{edited}@{r['requested_lcp']}->rung{deepest}"}


def reencode(args) -> dict:
    """The re-encoding watch's cost a round (tokenizer.Reencoder, only the unsettled text) against
    re-encoding the whole completion, on held-out stdlib code, `--round-tokens` at a time."""
    from mlx_lm.utils import load_tokenizer

    from ..settings import engine_settings
    from ..tokenizer import Reencoder
    from ..train.data import corpus_files, is_holdout

    settings = engine_settings(args.model, "none", None, None, None)
    tok = load_tokenizer(settings.model)
    held_out = sorted(p for name, p in corpus_files(None) if is_holdout(name) and p.suffix == ".py")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in held_out[:8])
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = tok.encode(text, add_special_tokens=False)[: max(lengths)]
    if len(ids) < max(lengths):
        raise ValueError(f"the held-out text has only {len(ids)} tokens")
    reencoder, widest, windowed = Reencoder(tok), 0, {}
    for end in range(args.round_tokens, len(ids) + 1, args.round_tokens):
        t0 = time.perf_counter()
        reencoder.first_difference(ids[:end], final=False)
        windowed[end] = time.perf_counter() - t0
        widest = max(widest, end - reencoder.settled)
    result = {
        "model": settings.model,
        "round_tokens": args.round_tokens,
        "widest_window_tokens": widest,
        "gave_up": reencoder.exhausted,
    }
    for n in lengths:
        near = [windowed[e] for e in windowed if n - 64 < e <= n]  # the rounds just before n
        whole = []
        for _ in range(5):
            t0 = time.perf_counter()
            tok.encode(tok.decode(ids[:n]), add_special_tokens=False)
            whole.append(time.perf_counter() - t0)
        result[f"windowed_ms_at_{n}"] = round(1000.0 * statistics.median(near), 3)
        result[f"whole_ms_at_{n}"] = round(1000.0 * statistics.median(whole), 3)
    return result
