"""The gRPC front end: `sanctum.v1.Inference`, `grpc.health.v1` and server reflection, over a
backend (the roles inline, serving/inline.py, or the Ray actor cluster, cluster/backend.py):
requests and chunks converted once here (wire/convert.py), errors mapped once
(wire/errors.py).

Admission cannot be starved. The server is grpcio's asyncio one, on its own event-loop thread:
an open stream costs a coroutine, not a thread, so health and reflection always answer, however
many streams sit idle. The concurrency bound (`max_streams`) applies to generation (Generate,
Complete) only: past it RESOURCE_EXHAUSTED, as when the backend's queue is full. Connections are
bounded by grpcio's own options (keepalive, idle and age limits, streams per connection, number
of connections: `ConnectionLimits`); a client that stops taking its responses loses its stream
after `slow_client_s`, and api/guard.py closes idle request streams, checks the
bearer token and answers malformed messages. Blocking backend work (submitting, waiting for the
next chunk, stats, cache administration) runs on thread pools: generation's as large as its
bound, administration's small and bounded too.

Health is NOT_SERVING until the models are loaded, while the verifier restarts, and from the
moment a drain starts. A drain (SIGTERM) refuses new requests with UNAVAILABLE, lets in-flight
streams finish, then stops. Client cancellation and deadlines cancel the request in the backend,
which stops it before its next round and frees its sequence. Message sizes are bounded both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ..serving.errors import InvalidRequest, QueueFull, Unavailable
from ..settings import ConnectionLimits
from ..wire.convert import (
    chunk_to_proto,
    entries_to_proto,
    request_from_proto,
    round_of,
    stats_to_proto,
    usage_to_proto,
)
from ..wire.errors import grpc_status
from ..wire.gen import inference_pb2 as pb
from ..wire.gen import inference_pb2_grpc as pb_grpc
from .guard import Access, Guard, check_exposure

log = logging.getLogger("sanctum.api")
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "sanctum.v1.Inference"
ADMIN_THREADS = 2  # stats and cache administration: Ray calls of up to ~10 s when a role is down
ADMIN_LIMIT = 16  # such calls in flight at once; more get RESOURCE_EXHAUSTED
_END = object()


class InferenceServicer(pb_grpc.InferenceServicer):
    """sanctum.v1.Inference on the event loop; the backend's blocking calls on thread pools."""

    def __init__(self, backend, max_streams: int, slow_client_s: float = 30.0):
        self.backend = backend
        self.draining = False
        self.max_streams = max_streams
        self.slow_client_s = slow_client_s
        self._inflight = 0  # generation requests
        self._cv = threading.Condition()
        # one thread per generation request, blocked on its next chunk (+ a few for cancelled
        # ones whose thread is still waiting for the backend's end)
        self._generation = ThreadPoolExecutor(max_streams + 8, thread_name_prefix="sanctum-gen")
        self._admin = ThreadPoolExecutor(ADMIN_THREADS, thread_name_prefix="sanctum-admin")
        self._admin_inflight = 0  # touched on the event loop only

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _enter(self) -> None:
        """Count a generation request in, or raise why not (Unavailable, QueueFull)."""
        try:
            self._admit()
        except (Unavailable, QueueFull) as exc:
            self.refused(exc)
            raise

    def refused(self, exc: Exception) -> None:
        """Count a request refused before it reached the backend (here, or malformed): the
        backend counts every other request, once (serving/metrics.py)."""
        metrics = getattr(self.backend, "metrics", None)
        if metrics is not None:
            metrics.refused(exc)

    def _admit(self) -> None:
        with self._cv:
            if self.draining:
                raise Unavailable("the server is draining; retry elsewhere")
            if self.backend is None:
                raise Unavailable("the server is loading its models")
            if self._inflight >= self.max_streams:
                raise QueueFull(
                    f"{self._inflight} generation requests in flight, the server's limit; "
                    "retry later"
                )
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

    def close(self) -> None:
        self._generation.shutdown(wait=False, cancel_futures=True)
        self._admin.shutdown(wait=False, cancel_futures=True)

    def _open(self, request: pb.GenerateRequest, mode: str, deadline: float | None):
        """On a generation thread: the request's id and its chunk iterator (raises at once for
        a full queue or a restarting verifier; bad input is the serving core's to refuse, once,
        before tokenization: serving/requests.py `validate`)."""
        try:
            req = request_from_proto(request)
        except InvalidRequest as exc:
            self.refused(exc)
            raise
        return self._submit(req, mode, deadline)

    def _submit(self, req, mode: str, deadline: float | None):
        return req.request_id, iter(self.backend.submit(req, mode, deadline))

    async def stream(self, req, mode: str, deadline: float | None = None):
        """The chunks of `req` (a serving GenerateRequest) for the HTTP front end, under the same
        admission as gRPC's (draining, loading, the bound on generation), the backend's blocking
        calls on the same threads. Raises the serving errors; a caller that stops early
        (disconnected, cancelled) cancels the request in the backend."""
        self._enter()
        loop = asyncio.get_running_loop()
        ended = False
        try:
            opening = loop.run_in_executor(self._generation, self._submit, req, mode, deadline)
            try:
                _, chunks = await asyncio.shield(opening)
            except asyncio.CancelledError:
                opening.add_done_callback(self._cancel_opened)
                raise
            except Exception:
                ended = True  # refused: nothing to cancel
                raise
            while True:
                try:
                    chunk = await loop.run_in_executor(self._generation, next, chunks, _END)
                except Exception:
                    ended = True
                    raise
                if chunk is _END:
                    ended = True
                    return
                yield chunk
        finally:
            if not ended:
                self.backend.cancel(req.request_id)
            self._leave()

    async def _chunks(self, request, context, mode: str):
        """The request's chunks; aborts the RPC with the right status on any error."""
        try:
            self._enter()
        except (Unavailable, QueueFull) as exc:
            await context.abort(*grpc_status(exc))
        loop = asyncio.get_running_loop()
        try:
            remaining = context.time_remaining()
            deadline = (
                time.time() + remaining if remaining is not None and remaining < 1e8 else None
            )
            opening = loop.run_in_executor(self._generation, self._open, request, mode, deadline)
            try:
                rid, chunks = await asyncio.shield(opening)
            except asyncio.CancelledError:  # the client left while the request was submitted:
                opening.add_done_callback(self._cancel_opened)  # cancel it once it is there
                raise
            except Exception as exc:
                await context.abort(*grpc_status(exc))
            ended = False
            context.add_done_callback(lambda _: None if ended else self.backend.cancel(rid))
            while True:
                try:
                    chunk = await loop.run_in_executor(self._generation, next, chunks, _END)
                except Exception as exc:
                    ended = True
                    await context.abort(*grpc_status(exc))
                if chunk is _END:
                    ended = True
                    return
                yield chunk
        finally:
            self._leave()

    def _cancel_opened(self, opening: asyncio.Future) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.backend.cancel(opening.result()[0])

    async def _admin_call(self, context, fn, *args):
        """`fn(*args)` on an administration thread; its error as the RPC's status."""
        if self.backend is None:
            await context.abort(*grpc_status(Unavailable("the server is loading its models")))
        if self._admin_inflight >= ADMIN_LIMIT:
            busy = QueueFull(f"{ADMIN_LIMIT} administrative calls in flight; retry later")
            await context.abort(*grpc_status(busy))
        self._admin_inflight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._admin, fn, *args)
        except Exception as exc:
            await context.abort(*grpc_status(exc))
        finally:
            self._admin_inflight -= 1

    # ---- RPCs --------------------------------------------------------------------------------
    async def Generate(self, request, context):
        """Stream the completion, one message per round."""
        async with contextlib.aclosing(self._chunks(request, context, "streaming")) as chunks:
            index = 0
            async for chunk in chunks:
                await self._write(context, chunk_to_proto(chunk, index))
                index += 1

    async def _write(self, context, message) -> None:
        """Send one response; a client that takes none for `slow_client_s` loses the stream
        (and the request its slot), instead of holding it for as long as it likes."""
        try:
            await asyncio.wait_for(context.write(message), self.slow_client_s)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no response taken for {self.slow_client_s:g} s: the client "
                "reads too slowly; stream closed",
            )

    async def Complete(self, request, context):
        """The whole completion in one message."""
        out, index = pb.CompleteResponse(), 0
        async with contextlib.aclosing(self._chunks(request, context, "sync")) as chunks:
            async for chunk in chunks:  # each converted once, into the one response
                out.text += chunk.text
                out.token_ids.extend(chunk.token_ids)
                if index:
                    out.rounds.add(**round_of(chunk))
                if chunk.finish_reason:
                    out.finish_reason = chunk.finish_reason
                if chunk.usage is not None:
                    out.usage.CopyFrom(usage_to_proto(chunk.usage))
                index += 1
        return out

    async def GetStats(self, request, context):
        """Serving model, queue and cache counters."""
        return stats_to_proto(await self._admin_call(context, self.backend.stats))

    async def ListCache(self, request, context):
        """Saved prompt-cache entries."""
        entries = await self._admin_call(context, self.backend.list_cache, request.model_key)
        return entries_to_proto(entries)

    async def ClearCache(self, request, context):
        """Drop saved prompt-cache entries."""
        removed = await self._admin_call(
            context, lambda: self.backend.clear_cache(request.model_key)
        )
        return pb.ClearCacheResponse(removed=removed)


