"""The cluster's parts that need no Ray: the shared-memory drafter channel, the drafter
service, the verifier's event socket (fast; the scheduler is tests/serving/test_serving.py,
wire formats tests/wire/test_wire.py, the isolation bench tests/bench/test_isolation.py; with
a real Ray cluster: test_cluster.py)."""

from __future__ import annotations

import queue
import threading

import mlx.core as mx
import pytest
from helpers import NO_GATE, wait_for
from helpers import PROMPTS as ALL_PROMPTS
from sanctum.cluster.transport import Slot
from sanctum.wire.gen import roles_pb2 as roles

PROMPTS = ALL_PROMPTS[:4]


# ---- the channel, the drafter service, the event socket (no Ray) ------------------------------------


def test_slot_name_fits_macos_and_roundtrips():
    slot = Slot(10)
    try:
        assert len(slot.name) + 1 <= 31 and slot.size >= 10  # "/name" within PSHMNAMLEN
        arrays = [
            mx.arange(7).astype(mx.float32),
            mx.ones((2, 3), mx.bfloat16),
            mx.zeros((1,), mx.float16),
        ]
        refs = slot.write(arrays)
        assert all(r.offset % 64 == 0 for r in refs)
        peer = Slot(name=slot.name)  # another process would attach like this
        for a, r in zip(arrays, refs):
            assert mx.array_equal(peer.read(r), a).item()
        peer.close()
    finally:
        slot.close()


def test_socket_channel_roundtrip_growth_and_disconnect():
    from multiprocessing import AuthenticationError

    from sanctum.cluster.transport import ShmChannel, SocketServer

    gone = threading.Event()

    def handle(client, req, read):
        call = req.draft
        taps = read(call.new_taps) if call.HasField("new_taps") else None
        embeds = read(call.block_embeds)
        extra = taps.sum() if taps is not None else 0
        return roles.DraftReply(compute_ms=1.0), embeds[1:] * 2 + extra

    server = SocketServer(lambda: handle, on_disconnect=lambda client: gone.set())
    server.wait_ready(10)
    ch = ShmChannel(server.address, server.authkey, timeout_s=10)

    def draft(start):
        return roles.DraftRequest(draft=roles.DraftCall(seq_id="s", start=start))

    try:
        embeds = mx.arange(8 * 16, dtype=mx.float32).reshape(8, 16)
        out = 7 * 16 * 4  # the reply's bytes
        a = ch.call(draft(3), [embeds], out)
        assert mx.array_equal(a.hidden, embeds[1:] * 2).item()
        assert a.moved == embeds.nbytes + a.hidden.nbytes
        # requests in flight together: each its own region, collected in any order, one dropped
        ids = [ch.submit(draft(i), [embeds + i], out) for i in range(3)]
        ch.discard(ids[1])
        later, first = ch.collect(ids[2]), ch.collect(ids[0])
        assert mx.array_equal(later.hidden, (embeds + 2)[1:] * 2).item()
        assert mx.array_equal(first.hidden, embeds[1:] * 2).item()
        # a 4 MiB request outgrows the 1 MiB slot while a small one is in flight in the old slot
        small = ch.submit(draft(5), [embeds + 5], out)
        taps = mx.ones((1024, 1024), mx.float32)
        big = ch.submit(draft(1030), [taps, embeds], out)
        assert ch.slot.size >= taps.nbytes
        hidden = ch.collect(big).hidden
        assert mx.allclose(hidden, embeds[1:] * 2 + 1024 * 1024).item()
        assert mx.array_equal(ch.collect(small).hidden, (embeds + 5)[1:] * 2).item()
        assert not ch._in_flight and not ch._arrived and not ch._retired  # all regions freed
        with pytest.raises(AuthenticationError):  # a wrong key gets nothing
            ShmChannel(server.address, b"wrong" * 7)
        assert mx.array_equal(ch.call(draft(1030), [taps, embeds], out).hidden, hidden).item()
    finally:
        ch.close()
        assert gone.wait(5)
        server.close()
    # closing stops both of the server's threads (a blocked accept() is not woken by a close)
    server.listener._thread.join(5)
    server._mlx.thread.join(5)
    assert not server.listener._thread.is_alive() and not server._mlx.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        server.submit(lambda: None)


