"""The front end's side of the actor cluster: `start_cluster` creates the verifier, drafter and
ladder-store actors (cluster/actors.py) on the connected Ray cluster, and `ClusterBackend`
answers the same calls as the inline backend (serving/inline.py) by talking to them: requests'
events over the verifier's Unix socket on one host (cluster/events.py), a Ray stream per request
across hosts; health follows the verifier (NOT_SERVING from its death until it serves again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import ray

from ..serving.errors import InternalError, Unavailable
from ..serving.inline import RoundDelay
from ..serving.metrics import Metrics
from ..serving.stats import CacheStats, EntryInfo, Stats
from ..settings import RoleProcesses, ServeSettings
from ..wire.convert import chunk_from_proto, request_to_proto
from ..wire.errors import from_role_error
from ..wire.gen import roles_pb2 as roles
from .actors import DrafterActor, StoreActor, VerifierActor
from .events import EventClient
from .transport import ChannelBroken

log = logging.getLogger("sanctum.cluster")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, as OpenBLAS counts
    them): under `taskset -c 0-1` on a 16-core host, 2, not 16."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def role_blas_threads(processes: RoleProcesses, usable: int | None = None) -> dict[str, str]:
    """BLAS threads per role (the CPU backend). Ray pins OMP_NUM_THREADS to an actor's CPU count
    (1 for num_cpus=0), so it is set here. Verifier and drafter mostly take turns (the verifier
    waits on each draft), so each gets what inline mode's one process uses, the CPUs it may run
    on as OpenBLAS counts them (on 4 cores a one-thread drafter slowed every round); but on two
    CPUs or fewer the drafter takes one: there the drafter's work beside the verifier's (a
    shared round asks for the next blocks before its rollback) made two threads each slower
    than one (docs/performance.md)."""
    usable = usable_cpus() if usable is None else usable
    return {
        "verifier": processes.verifier_threads or str(usable),
        "drafter": processes.drafter_threads or str(1 if usable <= 2 else usable),
        "store": "1",
    }


def start_cluster(
    settings: ServeSettings, round_delay: RoundDelay | None = None, save_delay_s: float = 0.0
) -> ClusterBackend:
    """Create the three actors on the connected Ray cluster (ray.init first); `round_delay`: a
    slower target, `save_delay_s`: a slower store's saves (benchmarks, tests)."""
    if not ray.is_initialized():
        raise RuntimeError("ray.init() first (a local cluster, or RAY_ADDRESS)")
    if not Path(settings.engine.model, "config.json").is_file():  # the tiny pair, on first use
        from ..tiny import ensure_pair

        ensure_pair(settings.engine.model, settings.engine.drafter)
    threads = role_blas_threads(settings.processes)

    def opts(role: str, **kw) -> dict:
        res = settings.resources.get(role)
        env = {"env_vars": {"OMP_NUM_THREADS": threads[role]}}
        if role != "store":  # idle BLAS workers would hold a core through the other one's turn
            env["env_vars"]["OPENBLAS_THREAD_TIMEOUT"] = settings.processes.blas_thread_timeout
        return dict(
            num_cpus=0,
            max_restarts=-1,
            runtime_env=env,
            **kw,
            **({"resources": res} if res else {}),
        )

    prefix = f"sanctum-{uuid.uuid4().hex[:8]}"
    store = StoreActor.options(**opts("store", name=f"{prefix}-store", max_task_retries=0)).remote(
        settings.cache, settings.processes, save_delay_s
    )
    drafter = None
    if settings.engine.drafter:
        drafter_opts = opts(
            "drafter", name=f"{prefix}-drafter", max_task_retries=-1, max_concurrency=4
        )
        drafter = DrafterActor.options(**drafter_opts).remote(
            settings, target_shape(settings.engine.model)
        )
    concurrency = settings.max_active + settings.max_queue + 16  # generator threads wait on tickets
    verifier_opts = opts(
        "verifier", name=f"{prefix}-verifier", max_task_retries=0, max_concurrency=concurrency
    )
    verifier = VerifierActor.options(**verifier_opts).remote(
        settings, f"{prefix}-drafter" if drafter else None, f"{prefix}-store", round_delay
    )
    return ClusterBackend(settings, verifier, drafter, store)


