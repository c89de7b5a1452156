"""The drafter role, and the verifier's proxy to it.

Where the vocabulary-sized weights live: with the VERIFIER. The drafter actor loads only the
drafter body (`load_drafter(parts="body")`: fc, its decoder layers, final norm; no embedding,
no LM head). The verifier already holds the target's embedding and LM head (the largest weights
of a large-vocabulary model) and owns the drafter head (`parts="head"`: the target's LM head
bound, not copied, plus DFlash 2's candidate selector). Each round the verifier sends the block's
input embeddings [L, H] and the taps of newly committed rows [C, n_taps*H]; the drafter returns
the final hidden states [L-1, H]; the verifier projects them to logits and picks the drafts.
So no process holds a second copy of the vocabulary weights, and the per-round payload does not
grow with the vocabulary as logits would.

`DraftService` (Ray-free) is the drafter actor's core: the body with one context cache per
(client, sequence). `RemoteDraftPeer` implements the engine's pipelined `DraftPeer` over a
transport channel (shared memory on one host, the object store across hosts): `submit` sends a
request and returns, `collect` waits for its reply, so the verifier asks for a sequence's next
block before its rollback and its stream and finds the answer (mostly) ready. When the drafter
dies it raises `DraftUnavailable` (the decoder then steps plainly) and reconnects in the
background once the actor has restarted; a sequence opened again starts a fresh session, and
the decoder sends it the context its sequence keeps (engine/decode/taps.py), so speculation resumes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from ..engine.decode.peer import DraftUnavailable, LocalDraftPeer
from ..settings import TRANSPORTS
from ..wire.gen import roles_pb2 as roles
from .transport import ChannelBroken, ObjectStoreChannel, ShmChannel

log = logging.getLogger("sanctum.drafter")


class DraftService:
    """The drafter body serving DraftRequests; sessions are keyed by (client, sequence)."""

    def __init__(self, drafter):
        self.peer = LocalDraftPeer(drafter)  # used from the one MLX thread only

    def handle(
        self, client: str, req: roles.DraftRequest, read
    ) -> tuple[roles.DraftReply, mx.array | None]:
        op = req.WhichOneof("op")
        reply = roles.DraftReply()
        try:
            if op == "open":
                self.peer.open(f"{client}/{req.open.seq_id}")
            elif op == "close":
                self.peer.close(f"{client}/{req.close.seq_id}")
            elif op == "draft":
                call = req.draft
                taps = read(call.new_taps) if call.HasField("new_taps") else None
                embeds = read(call.block_embeds)
                t0 = time.perf_counter()
                if call.batch_seq_ids:  # a shared round's blocks: one body forward
                    hidden = self.peer.draft_batch(
                        [f"{client}/{s}" for s in call.batch_seq_ids],
                        _split_rows(taps, list(call.batch_tap_rows)),
                        embeds,
                        [int(x) for x in call.batch_starts],
                    )
                else:
                    hidden = self.peer.draft(
                        f"{client}/{call.seq_id}", taps, embeds, int(call.start)
                    )
                mx.eval(hidden)
                reply.compute_ms = (time.perf_counter() - t0) * 1000.0
                return reply, hidden
            else:
                reply.error = f"unknown drafter op {op!r}"
        except DraftUnavailable as exc:
            reply.not_open, reply.error = True, str(exc)
        except Exception as exc:
            log.exception("drafter: %s failed", op)
            reply.error = f"{exc.__class__.__name__}: {exc}"
        return reply, None

    def drop_client(self, client: str) -> None:
        for key in [k for k in self.peer.caches if k.startswith(f"{client}/")]:
            self.peer.caches.pop(key, None)

    @property
    def num_sessions(self) -> int:
        return len(self.peer.caches)


def _split_rows(taps: mx.array | None, rows: list[int]) -> list[mx.array | None]:
    """The N sequences' tap rows, sent one after the other, apart again (None: none)."""
    out, at = [], 0
    for n in rows:
        out.append(taps[at : at + n] if n else None)
        at += n
    return out


@dataclass
class PendingDraft:
    """A draft request in flight on the channel."""

    call_id: int
    generation: int  # the connection it was sent on
    seq_id: str


@dataclass
class PendingBatch:
    """One draft request in flight for several sequences' blocks (a shared round's)."""

    call: PendingDraft
    open_parts: int  # parts neither collected nor discarded
    hidden: mx.array | None = None  # [N, L-1, H] once collected


@dataclass
class PendingPart:
    """One sequence's share of a PendingBatch: what `collect` and `discard` take for it."""

    batch: PendingBatch
    index: int


