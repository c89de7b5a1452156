"""The hardening limits, against a real gRPC server over the inline roles (no Ray): idle streams
cannot lock anyone out, the bearer token, TLS and mutual TLS, loopback-only unless a token is
set, malformed messages and bad sampling values. (Stalls: test_cluster.py; health following the
verifier and Ray on loopback: test_cluster.py, test_api.py; nginx: test_nginx.py.)"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sanctum.api.client import Client, make_request
from sanctum.api.server import Server

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # grpcio shares one per target otherwise


def idle_reflection_streams(address: str, n: int) -> list:
    """n server-reflection streams, each on its own connection, opened and never half-closed."""
    held = []
    for _ in range(n):
        channel = grpc.insecure_channel(address, options=OWN_CONNECTION)
        requests: queue.Queue = queue.Queue()
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(requests.get, None)
        )
        held.append((channel, call, requests))
    return held


def health_of(address: str, timeout: float = 5.0) -> str:
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


# ---- 1. no lock-out -------------------------------------------------------------------------------


def test_idle_streams_do_not_lock_anyone_out(serve):
    """Lock-out: streams opened and left idle, more than the generation bound, do not starve
    health, reflection or generation (grpcio would answer every RPC RESOURCE_EXHAUSTED once
    max_streams of them were open)."""
    srv = serve(max_streams=8)
    held = idle_reflection_streams(srv.address, 24)
    try:
        time.sleep(0.5)  # all open on the server
        t0 = time.perf_counter()
        assert health_of(srv.address) == "SERVING"
        assert time.perf_counter() - t0 < 1.0
        with Client(srv.address) as c:
            stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            listed = next(iter(stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)))  # fmt: skip
            assert "sanctum.v1.Inference" in {s.name for s in listed.list_services_response.service}
            assert len(list(c.generate("def f(x):", max_tokens=8, timeout=30))) > 1
            assert c.stats(timeout=10).mode == "inline"
    finally:
        for channel, call, _ in held:
            call.cancel()
            channel.close()


def test_idle_request_streams_are_closed_and_generation_is_bounded(serve):
    """A request stream without a message for stream_idle_s is closed by the server; the bound
    counts generation requests only, and past it they get RESOURCE_EXHAUSTED."""
    from sanctum.settings import ConnectionLimits

    srv = serve(max_streams=1, limits=ConnectionLimits(stream_idle_s=0.5))
    (channel, call, _), = idle_reflection_streams(srv.address, 1)  # fmt: skip
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        next(iter(call))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no message" in err.value.details() and 0.4 < time.perf_counter() - t0 < 5
    channel.close()
    with Client(srv.address) as c:
        busy = c.stream(make_request("class Stack:", max_tokens=3000))
        next(busy)
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate("x", max_tokens=2, timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "generation requests in flight" in err.value.details()
        assert c.health() == "SERVING" and c.stats().active == 1  # the rest still answers
        busy.cancel()


def test_a_client_that_stops_reading_loses_its_stream(serve):
    """A slow client is bounded too: one that takes no response for slow_client_s loses the
    stream and its request's slot (flow control would otherwise hold it there)."""
    from sanctum.settings import ConnectionLimits

    srv = serve(max_streams=4, limits=ConnectionLimits(slow_client_s=1.0))
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with (
        Client(srv.address, options=OWN_CONNECTION + small_window) as slow,
        Client(srv.address) as c,
    ):
        call = slow.stream(make_request("The quick brown fox", max_tokens=3000))  # ~850 tokens
        next(call)  # then reads nothing
        assert _eventually(lambda: c.stats().active == 1)
        assert _eventually(lambda: c.stats().active == 0, timeout=20)  # freed by the server
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "reads too slowly" in err.value.details()