def test_draft_service_equals_local_peer(engine):
    from sanctum.cluster.drafter import DraftService
    from sanctum.engine.decode.peer import LocalDraftPeer

    target, drafter, _ = engine
    service, local = DraftService(drafter), LocalDraftPeer(drafter)
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    taps = mx.random.normal((5, width))
    embeds = target.embed_tokens(mx.array([3, 4, 4, 4, 4, 4, 4, 4]))
    local.open("a")
    want = local.draft("a", taps, embeds, 5)
    service.handle("c1", roles.DraftRequest(open=roles.DraftOpen(seq_id="a")), None)
    arrays = {1: taps, 2: embeds}
    call = roles.DraftCall(seq_id="a", start=5, new_taps=roles.TensorRef(offset=1),
                           block_embeds=roles.TensorRef(offset=2))  # fmt: skip
    reply, got = service.handle("c1", roles.DraftRequest(draft=call), lambda r: arrays[r.offset])
    assert not reply.error and mx.allclose(got, want, atol=1e-5).item()
    reply, _ = service.handle("c2", roles.DraftRequest(draft=call), lambda r: arrays[r.offset])
    assert reply.not_open  # sessions belong to their client
    service.drop_client("c1")
    assert service.num_sessions == 0


def test_draft_service_drafts_a_shared_round_in_one_call(engine):
    """A DraftCall for N sequences (their blocks stacked, their new tap rows one after the
    other, a sequence with none) equals LocalDraftPeer.draft_batch on the same sessions."""
    from sanctum.cluster.drafter import DraftService
    from sanctum.engine.decode.peer import LocalDraftPeer

    target, drafter, _ = engine
    service, local = DraftService(drafter), LocalDraftPeer(drafter)
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    taps = [mx.random.normal((5, width)), None, mx.random.normal((3, width))]
    embeds = mx.stack([target.embed_tokens(mx.array([t] + [4] * 7)) for t in (3, 5, 7)])
    starts = [5, 0, 3]
    for s in "abc":
        local.open(s)
        service.handle("c1", roles.DraftRequest(open=roles.DraftOpen(seq_id=s)), None)
    want = local.draft_batch(list("abc"), taps, embeds, starts)
    arrays = {1: mx.concatenate([taps[0], taps[2]]), 2: embeds}
    call = roles.DraftCall(new_taps=roles.TensorRef(offset=1), block_embeds=roles.TensorRef(offset=2),
                           batch_seq_ids=list("abc"), batch_starts=starts, batch_tap_rows=[5, 0, 3])  # fmt: skip
    reply, got = service.handle("c1", roles.DraftRequest(draft=call), lambda r: arrays[r.offset])
    assert not reply.error and got.shape == (3, 7, want.shape[-1])
    assert mx.allclose(got, want, atol=1e-5).item()


def test_event_client_survives_a_stream_finalized_inside_its_reader():
    """A request's event stream left suspended (its caller raised, or went away) is finalized
    whenever the garbage collector runs, on any thread: here on the client's reader thread
    while it routes another request's events, the moment it hands them over. The reader must
    go on routing (it once deadlocked there on its own lock, and every request then hung)."""
    from sanctum.cluster.events import EventClient, EventServer
    from sanctum.serving.requests import Chunk
    from sanctum.serving.scheduler import END

    sinks = {}
    server = EventServer(lambda sub, sink: sinks.__setitem__(sub.request_id, sink), lambda _: None)
    client = EventClient(server.address, server.authkey)
    try:

        def submit(rid):
            q = client.submit(roles.Submit(request_id=rid))
            assert wait_for(lambda: rid in sinks, 5)
            return q

        abandoned = [client.events("a", submit("a"))]
        sinks["a"].put(Chunk("x", [1]))
        assert next(abandoned[0]).chunk.token_ids == [1]  # suspended inside its stream

        class FinalizingQueue:  # stands for a collection that finalizes "a" right here
            def __init__(self):
                self.got = queue.SimpleQueue()

            def put(self, event):
                abandoned.clear()  # the last reference: "a" is finalized on this thread, now
                self.got.put(event)

        submit("b")
        client._queues["b"] = fin = FinalizingQueue()
        sinks["b"].put(Chunk("y", [2]))
        assert fin.got.get(timeout=10).chunk.token_ids == [2]
        assert "a" not in client._queues  # its cleanup ran, inside the reader

        q = submit("c")  # the reader still routes
        sinks["c"].put(Chunk("z", [3]))
        sinks["c"].put(END)
        events = list(client.events("c", q))
        assert [e.chunk.token_ids for e in events[:-1]] == [[3]] and events[-1].end
        assert not client.broken
    finally:
        server.close()
        if client._lock.acquire(timeout=5):  # (a deadlocked reader would hold it for good)
            client._lock.release()
            client.close()


