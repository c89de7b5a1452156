"""What a backend reports about itself, as plain values: the serving counters (`Stats`), the
prompt cache's (`CacheStats`) and its entries (`EntryInfo`). Field names are the public
messages' (inference.proto StatsResponse, CacheStats, CacheEntryInfo), which wire/convert.py
fills from these; between role processes they travel as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.store import PromptStore
from ..settings import ServeSettings


@dataclass(frozen=True)
class CacheStats:
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    available: bool = False  # false while the store restarts (until the verifier sees it back)
    directory: str = ""
    kv_bytes: int = 0
    taps_bytes: int = 0
    rung_bytes: int = 0
    shared_bytes: int = 0  # in pages and rungs that more than one entry references
    logical_bytes: int = 0  # what the entries would take each stored alone
    superseded: int = 0  # entries dropped because a later turn extended them


@dataclass(frozen=True)
class EntryInfo:
    entry_id: str
    model_key: str
    kv_mode: str
    num_tokens: int
    rungs: list[int]
    nbytes: int  # the entry alone
    created: float
    prompt_len: int = 0
    kv_bytes: int = 0
    taps_bytes: int = 0
    rung_bytes: int = 0
    shared_bytes: int = 0  # of nbytes, in pages and rungs other entries reference too


@dataclass(frozen=True)
class Stats:
    """Serving model, queue, decode and drafter-channel counters since start."""

    model: str
    drafter: str  # empty: plain decoding
    block_size: int
    kv: str  # default KV mode
    mode: str  # inline | cluster
    active: int  # requests in progress
    waiting: int  # requests queued
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    cancelled: int
    rejected: int  # RESOURCE_EXHAUSTED answers
    drafter_available: bool
    transport: str  # drafter transport: inline | shm | object_store | down
    # where a round's time goes, on the verifier (ms, means over all rounds since start)
    round_draft_ms: float
    round_verify_ms: float
    round_rollback_ms: float
    round_other_ms: float
    # the drafter channel (cluster): calls, latency, bytes, waits, fully overlapped calls
    draft_calls: int = 0
    transport_ms_per_round: float = 0.0
    transport_bytes_per_round: float = 0.0
    drafter_compute_ms_per_round: float = 0.0
    drafter_wait_ms_per_round: float = 0.0
    overlapped_draft_calls: int = 0
    # the speculation gate: its thresholds (greedy, sampled; 0: off), plain steps it took
    min_tau: float = 0.0
    min_tau_sampled: float = 0.0
    gated_steps: int = 0
    # rounds whose drafts repeated an earlier stretch of their sequence (engine/lookup.py)
    lookup_rounds: int = 0
    cache: CacheStats = field(default_factory=CacheStats)


def serving_stats(mode: str, settings: ServeSettings, verifier, sched: dict, peer) -> Stats:
    """The verifier's and its scheduler's counters (`peer`: the remote drafter, None inline)."""
    m, e = verifier.metrics, settings.engine
    rounds = max(1, m.rounds)
    channel = {}
    if peer is not None:
        s = peer.summary()
        channel = dict(
            draft_calls=s["draft_calls"],
            transport_ms_per_round=s["transport_ms_per_call"],
            transport_bytes_per_round=s["bytes_per_call"],
            drafter_compute_ms_per_round=s["drafter_compute_ms_per_call"],
            drafter_wait_ms_per_round=s["drafter_wait_ms_per_call"],
            overlapped_draft_calls=s["hidden_calls"],
        )
    return Stats(
        model=e.model,
        drafter=e.drafter or "",
        block_size=verifier.decoder.block_size,
        kv=e.kv_mode,
        mode=mode,
        active=sched["active"],
        waiting=sched["waiting"],
        requests=m.requests,
        prompt_tokens=m.prompt_tokens,
        cached_tokens=m.cached_tokens,
        completion_tokens=m.completion_tokens,
        rounds=m.rounds,
        drafted_tokens=m.drafted_tokens,
        accepted_tokens=m.accepted_tokens,
        cancelled=sched["cancelled"],
        rejected=sched["rejected"],
        drafter_available=bool(e.drafter) and (peer is None or peer.available),
        transport="inline" if peer is None else peer.kind,
        **{f"round_{k}_ms": 1000.0 * m.round_s[k] / rounds for k in m.round_s},
        **channel,
        min_tau=verifier.decoder.min_tau,
        min_tau_sampled=verifier.decoder.min_tau_sampled,
        gated_steps=m.gated_steps,
        lookup_rounds=m.lookup_rounds,
    )


def cache_stats(store: PromptStore | None) -> CacheStats:
    if store is None:
        return CacheStats(available=False)
    s = store.stats
    a = store.accounting()
    return CacheStats(
        entries=len(store),
        bytes=store.nbytes,
        max_bytes=store.max_bytes,
        lookups=s["lookups"],
        hits=s["hits"],
        evictions=s["evictions"],
        available=True,
        directory=str(store.directory or ""),
        kv_bytes=a["kv_bytes"],
        taps_bytes=a["taps_bytes"],
        rung_bytes=a["rung_bytes"],
        shared_bytes=a["shared_bytes"],
        logical_bytes=a["logical_bytes"],
        superseded=s["superseded"],
    )


def entry_infos(store: PromptStore, model_key: str = "") -> list[EntryInfo]:
    """The saved entries (of one model and KV format, or all)."""
    return [EntryInfo(**e) for e in store.listing(model_key or None)]
