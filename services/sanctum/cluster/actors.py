"""The actor cluster's roles: verifier, drafter and ladder store, each its own Ray actor process
(the front end's side is cluster/backend.py). Each actor wraps the Ray-free role core (the
serving scheduler and verifier, cluster/drafter.py's DraftService, cluster/store.py's
StoreService) and speaks the role contracts (roles.proto) through wire/.

- `VerifierActor`: the target, its live caches and the `Scheduler` (the same one inline mode
  uses); the drafter head (the target's LM head + DFlash 2 selector) lives here, see
  cluster/drafter.py. Sends each request's chunks back to the front end over one Unix socket
  per front end on its host (cluster/events.py), or as a Ray streaming generator of
  `VerifierEvents` (roles.proto) to a front end on another host.
  Restarts forever; in-flight requests are NOT retried (their callers get UNAVAILABLE).
- `DrafterActor`: only the drafter body; per-round traffic arrives over shared memory
  (cluster/transport.py), never as an actor call, except across hosts. Restarts forever;
  the verifier decodes plainly meanwhile and reconnects.
- `StoreActor`: the prompt cache, persisted in a directory; a restart reloads it. Restarts
  forever; the verifier serves uncached meanwhile.
All three take no Ray CPUs (MLX threads are not Ray's to count) and accept custom resources
for placement on other hosts (deploy/README.md).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace

import numpy as np
import ray

from ..serving.inline import RoundDelay, make_verifier
from ..serving.stats import CacheStats, EntryInfo, Stats, serving_stats
from ..settings import CacheSettings, RoleProcesses, ServeSettings
from ..wire.convert import request_from_proto
from ..wire.gen import roles_pb2 as roles
from .events import EventServer, ends, fill_event

log = logging.getLogger("sanctum.cluster")


def _setup_process(processes: RoleProcesses) -> None:
    logging.basicConfig(
        level=processes.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:  # lowering it takes privileges: say how to start Ray instead
            log.warning(
                "running at niceness %d (Ray's worker_niceness); start Ray with "
                "RAY_worker_niceness=0 for full speed",
                nice,
            )
    # Python's own GIL switch interval unless told: a shorter one made the isolation tax worse
    # (docs/performance.md)
    if processes.switch_interval_s:
        sys.setswitchinterval(processes.switch_interval_s)


# ---- the actors ------------------------------------------------------------------------------


@ray.remote
class DrafterActor:
    """The drafter body (no vocabulary-sized weights), serving rounds over shared memory."""

    def __init__(self, settings: ServeSettings, shape: tuple[int, int, int]):
        _setup_process(settings.processes)
        from ..engine.model.drafter import load_drafter
        from .drafter import DraftService
        from .transport import SocketServer

        e = settings.engine

        def load():  # on the server's MLX thread: MLX streams belong to the thread that made them
            drafter = load_drafter(
                e.drafter,
                None,
                block_size=e.block_size,
                bits=e.drafter_bits,
                parts="body",
                target_shape=shape,
            )
            self.service = DraftService(drafter)
            self.bits = drafter.bits
            return self.service.handle

        self.server = SocketServer(load, lambda client: self.service.drop_client(client))
        self.server.wait_ready()
        self.info = roles.DrafterInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            address=self.server.address,
            authkey=self.server.authkey,
            pid=os.getpid(),
            drafter=e.drafter,
            bits=self.bits,
            started=time.time(),
        )
        log.info(
            "drafter: body loaded (%s, bits=%d), listening on %s",
            e.drafter,
            self.bits,
            self.server.address,
        )

    def connect(self) -> bytes:
        """How to reach this drafter (DrafterInfo)."""
        return self.info.SerializeToString()

    def serve_object_store(self, client: str, request: bytes, arrays: list[np.ndarray]):
        """The cross-host path: one DraftRequest with its tensors from the object store."""
        from ..wire.tensors import dtype_name, from_numpy, to_numpy

        req = roles.DraftRequest.FromString(request)

        def job():
            reply, hidden = self.service.handle(
                client, req, lambda r: from_numpy(arrays[r.offset], r.dtype)
            )
            out = []
            if hidden is not None:
                ref = roles.TensorRef(offset=0, shape=hidden.shape, dtype=dtype_name(hidden.dtype))
                reply.hidden.CopyFrom(ref)
                out.append(np.array(to_numpy(hidden)))
            return reply.SerializeToString(), out

        return self.server.submit(job).result()

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Remove the socket (and its directory) before the actor is killed."""
        self.server.close()


