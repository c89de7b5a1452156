"""The ladder-store role, and the verifier's proxy to it.

The store actor owns a `PromptStore` (persisted in a directory, so a restarted actor reloads
its entries). Bulk cache transfers (KV prefixes, rungs, taps) cross processes as a flat list
of numpy arrays through the Ray object store, described by a `TensorLayout` header
(roles.proto; the entry's one layout, cache/layout.py, packed by wire/tensors.py); MLX arrays
never get pickled. Its counters and listing travel as plain values (serving/stats.py).

`StoreProxy` gives the verifier the store interface it expects (`plan`, `put`). When the actor
is down, `plan` fails fast (the verifier then serves uncached) and a background ping notices
when it is back; `put` is fire-and-forget (a lost save costs a future cache hit, nothing else),
and `flush` waits for the saves sent so far (the front end's listing and clearing come after a
request's save: cluster/backend.py).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..cache.store import CacheEntry, PromptStore, ResumePlan
from ..serving.stats import CacheStats, EntryInfo, cache_stats, entry_infos
from ..wire.gen import roles_pb2 as roles
from ..wire.tensors import flatten, host_copies, unflatten

log = logging.getLogger("sanctum.store")


class StoreUnavailable(RuntimeError):
    """The ladder store is restarting or unreachable: serve uncached."""


# ---- the store side ------------------------------------------------------------------------


class StoreService:
    """A PromptStore behind the wire contracts (what the store actor runs; Ray-free)."""

    def __init__(self, store: PromptStore):
        self.store = store

    def plan(self, query: bytes) -> tuple[bytes, list[np.ndarray]]:
        q = roles.PlanQuery.FromString(query)
        plan = self.store.plan(q.model_key, np.asarray(q.prompt_ids, dtype=np.int32))
        layout, arrays = flatten(plan.kv, plan.rungs, plan.taps)
        header = roles.ResumePlanHeader(
            requested_lcp=plan.requested_lcp,
            resumed_at=plan.resumed_at,
            entry_id=plan.entry_id or "",
            layout=layout,
        )
        return header.SerializeToString(), host_copies(arrays)

    def put(self, header: bytes, arrays: list[np.ndarray]) -> str:
        h = roles.EntryHeader.FromString(header)
        kv, rungs, taps = unflatten(h.layout, arrays)
        entry = CacheEntry(
            h.model_key,
            h.kv_mode,
            np.asarray(h.tokens, dtype=np.int32),
            kv,
            rungs,
            taps,
            created=h.created or time.time(),
            prompt_len=h.prompt_len,
        )
        return self.store.put(entry) or ""

    def list(self, model_key: str = "") -> list[EntryInfo]:
        return entry_infos(self.store, model_key)

    def clear(self, model_key: str = "") -> int:
        return self.store.clear(model_key or None)

    def stats(self) -> CacheStats:
        return cache_stats(self.store)


# ---- the verifier side ---------------------------------------------------------------------


PROBE_WAIT_S = 0.1  # how long a request waits for a restarting store before going uncached


class StoreProxy:
    """`plan` / `put` against the store actor; fails fast while it is away."""

    def __init__(self, handle, timeout_s: float = 2.0, max_transfer_bytes: int | None = None):
        self.handle = handle
        self.timeout_s = timeout_s
        self.max_transfer_bytes = max_transfer_bytes  # bigger entries are not shipped
        self._probe = None  # ObjectRef of a ping while the store is considered down
        # saves sent and not yet known done (`flush`); put runs on the scheduler's thread,
        # flush on an actor call's
        self._saves: list = []
        self._saves_lock = threading.Lock()

    @property
    def available(self) -> bool:
        self._check()
        return self._probe is None

    def _check(self, wait_s: float = 0.0) -> None:
        """Is the store back? Looks at the pending ping (for up to `wait_s`); a ping that failed
        (sent while the actor was dead) is sent again at once and waited for too."""
        import ray

        deadline = time.monotonic() + wait_s
        while self._probe is not None:
            ready, _ = ray.wait([self._probe], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            try:
                ray.get(self._probe)
                self._probe = None
                log.info("ladder store: back; serving cached again")
            except Exception:
                self._probe = self.handle.ping.remote()
                if time.monotonic() >= deadline:
                    return

    def _down(self, exc: Exception) -> StoreUnavailable:
        log.warning(
            "ladder store unavailable (%s); serving uncached until it is back",
            exc.__class__.__name__,
        )
        if self._probe is None:
            self._probe = self.handle.ping.remote()
        return StoreUnavailable(str(exc))

    def plan(self, model_key: str, prompt_ids) -> ResumePlan:
        import ray

        # a restarted store answers its ping within milliseconds: worth a short wait, or the
        # first request after the restart would still be served cold
        self._check(wait_s=PROBE_WAIT_S)
        if self._probe is not None:
            raise StoreUnavailable("the ladder store is restarting")
        query = roles.PlanQuery(model_key=model_key, prompt_ids=[int(t) for t in prompt_ids])
        try:
            header, arrays = ray.get(
                self.handle.plan.remote(query.SerializeToString()), timeout=self.timeout_s
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise self._down(exc) from None
        h = roles.ResumePlanHeader.FromString(header)
        if not h.resumed_at:
            return ResumePlan(h.requested_lcp, 0)
        kv, rungs, taps = unflatten(h.layout, arrays)
        return ResumePlan(h.requested_lcp, h.resumed_at, h.entry_id or None, kv, rungs, taps)

    def put(self, entry: CacheEntry) -> None:
        import ray

        self._check()
        if self._probe is not None:
            return  # the store is away: this entry is not saved
        if self.max_transfer_bytes and entry.nbytes > self.max_transfer_bytes:
            log.warning(
                "prompt cache: entry of %d bytes exceeds the transfer limit %d (a quarter "
                "of the object store); not saved",
                entry.nbytes,
                self.max_transfer_bytes,
            )
            return
        layout, arrays = flatten(entry.kv, entry.rungs, entry.taps)
        header = roles.EntryHeader(
            model_key=entry.model_key,
            kv_mode=entry.kv_mode,
            tokens=entry.tokens.tolist(),
            layout=layout,
            created=entry.created,
            prompt_len=entry.prompt_len,
        )
        ref = self.handle.put.remote(header.SerializeToString(), ray.put(host_copies(arrays)))
        with self._saves_lock:
            if self._saves:  # forget those done (a failed one is done too)
                _, self._saves = ray.wait(self._saves, num_returns=len(self._saves), timeout=0)
            self._saves.append(ref)

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait (up to `timeout_s`) for the saves sent so far to be stored; returns how many
        are still on their way. A call that must see them (a listing, a clear) comes after:
        Ray orders one caller's calls to an actor, not two callers' (the verifier saves, the
        front end lists)."""
        import ray

        with self._saves_lock:
            pending = list(self._saves)
        if not pending:
            return 0
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        finished = set(done)
        with self._saves_lock:
            self._saves = [ref for ref in self._saves if ref not in finished]
            return len(self._saves)
