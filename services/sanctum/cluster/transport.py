"""Moving tensors between role processes without pickling them through actor calls.

Per-round traffic between the verifier and the drafter (taps of the newly committed rows, the
block's input embeddings, the drafter's hidden states) takes one of two paths, chosen by Ray node:

- same host (`ShmChannel`): one shared-memory slot per verifier process, written in place, plus
  a Unix socket carrying a tiny `DraftRequest` / `DraftReply` (roles.proto) per round. A round
  trip costs far less than an ordinary Ray actor call or a Ray compiled graph (which also shuts
  down when an actor dies and may only be driven by the process that compiled it;
  docs/performance.md); so this small channel is hand-written on the standard library
  (`multiprocessing.shared_memory`, `multiprocessing.connection` with an HMAC authkey).
- across hosts (`ObjectStoreChannel`): the same messages as actor calls, the tensors as numpy
  arrays put in the Ray object store.

Both channels let requests overlap (`submit`, then `collect`): the verifier asks for a
sequence's next block as soon as it knows the accepted tokens, and rolls back its caches and
streams the round's tokens while the drafter computes (speculative.py, "pipelined" peers).

A TensorRef's offset is a byte offset into the slot, or an index into the array list.
bfloat16, which numpy lacks, travels as its uint16 bit pattern. Shared-memory names stay under
macOS's 30-character limit; slots grow on demand (a prompt's taps can be large).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Client, wait

import mlx.core as mx
import numpy as np

from ..serving.mlx_thread import MlxThread
from ..wire.gen import roles_pb2 as roles
from ..wire.tensors import _NP, dtype_name, from_numpy, to_numpy
from .sockets import UnixListener

log = logging.getLogger("sanctum.transport")
ALIGN = 64  # byte alignment of tensors in a slot
MIN_SLOT_BYTES = 1 << 20


class ChannelBroken(ConnectionError):
    """The peer process went away (or stopped answering): the channel must be rebuilt."""


# ---- the shared-memory slot --------------------------------------------------------------


_OWNED: set[str] = set()  # segments this process created and has not unlinked


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to a segment another process owns, without letting this process's resource
    tracker unlink it at exit (Python < 3.13 registers every attach). Where this process owns
    it too (both ends in one process, as in tests), the registration is the owner's: kept, or
    the owner's unlink would make the tracker print a KeyError."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        shm = shared_memory.SharedMemory(name=name)
        if shm._name not in _OWNED:
            with contextlib.suppress(Exception):  # best effort: a warning at exit at worst
                resource_tracker.unregister(shm._name, "shared_memory")
        return shm


class Slot:
    """A shared-memory segment that tensors are packed into at aligned offsets."""

    def __init__(self, size: int = 0, name: str | None = None):
        if name is None:
            size = max(MIN_SLOT_BYTES, size)
            # "/snc-<pid>-<6 hex>": at most 20 characters (macOS allows 30)
            name = f"snc-{os.getpid():x}-{secrets.token_hex(3)}"
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.owner = True
            _OWNED.add(self.shm._name)
        else:
            self.shm = _attach(name)
            self.owner = False
        self.name, self.size = self.shm.name.lstrip("/"), self.shm.size

    @staticmethod
    def bytes_needed(arrays: list[mx.array]) -> int:
        return sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays)

    def write(self, arrays: list[mx.array], offset: int = 0) -> list[roles.TensorRef]:
        refs = []
        for a in arrays:
            src = to_numpy(a)
            dst = np.ndarray(src.shape, src.dtype, self.shm.buf, offset)
            dst[...] = src
            refs.append(roles.TensorRef(offset=offset, shape=a.shape, dtype=dtype_name(a.dtype)))
            offset += -(-a.nbytes // ALIGN) * ALIGN
        return refs

    def read(self, ref: roles.TensorRef) -> mx.array:
        shape = tuple(ref.shape)
        view = np.ndarray(shape, _NP[ref.dtype], self.shm.buf, ref.offset)
        return from_numpy(view, ref.dtype)

    def unlink(self) -> None:
        """Remove the name; the memory lives on while a process maps it. Done as soon as the
        peer has attached, so a process killed with SIGKILL leaves nothing in /dev/shm."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
            _OWNED.discard(self.shm._name)
            self.owner = False

    def close(self) -> None:
        self.unlink()
        with contextlib.suppress(BufferError):
            self.shm.close()