class RemoteDraftPeer:
    """The engine's DraftPeer, talking to a drafter actor (see the module docstring)."""

    RETRY_S = 0.25  # how often to look for a restarted drafter while it is away

    def __init__(
        self,
        handle,
        node_id: str,
        transport: str = "auto",
        timeout_s: float = 60.0,
        connect_timeout_s: float | None = 300.0,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be auto, shm or object_store, got {transport!r}")
        self.handle, self.node_id, self.transport = handle, node_id, transport
        self.timeout_s = timeout_s
        self.channel = None
        self.generation = 0  # bumped on every (re)connection
        self._connecting = None  # ObjectRef of a pending `connect`
        self._last_try = 0.0
        self.sessions: dict[str, int] = {}  # seq_id -> generation it was opened on
        self.stats = {
            "calls": 0,
            "compute_s": 0.0,
            "wait_s": 0.0,
            "submit_s": 0.0,
            "hidden": 0,
            "latency_calls": 0,
            "transport_s": 0.0,
            "bytes": 0,
            "reconnects": 0,
            "failures": 0,
        }
        self.info: roles.DrafterInfo | None = None
        self._lock = threading.Lock()
        self._start_connect()
        if connect_timeout_s:
            self._poll_connect(block_s=connect_timeout_s)

    # ---- connection ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """True when a channel is up (looks for a restarted drafter without waiting)."""
        if self.channel is None:
            self._poll_connect()
        return self.channel is not None

    @property
    def kind(self) -> str:
        return self.channel.kind if self.channel is not None else "down"

    def _start_connect(self) -> None:
        self._connecting = self.handle.connect.remote()
        self._last_try = time.monotonic()

    def _poll_connect(self, block_s: float = 0.0) -> None:
        with self._lock:  # the decode thread and a stats call may both look
            self._poll_connect_locked(block_s)

    def _poll_connect_locked(self, block_s: float) -> None:
        import ray

        if self.channel is not None:
            return
        if self._connecting is None:
            if time.monotonic() - self._last_try < self.RETRY_S:
                return
            self._start_connect()
        ready, _ = ray.wait([self._connecting], timeout=block_s)
        if not ready:
            return
        ref, self._connecting = self._connecting, None
        try:
            info = roles.DrafterInfo.FromString(ray.get(ref))
            same_host = info.node_id == self.node_id
            if self.transport == "shm" or (self.transport == "auto" and same_host):
                channel = ShmChannel(info.address, info.authkey, self.timeout_s)
            else:
                channel = ObjectStoreChannel(self.handle, self.timeout_s)
        except Exception as exc:
            log.warning(
                "drafter: connect failed (%s); decoding plainly meanwhile", exc.__class__.__name__
            )
            self._last_try = time.monotonic()
            return
        self.channel, self.info = channel, info
        self.generation += 1
        if self.generation > 1:
            self.stats["reconnects"] += 1
            log.info(
                "drafter: reconnected (pid %d, %s); speculation resumes", info.pid, channel.kind
            )

    def _broken(self, exc: Exception) -> DraftUnavailable:
        log.warning("drafter: %s; decoding plainly until it is back", exc)
        with self._lock:
            if self.channel is not None:
                self.channel.close()
            self.channel = None
            self.stats["failures"] += 1
            self._start_connect()
        return DraftUnavailable(str(exc))

    def _channel(self):
        if self.channel is None:
            self._poll_connect()
            if self.channel is None:
                raise DraftUnavailable("the drafter is restarting")
        return self.channel

    def _check(self, answer) -> None:
        reply = answer.reply
        if reply.not_open or reply.error:
            raise DraftUnavailable(reply.error or "sequence not open on the drafter")

    def _call(self, req: roles.DraftRequest) -> None:
        """A control request (open, close), answered before this returns."""
        try:
            self._check(self._channel().call(req, []))
        except ChannelBroken as exc:
            raise self._broken(exc) from None

    # ---- DraftPeer ---------------------------------------------------------------------------
    pipelined = True  # submit, then collect: the verifier works while the drafter computes

    def open(self, seq_id: str) -> bool:
        """A session for `seq_id` on the drafter: always a fresh one (its context empty)."""
        self._call(roles.DraftRequest(open=roles.DraftOpen(seq_id=seq_id)))
        self.sessions[seq_id] = self.generation
        return True

    def submit(
        self, seq_id: str, new_taps: mx.array | None, block_embeds: mx.array, start: int
    ) -> PendingDraft:
        """Send a draft request; `collect` its hidden states [L-1, H] later."""
        if self.sessions.get(seq_id) != self.generation or self.channel is None:
            # the drafter restarted since: the decoder opens a fresh session and resends
            raise DraftUnavailable("the drafter restarted; the sequence is opened again")
        arrays = [new_taps, block_embeds] if new_taps is not None else [block_embeds]
        mx.eval(arrays)  # the taps/embeddings' own compute is not transport (inline does it too)
        # room for the reply: [L-1, H] hidden states, at most 4 bytes an element
        reply_bytes = 4 * block_embeds.shape[0] * block_embeds.shape[-1]
        call = roles.DraftCall(seq_id=seq_id, start=int(start))
        t0 = time.perf_counter()
        try:
            call_id = self._channel().submit(roles.DraftRequest(draft=call), arrays, reply_bytes)
        except ChannelBroken as exc:
            raise self._broken(exc) from None
        self.stats["submit_s"] += time.perf_counter() - t0
        return PendingDraft(call_id, self.generation, seq_id)

    def collect(self, pending: PendingDraft | PendingPart) -> mx.array:
        """The hidden states of a submitted draft (waits for them)."""
        if isinstance(pending, PendingPart):
            batch = pending.batch
            if batch.hidden is None:
                batch.hidden = self.collect(batch.call)
            batch.open_parts -= 1
            return batch.hidden[pending.index]
        if pending.generation != self.generation or self.channel is None:
            raise DraftUnavailable("the drafter restarted while drafting")
        try:
            answer = self.channel.collect(pending.call_id)
        except ChannelBroken as exc:
            raise self._broken(exc) from None
        self._check(answer)
        compute = answer.reply.compute_ms / 1000.0
        s = self.stats
        s["calls"] += 1
        s["compute_s"] += compute
        s["bytes"] += answer.moved
        if answer.waited_s is None:
            s["hidden"] += 1  # the reply had come while the verifier was busy: no wait at all
        else:
            s["wait_s"] += answer.waited_s
            # waited for all of it (the call was sent just before): the channel's own latency
            if answer.waited_s >= compute:
                s["latency_calls"] += 1
                s["transport_s"] += answer.waited_s - compute
        return answer.hidden

    def discard(self, pending: PendingDraft | PendingPart) -> None:
        """Drop a submitted draft nobody will collect (the request ended)."""
        if isinstance(pending, PendingPart):  # the call goes once no part wants it
            batch = pending.batch
            batch.open_parts -= 1
            if batch.open_parts == 0 and batch.hidden is None:
                self.discard(batch.call)
            return
        if pending.generation == self.generation and self.channel is not None:
            self.channel.discard(pending.call_id)

    def draft(
        self, seq_id: str, new_taps: mx.array | None, block_embeds: mx.array, start: int
    ) -> mx.array:
        """new_taps [C, n_taps*H], block_embeds [L, H] -> hidden [L-1, H]."""
        return self.collect(self.submit(seq_id, new_taps, block_embeds, start))

    def submit_batch(
        self, seq_ids: list[str], new_taps: list, block_embeds: mx.array, starts: list[int]
    ) -> list[PendingPart]:
        """`submit` for N open sequences in one call, drafted in one body forward there
        (LocalDraftPeer.draft_batch): block_embeds [N, L, H]; `collect` each sequence's part
        ([L-1, H]) later."""
        if self.channel is None or any(self.sessions.get(s) != self.generation for s in seq_ids):
            raise DraftUnavailable("the drafter restarted; the sequences are opened again")
        rows = [0 if t is None else int(t.shape[0]) for t in new_taps]
        taps = mx.concatenate([t for t in new_taps if t is not None]) if any(rows) else None
        arrays = [taps, block_embeds] if taps is not None else [block_embeds]
        mx.eval(arrays)
        N, L, H = block_embeds.shape
        call = roles.DraftCall(
            batch_seq_ids=seq_ids, batch_starts=[int(s) for s in starts], batch_tap_rows=rows
        )
        t0 = time.perf_counter()
        try:
            call_id = self._channel().submit(roles.DraftRequest(draft=call), arrays, 4 * N * L * H)
        except ChannelBroken as exc:
            raise self._broken(exc) from None
        self.stats["submit_s"] += time.perf_counter() - t0
        batch = PendingBatch(PendingDraft(call_id, self.generation, ",".join(seq_ids)), N)
        return [PendingPart(batch, n) for n in range(N)]

    def draft_batch(
        self, seq_ids: list[str], new_taps: list, block_embeds: mx.array, starts: list[int]
    ) -> mx.array:
        """`submit_batch` and wait: hidden [N, L-1, H]."""
        parts = self.submit_batch(seq_ids, new_taps, block_embeds, starts)
        return mx.stack([self.collect(part) for part in parts])

    def close(self, seq_id: str) -> None:
        if self.sessions.pop(seq_id, None) == self.generation and self.channel is not None:
            try:
                self._call(roles.DraftRequest(close=roles.DraftClose(seq_id=seq_id)))
            except DraftUnavailable:
                pass

    def summary(self) -> dict:
        s = self.stats
        calls = max(1, s["calls"])
        return {
            "available": self.available,
            "transport": self.kind,
            "draft_calls": s["calls"],
            # the channel's latency (round trip minus compute), from calls waited on whole
            "transport_ms_per_call": 1000.0 * s["transport_s"] / max(1, s["latency_calls"]),
            "drafter_compute_ms_per_call": 1000.0 * s["compute_s"] / calls,
            # what the verifier's thread really spent on the drafter: sending plus waiting
            "drafter_wait_ms_per_call": 1000.0 * (s["wait_s"] + s["submit_s"]) / calls,
            "hidden_calls": s["hidden"],  # answered before the verifier asked: fully overlapped
            "bytes_per_call": s["bytes"] / calls,
            "reconnects": s["reconnects"],
        }
