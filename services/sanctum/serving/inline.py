"""The inline backend: the three roles as plain objects in this process (`sanctum serve
--inline`, the isolation baseline), and how a verifier is built from the settings
(`load_models`, `make_verifier`) wherever it runs.

A backend is what the gRPC front end serves from: this one, or the Ray actor cluster
(cluster/backend.py). Both answer the same calls (`submit`, `cancel`, `stats`, `list_cache`,
`clear_cache`, `ready`, `close`) with the same plain types (serving/requests.py,
serving/stats.py), so the servicer, the benchmarks and the tests cannot tell them apart except
by speed and fault behaviour. `RoundDelay` (a slower target) is for benchmarks and tests only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..settings import EngineSettings, ServeSettings
from .metrics import Metrics
from .requests import Chunk, GenerateRequest
from .stats import EntryInfo, Stats, cache_stats, entry_infos, serving_stats

if TYPE_CHECKING:  # the models load in the role processes: a front end need not import them
    from ..engine.decode.peer import DraftPeer
    from ..engine.model.drafter import Drafter
    from ..engine.model.target import Target
    from .verifier import Verifier

log = logging.getLogger("sanctum.backend")


@dataclass(frozen=True)
class RoundDelay:
    """A benchmark and test knob, never a setting: every target forward (a verify block, a plain
    step, a prefill call) takes `seconds` longer, as a slower target would. Busy for benchmarks
    (a real forward keeps its core busy; a sleep lets the cores go cold), asleep for tests."""

    seconds: float
    busy: bool = False

    def apply(self, target) -> None:
        forward = target.forward

        def slower(*args, **kwargs):
            out = forward(*args, **kwargs)
            if not self.busy:
                time.sleep(self.seconds)
            else:
                end = time.perf_counter() + self.seconds
                while time.perf_counter() < end:
                    pass
            return out

        target.forward = slower


def load_models(e: EngineSettings, parts: str = "both") -> tuple[Target, Drafter | None]:
    """The target, and the drafter (`parts`: "both", or "head" when the body runs elsewhere)."""
    from ..engine.model.drafter import load_drafter
    from ..engine.model.target import load_target
    from ..tiny import ensure_pair

    ensure_pair(e.model, e.drafter)
    target = load_target(e.model)
    drafter = None
    if e.drafter:
        drafter = load_drafter(
            e.drafter, target, block_size=e.block_size, bits=e.drafter_bits, parts=parts
        )
    return target, drafter


def make_verifier(
    settings: ServeSettings,
    store,
    remote_peer: Callable[[], DraftPeer] | None = None,
    round_delay: RoundDelay | None = None,
) -> Verifier:
    """Load the target and wrap it in the verifier role. Without `remote_peer` the whole
    drafter is loaded here (inline); with it, only the drafter head (the body is remote)."""
    from ..engine.decode.generate import GATE_PROBES, gate_threshold
    from ..engine.decode.peer import LocalDraftPeer
    from ..engine.decode.policy import DecodePolicy
    from .verifier import Verifier

    e = settings.engine
    target, drafter = load_models(e, "head" if remote_peer is not None else "both")
    if round_delay is not None:
        round_delay.apply(target)
    peer = None
    if drafter is not None:
        peer = remote_peer() if remote_peer is not None else LocalDraftPeer(drafter)
    verifier = Verifier(
        target,
        drafter,
        peer,
        store,
        settings.cache.ladder_depth,
        e.kv_mode,
        e.block_size,
        settings.max_tokens_limit,
        settings.cache.ladder_bytes,
        DecodePolicy(
            adaptive=bool(settings.adaptive_width),
            accept_rule=settings.accept_rule,
            lookup_min=settings.lookup_min,
        ),
    )
    d = verifier.decoder  # the gate's thresholds are measured on it, then fixed in its policy
    greedy, sampled = (gate_threshold(settings.min_tau, d, s) for s in GATE_PROBES)
    verifier.decoder = d.with_policy(min_tau=greedy, min_tau_sampled=sampled)
    if settings.warm_shared:  # shared rounds of 2..max_batch, and looked-up blocks' widths
        spent = verifier.warmed = verifier.decoder.warm(range(1, (settings.max_batch or 1) + 1))
        if spent:
            log.info("rounds of 1..%d sequences built in %.2f s", max(spent),
                     sum(spent.values()))  # fmt: skip
    return verifier


class InlineBackend:
    """The three roles as plain objects in this process: the isolation baseline (`--inline`)."""

    mode = "inline"

    def __init__(self, settings: ServeSettings, round_delay: RoundDelay | None = None):
        from ..cache.store import PromptStore
        from .scheduler import Scheduler

        self.settings = settings
        self.store = None
        self.restarts: dict[str, int] = {}  # one process: no role restarts on its own
        self.metrics = Metrics(self)

        def load():  # on the scheduler's thread, which then owns MLX
            self.store = PromptStore(
                settings.cache.max_bytes, settings.cache.directory, settings.cache.ladder_bytes
            )
            return make_verifier(settings, self.store, round_delay=round_delay)

        self.scheduler = Scheduler.for_settings(load, settings)

    def ready(self, timeout: float | None = None) -> None:
        """Block until the models are loaded (raises if loading failed)."""
        self.scheduler.wait_ready(timeout)

    @property
    def verifier(self):
        return self.scheduler.verifier

    def submit(
        self, req: GenerateRequest, mode: str = "streaming", deadline: float | None = None
    ) -> Iterator[Chunk]:
        """Chunks of `req` as they are committed; raises QueueFull / Unavailable at once."""
        return self.metrics.track(lambda: self.scheduler.submit(req, mode, deadline))

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)

    def stats(self) -> Stats:
        out = serving_stats(self.mode, self.settings, self.verifier, self.scheduler.stats(), None)
        return replace(out, cache=cache_stats(self.store))

    def list_cache(self, model_key: str = "") -> list[EntryInfo]:
        return entry_infos(self.store, model_key)

    def clear_cache(self, model_key: str = "") -> int:
        return self.store.clear(model_key or None)

    def close(self) -> None:
        self.scheduler.shutdown()