# ---- drafter side: serving DraftRequests over Unix sockets ---------------------------------


class SocketServer:
    """The drafter's serving loop. ONE thread owns MLX (MLX streams are per thread): it runs
    `load()` (which returns `handle(client, request, read) -> (reply, hidden | None)`), then
    serves every verifier connection's DraftRequests, multiplexed, reading tensors from (and
    writing the reply's into) the slot each client attached. Other threads hand it work with
    `submit` (the object-store path). Connections arrive on a Unix socket (HMAC authkey)."""

    def __init__(self, load, on_disconnect=None):
        from concurrent.futures import Future

        self._Future = Future
        self.on_disconnect = on_disconnect
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # new connections and jobs
        self._clients = 0
        self._mlx = MlxThread(load, self._serve, "snc-mlx", "the drafter")
        self.listener = UnixListener(self._accepted, "drafter channel")
        self.address, self.authkey = self.listener.address, self.listener.authkey

    def wait_ready(self, timeout: float | None = None) -> None:
        self._mlx.wait_ready(timeout)

    def submit(self, fn):
        """Run `fn()` on the MLX thread; returns a Future."""
        fut = self._Future()
        self._wake(("job", fn, fut))
        return fut

    def _accepted(self, conn) -> None:
        self._clients += 1
        self._wake(("conn", conn, f"c{self._clients}"))

    def _wake(self, item) -> None:
        """Queue `item` for the MLX thread and wake it (under the lock `close` takes, so no
        write goes to a pipe closed meanwhile, whose descriptor may already be reused)."""
        with self._wake_lock:
            if self._wake_w is None:
                raise RuntimeError("the drafter's socket server is closed")
            self._inbox.put(item)
            os.write(self._wake_w, b"w")

    def _serve(self, handle) -> None:
        self.handle = handle
        clients: dict = {}  # connection -> [client id, slot]
        try:
            self._serve_until_stopped(clients)
        finally:
            for conn, (_, slot) in clients.items():
                conn.close()
                if slot is not None:
                    slot.close()
            os.close(self._wake_r)

    def _serve_until_stopped(self, clients: dict) -> None:
        while True:
            for obj in wait([self._wake_r, *clients]):
                if obj == self._wake_r:
                    if not os.read(self._wake_r, 4096):
                        return  # `close`: the pipe's write end is closed
                    while not self._inbox.empty():
                        kind, a, b = self._inbox.get()
                        if kind == "conn":
                            clients[a] = [b, None]
                        else:
                            try:
                                b.set_result(a())
                            except BaseException as exc:
                                b.set_exception(exc)
                elif not self._serve_one(obj, clients[obj]):
                    client, slot = clients.pop(obj)
                    obj.close()
                    if slot is not None:
                        slot.close()
                    if self.on_disconnect is not None:
                        self.on_disconnect(client)

    def _serve_one(self, conn, state: list) -> bool:
        """Answer one request on `conn`; False when the client has gone."""
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return False
        req = roles.DraftRequest.FromString(data)
        if req.WhichOneof("op") == "attach":
            if state[1] is not None:
                state[1].close()
            state[1] = Slot(name=req.attach.shm_name)
            reply, hidden = roles.DraftReply(), None
        else:
            slot = state[1]
            reply, hidden = self.handle(state[0], req, slot.read if slot else None)
            if hidden is not None:
                call = req.draft
                if hidden.nbytes > call.reply_capacity:  # the verifier reserved too little
                    reply = roles.DraftReply(
                        error=f"hidden states of {hidden.nbytes} bytes do "
                        f"not fit the {call.reply_capacity} reserved"
                    )
                else:
                    (ref,) = slot.write([hidden], call.reply_offset)
                    reply.hidden.CopyFrom(ref)
        reply.call_id = req.call_id
        try:
            conn.send_bytes(reply.SerializeToString())
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Stop accepting, then stop the MLX thread's loop (it closes its connections and
        slots, and the pipe's read end)."""
        self.listener.close()
        with self._wake_lock:
            if self._wake_w is not None:
                os.close(self._wake_w)  # the loop reads end-of-file and returns
                self._wake_w = None


# ---- verifier side -----------------------------------------------------------------------


