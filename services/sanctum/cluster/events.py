"""A request's output, from the verifier actor to the front end.

The scheduler puts each request's items on its ticket: chunks, then END or an exception (which
also ends it). Across Ray nodes they travel as a Ray streaming generator
(`VerifierActor.generate`). On one host that is too dear for a few tokens a round: Ray's
per-item cost was most of the cluster's tax over inline (`sanctum bench isolation`;
docs/performance.md). So a front end on the verifier's host
holds ONE Unix-socket connection to it instead (standard library `multiprocessing.connection`,
HMAC authkey handed over through Ray), sends its submits and cancels on it, and receives
`VerifierEvents` whose events carry their request id (roles.proto), at a small fraction of a
Ray stream item's cost.

- `EventServer` (verifier actor): accepts front ends. Per connection, a reader thread takes
  submits and cancels, and a sender thread sends every event the scheduler's thread has queued
  since its last send in one message (so the MLX thread never waits on a slow reader). When a
  front end goes away, its open requests are cancelled.
- `EventClient` (front end): the connection and a reader thread handing each event to its
  request's queue; when the verifier goes away every open request gets `LOST`, and `on_lost`
  tells the front end at once (health turns NOT_SERVING), whether requests were open or not.

Ray-free: cluster/actors.py wires it up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client

from ..serving.errors import InvalidRequest
from ..serving.scheduler import End
from ..wire.convert import chunk_to_proto
from ..wire.errors import to_role_error
from ..wire.gen import roles_pb2 as roles
from .sockets import UnixListener
from .transport import ChannelBroken

log = logging.getLogger("sanctum.events")

LOST = object()  # EventClient queue item: the connection to the verifier broke
_STOP = object()


# ---- events and errors on the wire ----------------------------------------------------------


def fill_event(event: roles.VerifierEvent, item, index: int) -> None:
    """Set `event` to a ticket item (Chunk | BaseException | End), in place: the chunk is
    converted once, straight into the message that is sent; `index`: the chunk's."""
    if isinstance(item, End):
        event.end = True
    elif isinstance(item, BaseException):
        to_role_error(item, event.error)
    else:
        chunk_to_proto(item, index, out=event.chunk)


def ends(item) -> bool:
    return isinstance(item, (End, BaseException))


def hang_up(conn) -> None:
    """Close a connection that another thread may be blocked reading: shut the socket down
    first (closing the descriptor alone would not wake that thread, nor tell the peer)."""
    with contextlib.suppress(OSError):
        socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        conn.close()


def read_messages(conn, parse: Callable, handle: Callable, what: str) -> None:
    """Hand each message on `conn` (parsed by `parse`) to `handle` until the peer hangs up, or
    until one cannot be read or handled (logged: `what`); the caller then cleans up."""
    try:
        while True:
            handle(parse(conn.recv_bytes()))
    except (EOFError, OSError):
        pass
    except Exception:
        log.exception("events: %s; dropping the connection", what)


# ---- verifier side ----------------------------------------------------------------------------


class EventServer:
    """The verifier actor's end: `submit(sub, sink)` queues a request whose ticket items go to
    `sink.put` (raising for a bad one), `cancel(request_id)` stops one."""

    def __init__(
        self, submit: Callable[[roles.Submit, Sink], None], cancel: Callable[[str], object]
    ):
        self.submit, self.cancel = submit, cancel
        self.connections: set[_FrontEnd] = set()
        self.listener = UnixListener(
            lambda conn: self.connections.add(_FrontEnd(conn, self)), "events"
        )
        self.address, self.authkey = self.listener.address, self.listener.authkey

    def close(self) -> None:
        self.listener.close()
        for fe in list(self.connections):
            fe.gone()


class Sink:
    """A request's ticket items, for a connection: `put` (on the scheduler's thread) only
    queues them for the connection's sender thread."""

    def __init__(self, frontend: _FrontEnd, request_id: str):
        self.frontend, self.request_id = frontend, request_id
        self.index = 0  # of the next chunk

    def put(self, item) -> None:
        self.frontend.outbox.put((self.request_id, self.index, item))
        if not ends(item):
            self.index += 1


