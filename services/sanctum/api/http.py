"""The HTTP front end: OpenAI's `POST /v1/chat/completions` and `POST /v1/completions` (streamed
as server-sent events ending in `[DONE]`, or whole), `GET /v1/models`, `GET /health` and
`GET /metrics` (Prometheus), as a Starlette app served by uvicorn.

It runs on the gRPC server's event loop (api/server.py `Server.start_http`), over the same
backend and under the same admission (`InferenceServicer.stream`: draining, loading, the bound
on generation), so a drain waits for HTTP requests too. Requests become the serving core's
`GenerateRequest` (api/openai.py) and are validated once, by the core; errors come from the one
table (wire/errors.py `http_error`) in OpenAI's shape. The same host and token policy as gRPC:
with a token configured every path but /health needs `Authorization: Bearer <token>` (401);
bodies are bounded by the gRPC message limit (413 naming it); a client that disconnects cancels
its generation. Metrics are the backend's (serving/metrics.py), counted there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..serving.errors import InvalidRequest
from ..settings import ConnectionLimits
from ..wire.errors import http_error
from . import openai
from .guard import Access

log = logging.getLogger("sanctum.http")
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(status: int, message: str, kind: str, code: str, param=None, headers=None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def serving_error(exc: BaseException, call: openai.Call | None = None) -> JSONResponse:
    """A serving error as OpenAI's error object, under the field name the client used."""
    if isinstance(exc, InvalidRequest) and call is not None and exc.field == "max_tokens":
        text = str(exc).removeprefix("max_tokens: ")
        exc = InvalidRequest(call.max_tokens_field, text)
    status, body = http_error(exc)
    return JSONResponse(body, status_code=status)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class HttpFrontEnd:
    """The Starlette app over a gRPC servicer's backend and admission (module doc)."""

    def __init__(
        self,
        gate,
        access: Access,
        max_body_bytes: int,
        serving: Callable[[], bool],
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.gate = gate  # api/server.py InferenceServicer: .backend, .draining, .stream()
        self.expected = f"Bearer {access.token}".encode() if access.token else None
        self.max_body_bytes = max_body_bytes
        self.serving = serving
        self.limits = limits or ConnectionLimits()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._guarded(self.chat), methods=["POST"]),
                Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
                Route("/v1/models", self._guarded(self.models), methods=["GET"]),
                Route("/metrics", self._guarded(self.metrics), methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    # ---- access ----------------------------------------------------------------------------
    def _guarded(self, handler):
        async def guarded(request: Request):
            if self.expected is not None:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, self.expected):
                    return error_response(
                        401,
                        "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                        "authentication_error",
                        "unauthenticated",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
            return await handler(request)

        return guarded

    async def _body(self, request: Request) -> dict:
        """The JSON object in the body, read up to the size limit (InvalidRequest otherwise)."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _TooLarge(int(length))
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise _TooLarge(size)
            parts.append(part)
        try:
            body = json.loads(b"".join(parts))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest("body", f"not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body", "must be a JSON object")
        return body

    def _too_large(self, size: int) -> JSONResponse:
        return error_response(
            413,
            f"request body of {size} bytes or more exceeds the limit of {self.max_body_bytes} "
            "bytes (SANCTUM_MAX_MESSAGE_BYTES)",
            "invalid_request_error",
            "request_too_large",
        )

    def _model(self) -> str:
        backend = self.gate.backend
        return backend.settings.engine.model if backend is not None else ""

    # ---- routes ----------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        """OpenAI chat completions."""
        return await self._generate(request, openai.chat_request)

    async def completions(self, request: Request) -> Response:
        """OpenAI (legacy) completions."""
        return await self._generate(request, openai.completion_request)

    async def models(self, request: Request) -> Response:
        """The served model."""
        if self.gate.backend is None:
            return serving_error(_loading())
        model = {"id": self._model(), "object": "model", "created": 0, "owned_by": "sanctum"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        """200 while serving; 503 while loading, restarting the verifier or draining."""
        if self.serving() and not self.gate.draining:
            return JSONResponse({"status": "ok"})
        status = "draining" if self.gate.draining else "unavailable"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text format: the backend's registry (serving/metrics.py)."""
        backend = self.gate.backend
        if backend is None:
            return serving_error(_loading())
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self.gate._admin, backend.metrics.render)
        return Response(text, media_type=METRICS_TYPE)

    async def _generate(self, request: Request, parse) -> Response:
        call = None
        try:
            try:  # a body trickled in: cut, as gRPC cuts an idle request stream
                body = await asyncio.wait_for(self._body(request), self.limits.stream_idle_s)
            except asyncio.TimeoutError:
                s = self.limits.stream_idle_s
                return error_response(
                    408, f"request body not received within {s:g} s", "invalid_request_error",
                    "request_timeout",
                )  # fmt: skip
            try:
                req, call = parse(body, self._model())
            except InvalidRequest as exc:
                self.gate.refused(exc)
                raise
            chunks = self.gate.stream(req, "streaming" if call.stream else "sync")
            if call.stream:  # the status waits for the first chunk: errors before it get theirs
                first = await _until_gone(request, anext(chunks, None))
                return SlowClientStream(
                    self._events(call, req.request_id, first, chunks),
                    self.limits.slow_client_s,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return JSONResponse(await _until_gone(request, _whole(call, req.request_id, chunks)))
        except _TooLarge as exc:
            return self._too_large(exc.size)
        except ClientGone:
            log.info("http: client disconnected; request cancelled")
            return Response(status_code=499)
        except Exception as exc:
            return serving_error(exc, call)

    async def _events(self, call: openai.Call, rid: str, first, chunks):
        """The stream's server-sent events; an error after the first is an error event."""
        try:
            if call.kind == openai.CHAT:
                yield sse(openai.chunk_object(call, rid, "", role=True))
            usage, chunk = None, first
            while chunk is not None:
                if chunk.text:
                    yield sse(openai.chunk_object(call, rid, chunk.text))
                if chunk.finish_reason:
                    yield sse(openai.chunk_object(call, rid, None, chunk.finish_reason))
                usage = chunk.usage or usage
                chunk = await anext(chunks, None)
            if call.include_usage and usage is not None:
                yield sse(openai.usage_chunk(call, rid, usage))
        except Exception as exc:
            yield sse(http_error(exc)[1])
        finally:
            await chunks.aclose()  # a disconnected client: cancels the request
        yield "data: [DONE]\n\n"

    # ---- serving ---------------------------------------------------------------------------
    async def start(self, host: str, port: int, tls: dict | None = None) -> int:
        """Listen on host:port (0: any free port) and serve on this loop; the bound port."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then;
        # without it a response's head and body writes wait on the client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port} for HTTP: {exc}") from None
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=5,  # idle keep-alive connections close (uvicorn's default)
            timeout_graceful_shutdown=1,
            limit_concurrency=self.limits.max_connections,  # beyond: 503, as gRPC's bound
            http=type("Bounded", (BoundedH11,), {"head_s": self.limits.stream_idle_s}),
            **(tls or {}),
        )
        self.server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None and self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection, cut when it waits for a request head longer than `head_s`:
    a connection that sends nothing or trickles its head (uvicorn bounds only the idle time
    after a response, until more bytes arrive) cannot hold a connection slot for long."""

    head_s = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._waiting_since = self.loop.time()
        self._head_timer = self.loop.call_later(self.head_s, self._check_head)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_since = self.loop.time()

    def _check_head(self) -> None:
        if self.transport.is_closing():
            return
        serving = self.cycle is not None and not self.cycle.response_complete
        waited = self.loop.time() - self._waiting_since
        if not serving and waited >= self.head_s:
            log.info("http: no request head in %.0f s; connection closed", waited)
            self.transport.close()
            return
        self._head_timer = self.loop.call_later(
            self.head_s - waited if not serving else self.head_s, self._check_head
        )

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


class SlowClientStream(StreamingResponse):
    """Server-sent events whose client must take each within `slow_s` (as gRPC's
    slow_client_s): a client that stops reading loses its stream, and the request its slot."""

    def __init__(self, content, slow_s: float, **kw):
        super().__init__(content, **kw)
        self.slow_s = slow_s

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.slow_s)
            except asyncio.TimeoutError:
                log.warning("http: no event taken for %g s; stream closed", self.slow_s)
                raise ClientGone from None

        try:
            await super().stream_response(timed)
        except ClientGone:
            await self.body_iterator.aclose()  # cancels the request now


class _TooLarge(Exception):
    def __init__(self, size: int):
        self.size = size


def _loading():
    from ..serving.errors import Unavailable

    return Unavailable("the server is loading its models")


async def _whole(call: openai.Call, rid: str, chunks) -> dict:
    """The whole answer of a non-streamed request."""
    text, finish, usage = [], None, None
    try:
        async for chunk in chunks:
            text.append(chunk.text)
            finish = chunk.finish_reason or finish
            usage = chunk.usage or usage
    finally:
        await chunks.aclose()
    return openai.completion_object(call, rid, "".join(text), finish, usage)


async def _until_gone(request: Request, awaitable):
    """`awaitable`'s result, or ClientGone (and `awaitable` cancelled) if the client leaves
    first: a request's body is read by now, so the next message can only be its disconnect."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