@dataclass
class Answer:
    """A collected reply: the DraftReply, the hidden states it carried (copied out of the slot),
    bytes moved both ways, and how long the caller waited for it (None: it had already come)."""

    reply: roles.DraftReply
    hidden: mx.array | None
    moved: int
    waited_s: float | None


@dataclass
class _InFlight:
    slot: Slot
    offset: int
    size: int
    sent_bytes: int
    discard: bool = False


class ShmChannel:
    """The verifier's end of a same-host drafter channel. Requests may overlap (`submit` now,
    `collect` later): each gets its own region of the slot, which holds its inputs and then the
    reply's hidden states, and a call id that its reply echoes. Replies come back in order; one
    read while waiting for another is kept until collected. Only the verifier's decode thread
    calls it (a lock guards it anyway)."""

    kind = "shm"

    def __init__(self, address: str, authkey: bytes, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        self.slot: Slot | None = None
        self._retired: list[Slot] = []  # outgrown slots that replies in flight still point into
        self._next_id = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._arrived: dict[int, roles.DraftReply] = {}
        self._lock = threading.RLock()

    # ---- slot regions ------------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> int:
        """First fit among the regions in flight in the current slot; grows the slot if none."""
        nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if self.slot is not None:
            used = sorted(
                (f.offset, f.offset + f.size)
                for f in self._in_flight.values()
                if f.slot is self.slot
            )
            at = 0
            for lo, hi in used:
                if lo - at >= nbytes:
                    return at
                at = max(at, hi)
            if self.slot.size - at >= nbytes:
                return at
        in_use = sum(f.size for f in self._in_flight.values() if f.slot is self.slot)
        self._grow(2 * (in_use + nbytes))
        return 0

    def _grow(self, nbytes: int) -> None:
        size = max(MIN_SLOT_BYTES, 1 << max(0, nbytes - 1).bit_length())
        old, self.slot = self.slot, Slot(size)
        # the drafter switches slots after answering what was sent before: in order
        attach = roles.DraftAttach(shm_name=self.slot.name, size=self.slot.size)
        self.collect(self._send(roles.DraftRequest(attach=attach), self.slot, 0, 0, 0))
        self.slot.unlink()  # both sides have it mapped: the name is no longer needed
        if old is not None:
            self._retired.append(old)
            self._close_retired()

    def _close_retired(self) -> None:
        busy = {id(f.slot) for f in self._in_flight.values()}
        for old in [s for s in self._retired if id(s) not in busy]:
            self._retired.remove(old)
            old.close()

    # ---- requests ----------------------------------------------------------------------------
    def _send(self, req, slot, offset: int, size: int, sent_bytes: int) -> int:
        self._next_id += 1
        req.call_id = self._next_id
        try:
            self.conn.send_bytes(req.SerializeToString())
        except OSError as exc:
            raise ChannelBroken(f"drafter connection lost: {exc.__class__.__name__}") from None
        self._in_flight[req.call_id] = _InFlight(slot, offset, size, sent_bytes)
        return req.call_id

    def submit(self, req: roles.DraftRequest, arrays: list[mx.array], reply_bytes: int = 0) -> int:
        """Send `req` with `arrays` placed in the slot (their TensorRefs are filled in, in the
        order of `req`'s tensor fields) and room for a reply of `reply_bytes`; returns its id."""
        with self._lock:
            size = max(Slot.bytes_needed(arrays), reply_bytes)
            offset = self._allocate(size) if size else 0
            refs = self.slot.write(arrays, offset) if arrays else []
            _fill_refs(req, refs)
            if req.WhichOneof("op") == "draft":
                req.draft.reply_offset, req.draft.reply_capacity = offset, size
            sent = sum(a.nbytes for a in arrays)
            return self._send(req, self.slot, offset, size, sent)

    def collect(self, call_id: int) -> Answer:
        """The reply to `call_id` (waits for it); frees its region."""
        with self._lock:
            waited = None
            if call_id not in self._arrived:
                t0 = time.perf_counter()
                while call_id not in self._arrived:
                    self._read_one()
                waited = time.perf_counter() - t0
            return self._answer(call_id, waited)

    def call(self, req: roles.DraftRequest, arrays: list[mx.array], reply_bytes: int = 0) -> Answer:
        return self.collect(self.submit(req, arrays, reply_bytes))

    def discard(self, call_id: int) -> None:
        """Not interested in this reply any more: its region is freed once it has come."""
        with self._lock:
            if call_id in self._arrived:
                self._arrived.pop(call_id)
                self._release(call_id)
            elif call_id in self._in_flight:
                self._in_flight[call_id].discard = True

    def _read_one(self) -> None:
        try:
            if not self.conn.poll(self.timeout_s):
                raise ChannelBroken(f"the drafter did not answer within {self.timeout_s:.0f} s")
            reply = roles.DraftReply.FromString(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise ChannelBroken(f"drafter connection lost: {exc.__class__.__name__}") from None
        flight = self._in_flight.get(reply.call_id)
        if flight is None:
            raise ChannelBroken(f"the drafter answered an unknown call {reply.call_id}")
        if flight.discard:
            self._release(reply.call_id)
        else:
            self._arrived[reply.call_id] = reply

    def _release(self, call_id: int) -> None:
        if self._in_flight.pop(call_id).slot is not self.slot:
            self._close_retired()

    def _answer(self, call_id: int, waited: float | None = None) -> Answer:
        reply = self._arrived.pop(call_id)
        flight = self._in_flight[call_id]
        hidden = flight.slot.read(reply.hidden) if reply.HasField("hidden") else None  # copies
        self._release(call_id)
        moved = flight.sent_bytes + (hidden.nbytes if hidden is not None else 0)
        return Answer(reply, hidden, moved, waited)

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        for slot in [*self._retired, self.slot]:
            if slot is not None:
                slot.close()
        self._retired, self.slot = [], None


class ObjectStoreChannel:
    """Across hosts: each request is an actor call whose tensors go through the object store.
    Requests may overlap as on the shared-memory channel (the call's ObjectRef is the handle)."""

    kind = "object_store"

    def __init__(self, handle, timeout_s: float = 60.0):
        self.handle = handle
        self.client = f"o{secrets.token_hex(4)}"
        self.timeout_s = timeout_s
        self._next_id = 0
        self._in_flight: dict[int, tuple] = {}  # call id -> (ObjectRef, bytes sent)

    def submit(self, req, arrays, reply_bytes: int = 0) -> int:
        import ray

        refs = [
            roles.TensorRef(offset=i, shape=a.shape, dtype=dtype_name(a.dtype))
            for i, a in enumerate(arrays)
        ]
        _fill_refs(req, refs)
        self._next_id += 1
        req.call_id = self._next_id
        payload = ray.put([to_numpy(a) for a in arrays])
        ref = self.handle.serve_object_store.remote(self.client, req.SerializeToString(), payload)
        self._in_flight[req.call_id] = (ref, sum(a.nbytes for a in arrays))
        return req.call_id

    def collect(self, call_id: int) -> Answer:
        import ray

        ref, sent = self._in_flight.pop(call_id)
        ready, _ = ray.wait([ref], timeout=0)
        t0 = time.perf_counter()
        try:
            data, out = ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayError as exc:  # GetTimeoutError and RayActorError included
            # the actor died or is restarting (or its task failed): decode plainly meanwhile
            raise ChannelBroken(f"drafter call failed: {exc.__class__.__name__}") from None
        waited = None if ready else time.perf_counter() - t0
        reply = roles.DraftReply.FromString(data)
        hidden = None
        if reply.HasField("hidden"):
            hidden = from_numpy(out[0], reply.hidden.dtype)
        moved = sent + (hidden.nbytes if hidden is not None else 0)
        return Answer(reply, hidden, moved, waited)

    def call(self, req, arrays, reply_bytes: int = 0) -> Answer:
        return self.collect(self.submit(req, arrays, reply_bytes))

    def discard(self, call_id: int) -> None:
        self._in_flight.pop(call_id, None)

    def close(self) -> None:
        self._in_flight.clear()


def _fill_refs(req: roles.DraftRequest, refs: list[roles.TensorRef]) -> None:
    if req.WhichOneof("op") != "draft":
        return
    call = req.draft
    if len(refs) == 2:
        call.new_taps.CopyFrom(refs[0])
        call.block_embeds.CopyFrom(refs[1])
    elif len(refs) == 1:
        call.block_embeds.CopyFrom(refs[0])
