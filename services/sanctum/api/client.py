"""A Python client for `sanctum serve`, and the `sanctum generate --server` path.

from sanctum.api.client import Client
with Client("127.0.0.1:1337") as c:
    for piece in c.generate("def fibonacci(n):", max_tokens=64):
        print(piece.text, end="")

A server started with --auth-token-file wants `authorization: Bearer <token>` on every call: the
client sends `token`, else SANCTUM_AUTH_TOKEN, else the contents of SANCTUM_AUTH_TOKEN_FILE.
TLS: `tls_ca` (PEM bytes or a path; None with `tls=True`: the system's roots) verifies the server;
`tls_cert` + `tls_key` present a client certificate (mutual TLS).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..settings import client_token
from ..wire.convert import KV_TO_WIRE, round_of, rounds_tau
from ..wire.gen import inference_pb2 as pb
from ..wire.gen import inference_pb2_grpc as pb_grpc


def make_request(
    prompt: str | None = None,
    *,
    token_ids: list[int] | None = None,
    messages: list[dict] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | tuple[str, ...] = (),
    kv_mode: str | None = None,
    use_cache: bool | None = None,
    request_id: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest; None leaves a field unset (the server's default applies)."""
    req = pb.GenerateRequest(stop=list(stop), kv_mode=KV_TO_WIRE[kv_mode], request_id=request_id)
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        req.chat.SetInParent()
        for m in messages:
            req.chat.messages.add(role=m["role"], content=m["content"])
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("use_cache", use_cache),
    ):
        if value is not None:
            setattr(req, name, value)
    return req


def _pem(value: bytes | str | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call on the channel."""

    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = [*(details.metadata or ()), self.header]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


class Client:
    """A channel to one server; every call takes an optional `timeout` (seconds: a deadline)."""

    def __init__(
        self,
        target: str,
        max_message_bytes: int = 16 << 20,
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: bytes | str | None = None,
        tls_cert: bytes | str | None = None,
        tls_key: bytes | str | None = None,
        options: tuple = (),
    ):
        self.target = target
        opts = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *options,
        ]
        if tls or tls_ca or tls_cert:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_ca),
                private_key=_pem(tls_key),
                certificate_chain=_pem(tls_cert),
            )
            self.channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(target, options=opts)
        token = client_token(token)
        if token:
            self.channel = grpc.intercept_channel(self.channel, _BearerToken(token))
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None):
        """The raw streaming call (iterate it; `.cancel()` stops the request)."""
        return self.stub.Generate(request, timeout=timeout)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kw
    ) -> Iterator[pb.GenerateResponse]:
        """Stream a completion: one GenerateResponse per round (see `make_request` for `kw`)."""
        return self.stub.Generate(make_request(prompt, **kw), timeout=timeout)

    def complete(
        self, prompt: str | None = None, *, timeout: float | None = None, **kw
    ) -> pb.CompleteResponse:
        """The whole completion in one response."""
        return self.stub.Complete(make_request(prompt, **kw), timeout=timeout)

    def stats(self, timeout: float | None = 10) -> pb.StatsResponse:
        return self.stub.GetStats(pb.StatsRequest(), timeout=timeout)

    def list_cache(self, model_key: str = "", timeout: float | None = 10) -> pb.ListCacheResponse:
        return self.stub.ListCache(pb.ListCacheRequest(model_key=model_key), timeout=timeout)

    def clear_cache(self, model_key: str = "", timeout: float | None = 10) -> int:
        return self.stub.ClearCache(
            pb.ClearCacheRequest(model_key=model_key), timeout=timeout
        ).removed

    def health(self, service: str = "", timeout: float | None = 5) -> str:
        """SERVING | NOT_SERVING | SERVICE_UNKNOWN | UNKNOWN."""
        resp = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Poll health until SERVING (models loaded)."""
        end = time.monotonic() + timeout
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{self.target} not SERVING after {timeout:.0f} s")
            time.sleep(0.2)


def generate_remote(server: str, args, sampling) -> dict:
    """`sanctum generate --server HOST:PORT`: the same JSON object as the local form."""
    for flag in ("model", "drafter", "block_size", "bits"):
        if getattr(args, flag, None) is not None:
            raise ValueError(
                f"--{flag.replace('_', '-')} is a server setting; pass it to `sanctum serve`"
            )
    req = make_request(
        args.prompt,
        max_tokens=args.max_tokens,
        stop=args.stop,
        kv_mode=getattr(args, "kv_mode", None),
        seed=sampling.seed,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )
    tokens, rounds, text, finish, usage = [], [], "", None, None
    t0 = time.perf_counter()
    token = None
    if getattr(args, "auth_token_file", None):
        token = Path(args.auth_token_file).read_text().strip()
    tls = {k: getattr(args, k, None) for k in ("tls_ca", "tls_cert", "tls_key")}
    with Client(server, token=token, tls=bool(getattr(args, "tls", False)), **tls) as client:
        try:
            stats = client.stats()
            for m in client.stub.Generate(req):
                tokens.extend(m.token_ids)
                text += m.text
                if m.index:
                    rounds.append(round_of(m))
                    if getattr(args, "verbose", False):
                        r = rounds[-1]
                        print(
                            f"bs={r['bs']} accepted={r['accepted']} committed={r['committed']} "
                            f"completion_tokens={len(tokens)}",
                            file=sys.stderr,
                        )
                finish = m.finish_reason or finish
                if m.HasField("usage"):
                    usage = m.usage
        except grpc.RpcError as exc:
            raise ValueError(f"{server}: {exc.code().name}: {exc.details()}") from None
    elapsed = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "text": text,
        "rounds": rounds,
        "tau": rounds_tau(rounds),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": len(tokens),
        "finish_reason": finish,
        "elapsed_s": round(elapsed, 4),
        "tok_per_s": round(len(tokens) / elapsed, 2) if elapsed > 0 else None,
        "kv": usage.kv if usage else None,
        "drafter": stats.drafter or None,
    }
