"""Who may call the gRPC front end, and what a call may send: access settings (bearer token, TLS,
mutual TLS) and one `grpc.aio` server interceptor that enforces them for every service.

- Authentication: with a token configured, every RPC but health and reflection needs gRPC
  metadata `authorization: Bearer <token>` (compared in constant time), else UNAUTHENTICATED.
  TLS and mutual TLS are grpcio's own server credentials.
- Exposure: a non-loopback address needs a token to start at all (`check_exposure`), and
  without TLS the start logs a warning: the token and the prompts cross the network in clear.
- Malformed messages: requests are parsed here, not by grpcio, so bytes that are not the
  method's message get INVALID_ARGUMENT and one log line (grpcio answers INTERNAL and logs a
  traceback every time).
- Idle streams: a client-streaming RPC (server reflection) that sends no message for
  `stream_idle_s` is closed (DEADLINE_EXCEEDED), so idle streams cannot pile up.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("sanctum.api")

# health and reflection answer everyone: load balancers and tools find the service through them
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Access:
    """Who may connect and call: a bearer token and TLS material (PEM bytes), all optional."""

    token: str | None = None
    tls_cert: bytes | None = None  # the server's certificate chain
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None  # set: clients must present a certificate it signed

    @classmethod
    def from_files(
        cls,
        token_file: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
    ) -> Access:
        """Read the files `sanctum serve` was given; ValueError names a bad one."""
        token = None
        if token_file:
            path = Path(token_file)
            token = _read(path, "--auth-token-file").decode().strip()
            if not token:
                raise ValueError(f"--auth-token-file {path} is empty")
            if os.name == "posix" and path.stat().st_mode & 0o077:
                log.warning("the token file %s is readable by other users (chmod 600 it)", path)
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if tls_client_ca and not tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        return cls(
            token,
            _read(Path(tls_cert), "--tls-cert") if tls_cert else None,
            _read(Path(tls_key), "--tls-key") if tls_key else None,
            _read(Path(tls_client_ca), "--tls-client-ca") if tls_client_ca else None,
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """grpcio's TLS credentials (mutual with a client CA), or None for plaintext."""
        if self.tls_cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.tls_client_ca,
            require_client_auth=self.tls_client_ca is not None,
        )


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one ("0.0.0.0" and "::" are not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_exposure(host: str, access: Access) -> None:
    """Refuse to listen beyond loopback without a token; warn when it would be without TLS."""
    if is_loopback(host):
        return
    if not access.token:
        raise ValueError(
            f"listening on {host} (not loopback) needs an auth token: --auth-token-file PATH "
            "or SANCTUM_AUTH_TOKEN_FILE (and TLS: --tls-cert, --tls-key)"
        )
    if access.tls_cert is None:
        log.warning(
            "listening on %s without TLS: the token and the prompts cross the network "
            "in clear; add --tls-cert and --tls-key",
            host,
        )


class Guard(grpc.aio.ServerInterceptor):
    """Authenticates, parses requests strictly and bounds idle request streams (module doc)."""

    def __init__(self, access: Access, stream_idle_s: float):
        self.expected = f"Bearer {access.token}".encode() if access.token else None
        self.stream_idle_s = stream_idle_s

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # an unknown method: grpcio answers UNIMPLEMENTED
            return None
        if self.expected is not None and not details.method.startswith(OPEN_PREFIXES):
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            if not hmac.compare_digest(str(given).encode(), self.expected):
                return _refuse(handler, "missing or wrong bearer token (authorization metadata)")
        return _parsed(handler, details.method, self.stream_idle_s)


def _refuse(handler, message: str):
    """A handler of `handler`'s kind that answers UNAUTHENTICATED without reading a message."""

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = _kind(handler)
    return getattr(grpc, f"{kind}_rpc_method_handler")(deny)


def _kind(handler) -> str:
    return ("stream" if handler.request_streaming else "unary") + (
        "_stream" if handler.response_streaming else "_unary"
    )


def _message_name(parse) -> str:
    owner = getattr(parse, "__self__", None)  # Message.FromString is a bound classmethod
    return getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request")


def _parsed(handler, method: str, idle_s: float):
    """`handler` taking raw bytes: parsed here (INVALID_ARGUMENT when malformed); a request
    stream idle for `idle_s` is closed."""
    parse, behaviour = handler.request_deserializer, getattr(handler, _kind(handler))
    if parse is None:
        return handler
    name = _message_name(parse)

    async def one(raw: bytes, context):
        try:
            return parse(raw)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            log.warning("malformed %s from %s to %s: %s", name, context.peer(), method, exc)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {name} message"
        )

    async def each(raw_messages, context):
        messages = raw_messages.__aiter__()
        while True:
            try:
                raw = await asyncio.wait_for(messages.__anext__(), idle_s)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no message on this stream for {idle_s:g} s: closed",
                )
            yield await one(raw, context)

    read = each if handler.request_streaming else one
    if inspect.isasyncgenfunction(behaviour):  # responses yielded

        async def wrapped(request, context):
            async for response in behaviour(await _arg(read, request, context), context):
                yield response

    else:  # a coroutine (it may write responses through the context)

        async def wrapped(request, context):
            return await behaviour(await _arg(read, request, context), context)

    return getattr(grpc, f"{_kind(handler)}_rpc_method_handler")(
        wrapped, request_deserializer=None, response_serializer=handler.response_serializer
    )


async def _arg(read, request, context):
    """The behaviour's argument: one parsed message, or an async iterator parsing a stream."""
    if inspect.isasyncgenfunction(read):
        return read(request, context)
    return await read(request, context)
