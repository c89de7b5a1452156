"""Ladder policy: where recurrent-state rungs go, and how a live target cache becomes a saved
entry and back.

Rungs can only sit at forward-call boundaries, so the positions are chosen BEFORE prefill and
prefill stops at them. Priorities (HYBRID_CACHE.md): the prompt boundary (always, even when the
prompt fits one chunk: that was the seed's bug), the end of the completion, chat message starts
(later turns share exactly those prefixes), rungs inherited from the entry we resumed from
(never thrown away), then leftover depth spread evenly over the prompt.
"""

from __future__ import annotations

import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from .store import CacheEntry, ResumePlan


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
    spare = depth - len(stops) - 1  # one rung is kept for the end of the completion
    span = prompt_len - resumed_at
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
) -> dict:
    """Pick at most `depth` rungs for a new entry from what prefill captured, what the resumed
    entry had below the resume point, and the end-of-completion state (`captured[end]`).
    First the prompt boundary, then where the next turn's prefix is expected to end inside the
    completion (when the reply's text re-encodes differently), then the end."""
    pool = {**inherited, **captured}
    order = [prompt_len, *([next_turn_end] if next_turn_end is not None else []), end]
    order += sorted((p for p in message_starts if p in pool), reverse=True)
    order += sorted((p for p in inherited if p not in order), reverse=True)
    order += sorted((p for p in pool if p not in order), reverse=True)
    chosen: dict = {}
    for p in order:
        if len(chosen) >= max(depth, 1):
            break
        if p in pool and p not in chosen and 0 < p <= end:
            chosen[p] = pool[p]
    return chosen


def snapshot_kv(cache: list) -> list[tuple]:
    """The attention layers' KV, sliced to the tokens held (fresh arrays, safe to keep)."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            continue
        n = c.offset
        if isinstance(c, QuantizedKVCache):
            out.append(tuple(a[..., :n, :] for a in (*c.keys, *c.values)))
        else:
            out.append((c.keys[..., :n, :], c.values[..., :n, :]))
    return out


def restore_into(target, cache: list, plan: ResumePlan) -> None:
    """Fill an empty live cache from a resume plan: KV trimmed to the rung, GDN state at it."""
    kv = iter(plan.kv)
    n = plan.resumed_at
    for c in cache:
        if isinstance(c, ArraysCache):
            continue
        arrays = next(kv)
        if isinstance(c, QuantizedKVCache):
            if len(arrays) != 6:
                raise ValueError("cache entry is not in Q8 format")
            c.keys, c.values = tuple(arrays[:3]), tuple(arrays[3:])
        elif isinstance(c, KVCache):
            if len(arrays) != 2:
                raise ValueError("cache entry is not in FP16 format")
            c.keys, c.values = arrays
        c.offset = n
    target.restore_recurrent_state(cache, plan.rungs[n])


def make_entry(
    model_key: str,
    kv_mode: str,
    tokens: list[int],
    cache: list,
    rungs: dict,
    taps,
) -> CacheEntry:
    return CacheEntry(
        model_key=model_key,
        kv_mode=kv_mode,
        tokens=np.asarray(tokens, dtype=np.int32),
        kv=snapshot_kv(cache),
        rungs=rungs,
        taps=taps,
    )