def _eventually(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---- 3. access control ------------------------------------------------------------------------------


def test_bearer_token_guards_everything_but_health_and_reflection(serve, tmp_path, monkeypatch):
    """Access control: with --auth-token-file, a caller without the token gets
    UNAUTHENTICATED for every RPC (ClearCache removes nothing) but health and reflection; the
    Python client and `sanctum generate --server` send it (argument, SANCTUM_AUTH_TOKEN)."""
    from sanctum.api.guard import Access
    from sanctum.cli import main

    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    srv = serve(access=Access.from_files(str(token_file)))
    monkeypatch.delenv("SANCTUM_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SANCTUM_AUTH_TOKEN_FILE", raising=False)
    with Client(srv.address, token="s3cret-token") as good:
        list(good.generate("def saved(a):", max_tokens=4, timeout=30))
        entries = len(good.list_cache().entries)
    for token in (None, "wrong"):
        with Client(srv.address, token=token) as c:
            for call in (lambda: list(c.generate("hi", max_tokens=2, timeout=10)),
                         lambda: c.complete("hi", max_tokens=2, timeout=10),
                         c.stats, c.list_cache, c.clear_cache):  # fmt: skip
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"  # open to load balancers ...
            stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)  # ... and to tools
            reply = next(iter(stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)))  # fmt: skip
            assert reply.list_services_response.service
    with Client(srv.address, token="s3cret-token") as good:
        assert len(good.list_cache().entries) == entries >= 1  # nothing was cleared
    monkeypatch.setenv("SANCTUM_AUTH_TOKEN", "s3cret-token")
    args = ["generate", "--server", srv.address, "--prompt", "x = 1", "--max-tokens", "4"]
    assert main([*args, "--json"]) == 0
    monkeypatch.delenv("SANCTUM_AUTH_TOKEN")
    assert main(args) == 2  # refused: the error names the status
    assert main([*args, "--auth-token-file", str(token_file)]) == 0


