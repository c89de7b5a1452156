"""The HTTP front end, with the official `openai` client against a real server: uvicorn
on the gRPC server's loop over the inline roles (the cluster: test_api.py's `sanctum serve`).

Pins: chat and completions, streamed and not, give gRPC Generate's greedy text and usage;
stop sequences; seeded sampling is reproducible; the prompt cache's tokens in the usage; bad
input -> 400 naming the field (nothing breaks); 401 without the token; 413 past the body limit;
429 at the generation bound; 503 while draining; a client that disconnects cancels its request;
/metrics parses with prometheus-client's parser and its counters move by exactly each request's
figures, once per request whether gRPC or HTTP served it.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from helpers import NO_GATE, wait_for
from prometheus_client.parser import text_string_to_metric_families
from sanctum.api.client import Client
from sanctum.api.server import Server

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add"}]


@pytest.fixture
def serve(serve):
    """conftest's `serve`, with HTTP started on a free port too."""

    def start(**kw):
        srv = serve(**kw)
        srv.start_http(0)
        return srv

    return start


@pytest.fixture
def srv(serve):
    return serve()


def oai(srv, key="unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=key, **kw)


def grpc_text(srv, **kw) -> tuple[str, object]:
    """gRPC Generate's text and usage for the same request."""
    with Client(srv.address) as c:
        pieces = list(c.generate(**kw))
    return "".join(p.text for p in pieces), pieces[-1].usage


def metrics(srv) -> dict:
    """{(sample name, labels): value} from GET /metrics, parsed by prometheus-client."""
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_chat_and_completions_equal_grpc_generate(srv):
    """The same greedy request, four ways over HTTP, gives gRPC Generate's text and usage."""
    client = oai(srv)
    model = client.models.list().data[0].id
    assert model == srv.backend.settings.engine.model
    want, usage = grpc_text(srv, messages=CHAT, max_tokens=12)
    assert usage.completion_tokens == 12 and want
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12)
    assert chat.choices[0].message.content == want
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == usage.prompt_tokens
    assert chat.usage.completion_tokens == 12
    assert chat.usage.total_tokens == usage.prompt_tokens + 12
    events = list(
        client.chat.completions.create(
            model=model, messages=CHAT, max_completion_tokens=12, stream=True
        )
    )
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == want
    assert events[-1].choices[0].finish_reason == "length"

    want, usage = grpc_text(srv, prompt="def fibonacci(n):", max_tokens=10)
    text = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=10)
    assert text.choices[0].text == want and text.usage.completion_tokens == 10
    events = list(
        client.completions.create(
            model=model,
            prompt="def fibonacci(n):",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(e.choices[0].text for e in events if e.choices) == want
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 10
    assert events[-1].usage.prompt_tokens == usage.prompt_tokens
    ids = srv.backend.verifier.target.tokenizer.encode(
        "def fibonacci(n):", add_special_tokens=False
    )
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=10)
    assert by_ids.choices[0].text == want


def test_stream_is_server_sent_events_ending_in_done(srv):
    body = {"model": "m", "prompt": "class Stack:", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{srv.http_port}/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_connections_send_without_nagle(srv):
    """Each response is written in pieces (head, body, events): on a kept-alive connection
    without TCP_NODELAY every request would wait for the client's delayed ACK (asyncio sets it
    only on a listening socket made with proto IPPROTO_TCP)."""
    import socket

    with httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}") as client:
        assert client.get("/health").status_code == 200
        connections = list(srv.http.server.server_state.connections)
        assert connections
        for conn in connections:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_idle_and_trickling_connections_are_cut(serve):
    """The hardening limits on HTTP too: a connection that sends no request head (or half of
    one) is closed after SANCTUM_STREAM_IDLE_S, a body that does not arrive gets 408 (uvicorn
    alone holds both for ever, each holding one of its connection slots)."""
    import socket

    from sanctum.settings import ConnectionLimits

    srv = serve(limits=ConnectionLimits(stream_idle_s=0.5))
    for head in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        with socket.create_connection(("127.0.0.1", srv.http_port)) as sock:
            sock.sendall(head)
            sock.settimeout(10)
            t0 = time.monotonic()
            assert sock.recv(100) == b""  # closed by the server
            assert time.monotonic() - t0 < 5
    with socket.create_connection(("127.0.0.1", srv.http_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                     b"Content-Type: application/json\r\n\r\n{")  # fmt: skip
        sock.settimeout(10)
        assert sock.recv(100).startswith(b"HTTP/1.1 408")
    ok = oai(srv).chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_stop_sequences_end_the_text_before_them(srv):
    client = oai(srv)
    full = client.completions.create(model="m", prompt="import os", max_tokens=16)
    text = full.choices[0].text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip())
    cut = client.completions.create(model="m", prompt="import os", max_tokens=16, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=16, stop=stop)
    assert stop not in chat.choices[0].message.content


def test_seeded_sampling_is_reproducible(srv):
    client = oai(srv)

    def sample(seed, stream=False):
        kw = dict(model="m", messages=CHAT, max_tokens=16, temperature=1.0, seed=seed)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        events = client.chat.completions.create(stream=True, **kw)
        return "".join(e.choices[0].delta.content or "" for e in events)

    first = sample(7)
    assert sample(7) == first and sample(7, stream=True) == first
    assert any(sample(s) != first for s in (8, 9, 10))  # the seed matters
    top_k = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": 1}
    )
    greedy = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8)
    assert top_k.choices[0].message.content == greedy.choices[0].message.content