class ClusterBackend:
    """The front end's view of the actor cluster (same calls as InlineBackend)."""

    mode = "cluster"
    LOST = (
        "the verifier actor died while serving this request; it is restarting, "
        "retry the request shortly"
    )

    def __init__(self, settings: ServeSettings, verifier, drafter, store):
        self.settings = settings
        self.verifier, self.drafter, self.store = verifier, drafter, store
        self.on_health = None  # callable(bool): the server flips health while the verifier restarts
        self._watching = threading.Lock()
        self._restarting = False  # from the verifier's death until it serves again
        self._closing = False
        self._probe: threading.Thread | None = None
        self._watch: threading.Thread | None = None
        # how requests' events come back: "socket" (one connection, same host: events.py) or
        # "ray" (a Ray stream per request); None until known (again after a verifier restart)
        self.events_path: str | None = None
        self._events: EventClient | None = None
        self._events_lock = threading.Lock()
        self.restarts = {"verifier": 0}  # deaths seen (serving/metrics.py)
        self.metrics = Metrics(self)

    def ready(self, timeout: float | None = None) -> None:
        """Block until the verifier (and through it the drafter and store) has loaded."""
        ray.get(self.verifier.ready.remote(), timeout=timeout)
        self._event_client(timeout)
        self._restarting = False
        if self.events_path == "ray" and self._probe is None and not self._closing:
            self._probe = threading.Thread(
                target=self._probe_loop, name="sanctum-verifier-probe", daemon=True
            )
            self._probe.start()

    def _probe_loop(self, every_s: float = 1.0) -> None:
        """Without the event socket (the verifier on another host) nothing hangs up when the
        verifier dies: ask it for its pid every second instead."""
        while not self._closing:
            time.sleep(every_s)
            if not ray.is_initialized():  # shut down (a call now would start a new Ray)
                return
            if self.events_path != "ray" or self._restarting:
                continue
            try:
                ray.get(self.verifier.pid.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._verifier_lost()

    def _event_client(self, timeout: float | None = 60.0) -> EventClient | None:
        """The connection for events when the verifier is on this host; None: Ray streams."""
        with self._events_lock:
            if self._events is not None and not self._events.broken:
                return self._events
            if self.events_path == "ray" or self.settings.transport == "object_store":
                self.events_path = "ray"
                return None
            try:
                address, authkey, node = ray.get(
                    self.verifier.events_address.remote(), timeout=timeout
                )
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                raise Unavailable("the verifier is restarting; retry shortly") from None
            if (
                self.settings.transport == "auto"
                and node != ray.get_runtime_context().get_node_id()
            ):
                self.events_path = "ray"
                return None
            try:  # its hang-up is how a dead verifier is noticed, requests in flight or not
                self._events = EventClient(address, authkey, on_lost=self._verifier_lost)
            except OSError as exc:
                raise Unavailable(f"cannot reach the verifier's event socket: {exc}") from None
            self.events_path = "socket"
            return self._events

    def submit(self, req, mode: str = "streaming", deadline: float | None = None):
        """Chunks of `req` as they are committed; raises QueueFull / Unavailable at once."""
        return self.metrics.track(lambda: self._submit(req, mode, deadline))

    def _submit(self, req, mode: str, deadline: float | None):
        if self._restarting:  # fail fast: waiting would hold the caller for the whole restart
            raise Unavailable("the verifier is restarting; retry shortly")
        sub = roles.Submit(request_id=req.request_id, mode=mode, deadline_unix=deadline or 0.0)
        request_to_proto(req, out=sub.request)
        events = self._event_client()
        if events is None:
            stream = self.verifier.generate.options(num_returns="streaming").remote(
                sub.SerializeToString()
            )
            return self._chunks(self._ray_events(stream))
        try:
            q = events.submit(sub)
        except ChannelBroken:
            self._verifier_lost()
            raise Unavailable(self.LOST) from None
        return self._chunks(events.events(req.request_id, q))

    @staticmethod
    def _ray_events(stream):
        try:
            for ref in stream:
                yield from roles.VerifierEvents.FromString(ray.get(ref)).events
        except ray.exceptions.RayActorError:
            raise ChannelBroken("the verifier actor died") from None
        except ray.exceptions.RayTaskError as exc:
            raise InternalError(f"verifier task failed: {exc.cause!r}") from None

    def _chunks(self, events):
        try:
            for ev in events:
                kind = ev.WhichOneof("kind")
                if kind == "error":
                    raise from_role_error(ev.error)
                if kind == "chunk":
                    yield chunk_from_proto(ev.chunk)
        except ChannelBroken:
            self._verifier_lost()
            raise Unavailable(self.LOST) from None
        finally:  # now, not whenever the garbage collector reaches the raised error's frames
            events.close()

    def _verifier_lost(self) -> None:
        """Report NOT_SERVING until the restarted verifier has loaded its models."""
        if self._closing or not self._watching.acquire(blocking=False):
            return
        self._restarting = True
        self.restarts["verifier"] += 1
        log.warning("verifier: lost; NOT_SERVING until it is back")
        with self._events_lock:
            if self.events_path == "ray":  # the restarted verifier may run on another host
                self.events_path = None
        if self.on_health:
            self.on_health(False)

        def watch():
            try:
                while not self._closing and ray.is_initialized():  # (else Ray would auto-init)
                    try:  # short waits: `close` joins this thread
                        self.ready(timeout=5)
                    except Exception:
                        time.sleep(0.5)
                        continue
                    log.info("verifier: back after a restart")
                    if self.on_health:
                        self.on_health(True)
                    return
            finally:
                self._watching.release()

        self._watch = threading.Thread(target=watch, name="sanctum-verifier-watch", daemon=True)
        self._watch.start()

    def cancel(self, request_id: str) -> None:
        events = self._events
        if events is not None and not events.broken:
            events.cancel(request_id)
            return
        with contextlib.suppress(Exception):  # a dead verifier has nothing left to cancel
            self.verifier.cancel.remote(request_id)

    def _saved(self, timeout_s: float = 10.0) -> None:
        """The saves the verifier has sent are stored (waiting up to `timeout_s`): what a
        listing, a clear or the counters say then includes every request already ended."""
        with contextlib.suppress(Exception):  # a verifier away has no saves in flight
            ray.get(self.verifier.flush_saves.remote(timeout_s), timeout=timeout_s + 5)

    def stats(self) -> Stats:
        self._saved(timeout_s=2.0)  # (metrics scrapes call this: a short wait at most)
        try:
            out: Stats = ray.get(self.verifier.stats.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            raise Unavailable("the verifier is restarting") from None
        seen = out.cache.available
        try:
            cache: CacheStats = ray.get(self.store.stats.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            cache = CacheStats(available=False)
        # available = the store answers AND the verifier serves from it again
        return replace(out, cache=replace(cache, available=cache.available and seen))

    def _store_call(self, method, *args):
        try:
            return ray.get(method.remote(*args), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            raise Unavailable("the ladder store is restarting; retry shortly") from None

    def list_cache(self, model_key: str = "") -> list[EntryInfo]:
        self._saved()
        return self._store_call(self.store.list, model_key)

    def clear_cache(self, model_key: str = "") -> int:
        self._saved()
        return self._store_call(self.store.clear, model_key)

    def pids(self) -> dict[str, int]:
        """Process ids of the role actors (fault-injection tests, operators)."""
        handles = {"verifier": self.verifier, "drafter": self.drafter, "store": self.store}
        return {k: ray.get(h.pid.remote(), timeout=60) for k, h in handles.items() if h is not None}

    def close(self) -> None:
        self._closing = True
        # the probe and the restart watch call Ray: joined here, so none is still inside a Ray
        # call when the caller shuts Ray down next (each notices `_closing` within seconds)
        for thread in (self._probe, self._watch):
            if thread is not None and thread is not threading.current_thread():
                thread.join(15)
        if self._events is not None:
            self._events.close()
        # their sockets first: a killed actor runs no cleanup (a later start sweeps what is left)
        closing = [h.close.remote() for h in (self.verifier, self.drafter) if h is not None]
        with contextlib.suppress(Exception):
            ray.get(closing, timeout=5)
        for h in (self.verifier, self.drafter, self.store):
            if h is not None:
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(h, no_restart=True)


def target_shape(model: str) -> tuple[int, int, int]:
    """(num_layers, hidden, vocab) from the target's config, without loading its weights."""
    from ..engine.model.checkpoint import read_config, resolve_checkpoint

    raw = read_config(resolve_checkpoint(model))
    text = raw.get("text_config", raw)
    return int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"])
