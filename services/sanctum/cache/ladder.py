"""Ladder policy: where recurrent-state rungs go, and how a live target cache becomes a saved
entry and back (through mlx-lm's cache `state` protocol; the target says which layers are
attention and which Gated DeltaNet).

Rungs can only sit at forward-call boundaries, so the positions are chosen BEFORE prefill and
prefill stops at them. Priorities (docs/design/prompt-cache.md): the prompt boundary (always,
even when the prompt fits one chunk), the end of the completion, chat message starts
(later turns share exactly those prefixes), rungs inherited from the entry we resumed from
(never thrown away), then leftover depth spread evenly over the prompt.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .layout import KV, Rungs
from .store import CacheEntry, ResumePlan

# Spread rungs sit at least this many tokens (a drafted block's rows) from the resume point and
# from each other: one closer saves less than a block's recomputation, yet costs prefill a pause
# (a forward of its own; a riding prompt tail a round) and the entry a state's bytes
MIN_SPREAD_GAP = 8


def prefill_stops(
    depth: int, prompt_len: int, resumed_at: int, message_starts=()
) -> tuple[int, ...]:
    """Positions in (resumed_at, prompt_len] where prefill must stop to take a rung."""
    if depth <= 0:
        return ()
    stops = [prompt_len]
    for p in sorted(set(message_starts), reverse=True):
        if resumed_at < p < prompt_len and len(stops) < depth:
            stops.append(p)
    span = prompt_len - resumed_at
    # one rung is kept for the end of the completion
    spare = min(depth - len(stops) - 1, span // MIN_SPREAD_GAP - 1)
    for k in range(1, spare + 1):
        p = resumed_at + span * k // (spare + 1)
        if resumed_at < p < prompt_len and p not in stops:
            stops.append(p)
    return tuple(sorted(stops))


def choose_rungs(
    depth: int,
    prompt_len: int,
    end: int,
    message_starts,
    captured: dict,
    inherited: dict,
    next_turn_end: int | None = None,
    max_bytes: int = 0,
) -> dict:
    """Pick at most `depth` rungs for a new entry from what prefill captured, what the resumed
    entry had below the resume point, and the end-of-completion state (`captured[end]`).
    First the prompt boundary, then where the next turn's prefix is expected to end inside the
    completion (when the reply's text re-encodes differently), then the end. With `max_bytes`
    (> 0), rungs past the first stop being added once their bytes would exceed it."""
    pool = {**inherited, **captured}
    order = [prompt_len, *([next_turn_end] if next_turn_end is not None else []), end]
    order += sorted((p for p in message_starts if p in pool), reverse=True)
    order += sorted((p for p in inherited if p not in order), reverse=True)
    order += sorted((p for p in pool if p not in order), reverse=True)
    chosen: dict = {}
    used = 0
    for p in order:
        if len(chosen) >= max(depth, 1):
            break
        if p in pool and p not in chosen and 0 < p <= end:
            size = rung_bytes(pool[p])
            if chosen and max_bytes > 0 and used + size > max_bytes:
                continue
            chosen[p] = pool[p]
            used += size
    return chosen


def rung_bytes(states) -> int:
    """Bytes of one rung's (conv, state) pairs."""
    return sum(getattr(a, "nbytes", 0) for pair in states for a in pair)


def attention_caches(target, cache: list) -> list:
    """The attention layers' caches (the others are Gated DeltaNet's: rungs hold their state)."""
    return [c for c, gdn in zip(cache, target.is_gdn, strict=True) if not gdn]


def snapshot_kv(target, cache: list) -> KV:
    """The attention layers' KV through mlx-lm's cache protocol (`state`: keys, values, offset,
    then a quantized cache's group size and bits), copied to the tokens held (a gather: exact):
    arrays of their own, safe to keep. A live buffer can be a view of a larger one (a shared
    round's stacked KV), which a kept view would hold alive with it. A layer's arrays: (keys,
    values), or 8-bit KV's three parts of each."""
    out = []
    for c in attention_caches(target, cache):
        keys, values, offset = c.state[:3]
        rows = mx.arange(offset)
        out.append(tuple(mx.take(a, rows, axis=-2) for _, a in tree_flatten((keys, values))))
    return out


def restore_into(target, cache: list, plan: ResumePlan) -> None:
    """Fill an empty live cache from a resume plan: KV trimmed to the rung, GDN state at it."""
    n = plan.resumed_at
    for c, arrays in zip(attention_caches(target, cache), plan.kv, strict=True):
        quantization = c.state[3:]  # (group size, bits) of an 8-bit cache; none in fp16
        parts = 3 if quantization else 1  # per keys and values: (weights, scales, biases) in q8
        if len(arrays) != 2 * parts:
            raise ValueError(f"cache entry is not in {'Q8' if quantization else 'FP16'} format")
        keys, values = tuple(arrays[:parts]), tuple(arrays[parts:])
        if not quantization:
            keys, values = keys[0], values[0]
        c.state = (keys, values, n, *quantization)
    target.restore_recurrent_state(cache, plan.rungs[n])


def make_entry(
    target,
    cache: list,
    model_key: str,
    kv_mode: str,
    tokens: list[int],
    rungs: Rungs,
    taps: mx.array | None,
    prompt_len: int = 0,
) -> CacheEntry:
    """A live sequence's cache as a new entry: its KV once, the chosen rungs, its taps."""
    return CacheEntry(
        model_key=model_key,
        kv_mode=kv_mode,
        tokens=np.asarray(tokens, dtype=np.int32),
        kv=snapshot_kv(target, cache),
        rungs=rungs,
        taps=taps,
        prompt_len=prompt_len,
    )