def test_usage_counts_cached_tokens_and_sanctums_figures(srv):
    client = oai(srv)
    messages = [{"role": "user", "content": "a conversation worth caching " * 8}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=8).usage
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=8).usage
    assert first.prompt_tokens == again.prompt_tokens > 40
    cached = again.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.prompt_tokens  # resumed from the first turn's entry
    figures = again.model_extra["sanctum"]
    assert figures["resumed_at"] == cached and figures["rounds"] >= 1
    assert 0 <= figures["accepted_tokens"] <= figures["drafted_tokens"]
    assert figures["tau"] >= 1.0


def error_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value.status_code, err.value.body


def test_bad_input_is_400_naming_the_field_and_nothing_breaks(srv):
    client = oai(srv)
    chat = client.chat.completions.create
    cases = {
        "n": lambda: chat(model="m", messages=CHAT, n=2),
        "temperature": lambda: chat(model="m", messages=CHAT, temperature=-1),
        "top_p": lambda: chat(model="m", messages=CHAT, top_p=0),
        "max_tokens": lambda: chat(model="m", messages=CHAT, max_tokens=0),
        "max_completion_tokens": lambda: chat(model="m", messages=CHAT, max_completion_tokens=-3),
        "messages": lambda: chat(model="m", messages=[]),
        "messages[0].role": lambda: chat(model="m", messages=[{"role": "wizard", "content": "x"}]),
        "stop": lambda: chat(model="m", messages=CHAT, stop=[1, 2]),
        "prompt": lambda: client.completions.create(model="m", prompt=""),
        "seed": lambda: chat(model="m", messages=CHAT, extra_body={"seed": "seven"}),
        "top_k": lambda: chat(model="m", messages=CHAT, extra_body={"top_k": -1}),
    }
    for name, value in (("seed", -1), ("seed", 2**64), ("top_k", 2**40)):
        extra = {name: value}
        status, body = error_of(lambda e=extra: chat(model="m", messages=CHAT, extra_body=e))
        assert status == 400 and body["param"] == name, body
    for name, call in cases.items():
        status, body = error_of(call)
        assert status == 400, (name, body)
        assert body["param"] == name and body["message"].startswith(f"{name}: "), body
        assert body["type"] == "invalid_request_error"
    url = f"http://127.0.0.1:{srv.http_port}/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(url, json=["a", "list"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    tokens = 10**9
    status, body = error_of(lambda: client.completions.create(model="m", prompt=[tokens]))
    assert status == 400 and body["param"] == "prompt" and "token id" in body["message"]
    ok = chat(model="m", messages=CHAT, max_tokens=4)
    assert ok.usage.completion_tokens == 4  # still serving


def test_bearer_token_guards_everything_but_health(serve, tmp_path):
    from sanctum.api.guard import Access

    srv = serve(access=Access(token="s3cret"))
    base = f"http://127.0.0.1:{srv.http_port}"
    status, body = error_of(
        lambda: oai(srv, key="wrong").chat.completions.create(model="m", messages=CHAT)
    )
    assert status == 401 and body["type"] == "authentication_error"
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    good = oai(srv, key="s3cret").chat.completions.create(model="m", messages=CHAT, max_tokens=3)
    assert good.usage.completion_tokens == 3
    auth = {"authorization": "Bearer s3cret"}
    assert httpx.get(f"{base}/metrics", headers=auth).status_code == 200