class Server:
    """A running gRPC front end over `backend` (start, ready, drain, stop). Its methods may be
    called from any thread; the server itself runs on its own event-loop thread."""

    def __init__(
        self,
        backend=None,
        host: str = "127.0.0.1",
        port: int = 1337,
        max_message_bytes: int = 16 << 20,
        max_streams: int = 96,
        *,
        access: Access | None = None,
        limits: ConnectionLimits | None = None,
    ):
        self.access = access or Access()
        check_exposure(host, self.access)
        limits = limits or ConnectionLimits()
        self.servicer = InferenceServicer(backend, max_streams, limits.slow_client_s)
        self._serving = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sanctum-grpc", daemon=True
        )
        self._thread.start()
        try:
            self.port = self._call(self._start(host, port, max_message_bytes, limits))
        except BaseException:
            self._stop_loop()
            raise
        self.address = f"{host}:{self.port}"
        self.host, self.max_message_bytes, self.limits = host, max_message_bytes, limits
        self.http = None  # api/http.py HttpFrontEnd, once start_http ran
        self.http_port: int | None = None
        self.backend = None
        if backend is not None:
            self.attach(backend)

    def _call(self, coro, timeout: float | None = None):
        """Run `coro` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(
        self, host: str, port: int, max_message_bytes: int, limits: ConnectionLimits
    ) -> int:
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            *limits.grpc_options(),
        ]
        self.grpc = grpc.aio.server(
            interceptors=[Guard(self.access, limits.stream_idle_s)], options=options
        )
        pb_grpc.add_InferenceServicer_to_server(self.servicer, self.grpc)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc
        )
        await self._apply_health()
        address = f"{host}:{port}"
        credentials = self.access.server_credentials()
        bound = (
            self.grpc.add_secure_port(address, credentials)
            if credentials is not None
            else self.grpc.add_insecure_port(address)
        )
        if not bound:
            raise OSError(f"cannot listen on {address}")
        await self.grpc.start()
        return bound

    def start_http(self, port: int, tls: dict | None = None) -> int:
        """Serve HTTP (api/http.py: OpenAI's API, /health, /metrics) on this server's host and
        event loop, over its backend, admission and token; `port` 0: any free one. `tls`:
        uvicorn's ssl_* options. Returns the bound port."""
        from .http import HttpFrontEnd

        self.http = HttpFrontEnd(
            self.servicer,
            self.access,
            self.max_message_bytes,
            lambda: self._serving,
            self.limits,
        )
        self.http_port = self._call(self.http.start(self.host, port, tls))
        return self.http_port

    def attach(self, backend) -> None:
        """Serve from `backend` (health stays NOT_SERVING until `ready`)."""
        self.backend = self.servicer.backend = backend
        backend.on_health = self._set_health

    def _set_health(self, serving: bool, wait: bool = False) -> None:
        """Report SERVING or NOT_SERVING (any thread; the latest call wins)."""
        self._serving = serving
        if not self._thread.is_alive():  # stopped: nobody to tell
            return
        if threading.current_thread() is self._thread:
            self._loop.create_task(self._apply_health())
            return
        done = asyncio.run_coroutine_threadsafe(self._apply_health(), self._loop)
        if wait:
            done.result(10)

    async def _apply_health(self) -> None:
        if self.servicer.draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE):
            await self.health.set(name, status)

    def ready(self, timeout: float | None = None) -> None:
        """Wait for the backend's models, then report SERVING."""
        self.backend.ready(timeout)
        self._set_health(True, wait=True)

    def drain(self, timeout: float = 30.0) -> bool:
        """NOT_SERVING, refuse new requests, let in-flight ones finish (True if all did)."""
        self.servicer.draining = True
        self._call(self.health.enter_graceful_shutdown(), 10)
        finished = self.servicer.wait_idle(timeout)
        if not finished:
            log.warning("drain: requests still running after %.0f s; stopping anyway", timeout)
        return finished

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (in-flight RPCs get `grace` seconds), then the loop thread."""
        if self._thread.is_alive():
            if self.http is not None:
                self._call(self.http.stop())
            self._call(self.grpc.stop(grace))
            self._stop_loop()
        self.servicer.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
