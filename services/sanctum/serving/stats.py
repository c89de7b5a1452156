"""What a backend counts and reports about itself, as plain values. The verifier counts into one
`Counters` as it serves; `Stats` is a snapshot of those counters with the scheduler's and the
drafter channel's, the prompt cache's (`CacheStats`) and its entries (`EntryInfo`). The
snapshots' field names are the public messages' (inference.proto StatsResponse, CacheStats,
CacheEntryInfo), which wire/convert.py fills from these; between role processes they travel as
they are, and the Prometheus collector (serving/metrics.py) reads `Stats` at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..cache.store import PromptStore
from ..settings import ServeSettings
from .requests import Usage

ROUND_PHASES = ("draft", "verify", "rollback", "other")


@dataclass
class Counters:
    """The verifier's running totals since start, the one place they are counted (on the
    model's thread). `snapshot` gives them as `Stats` fields; nothing else copies them."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    gated_steps: int = 0  # plain steps the speculation gate took instead of rounds
    lookup_rounds: int = 0  # rounds whose drafts came from the sequence (engine/decode/lookup.py)
    round_s: dict = field(
        default_factory=lambda: dict.fromkeys(ROUND_PHASES, 0.0)
    )  # seconds spent in each phase of a round, summed over rounds

    def opened(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request resumed from the cache, its prompt about to be prefilled."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def add_round(self, s) -> None:
        """One round of one request (its engine `RoundStats`)."""
        self.rounds += 1
        self.gated_steps += s.gated
        self.lookup_rounds += s.looked_up
        for phase in self.round_s:
            self.round_s[phase] += getattr(s, f"{phase}_s")

    def finished(self, usage: Usage) -> None:
        """A request that reached its finish reason: its generated and drafted tokens."""
        self.completion_tokens += usage.completion_tokens
        self.drafted_tokens += usage.drafted_tokens
        self.accepted_tokens += usage.accepted_tokens

    def snapshot(self) -> dict:
        """The totals by their `Stats` names; each phase's time as a mean over all rounds (ms)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "round_s"}
        rounds = max(1, self.rounds)
        out.update({f"round_{k}_ms": 1000.0 * v / rounds for k, v in self.round_s.items()})
        return out


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
    """What the Stats RPC returns: the serving model's settings and a snapshot of its counters
    since start (the verifier's `Counters`, the scheduler's queue, the drafter channel)."""

    model: str
    drafter: str  # empty: plain decoding
    block_size: int
    kv: str  # default KV mode
    mode: str  # inline | cluster
    active: int  # requests in progress
    waiting: int  # requests queued
    # requests .. accepted_tokens, round_*_ms, gated_steps, lookup_rounds: Counters.snapshot
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
    # rounds whose drafts repeated an earlier stretch of their sequence (engine/decode/lookup.py)
    lookup_rounds: int = 0
    cache: CacheStats = field(default_factory=CacheStats)


def serving_stats(mode: str, settings: ServeSettings, verifier, sched: dict, peer) -> Stats:
    """The verifier's and its scheduler's counters (`peer`: the remote drafter, None inline)."""
    e = settings.engine
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
        cancelled=sched["cancelled"],
        rejected=sched["rejected"],
        drafter_available=bool(e.drafter) and (peer is None or peer.available),
        transport="inline" if peer is None else peer.kind,
        min_tau=verifier.decoder.min_tau,
        min_tau_sampled=verifier.decoder.min_tau_sampled,
        **verifier.counters.snapshot(),
        **channel,
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
