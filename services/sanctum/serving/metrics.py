"""Prometheus metrics of one backend (`GET /metrics`, api/http.py), in prometheus-client's text
format, `sanctum_` names in its conventions (`_total`, `_seconds`).

Counted once per request, whichever front end (gRPC, HTTP) served it: a backend's `submit`
passes its chunks through `Metrics.track`, which both front ends call the same way. Per-request
figures (outcome, tokens, tau, acceptance, TTFT, inter-token latency) are counted there, in the
process that serves the front ends; the backend's own state (queue, active requests, rounds and
their phases, the prompt cache, the drafter, actor restarts) is read from `backend.stats()` at
scrape time, so it is never counted twice. Ray-free and gRPC-free: the backend is duck-typed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .requests import Chunk, Usage
from .stats import ROUND_PHASES

log = logging.getLogger("sanctum.metrics")
disable_created_metrics()  # no `_created` series: a scrape shows what it counts, nothing more

TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def outcome_of(exc: BaseException) -> str:
    """The request counter's label for a request that ended with `exc` (serving/errors.py)."""
    return getattr(exc, "outcome", "internal")


class Metrics:
    """One backend's registry: the per-request counters, and its state read at scrape time."""

    def __init__(self, backend=None):
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "sanctum_requests",
            "Generation requests by outcome: the finish reason (stop, length), cancelled, or "
            "the error (invalid_argument, resource_exhausted, unavailable, internal)",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("sanctum_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "sanctum_cached_tokens", "Prompt tokens restored from the prompt cache", registry=r
        )
        self.completion_tokens = Counter(
            "sanctum_completion_tokens", "Generated tokens", registry=r
        )
        self.drafted_tokens = Counter(
            "sanctum_drafted_tokens", "Tokens proposed by the drafter", registry=r
        )
        self.accepted_tokens = Counter(
            "sanctum_accepted_tokens", "Drafted tokens the target accepted", registry=r
        )
        self.tau = Histogram(
            "sanctum_request_tau",
            "A request's mean acceptance length (tokens committed per speculative round)",
            buckets=TAU_BUCKETS,
            registry=r,
        )
        self.acceptance = Histogram(
            "sanctum_request_acceptance_ratio",
            "A request's accepted / drafted tokens",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "sanctum_time_to_first_token_seconds",
            "From submission to the first generated token, as the front end sees it",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sanctum_inter_token_latency_seconds",
            "Time between output chunks, per token of the later chunk",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "sanctum_request_duration_seconds",
            "From submission to the request's end",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        if backend is not None:
            r.register(_BackendState(backend))

    def track(self, submit: Callable[[], Iterable[Chunk]]) -> Iterator[Chunk]:
        """`submit()`'s chunks, counted as they pass. A refusal at submission (QueueFull,
        Unavailable) is counted and raised at once, as `submit` raises it."""
        t0 = time.perf_counter()
        try:
            chunks = iter(submit())
        except Exception as exc:
            self.requests.labels(outcome_of(exc)).inc()
            raise
        return self._follow(chunks, t0)

    def refused(self, exc: BaseException) -> None:
        """A request a front end refused before submitting it (its gate, a malformed request)."""
        self.requests.labels(outcome_of(exc)).inc()

    def _follow(self, chunks: Iterator[Chunk], t0: float) -> Iterator[Chunk]:
        outcome, last = "cancelled", None  # ended without a finish reason: cancelled or expired
        try:
            for chunk in chunks:
                now, n = time.perf_counter(), len(chunk.token_ids)
                if n:
                    if last is None:
                        self.ttft.observe(now - t0)
                    else:
                        for _ in range(n):
                            self.itl.observe((now - last) / n)
                    last = now
                if chunk.usage is not None:
                    self._usage(chunk.usage)
                if chunk.finish_reason:
                    outcome = chunk.finish_reason
                yield chunk
        except Exception as exc:
            outcome = outcome_of(exc)
            raise
        finally:  # also when the front end drops the request (GeneratorExit)
            self.requests.labels(outcome).inc()
            self.duration.observe(time.perf_counter() - t0)

    def _usage(self, u: Usage) -> None:
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self.completion_tokens.inc(u.completion_tokens)
        self.drafted_tokens.inc(u.drafted_tokens)
        self.accepted_tokens.inc(u.accepted_tokens)
        if u.rounds and u.drafted_tokens:
            self.tau.observe(u.tau)
            self.acceptance.observe(u.accepted_tokens / u.drafted_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition (blocking: it asks the backend for its stats)."""
        return generate_latest(self.registry)


class _BackendState:
    """What the backend reports about itself (serving/stats.py `Stats`), at scrape time."""

    def __init__(self, backend):
        self.backend = backend

    def collect(self):
        up = GaugeMetricFamily("sanctum_up", "1 while the backend answers its stats")
        try:
            s = self.backend.stats()
        except Exception as exc:  # a restarting verifier: say so, keep the other metrics
            log.debug("metrics: no backend stats: %r", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        gauges = {
            "sanctum_queue_depth": ("Requests waiting for a decoding slot", s.waiting),
            "sanctum_active_requests": ("Requests being prefilled or decoded", s.active),
            "sanctum_drafter_available": (
                "1 while speculative decoding has its drafter (0: plain steps)",
                int(s.drafter_available),
            ),
            "sanctum_cache_entries": ("Prompt-cache entries", s.cache.entries),
            "sanctum_cache_bytes": ("Prompt-cache size", s.cache.bytes),
            "sanctum_cache_max_bytes": ("Prompt-cache size limit", s.cache.max_bytes),
            "sanctum_cache_hit_ratio": (
                "Prompt-cache lookups that found a prefix, over all lookups",
                s.cache.hits / s.cache.lookups if s.cache.lookups else 0.0,
            ),
        }
        gate = GaugeMetricFamily(
            "sanctum_gate_min_tau",
            "The speculation gate's threshold by request kind: tokens a round must commit on "
            "average, else plain steps for a while (0: off)",
            labels=["kind"],
        )
        gate.add_metric(["greedy"], s.min_tau)
        gate.add_metric(["sampled"], s.min_tau_sampled)
        yield gate
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "sanctum_rounds": ("Speculative or plain decoding rounds", s.rounds),
            "sanctum_gated_steps": (
                "Plain steps the speculation gate took instead of speculative rounds",
                s.gated_steps,
            ),
            "sanctum_lookup_rounds": (
                "Speculative rounds whose drafts repeated an earlier stretch of their sequence",
                s.lookup_rounds,
            ),
            "sanctum_cache_lookups": ("Prompt-cache lookups", s.cache.lookups),
            "sanctum_cache_hits": ("Prompt-cache lookups that found a prefix", s.cache.hits),
            "sanctum_cache_evictions": ("Prompt-cache entries evicted", s.cache.evictions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        phases = CounterMetricFamily(
            "sanctum_round_phase_seconds",
            "Verifier time in each phase of a round",
            labels=["phase"],
        )
        for phase in ROUND_PHASES:
            ms_per_round = getattr(s, f"round_{phase}_ms")
            phases.add_metric([phase], ms_per_round * s.rounds / 1000.0)
        yield phases
        restarts = CounterMetricFamily(
            "sanctum_actor_restarts", "Role restarts the backend saw", labels=["role"]
        )
        for role, n in sorted(getattr(self.backend, "restarts", {}).items()):
            restarts.add_metric([role], n)
        yield restarts