class _FrontEnd:
    """One front end's connection, on the verifier's side."""

    def __init__(self, conn, server: EventServer):
        self.conn, self.server = conn, server
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.open: set[str] = set()  # its requests not ended yet
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._read_loop, name="snc-events-in", daemon=True).start()
        threading.Thread(target=self._send_loop, name="snc-events-out", daemon=True).start()

    def _read_loop(self) -> None:
        read_messages(
            self.conn,
            roles.FrontEndMessage.FromString,
            self._on_message,
            "a front end's message failed",
        )
        self.gone()

    def _on_message(self, msg: roles.FrontEndMessage) -> None:
        op = msg.WhichOneof("op")
        if op == "submit":
            sink = Sink(self, msg.submit.request_id)
            with self.lock:
                self.open.add(sink.request_id)
            try:
                self.server.submit(msg.submit, sink)
            except Exception as exc:  # a bad request, a full queue, draining
                sink.put(exc)
        elif op == "cancel":
            self.server.cancel(msg.cancel)

    def _send_loop(self) -> None:
        while True:
            batch = [self.outbox.get()]
            with contextlib.suppress(queue.Empty):
                while batch[-1] is not _STOP:
                    batch.append(self.outbox.get_nowait())
            msg = roles.VerifierEvents()
            for entry in batch:
                if entry is _STOP:
                    break
                request_id, index, item = entry
                event = msg.events.add(request_id=request_id)
                fill_event(event, item, index)
                if ends(item):
                    with self.lock:
                        self.open.discard(request_id)
            if msg.events:
                try:
                    self.conn.send_bytes(msg.SerializeToString())
                except OSError:
                    self.gone()
                    return
            if batch[-1] is _STOP:
                return

    def gone(self) -> None:
        """The front end went away (or the server closes): cancel what it still had open."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            orphans, self.open = self.open, set()
        self.server.connections.discard(self)
        for request_id in orphans:
            self.server.cancel(request_id)
        if orphans:
            log.info("events: a front end went away; cancelled its %d open requests", len(orphans))
        self.outbox.put(_STOP)
        hang_up(self.conn)


# ---- front end side -----------------------------------------------------------------------------


class EventClient:
    """The front end's connection to the verifier actor on its host. Thread-safe: every gRPC
    handler thread submits on it; one reader thread routes the events."""

    def __init__(self, address: str, authkey: bytes, on_lost: Callable[[], None] | None = None):
        self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        self.on_lost = on_lost  # called once if the verifier hangs up (not after `close`)
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()  # the queues
        self._send_lock = threading.Lock()
        self.broken = False
        threading.Thread(target=self._read_loop, name="sanctum-events", daemon=True).start()

    def submit(self, sub: roles.Submit) -> queue.SimpleQueue:
        """Send `sub`; its events (then LOST if the verifier goes away) arrive on the queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        data = roles.FrontEndMessage(submit=sub).SerializeToString()
        with self._lock:
            if self.broken:
                raise ChannelBroken("the verifier's event connection is closed")
            if sub.request_id in self._queues:  # its events would go to the wrong caller
                raise InvalidRequest("request_id", f"{sub.request_id!r} is already in use")
            self._queues[sub.request_id] = q  # before sending: the first event may come at once
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except OSError as exc:
            with self._lock:
                self._queues.pop(sub.request_id, None)
            raise ChannelBroken(f"the verifier's event connection broke: {exc}") from None
        return q

    def events(self, request_id: str, q: queue.SimpleQueue) -> Iterator[roles.VerifierEvent]:
        """The request's events up to its end or error; raises ChannelBroken if the verifier
        goes away first."""
        try:
            while True:
                event = q.get()
                if event is LOST:
                    raise ChannelBroken("the verifier went away")
                yield event
                if event.WhichOneof("kind") != "chunk":
                    return
        finally:
            # no lock here: a generator left suspended (its caller raised, or went away) is
            # finalized by the garbage collector on whatever thread allocates next, the reader
            # thread too, inside `_route`, which holds `_lock` (it deadlocked there: every
            # request's events then stopped). Each dict step is atomic; a late finalizer leaves
            # alone a newer request that reuses the id.
            if self._queues.get(request_id) is q:
                self._queues.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        data = roles.FrontEndMessage(cancel=request_id).SerializeToString()
        with self._send_lock, contextlib.suppress(OSError):
            if not self.broken:
                self.conn.send_bytes(data)

    def _read_loop(self) -> None:
        read_messages(
            self.conn,
            roles.VerifierEvents.FromString,
            self._route,
            "unreadable message from the verifier",
        )
        hung_up = not self.broken
        self.close()
        if hung_up and self.on_lost is not None:
            self.on_lost()

    def _route(self, msg: roles.VerifierEvents) -> None:
        with self._lock:
            for event in msg.events:
                q = self._queues.get(event.request_id)
                if q is None:
                    continue  # its caller stopped reading (cancelled)
                q.put(event)  # SimpleQueue.put: safe even if a finalizer runs inside it
                if event.WhichOneof("kind") != "chunk":
                    self._queues.pop(event.request_id, None)  # (or its stream's cleanup did)

    def close(self) -> None:
        with self._lock:
            self.broken = True
            lost, self._queues = self._queues, {}
        for q in lost.values():
            q.put(LOST)
        hang_up(self.conn)