def test_body_limit_is_413_naming_it(serve):
    srv = serve(max_message_bytes=4096)
    big = [{"role": "user", "content": "x" * 5000}]
    status, body = error_of(lambda: oai(srv).chat.completions.create(model="m", messages=big))
    assert status == 413 and "4096 bytes" in body["message"], body
    # chunked, without a Content-Length: counted as it arrives
    chunks = iter([b'{"model": "m", "prompt": "', b"y" * 5000, b'"}'])
    r = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/completions", content=chunks)
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    ok = oai(srv).chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_full_is_429_and_a_disconnect_cancels(serve, backend):
    srv = serve(max_streams=1)
    before = metrics(srv)
    client = oai(srv, max_retries=0)
    # greedy, the tiny pair writes 846 tokens after this prompt before its end of text
    stream = client.completions.create(
        model="m", prompt="The quick brown fox", max_tokens=2000, stream=True
    )
    assert next(iter(stream)).choices[0].text is not None  # in flight, holding the one slot
    status, body = error_of(lambda: client.chat.completions.create(model="m", messages=CHAT))
    assert status == 429 and body["type"] == "rate_limit_error", body
    full = ("sanctum_requests_total", (("outcome", "resource_exhausted"),))
    assert metrics(srv).get(full, 0) == before.get(full, 0) + 1
    stream.close()  # the client goes away mid-stream
    assert wait_for(lambda: backend.stats().active == 0), "the request kept decoding"
    key = ("sanctum_requests_total", (("outcome", "cancelled"),))
    assert wait_for(lambda: metrics(srv).get(key, 0) == before.get(key, 0) + 1)
    after = metrics(srv)
    assert after[("sanctum_completion_tokens_total", ())] < (
        before[("sanctum_completion_tokens_total", ())] + 846
    )
    ok = client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)  # the slot is free
    assert ok.usage.completion_tokens == 2


def test_draining_is_503(serve):
    srv = serve()
    base = f"http://127.0.0.1:{srv.http_port}"
    assert httpx.get(f"{base}/health").status_code == 200
    assert srv.drain(5)
    assert httpx.get(f"{base}/health").json() == {"status": "draining"}
    status, body = error_of(
        lambda: oai(srv, max_retries=0).chat.completions.create(model="m", messages=CHAT)
    )
    assert status == 503 and "draining" in body["message"]


def test_metrics_count_each_request_once_whichever_front_end(srv):
    """Counters move by exactly the requests' own usage: one HTTP, one gRPC, two invalid."""
    before = metrics(srv)
    http = oai(srv).completions.create(model="m", prompt="def add(a, b):", max_tokens=9).usage
    with Client(srv.address) as c:
        grpc_usage = list(c.generate("x = [1, 2, 3]", max_tokens=7))[-1].usage
    with pytest.raises(openai.BadRequestError):  # refused by the serving core
        oai(srv).completions.create(model="m", prompt="x", temperature=-2.0)
    with pytest.raises(openai.BadRequestError):  # refused by the HTTP front end
        oai(srv).completions.create(model="m", prompt="x", n=3)
    after = metrics(srv)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    extra = http.model_extra["sanctum"]
    assert delta("sanctum_requests_total", outcome="length") == 2
    assert delta("sanctum_requests_total", outcome="invalid_argument") == 2
    assert delta("sanctum_prompt_tokens_total") == http.prompt_tokens + grpc_usage.prompt_tokens
    assert delta("sanctum_completion_tokens_total") == 9 + 7
    assert delta("sanctum_cached_tokens_total") == (
        http.prompt_tokens_details.cached_tokens + grpc_usage.cached_tokens
    )
    assert delta("sanctum_drafted_tokens_total") == (
        extra["drafted_tokens"] + grpc_usage.drafted_tokens
    )
    assert delta("sanctum_accepted_tokens_total") == (
        extra["accepted_tokens"] + grpc_usage.accepted_tokens
    )
    assert delta("sanctum_time_to_first_token_seconds_count") == 2
    assert delta("sanctum_request_tau_count") == 2
    assert delta("sanctum_request_acceptance_ratio_count") == 2
    # every token after each request's first chunk: one inter-token observation
    assert 0 < delta("sanctum_inter_token_latency_seconds_count") < 9 + 7
    assert delta("sanctum_rounds_total") == extra["rounds"] + grpc_usage.rounds
    assert delta("sanctum_round_phase_seconds_total", phase="verify") > 0
    for gauge in ("sanctum_queue_depth", "sanctum_active_requests", "sanctum_cache_entries"):
        assert (gauge, ()) in after
    assert after[("sanctum_up", ())] == 1 and after[("sanctum_drafter_available", ())] == 1
    assert after[("sanctum_cache_bytes", ())] > 0
    assert 0 <= after[("sanctum_cache_hit_ratio", ())] <= 1
    assert ("sanctum_cache_evictions_total", ()) in after