@ray.remote
class StoreActor:
    """The ladder store; with a directory it reloads its entries after a restart."""

    def __init__(self, cache: CacheSettings, processes: RoleProcesses, save_delay_s: float = 0.0):
        _setup_process(processes)
        from ..cache.store import PromptStore
        from .store import StoreService

        self.service = StoreService(
            PromptStore(cache.max_bytes, cache.directory, cache.ladder_bytes)
        )
        self.save_delay_s = save_delay_s  # a test knob, never a setting: a slower disk's saves
        log.info(
            "ladder store: %d entries loaded from %s", len(self.service.store), cache.directory
        )

    def ping(self) -> int:
        return os.getpid()

    pid = ping

    def plan(self, query: bytes):
        return self.service.plan(query)

    def put(self, header: bytes, arrays: list[np.ndarray]) -> str:
        if self.save_delay_s:
            time.sleep(self.save_delay_s)
        return self.service.put(header, arrays)

    def list(self, model_key: str = "") -> list[EntryInfo]:
        return self.service.list(model_key)

    def clear(self, model_key: str = "") -> int:
        return self.service.clear(model_key)

    def stats(self) -> CacheStats:
        return self.service.stats()


@ray.remote
class VerifierActor:
    """The target and its live sequences, scheduled round by round."""

    def __init__(
        self,
        settings: ServeSettings,
        drafter_name: str | None,
        store_name: str | None,
        round_delay: RoundDelay | None = None,
    ):
        _setup_process(settings.processes)
        # peers by name, not handle: handles as constructor arguments live in the object store,
        # where a restart may no longer find them (ray-project/ray#53727)
        drafter = ray.get_actor(drafter_name) if drafter_name else None
        store = ray.get_actor(store_name) if store_name else None
        from ..serving.scheduler import Scheduler
        from .drafter import RemoteDraftPeer
        from .store import StoreProxy

        self.settings = settings
        node = ray.get_runtime_context().get_node_id()
        # a saved entry crosses the object store (2 GiB by default on macOS): cap what one ships
        capacity = ray.cluster_resources().get("object_store_memory")
        limit = int(capacity // 4) if capacity else None
        self.store = StoreProxy(store, max_transfer_bytes=limit) if store is not None else None
        self.peer = None

        def remote_peer():
            self.peer = RemoteDraftPeer(drafter, node, settings.transport)
            return self.peer

        # the scheduler's thread loads the models and then owns MLX
        def load():
            return make_verifier(
                settings, self.store, remote_peer if drafter else None, round_delay
            )

        self.scheduler = Scheduler.for_settings(load, settings)
        self.scheduler.wait_ready()
        self.verifier = self.scheduler.verifier
        self.events = EventServer(self._submit, self.scheduler.cancel)
        log.info(
            "verifier: %s loaded; drafter transport %s",
            settings.engine.model,
            self.peer.kind if self.peer else "none",
        )

    def ready(self) -> None:
        """Answers once the models are loaded (the constructor waits for them)."""

    def events_address(self) -> tuple[str, bytes, str]:
        """(Unix socket, authkey, node id): a front end on this host takes its requests' events
        there (cluster/events.py) instead of a Ray stream per request."""
        node = ray.get_runtime_context().get_node_id()
        return self.events.address, self.events.authkey, node

    def _submit(self, sub: roles.Submit, sink=None):
        req = request_from_proto(sub.request, sub.request_id)
        deadline = sub.deadline_unix or None
        return self.scheduler.submit(req, sub.mode or "streaming", deadline, sink=sink)

    def generate(self, submit: bytes):
        """The Ray-stream path (a front end on another host): VerifierEvents (bytes) per item,
        every event ready at that moment, until the request ends."""
        try:
            ticket = self._submit(roles.Submit.FromString(submit))
        except Exception as exc:
            events = roles.VerifierEvents()
            fill_event(events.events.add(), exc, 0)
            yield events.SerializeToString()
            return
        index = 0
        while True:
            events = roles.VerifierEvents()
            batch = ticket.next_batch()
            for item in batch:
                fill_event(events.events.add(), item, index)
                index += 0 if ends(item) else 1
            yield events.SerializeToString()
            if ends(batch[-1]):
                return

    def cancel(self, request_id: str) -> bool:
        return self.scheduler.cancel(request_id)

    def flush_saves(self, timeout_s: float = 10.0) -> int:
        """Wait for the prompt-cache saves sent so far (StoreProxy.flush); how many are left."""
        return self.store.flush(timeout_s) if self.store is not None else 0

    def stats(self) -> Stats:
        out = serving_stats(
            "cluster", self.settings, self.verifier, self.scheduler.stats(), self.peer
        )
        # the verifier's own view of the store (it may not have seen a restart yet)
        seen = self.store is not None and self.store.available
        return replace(out, cache=CacheStats(available=seen))

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Stop taking front ends; remove the socket (and its directory) before the kill."""
        self.events.close()
