"""A real local Ray cluster behind a real gRPC server: both drafter transports give the
engine's greedy output, and each role's death has the stated outcome (drafter: plain
decoding, same output, speculation resumes; store: uncached, then reloaded from disk;
verifier: UNAVAILABLE in flight, then new requests succeed). The parts without Ray:
test_channels.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
from helpers import NO_GATE, wait_for
from helpers import PROMPTS as ALL_PROMPTS

PROMPTS = ALL_PROMPTS[:4]


# ---- a real Ray cluster behind gRPC: transports and faults -----------------------------------------

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(pair, tmp_path_factory):
    from sanctum.api.client import Client
    from sanctum.api.server import Server
    from sanctum.cluster.backend import start_cluster
    from sanctum.cluster.localray import init_local_ray
    from sanctum.settings import serve_settings

    init_local_ray(num_cpus=2, log_to_driver=False, namespace=f"test-cluster-{os.getpid()}")
    settings = serve_settings(
        pair[0], pair[1], cache_dir=str(tmp_path_factory.mktemp("store")), env=NO_GATE
    )
    backend = start_cluster(settings)
    server = Server(backend, "127.0.0.1", 0, max_streams=16)
    try:
        server.ready(300)
        with Client(server.address) as client:
            yield backend, client
    finally:
        server.stop(0)
        backend.close()
        ray.shutdown()


def _tokens(responses):
    return [t for m in responses for t in m.token_ids]


@pytest.mark.slow
def test_a_batched_round_with_the_drafter_actor_gives_the_engine_output(cluster, engine, pair):
    """Verifier.step_batch over a pipelined peer: a shared round's next blocks prefetched
    from the actor in one call (one drafter forward), one shared target verify; each request
    gets its solo output."""
    from sanctum.cluster.drafter import RemoteDraftPeer
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.verifier import Verifier

    backend, _ = cluster
    target, _, reference = engine
    head = load_drafter(pair[1], target, parts="head")
    peer = RemoteDraftPeer(backend.drafter, ray.get_runtime_context().get_node_id(), "shm")
    verifier = Verifier(target, head, peer)
    lengths = dict(zip(PROMPTS[:3], (24, 10, 17)))
    live, out = [], {}
    for prompt, n in lengths.items():
        act, chunk = verifier.open(GenerateRequest(prompt=prompt, max_tokens=n, use_cache=False))
        live.append(act)
        out[prompt] = list(chunk.token_ids)
    sequence_rounds = 0
    while live:
        sequence_rounds += len(live)
        for act, chunk in zip(live, verifier.step_batch(live)):
            out[act.req.prompt] += chunk.token_ids
        for act in [a for a in live if a.finished]:
            verifier.close(act)
        live = [a for a in live if not a.finished]
    for prompt, n in lengths.items():
        assert out[prompt] == reference(prompt, n), prompt
    # the shared rounds' blocks went in shared calls: fewer calls than sequence-rounds
    assert peer.summary()["draft_calls"] < sequence_rounds - len(lengths)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_drafter_transports_give_the_engine_output(cluster, engine, pair, transport):
    """The verifier role in this process, the drafter body in its actor, over each transport."""
    from sanctum.cluster.drafter import RemoteDraftPeer
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.verifier import Verifier

    backend, _ = cluster
    target, _, reference = engine
    head = load_drafter(pair[1], target, parts="head")
    assert head.body is None  # no second copy of the drafter body (nor of any vocab weights)
    node = ray.get_runtime_context().get_node_id()
    peer = RemoteDraftPeer(backend.drafter, node, transport)
    verifier = Verifier(target, head, peer)
    chunks = list(verifier.generate(GenerateRequest(prompt=PROMPTS[0], max_tokens=24)))
    assert [t for c in chunks for t in c.token_ids] == reference(PROMPTS[0], 24)
    s = peer.summary()
    assert (
        s["transport"] == transport
        and s["draft_calls"] == len(chunks) - 1
        and s["bytes_per_call"] > 0
    )
    # the role processes run at normal priority (Ray's default would be niceness 15)
    assert all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in backend.pids().values())
    # the verifier and the drafter mostly take turns, so each gets inline mode's BLAS threads:
    # one per CPU this process may use; on two CPUs or fewer the drafter takes one
    usable = len(os.sched_getaffinity(0))
    cpus = str(usable)
    want = {
        "verifier": os.environ.get("OMP_NUM_THREADS") or cpus,
        "drafter": os.environ.get("SANCTUM_DRAFTER_THREADS") or ("1" if usable <= 2 else cpus),
        "store": "1",
    }
    for role, pid in backend.pids().items():
        with open(f"/proc/{pid}/environ") as f:
            env = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
        assert env["OMP_NUM_THREADS"] == want[role], role


@pytest.mark.slow
def test_looked_up_blocks_skip_the_drafter_actor_and_decode_as_inline(cluster, engine, pair):
    """Blocks read from the sequence (engine/lookup.py; `lookup_min` 1, so that the random pair
    finds repeats) with the pipelined drafter actor: a round whose next block is looked up asks
    the actor for nothing, the context rows it lacks go with the next draft, and the request
    proposes, accepts and emits what the inline roles do."""
    from sanctum.cluster.drafter import RemoteDraftPeer
    from sanctum.engine.decode.peer import LocalDraftPeer
    from sanctum.engine.decode.policy import DecodePolicy
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.verifier import Verifier

    backend, _ = cluster
    target, drafter, reference = engine
    head = load_drafter(pair[1], target, parts="head")
    peer = RemoteDraftPeer(backend.drafter, ray.get_runtime_context().get_node_id(), "shm")
    remote = Verifier(target, head, peer, policy=DecodePolicy(lookup_min=1))
    inline = Verifier(target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(lookup_min=1))
    req = GenerateRequest(prompt=ALL_PROMPTS[2], max_tokens=64, use_cache=False)
    got = {}
    for name, verifier in (("remote", remote), ("inline", inline)):
        chunks = list(verifier.generate(req))
        got[name] = [(c.token_ids, c.accepted) for c in chunks], chunks[-1].usage
    (chunks, usage), (want, inline_usage) = got["remote"], got["inline"]
    assert chunks == want
    assert [t for c, _ in chunks for t in c] == reference(ALL_PROMPTS[2], 64)
    assert usage.lookup_rounds == inline_usage.lookup_rounds > 0
    assert peer.summary()["draft_calls"] == usage.rounds - usage.lookup_rounds


@pytest.mark.slow
def test_events_over_the_socket_and_the_ray_stream_agree(cluster, engine):
    """A front end on the verifier's host takes events over the socket; one that is told the
    object store (as across hosts) over a Ray stream per request: same chunks, same errors."""
    from dataclasses import replace

    from sanctum.cluster.backend import ClusterBackend
    from sanctum.serving.errors import InvalidRequest
    from sanctum.serving.requests import GenerateRequest

    backend, _ = cluster
    _, _, reference = engine
    assert backend.events_path == "socket"
    settings = replace(backend.settings, transport="object_store")
    remote = ClusterBackend(settings, backend.verifier, backend.drafter, backend.store)
    remote.ready(60)  # (not closed below: closing a backend kills the actors)
    assert remote.events_path == "ray"
    outs = []
    for b in (backend, remote):
        chunks = list(b.submit(GenerateRequest(prompt=PROMPTS[1], max_tokens=24, use_cache=False)))
        assert chunks[-1].finish_reason and chunks[-1].usage.completion_tokens == 24
        outs.append([(c.token_ids, c.drafted, c.accepted) for c in chunks])
        with pytest.raises(InvalidRequest):
            list(b.submit(GenerateRequest(prompt="", max_tokens=4)))
    assert outs[0] == outs[1]
    assert [t for ids, _, _ in outs[0] for t in ids] == reference(PROMPTS[1], 24)


@pytest.mark.slow
def test_a_listing_right_after_a_request_shows_its_save_however_slow_the_store(
    cluster, pair, tmp_path
):
    """A request's prompt-cache entry is sent to the store by the verifier and listed or
    cleared by the front end: two callers, whose calls Ray does not order. With a store whose
    saves take 2 s, a listing right after a request ends waits for its save instead of
    missing it, and a clear right after one clears it too."""
    from sanctum.cluster.backend import start_cluster
    from sanctum.serving.requests import GenerateRequest
    from sanctum.settings import serve_settings

    settings = serve_settings(pair[0], pair[1], cache_dir=str(tmp_path), env=NO_GATE)
    backend = start_cluster(settings, save_delay_s=2.0)  # beside the module's cluster
    try:
        backend.ready(300)
        assert backend.list_cache() == []
        list(backend.submit(GenerateRequest(prompt=PROMPTS[0], max_tokens=6)))
        t0 = time.monotonic()
        assert len(backend.list_cache()) == 1
        assert time.monotonic() - t0 > 1.0  # it waited for the save
        list(backend.submit(GenerateRequest(prompt=PROMPTS[1], max_tokens=6)))
        assert backend.clear_cache() == 2  # the one just saved as well
        assert backend.list_cache() == []
    finally:
        backend.close()


@pytest.mark.slow
def test_drafter_dies_mid_request(cluster, engine):
    backend, client = cluster
    _, _, reference = engine
    stream = client.generate(PROMPTS[3], max_tokens=200, use_cache=False, timeout=180)  # no EOS
    head = [next(stream) for _ in range(4)]
    assert all(m.drafted == 7 for m in head[1:])
    ray.kill(backend.drafter, no_restart=False)
    rest = list(stream)
    assert _tokens(head + rest) == reference(PROMPTS[3], 200)  # same greedy output
    assert any(m.drafted == 0 for m in rest)  # plain rounds while the drafter was away
    assert wait_for(lambda: client.stats().drafter_available, timeout=90)
    again = list(client.generate(PROMPTS[3], max_tokens=16, use_cache=False, timeout=60))
    assert all(m.drafted == 7 for m in again[1:])  # speculation resumed
    assert _tokens(again) == reference(PROMPTS[3], 16)


@pytest.mark.slow
def test_store_dies_then_reloads_its_entries(cluster, engine):
    backend, client = cluster
    _, _, reference = engine
    prompt = "def saved_before_the_crash(a, b):\n    return a + b"
    before = {e.entry_id for e in client.list_cache().entries}  # earlier tests saved some too
    first = list(client.generate(prompt, max_tokens=12, timeout=60))

    def saved():  # this request's entry is listed (the store lists only what is on disk)
        return any(e.entry_id not in before and e.rungs for e in client.list_cache().entries)

    assert wait_for(saved, timeout=20)
    os.kill(backend.pids()["store"], signal.SIGKILL)
    during = list(client.generate(PROMPTS[2], max_tokens=12, timeout=60))  # still served
    assert _tokens(during) == reference(PROMPTS[2], 12)
    assert wait_for(lambda: client.stats().cache.available, timeout=90)
    assert wait_for(lambda: client.stats().cache.entries >= 1, timeout=30)  # reloaded from disk
    resumed = list(client.generate(prompt, max_tokens=12, timeout=60))
    assert _tokens(resumed) == _tokens(first) == reference(prompt, 12)
    assert resumed[-1].usage.cached_tokens > 0


@pytest.mark.slow
def test_health_follows_the_verifier(cluster, engine):
    """Health follows the verifier, even when it is killed with no request in flight: Check and
    Watch say NOT_SERVING from the moment it dies (its event socket hangs up) until it serves again;
    requests meanwhile get UNAVAILABLE at once, and once SERVING they succeed."""
    import grpc
    from grpc_health.v1 import health_pb2

    backend, client = cluster
    _, _, reference = engine
    watch = client.health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=180)
    watched = []

    def read_watch():
        with contextlib.suppress(grpc.RpcError):
            for m in watch:
                watched.append(health_pb2.HealthCheckResponse.ServingStatus.Name(m.status))

    reader = threading.Thread(target=read_watch)
    reader.start()
    assert wait_for(lambda: watched == ["SERVING"], timeout=10)
    os.kill(backend.pids()["verifier"], signal.SIGKILL)
    killed = time.monotonic()
    assert wait_for(lambda: client.health() == "NOT_SERVING", timeout=5, interval=0.02)
    assert time.monotonic() - killed < 1.0
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(PROMPTS[0], max_tokens=4, timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 2.0
    assert wait_for(lambda: client.health() == "SERVING", timeout=120, interval=0.05)
    assert _tokens(client.generate(PROMPTS[0], max_tokens=8, timeout=60)) == reference(
        PROMPTS[0], 8
    )  # SERVING means served
    assert wait_for(lambda: watched == ["SERVING", "NOT_SERVING", "SERVING"], timeout=5), watched
    watch.cancel()
    reader.join(10)


@pytest.mark.slow
def test_verifier_dies_in_flight_then_serves_again(cluster, engine):
    import grpc

    backend, client = cluster
    _, _, reference = engine
    old = backend.pids()["verifier"]
    stream = client.generate(PROMPTS[3], max_tokens=3000, timeout=120)
    next(stream), next(stream)
    os.kill(old, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "verifier" in err.value.details() and "retry" in err.value.details()
    client.wait_serving(180)
    assert backend.pids()["verifier"] != old
    assert _tokens(client.generate(PROMPTS[3], max_tokens=16, timeout=120)) == reference(
        PROMPTS[3], 16
    )


def test_socket_directories_are_removed_or_swept():
    """/tmp/snc-* socket directories: a listener removes its own at close; a killed process's
    is swept by the next start, and a live process's is left alone."""
    import subprocess
    import sys
    import tempfile

    from sanctum.cluster.sockets import UnixListener, sweep_stale_socket_dirs

    own = UnixListener(lambda conn: None, "test")
    own_dir = os.path.dirname(own.address)
    assert os.path.basename(own_dir).startswith(f"snc-{os.getpid()}-")
    assert os.stat(own_dir).st_mode & 0o777 == 0o700
    code = ("import sys, time; from sanctum.cluster.sockets import UnixListener; "
            "print(UnixListener(lambda c: None, 'x').address, flush=True); time.sleep(60)")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    killed_dir = os.path.dirname(child.stdout.readline().strip())
    child.kill()
    child.wait()
    assert os.path.isdir(killed_dir)  # SIGKILL: nothing ran its cleanup
    assert sweep_stale_socket_dirs(tempfile.gettempdir()) >= 1
    assert not os.path.exists(killed_dir) and os.path.isdir(own_dir)  # the live one stays
    own.close()
    assert not os.path.exists(own_dir)


def test_bench_batch_through_the_cluster_checks_every_output(pair):
    """`sanctum bench batch --cluster` (its own local Ray, in a child process): shared rounds
    through the actor cluster, each output equal to its request served alone."""
    import json
    import subprocess
    import sys

    argv = ["bench", "batch", "--model", pair[0], "--drafter", pair[1], "--cluster",
            "--concurrency", "1,2", "--max-tokens", "12", "--json"]  # fmt: skip
    code = f"import sys; from sanctum.cli import main; sys.exit(main({argv!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["serving"] == "cluster"
    assert [r["concurrency"] for r in result["levels"]] == [1, 2]
    assert result["all_outputs_equal_alone"]
    assert all(r["completion_tokens"] > 0 for r in result["levels"])
