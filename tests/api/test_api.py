"""End to end over gRPC on loopback: a real local Ray cluster (verifier, drafter and store actors)
behind the real server, driven by the real client. One cluster for the module.

Pins: streamed output == the inline engine's greedy output (text, token ids, chat); the unary
form; health and reflection; prompt-cache resume and administration; every bad input ->
INVALID_ARGUMENT naming the field, nothing touched, still serving; cancellation and deadlines
free the sequence; 8 concurrent clients; the CLI's --server JSON == the local JSON; a bounded
queue and message limits (inline server); SIGTERM drain (a `sanctum serve --inline` process).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from helpers import NO_GATE, PROMPTS, free_port, wait_for
from sanctum.api.client import Client, make_request
from sanctum.api.server import Server
from sanctum.serving.inline import InlineBackend, RoundDelay
from sanctum.settings import serve_settings


@pytest.fixture(scope="module")
def reference(pair):
    """The inline engine in this process: greedy tokens for a prompt (ids)."""
    from sanctum.engine.decode.generate import generate
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.engine.model.target import load_target

    target = load_target(pair[0])
    drafter = load_drafter(pair[1], target)

    def run(prompt=None, ids=None, max_tokens=24):
        ids = ids if ids is not None else target.tokenizer.encode(prompt, add_special_tokens=False)
        return [
            t
            for s in generate(target, ids, drafter=drafter, max_tokens=max_tokens)
            for t in s.tokens
        ]

    run.target = target
    return run


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    from sanctum.cluster.backend import start_cluster
    from sanctum.cluster.localray import init_local_ray

    init_local_ray(num_cpus=2, log_to_driver=False, namespace=f"test-api-{os.getpid()}")
    settings = serve_settings(pair[0], pair[1], cache_dir=str(tmp_path_factory.mktemp("cache")),
                              max_active=8, max_queue=8, env=NO_GATE)  # fmt: skip
    backend = start_cluster(settings)
    srv = Server(backend, "127.0.0.1", 0, max_message_bytes=4 << 20, max_streams=32)
    try:
        srv.ready(300)
        yield srv
    finally:
        srv.stop(0)
        backend.close()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as c:
        yield c


def tokens_of(responses) -> list[int]:
    return [t for m in responses for t in m.token_ids]


# ---- serving -----------------------------------------------------------------------------------


def test_health_and_reflection(client):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert client.health() == "SERVING"
    assert client.health("sanctum.v1.Inference") == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="sanctum.v1.Inference")]  # fmt: skip
    listed, files = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"sanctum.v1.Inference", "grpc.health.v1.Health"} <= names
    assert files.file_descriptor_response.file_descriptor_proto


def test_stream_equals_inline_engine(client, reference):
    prompt = PROMPTS[0]
    responses = list(client.generate(prompt, max_tokens=24, use_cache=False, timeout=60))
    assert tokens_of(responses) == reference(prompt)
    assert [m.index for m in responses] == list(range(len(responses)))
    assert all(m.drafted == 7 for m in responses[1:])  # block 8: every round speculative
    last = responses[-1]
    assert last.finish_reason == "length" and last.HasField("usage")
    u = last.usage
    ids = reference.target.tokenizer.encode(prompt, add_special_tokens=False)
    assert (u.prompt_tokens, u.completion_tokens, u.mode) == (len(ids), 24, "streaming")
    assert u.rounds == len(responses) - 1 and u.tau >= 1.0
    assert "".join(m.text for m in responses) == reference.target.tokenizer.decode(
        tokens_of(responses)
    )


def test_seeded_sampling_equals_inline_roles(client, reference, pair):
    """Sampling (rejection rule) through the cluster, drafts asked a round ahead over shared
    memory, gives the tokens the inline roles give for the same seed."""
    from sanctum.engine.decode.peer import LocalDraftPeer
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.verifier import Verifier

    target = reference.target
    drafter = load_drafter(pair[1], target)
    inline = Verifier(target, drafter, LocalDraftPeer(drafter))
    knobs = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
    outputs = []
    for seed in (7, 8):
        req = GenerateRequest(prompt=PROMPTS[4], max_tokens=24, seed=seed, use_cache=False, **knobs)
        want = [t for c in inline.generate(req) for t in c.token_ids]
        got = tokens_of(client.generate(PROMPTS[4], max_tokens=24, seed=seed, use_cache=False,
                                        timeout=60, **knobs))  # fmt: skip
        assert got == want
        outputs.append(got)
    assert outputs[0] != outputs[1]  # really sampled: the seed matters


def test_token_ids_and_chat_prompts(client, reference):
    from sanctum.tokenizer import render_chat

    ids = reference.target.tokenizer.encode("x = 1\ny = 2", add_special_tokens=False)
    got = tokens_of(client.generate(token_ids=ids, max_tokens=16, timeout=60))
    assert got == reference(ids=ids, max_tokens=16)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat_ids = reference.target.tokenizer.encode(render_chat(reference.target.tokenizer, messages),
                                                 add_special_tokens=False)  # fmt: skip
    got = tokens_of(client.generate(messages=messages, max_tokens=16, timeout=60))
    assert got == reference(ids=chat_ids, max_tokens=16)


def test_complete_equals_stream(client, reference):
    out = client.complete(PROMPTS[1], max_tokens=20, timeout=60)
    assert list(out.token_ids) == reference(PROMPTS[1], max_tokens=20)
    assert out.usage.mode == "sync" and out.finish_reason == "length"
    assert sum(r.committed for r in out.rounds) + 1 == len(out.token_ids)


def test_prompt_cache_resume_and_admin(client, reference):
    prompt = "def prompt_cache_probe(x):\n    return x"
    first = list(client.generate(prompt, max_tokens=12, timeout=60))
    assert wait_for(lambda: len(client.list_cache().entries) > 0)
    second = list(client.generate(prompt, max_tokens=12, timeout=60))
    assert tokens_of(first) == tokens_of(second) == reference(prompt, max_tokens=12)
    u = second[-1].usage
    assert u.cached_tokens > 0 and u.cache_hit_ratio > 0 and u.resumed_at == u.cached_tokens
    stats = client.stats()
    assert stats.cache.entries >= 1 and stats.cache.hits >= 1 and stats.cache.available
    assert client.clear_cache() >= 1
    assert len(client.list_cache().entries) == 0


def test_stats(client):
    s = client.stats()
    assert (s.mode, s.transport, s.kv, s.block_size) == ("cluster", "shm", "fp16", 8)
    assert s.drafter_available and s.draft_calls > 0 and s.transport_bytes_per_round > 0


# ---- bad input -----------------------------------------------------------------------------------

BAD = {
    "empty prompt": ({"prompt": ""}, "text"),
    "no prompt": ({}, "prompt"),
    "prompt over the context limit": ({"token_ids": [5] * 32800}, "token_ids"),
    "max_tokens 0": ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    "max_tokens above the limit": ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    "temperature < 0": ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    "top_p 0": ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    "top_p > 1": ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    "top_k < 0": ({"prompt": "hi", "top_k": -1}, "top_k"),
    "unknown chat role": (
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "chat.messages[0].role",
    ),
    "negative token id": ({"token_ids": [1, -3, 2]}, "token_ids"),
    "token id beyond the vocabulary": ({"token_ids": [1, 10**9]}, "token_ids"),
}


def test_bad_inputs_are_invalid_argument_and_touch_nothing(client, reference):
    before = client.stats()
    for name, (kw, field) in BAD.items():
        kw = dict(kw)
        prompt = kw.pop("prompt", None)
        for streaming in (True, False):
            with pytest.raises(grpc.RpcError) as err:
                if streaming:
                    list(client.generate(prompt, timeout=30, **kw))
                else:
                    client.complete(prompt, timeout=30, **kw)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert err.value.details().startswith(f"{field}:"), (name, err.value.details())
    after = client.stats()
    assert (after.requests, after.cache.lookups, after.cache.entries) == (
        before.requests, before.cache.lookups, before.cache.entries)  # fmt: skip
    assert client.health() == "SERVING"
    assert tokens_of(client.generate(PROMPTS[2], max_tokens=8, timeout=60)) == reference(
        PROMPTS[2], max_tokens=8
    )


def test_prompt_too_long_after_tokenization(client):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(token_ids=[5] * 32000, max_tokens=4000, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("token_ids:") and "context limit" in err.value.details()


# ---- cancellation, deadlines, concurrency --------------------------------------------------------


def test_cancellation_frees_the_sequence(client):
    before = client.stats().cancelled
    call = client.stream(make_request(PROMPTS[3], max_tokens=3000))
    got = [next(call), next(call)]
    assert client.stats().active == 1
    call.cancel()
    assert wait_for(lambda: client.stats().active == 0, timeout=10)
    assert client.stats().cancelled == before + 1
    assert len(got) == 2


def test_deadline_stops_generation(client):
    before = client.stats().cancelled
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(PROMPTS[3], max_tokens=3000, timeout=0.5))  # ~850 tokens to EOS
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    assert wait_for(lambda: client.stats().active == 0, timeout=10)
    assert client.stats().cancelled == before + 1


def test_eight_concurrent_clients(server, reference):
    expected = {p: reference(p, max_tokens=20) for p in PROMPTS}
    results, errors = {}, []

    def one(prompt):
        try:
            with Client(server.address) as c:
                results[prompt] = [
                    list(m.token_ids) for m in c.generate(prompt, max_tokens=20, timeout=120)
                ]
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    for p in PROMPTS:
        assert [t for chunk in results[p] for t in chunk] == expected[p], p
    # interleaved: streams were open at the same time, each got its own tokens
    assert all(len(results[p]) > 1 for p in PROMPTS)


def test_cli_generate_server_json_matches_local(server, pair, capsys):
    from sanctum.cli import main

    args = ["generate", "--prompt", PROMPTS[5], "--max-tokens", "20", "--json"]
    assert main([*args, "--server", server.address]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main([*args, "--model", pair[0], "--drafter", pair[1]]) == 0
    local = json.loads(capsys.readouterr().out)
    for k in ("elapsed_s", "tok_per_s"):
        remote.pop(k), local.pop(k)
    assert remote == local


# ---- an inline server: bounded queue, message limits, drain ------------------------------------


def test_queue_full_and_message_limit(pair, tmp_path):
    settings = serve_settings(
        pair[0], pair[1], cache_dir="none", max_active=1, max_queue=1, env=NO_GATE
    )
    backend = InlineBackend(settings, RoundDelay(0.02))  # slow rounds: the busy ones stay busy
    srv = Server(backend, "127.0.0.1", 0, max_message_bytes=64 << 10, max_streams=8)
    try:
        srv.ready(120)
        with Client(srv.address) as c:
            assert c.stats().mode == "inline"
            busy = [c.stream(make_request(PROMPTS[0], max_tokens=3000))]
            next(busy[0])  # decoding; only then the second (else it may be admitted first)
            busy.append(c.stream(make_request(PROMPTS[1], max_tokens=3000)))
            assert wait_for(lambda: c.stats().waiting == 1)
            with pytest.raises(grpc.RpcError) as err:
                list(c.generate(PROMPTS[2], max_tokens=4, timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.stats().rejected == 1
            for call in busy:
                call.cancel()
            assert wait_for(lambda: c.stats().active == 0 and c.stats().waiting == 0)
            with pytest.raises(grpc.RpcError) as err:  # 100 KB request > the 64 KB limit
                list(c.generate("x" * (100 << 10), max_tokens=4, timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(list(c.generate(PROMPTS[2], max_tokens=4, timeout=30))) > 0
    finally:
        srv.stop(0)
        backend.close()


def test_not_serving_until_models_are_loaded():
    srv = Server(None, "127.0.0.1", 0)
    try:
        with Client(srv.address) as c:
            assert c.health() == "NOT_SERVING" and c.health("sanctum.v1.Inference") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                list(c.generate("hi", max_tokens=2, timeout=10))
            assert (
                err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            )
    finally:
        srv.stop(0)


def process_tree(root: int) -> set[int]:
    """`root` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def listening_sockets(pids: set[int]) -> dict[str, int]:
    """ "address:port" -> pid for every TCP socket these processes listen on (/proc/net/tcp*)."""
    import ipaddress

    listening = {}  # socket inode -> address
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                hex_ip, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_ip)  # little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                ip = ipaddress.ip_address(raw)
                ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 -> 127.0.0.1
                listening[fields[9]] = f"{ip}:{int(hex_port, 16)}"
    found = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in listening:
                    found[listening[link[8:-1]]] = pid
    return found