def test_listening_beyond_loopback_needs_a_token(tmp_path, capsys):
    """`--host 0.0.0.0` (every interface) refuses to start without a token (before loading
    anything), and warns without TLS."""
    from sanctum.api.guard import Access, check_exposure, is_loopback
    from sanctum.cli import main

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    with pytest.raises(ValueError, match="auth token"):
        Server(None, "0.0.0.0", 0)
    assert main(["serve", "--inline", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "needs an auth token" in capsys.readouterr().err
    check_exposure("127.0.0.1", Access())  # loopback: no token needed
    check_exposure("0.0.0.0", Access(token="t"))  # allowed, with a warning (no TLS)


def _certificates(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name, issuer=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer[0].subject if issuer else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
        return cert, key

    ca = make("sanctum test CA", ca=True)
    server = make("localhost", ca, san=[x509.DNSName("localhost"),
                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])  # fmt: skip
    client = make("a client", ca)
    paths = {}
    for name, (cert, key) in (("ca", ca), ("server", server), ("client", client)):
        paths[f"{name}.crt"] = tmp_path / f"{name}.crt"
        paths[f"{name}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}.key"] = tmp_path / f"{name}.key"
        paths[f"{name}.key"].write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))  # fmt: skip
    return {k: str(v) for k, v in paths.items()}


def test_tls_and_mutual_tls(serve, tmp_path):
    """--tls-cert/--tls-key serve TLS (grpcio's credentials); with --tls-client-ca a client
    needs a certificate that CA signed; plaintext clients get nowhere."""
    from sanctum.api.guard import Access

    pem = _certificates(tmp_path)
    srv = serve(access=Access.from_files(None, pem["server.crt"], pem["server.key"],
                                         pem["ca.crt"]))  # fmt: skip
    with Client(srv.address, tls_ca=pem["ca.crt"], tls_cert=pem["client.crt"],
                tls_key=pem["client.key"], options=OWN_CONNECTION) as c:  # fmt: skip
        assert c.health() == "SERVING"
        assert len(list(c.generate("def f(x):", max_tokens=4, timeout=30))) > 1
    for kw in ({"tls_ca": pem["ca.crt"]}, {}):  # no client certificate; no TLS at all
        with Client(srv.address, options=OWN_CONNECTION, **kw) as c, pytest.raises(grpc.RpcError):
            c.health(timeout=3)
    with pytest.raises(ValueError, match="go together"):
        Access.from_files(None, pem["server.crt"], None)


# ---- smaller: malformed messages, non-finite sampling values ---------------------------------


def test_malformed_messages_are_invalid_argument_with_one_log_line(serve, caplog):
    """Bytes that are not the method's message get INVALID_ARGUMENT and one log line (grpcio's
    own answer is INTERNAL and a traceback each time)."""
    srv = serve()
    garbage = b"\xff\xff\xff\xff\x0f garbage"
    with grpc.insecure_channel(srv.address) as channel, caplog.at_level(logging.INFO):
        for method, call in (
            ("/sanctum.v1.Inference/Generate", channel.unary_stream),
            ("/sanctum.v1.Inference/Complete", channel.unary_unary),
            ("/grpc.health.v1.Health/Check", channel.unary_unary),
        ):
            rpc = call(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as err:
                result = rpc(garbage, timeout=10)
                list(result) if method.endswith("Generate") else None
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid" in err.value.details()
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 3 and not any(r.exc_info for r in caplog.records)
    assert "Exception deserializing" not in caplog.text
    assert health_of(srv.address) == "SERVING"


@pytest.mark.parametrize("field,value", [("temperature", float("inf")), ("temperature", float("nan")),
                                         ("top_p", float("nan"))])  # fmt: skip
def test_non_finite_sampling_values_are_invalid(serve, field, value):
    """Non-finite sampling values (`temperature: inf`) are refused, not sampled."""
    srv = serve()
    with Client(srv.address) as c, pytest.raises(grpc.RpcError) as err:
        list(c.generate("hi", max_tokens=4, timeout=10, **{field: value}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")


def test_concurrent_streams_keep_their_own_tokens(serve):
    """The asyncio front end with its thread pools: streams interleave and each gets exactly
    what it would get alone."""
    srv = serve(max_streams=8)
    prompts = ["def f(x):", "class Stack:", "import os", "while True:"]
    with Client(srv.address) as c:
        alone = {p: [t for m in c.generate(p, max_tokens=12, use_cache=False, timeout=30)
                     for t in m.token_ids] for p in prompts}  # fmt: skip
        together: dict = {}

        def one(p):
            together[p] = [t for m in c.generate(p, max_tokens=12, use_cache=False, timeout=60)
                           for t in m.token_ids]  # fmt: skip

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert together == alone


@pytest.mark.slow
def test_abuse_bench_runs_end_to_end(make_pair):
    """`sanctum bench abuse` (small: its own inline server, 1 MB prompt, 50 messages, 5 idle
    streams): every abuser gets its refusal and the normal stream keeps streaming."""
    import json
    import os
    import subprocess
    import sys

    pair = make_pair("hybrid", "dflash")
    env = dict(os.environ, SANCTUM_NO_OPENBLAS="1")
    out = subprocess.run(
        [sys.executable, "-m", "sanctum.cli", "bench", "abuse", "--inline", "--model", str(pair[0]),
         "--drafter", str(pair[1]), "--prompt-mb", "1", "--chat-messages", "50",
         "--idle-streams", "5", "--stream-idle-s", "1", "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    f = json.loads(out.stdout)
    assert f["normal_error"] is None and f["normal_chunks"] > 10 and f["normal_worst_gap_ms"] > 0
    assert f["health_checks"] > 0 and f["health_not_serving"] == 0
    assert f["prompt_1mb"].startswith("INVALID_ARGUMENT")
    assert f["stop_strings_100x10kb"].startswith("INVALID_ARGUMENT")
    assert f["malformed_protobuf"].startswith("INVALID_ARGUMENT")
    assert f["chat_50_messages"].startswith("OK")
    assert f["idle_streams"].startswith("5 DEADLINE_EXCEEDED")
    assert "closed by the server" in f["garbage_bytes"] and "closed" in f["garbage_h2_frames"]