def test_http_bench_runs_end_to_end(make_pair):
    """`sanctum bench http` (one server, every front end on the same prompts) runs and agrees."""
    import argparse

    from sanctum.bench.http import run

    pair = make_pair("hybrid", "dflash")
    args = argparse.Namespace(model=str(pair[0]), drafter=str(pair[1]),
                              prompts=["def f(x):", "class A:"], max_tokens=3, repeats=1)  # fmt: skip
    out = run(args)
    assert out["same_text"] is True and out["prompts"] == 2
    for mode in ("grpc_unary", "http_unary", "grpc_stream", "http_stream", "openai_sdk"):
        assert out[f"{mode}_ms"] > 0
    assert len(out["http_unary_overhead_90ci_ms"]) == 2


def test_tls_serves_https_with_the_grpc_certificates(serve, backend, tmp_path):
    """The HTTP front end takes the gRPC server's certificate and key (mutual TLS: its CA)."""
    import ssl

    from sanctum.api.commands import http_tls
    from sanctum.api.guard import Access
    from sanctum.settings import server_settings
    from test_hardening import _certificates

    paths = _certificates(tmp_path)
    net = server_settings(tls_cert=paths["server.crt"], tls_key=paths["server.key"],
                          tls_client_ca=paths["ca.crt"], env=NO_GATE)  # fmt: skip
    srv = Server(backend, "127.0.0.1", 0, access=Access.from_files(None, net.tls_cert, net.tls_key))
    try:
        srv.ready(60)
        port = srv.start_http(0, http_tls(net))
        url = f"https://127.0.0.1:{port}/health"
        ctx = ssl.create_default_context(cafile=paths["ca.crt"])
        with pytest.raises(httpx.TransportError):  # no client certificate: refused
            httpx.get(url, verify=ctx)
        ctx.load_cert_chain(paths["client.crt"], paths["client.key"])
        assert httpx.get(url, verify=ctx).json() == {"status": "ok"}
        with pytest.raises(httpx.TransportError):  # not plaintext
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        srv.stop(0)


def test_serve_refuses_a_taken_http_port_before_loading(make_pair, tmp_path):
    """`sanctum serve` with its HTTP port taken says so and exits 2, before loading models."""
    import os
    import socket
    import subprocess
    import sys

    pair = make_pair("hybrid", "dflash")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "sanctum.cli", "serve", "--inline", "--model", str(pair[0]),
             "--drafter", str(pair[1]), "--port", "0", "--http-port", str(port)],
            env=dict(os.environ, SANCTUM_NO_OPENBLAS="1", SANCTUM_HOME=str(tmp_path)),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port} for HTTP" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_client_that_takes_no_event_loses_its_stream():
    """SlowClientStream: a send that never completes (a client that stopped reading, its
    socket buffers full) ends the stream after slow_s and closes the event source, which
    cancels the request (the source here records that it was closed)."""
    import asyncio

    from sanctum.api.http import SlowClientStream

    closed = []

    async def events():
        try:
            for i in range(10**6):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    sent = []

    async def send(message):
        sent.append(message)
        if len(sent) > 3:  # the client's buffers are full from the 4th message on
            await asyncio.Event().wait()

    async def main():
        t0 = time.monotonic()
        await SlowClientStream(events(), 0.2, media_type="text/event-stream").stream_response(send)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 2
    assert closed == [True] and len(sent) == 4
