"""The gRPC front end: `sanctum.v1.Inference`, `grpc.health.v1` and server reflection, over a
backend (the roles inline, or the Ray actor cluster; see cluster/backend.py).

Health is NOT_SERVING until the models are loaded, while the verifier restarts, and from the
moment a drain starts. A drain (SIGTERM) refuses new requests with UNAVAILABLE, lets in-flight
streams finish, then stops. Client cancellation and deadlines cancel the request in the backend,
which stops it before its next round and frees its sequence. Message sizes are bounded both ways.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..requests import InvalidRequest, validate
from .convert import chunk_to_proto, invalid_message, request_from_proto, round_of
from .gen import inference_pb2 as pb
from .gen import inference_pb2_grpc as pb_grpc

log = logging.getLogger("sanctum.api")
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "sanctum.v1.Inference"


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    from ..cluster.scheduler import QueueFull, Unavailable

    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, invalid_message(exc)
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    log.error("internal error: %r", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc}"


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, backend):
        self.backend = backend
        self.draining = False
        self._inflight = 0
        self._cv = threading.Condition()

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _enter(self, context) -> None:
        with self._cv:
            if self.draining:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, "the server is draining; retry elsewhere"
                )
            if self.backend is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading its models")
            self._inflight += 1

    def _leave(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait for in-flight requests to end; False if some are still running at `timeout`."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._inflight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _chunks(self, request, context, mode: str):
        """The request's chunks; aborts the RPC with the right status on any error."""
        try:
            req = request_from_proto(request)
            if self.backend.limits is not None:
                validate(req, self.backend.limits)  # here too: bad input never reaches a role
        except InvalidRequest as exc:
            context.abort(*_status(exc))
        rid = req.request_id
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self.backend.cancel(rid))
        remaining = context.time_remaining()
        deadline = time.time() + remaining if remaining is not None and remaining < 1e8 else None
        try:
            yield from self.backend.submit(req, mode, deadline)
            done.set()
        except Exception as exc:
            done.set()
            if context.is_active():
                context.abort(*_status(exc))

    # ---- RPCs --------------------------------------------------------------------------------
    def Generate(self, request, context):
        """Stream the completion, one message per round."""
        self._enter(context)
        try:
            for i, chunk in enumerate(self._chunks(request, context, "streaming")):
                yield chunk_to_proto(chunk, i)
        finally:
            self._leave()

    def Complete(self, request, context):
        """The whole completion in one message."""
        self._enter(context)
        try:
            out = pb.CompleteResponse()
            for i, chunk in enumerate(self._chunks(request, context, "sync")):
                m = chunk_to_proto(chunk, i)
                out.text += m.text
                out.token_ids.extend(m.token_ids)
                if i:
                    out.rounds.add(**round_of(m))
                if m.finish_reason:
                    out.finish_reason = m.finish_reason
                if m.HasField("usage"):
                    out.usage.CopyFrom(m.usage)
            return out
        finally:
            self._leave()

    def GetStats(self, request, context):
        """Serving model, queue and cache counters."""
        if self.backend is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading its models")
        try:
            return self.backend.stats()
        except Exception as exc:
            context.abort(*_status(exc))

    def ListCache(self, request, context):
        """Saved prompt-cache entries."""
        try:
            return self.backend.list_cache(request.model_key)
        except Exception as exc:
            context.abort(*_status(exc))

    def ClearCache(self, request, context):
        """Drop saved prompt-cache entries."""
        try:
            return pb.ClearCacheResponse(removed=self.backend.clear_cache(request.model_key))
        except Exception as exc:
            context.abort(*_status(exc))


class Server:
    """A running gRPC front end over `backend` (start, ready, drain, stop)."""

    def __init__(self, backend=None, host: str = "127.0.0.1", port: int = 1337,
                 max_message_bytes: int = 16 << 20, max_streams: int = 96):  # fmt: skip
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        # one thread per open stream; past max_streams gRPC itself answers RESOURCE_EXHAUSTED
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + 8,
                                                           thread_name_prefix="sanctum-grpc"),
                                options=options, maximum_concurrent_rpcs=max_streams)  # fmt: skip
        self.servicer = InferenceServicer(backend)
        pb_grpc.add_InferenceServicer_to_server(self.servicer, self.grpc)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc
        )
        self._set_health(False)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.backend = None
        if backend is not None:
            self.attach(backend)
        self.grpc.start()

    def attach(self, backend) -> None:
        """Serve from `backend` (health stays NOT_SERVING until `ready`)."""
        self.backend = self.servicer.backend = backend
        backend.on_health = self._set_health

    def _set_health(self, serving: bool) -> None:
        if self.servicer.draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE):
            self.health.set(name, status)

    def ready(self, timeout: float | None = None) -> None:
        """Wait for the backend's models, then report SERVING."""
        self.backend.ready(timeout)
        self._set_health(True)

    def drain(self, timeout: float = 30.0) -> bool:
        """NOT_SERVING, refuse new requests, let in-flight ones finish (True if all did)."""
        self.servicer.draining = True
        self.health.enter_graceful_shutdown()
        finished = self.servicer.wait_idle(timeout)
        if not finished:
            log.warning("drain: requests still running after %.0f s; stopping anyway", timeout)
        return finished

    def stop(self, grace: float | None = 1.0) -> None:
        self.grpc.stop(grace).wait()


def serve(settings, host: str, port: int, inline: bool = False, drain_timeout: float = 30.0,
          max_message_bytes: int = 16 << 20) -> int:  # fmt: skip
    """`sanctum serve`: gRPC on host:port over the actor cluster (a local Ray, or RAY_ADDRESS)
    or, with `inline`, over the roles in this process. Returns at the end of a drain."""
    import os
    import signal

    logging.basicConfig(level=os.environ.get("SANCTUM_LOG", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    stop = threading.Event()

    def on_signals():  # again after ray.init, whose core worker installs its own SIGTERM handler
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())

    on_signals()
    ray_started = False
    if not inline:
        import ray

        address = os.environ.get("RAY_ADDRESS") or None
        from ..cluster.actors import LOCAL_RAY_SYSTEM_CONFIG

        local = {} if address else {"_system_config": LOCAL_RAY_SYSTEM_CONFIG}
        if not address and os.environ.get("SANCTUM_OBJECT_STORE_BYTES"):
            local["object_store_memory"] = int(os.environ["SANCTUM_OBJECT_STORE_BYTES"])
        # before the gRPC server starts: Ray forks its processes, gRPC prefers no fork after start
        ray.init(address=address, namespace="sanctum", include_dashboard=False,
                 log_to_driver=True, **local)  # fmt: skip
        ray_started = True
        on_signals()
    try:
        streams = settings.max_active + settings.max_queue + 8
        server = Server(None, host, port, max_message_bytes, max_streams=streams)
        log.info("listening on %s (NOT_SERVING until the models are loaded)", server.address)
        if inline:
            from ..cluster.backend import InlineBackend

            backend = InlineBackend(settings)
        else:
            from ..cluster.actors import start_cluster

            backend = start_cluster(settings)
        server.attach(backend)
        server.ready()
        print(f"sanctum: serving {settings.engine.model} on {server.address} "
              f"({backend.mode})", flush=True)  # fmt: skip
        while not stop.wait(0.25):  # a timeout: a signal landing on another thread still runs
            pass  # its Python handler only when the main thread wakes
        log.info("draining: health NOT_SERVING, new requests refused, in-flight ones finishing")
        server.drain(drain_timeout)
        server.stop(grace=1.0)
        backend.close()
        return 0
    finally:
        if ray_started:
            import ray

            ray.shutdown()