def _http_checks(c, http_port):
    """The openai client over `sanctum serve`'s HTTP port: gRPC's greedy text, metrics counting
    both front ends' requests. Returns an HTTP client for the rest of the test."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    base = f"http://127.0.0.1:{http_port}"
    http = httpx.Client(base_url=base, timeout=30)
    assert http.get("/health").json() == {"status": "ok"}
    want = "".join(m.text for m in c.generate(PROMPTS[2], max_tokens=8))
    got = openai.OpenAI(base_url=f"{base}/v1", api_key="none").completions.create(
        model="m", prompt=PROMPTS[2], max_tokens=8
    )
    assert got.choices[0].text == want and got.usage.completion_tokens == 8
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    done = {s.labels["outcome"]: s.value for s in families["sanctum_requests"].samples}
    assert done == {"length": 2.0}  # one gRPC, one HTTP: each counted once
    return http


@pytest.mark.parametrize("mode", ["inline", "cluster"])
def test_sigterm_drains(pair, tmp_path, mode):
    """`sanctum serve` as a process: SIGTERM flips health, refuses new work, lets the in-flight
    stream finish, exits 0 (cluster: Ray's own SIGTERM handler must not preempt the drain).
    Cluster mode: every socket its process tree listens on, Ray's included (GCS, raylet, object
    manager, workers, agents, metrics), is on loopback; a socket directory left by a killed
    process is swept at start, and its own are gone after the drain."""
    import ipaddress
    import tempfile

    port, http_port = free_port(), free_port()
    env = dict(os.environ, SANCTUM_NO_OPENBLAS="1", SANCTUM_HOME=str(tmp_path))
    env.pop("RAY_ADDRESS", None)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(tempfile.gettempdir(), f"snc-{dead.pid}-stale")
    os.makedirs(stale, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sanctum.cli", "serve", "--model", pair[0], "--drafter", pair[1],
         "--port", str(port), "--http-port", str(http_port), "--cache-dir", str(tmp_path / "cache"),
         *(["--inline"] if mode == "inline" else [])],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        with Client(f"127.0.0.1:{port}") as c:
            c.wait_serving(120)
            # HTTP in the same process, on the same backend (inline or the cluster)
            http = _http_checks(c, http_port)
            call = c.stream(make_request(PROMPTS[0], max_tokens=200, use_cache=False))
            first = next(call)
            tree = process_tree(proc.pid)
            if mode == "cluster":
                sockets = listening_sockets(tree)
                assert len(tree) > 5 and f"127.0.0.1:{port}" in sockets  # Ray's processes too
                assert f"127.0.0.1:{http_port}" in sockets
                wide = [
                    a for a in sockets if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback
                ]
                assert not wide, wide
                assert not os.path.exists(stale)  # swept at start
                assert _socket_dirs(tree)  # the verifier's and the drafter's, while serving
            proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: c.health() == "NOT_SERVING", timeout=5)
            assert http.get("/health").status_code == 503
            with pytest.raises(grpc.RpcError) as err:
                list(c.generate(PROMPTS[1], max_tokens=4, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(call)  # the in-flight stream finishes
            assert rest[-1].finish_reason == "length"
            assert len(tokens_of([first, *rest])) == 200
        assert proc.wait(timeout=60) == 0
        assert wait_for(lambda: not _socket_dirs(tree), timeout=10), _socket_dirs(tree)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read()
        assert f"({mode})" in out and "draining" in out, out


def _socket_dirs(pids: set[int]) -> list[str]:
    import tempfile

    root = tempfile.gettempdir()
    return [n for n in os.listdir(root) if n.startswith("snc-") and n.split("-")[1] in
            {str(p) for p in pids}]  # fmt: skip
