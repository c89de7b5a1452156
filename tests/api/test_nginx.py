"""A real proxy: Debian's nginx (installed here when absent: apt-get as root) runs
deploy/nginx/sanctum.conf in front of a real server (inline roles), and streaming, deadlines,
cancellation, health (Check and Watch, through a drain), large requests and the bearer token
work through it. Skipped only where nginx is absent and cannot be installed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import NO_GATE, free_port
from sanctum.api.client import Client, make_request
from sanctum.api.server import Server
from sanctum.serving.inline import InlineBackend, RoundDelay
from sanctum.settings import serve_settings

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "sanctum.conf"
TOKEN = "proxy-test-token"
PROXIED_HTTP = {}  # the proxy's HTTP address, set by the `proxy` fixture


def _installed_nginx() -> str | None:
    # /usr/sbin is not on every PATH
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


def _nginx() -> str | None:
    """The nginx binary; installed with apt-get first when absent and we may (root)."""
    found = _installed_nginx()
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", RUNLEVEL="1")  # RUNLEVEL: no start
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx"]
    running_before = os.path.exists("/run/nginx.pid")
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=600)
    found = _installed_nginx()
    if found and not running_before and os.path.exists("/run/nginx.pid"):
        subprocess.run([found, "-s", "quit"], capture_output=True, timeout=30)  # the package's own
    return found


@pytest.fixture(scope="module")
def upstream(make_pair, tmp_path_factory):
    from sanctum.api.guard import Access

    pair = make_pair("hybrid", "dflash")
    backend = InlineBackend(serve_settings(str(pair[0]), str(pair[1]), cache_dir="none",
                                           max_active=2, env=NO_GATE), RoundDelay(0.01))  # fmt: skip
    srv = Server(backend, "127.0.0.1", 0, max_streams=8, access=Access(token=TOKEN))
    srv.ready(120)
    srv.start_http(0)
    yield srv
    srv.stop(0)
    backend.close()


@pytest.fixture(scope="module")
def proxy(upstream, tmp_path_factory):
    """nginx with the shipped server block, its addresses pointed at this test's ports."""
    binary = _nginx()
    if binary is None:
        pytest.skip("nginx is not installed and cannot be installed here (not root, no apt-get)")
    work = tmp_path_factory.mktemp("nginx")
    port, http_port = free_port(), free_port()
    site = CONF.read_text().replace("127.0.0.1:1337", upstream.address)
    site = site.replace("server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream.http_port};")
    site = site.replace("listen 127.0.0.1:9337", f"listen 127.0.0.1:{port}")
    site = site.replace("listen 127.0.0.1:9080", f"listen 127.0.0.1:{http_port}")
    assert str(port) in site and str(http_port) in site and str(upstream.http_port) in site
    (work / "sanctum.conf").write_text(site)
    (work / "nginx.conf").write_text(f"""
daemon off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log info;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 256; }}
http {{
    access_log {work}/access.log;
    client_body_temp_path {work}/body;
    include {work}/sanctum.conf;
}}
""")
    proc = subprocess.Popen([binary, "-p", str(work), "-c", str(work / "nginx.conf")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        PROXIED_HTTP["url"] = f"http://127.0.0.1:{http_port}/v1"
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()  # the nginx master this fixture started (it stops its worker)
        proc.wait(10)


@pytest.fixture(scope="module")
def client(proxy):
    with Client(proxy, token=TOKEN) as c:
        yield c


def test_shipped_config_keeps_long_streams_and_large_requests():
    """nginx's defaults cut a silent stream at 60 s (Health.Watch) and refuse bodies over 1 MB
    with HTTP 413: the shipped config raises both to what the server allows."""
    from sanctum.settings import server_settings

    text = CONF.read_text()
    hours = {
        k: re.search(rf"{k} (\d+)h;", text) for k in ("grpc_read_timeout", "grpc_send_timeout")
    }
    assert all(m and int(m.group(1)) >= 1 for m in hours.values())
    body = re.search(r"client_max_body_size (\d+)m;", text)
    assert body and int(body.group(1)) << 20 >= server_settings(env={}).max_message_bytes


def test_streaming_through_the_proxy_equals_direct(client, upstream):
    direct = Client(upstream.address, token=TOKEN)
    want = [list(m.token_ids) for m in direct.generate("def f(x):", max_tokens=16, timeout=30)]
    direct.close()
    got = [list(m.token_ids) for m in client.generate("def f(x):", max_tokens=16, timeout=30)]
    assert got == want and len(got) > 1  # same chunks, streamed
    with Client(client.target) as no_token, pytest.raises(grpc.RpcError) as err:
        list(no_token.generate("hi", max_tokens=2, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the metadata reached the server


def test_openai_streaming_through_the_proxy(proxy, upstream):
    """The HTTP server block: the openai client through nginx gets the server's own text, its
    server-sent events as they are made (not buffered to the end), and the token checked."""
    import openai

    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{upstream.http_port}/v1", api_key=TOKEN)
    proxied = openai.OpenAI(base_url=PROXIED_HTTP["url"], api_key=TOKEN, max_retries=0)
    args = dict(model="sanctum", prompt="class Stack:", max_tokens=64)
    want = direct.completions.create(**args).choices[0].text
    t0, arrivals, parts = time.monotonic(), [], []
    for event in proxied.completions.create(**args, stream=True):
        if event.choices and event.choices[0].text:
            arrivals.append(time.monotonic() - t0)
            parts.append(event.choices[0].text)
    total = time.monotonic() - t0
    assert "".join(parts) == want
    assert len(arrivals) > 3 and arrivals[0] < 0.6 * total, (arrivals, total)
    wrong = openai.OpenAI(base_url=PROXIED_HTTP["url"], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(**args)


def test_deadline_and_cancel_through_the_proxy_free_the_sequence(client):
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate("class Stack:", max_tokens=3000, timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
    assert _eventually(lambda: client.stats().active == 0)
    before = client.stats().cancelled
    call = client.stream(make_request("class Stack:", max_tokens=3000))
    next(call), next(call)
    assert client.stats().active == 1
    call.cancel()
    assert _eventually(lambda: client.stats().active == 0)
    assert client.stats().cancelled >= before + 1


def test_idle_streams_through_the_proxy_lock_no_one_out(client, proxy):
    """No lock-out through nginx either: idle reflection streams opened through it (24, three
    times the server's bound of 8) leave health and generation alone."""
    import queue

    from grpc_reflection.v1alpha import reflection_pb2_grpc

    held = []
    for _ in range(24):
        channel = grpc.insecure_channel(proxy, options=[("grpc.use_local_subchannel_pool", 1)])
        requests: queue.Queue = queue.Queue()
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(requests.get, None)
        )
        held.append((channel, call))
    try:
        time.sleep(0.5)
        assert client.health() == "SERVING"
        assert len(list(client.generate("def f(x):", max_tokens=4, timeout=30))) > 1
    finally:
        for channel, call in held:
            call.cancel()
            channel.close()


def test_large_request_reaches_the_server(client):
    """2 MB: past nginx's default body limit (413), within the server's: its own answer comes
    back (too long for the context, by size)."""
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate("x" * (2 << 20), max_tokens=2, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("text:")


def test_health_check_and_watch_through_the_proxy(client, upstream):
    """Last (it drains the server): Watch streams SERVING, then NOT_SERVING when the drain
    starts, through nginx."""
    assert client.health() == "SERVING"
    watch = client.health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=60)
    seen = []

    def read():
        for m in watch:
            seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(m.status))
            if len(seen) == 2:
                return

    reader = threading.Thread(target=read)
    reader.start()
    assert _eventually(lambda: seen == ["SERVING"])
    upstream.drain(5)
    reader.join(10)
    assert seen == ["SERVING", "NOT_SERVING"]
    watch.cancel()


def _eventually(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