def test_event_socket_streams_requests_and_cancels_orphans(pair, engine):
    """The verifier's event socket (same-host front ends) over the real scheduler: requests
    multiplexed on one connection give the engine's output; a bad request is an error event; a
    wrong authkey is refused; a front end that goes away has its open requests cancelled; a
    verifier that goes away ends the front end's open requests with ChannelBroken."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client as RawClient

    from sanctum.cluster.events import EventClient, EventServer
    from sanctum.cluster.transport import ChannelBroken
    from sanctum.serving.errors import InvalidRequest
    from sanctum.serving.inline import InlineBackend, RoundDelay
    from sanctum.serving.requests import GenerateRequest
    from sanctum.settings import serve_settings
    from sanctum.wire.convert import chunk_from_proto, request_from_proto, request_to_proto

    _, _, reference = engine
    backend = InlineBackend(serve_settings(pair[0], pair[1], cache_dir="none",
                                           env=NO_GATE), RoundDelay(0.02))  # fmt: skip
    server = None
    try:
        backend.ready(60)
        sched = backend.scheduler

        def submit(sub, sink):
            req = request_from_proto(sub.request, sub.request_id)
            sched.submit(req, sub.mode, sub.deadline_unix or None, sink=sink)

        server = EventServer(submit, sched.cancel)

        def send(client, prompt, max_tokens):
            req = GenerateRequest(prompt=prompt, max_tokens=max_tokens)
            sub = roles.Submit(request=request_to_proto(req), request_id=req.request_id)
            return req.request_id, client.submit(sub)

        client = EventClient(server.address, server.authkey)
        calls = [send(client, p, 20) for p in PROMPTS[:2]]  # both in flight on one connection
        for (rid, q), prompt in zip(calls, PROMPTS[:2], strict=True):
            events = list(client.events(rid, q))
            assert events[-1].end and [e.chunk.index for e in events[:-1]] == list(
                range(len(events) - 1)
            )
            chunks = [chunk_from_proto(e.chunk) for e in events[:-1]]
            assert [t for c in chunks for t in c.token_ids] == reference(prompt, 20)

        rid, q = send(client, "", 4)
        (bad,) = list(client.events(rid, q))
        assert bad.error.code == roles.RoleError.INVALID_ARGUMENT and bad.error.field == "prompt"
        rid, q = send(client, PROMPTS[0], 4)
        with pytest.raises(InvalidRequest, match="request_id"):  # while it is still open
            client.submit(roles.Submit(request=request_to_proto(
                GenerateRequest(prompt=PROMPTS[1], max_tokens=4)), request_id=rid))  # fmt: skip
        assert len(list(client.events(rid, q))) > 1  # the first request is unharmed

        with pytest.raises(AuthenticationError):
            RawClient(server.address, family="AF_UNIX", authkey=b"wrong")

        cancelled = sched.stats()["cancelled"]
        rid, q = send(client, PROMPTS[3], 3000)
        stream = client.events(rid, q)
        next(stream), next(stream)
        client.close()  # the front end goes away mid-request
        assert wait_for(sched.idle, 10) and sched.stats()["cancelled"] == cancelled + 1

        other = EventClient(server.address, server.authkey)  # still accepting
        rid, q = send(other, PROMPTS[3], 3000)
        stream = other.events(rid, q)
        next(stream)
        server.close()  # the verifier goes away
        with pytest.raises(ChannelBroken):
            list(stream)
        assert other.broken
    finally:
        if server is not None:
            server.close()
        backend.close()
