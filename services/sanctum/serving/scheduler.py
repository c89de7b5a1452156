"""Interleaving requests on one verifier: one worker thread owns MLX and runs one round of each
open request in turn, and one slice of each prompt still being prefilled (a long prompt pauses
the other streams for a slice at a time, not for all of it); request handlers only enqueue and
read their own ticket (as mlx-lm's server does). Preparing a request (validation, tokenization,
chat rendering) runs on a small pool of other threads first, so a large prompt never holds up the
rounds: no request delays another's next round by more than one round plus one prefill slice.
The same scheduler runs inline (in the serving process) and inside the verifier actor.
Ray-free and gRPC-free.

Contract: `submit` returns a `Ticket` at once (or raises `QueueFull` / `Unavailable`); the
ticket yields the request's chunks in order (the first from prefill, then one per round) and
ends, or raises the request's error (`InvalidRequest`, ...). `cancel` (or a passed deadline)
stops the request before its next round and frees its sequence.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import statistics
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..settings import ServeSettings
from .errors import InternalError, InvalidRequest, QueueFull, Unavailable
from .mlx_thread import MlxThread
from .requests import Chunk, GenerateRequest

if TYPE_CHECKING:  # the verifier imports MLX; the scheduler only passes its objects along
    from .verifier import Active, Prepared

log = logging.getLogger("sanctum.scheduler")

# Prompt tokens prefilled per turn of the worker loop before the decoding requests get a round,
# and fewer when they would take longer than PREFILL_SLICE_S, or, while others decode, than their
# turn of rounds takes (TURNS_KEPT), judged by the cost per token of the request's last slice:
# attention makes each token dearer as the context grows.
# (ServeSettings.prefill_slice, prefill_slice_ms: SANCTUM_PREFILL_SLICE, SANCTUM_PREFILL_SLICE_MS)
PREFILL_SLICE = 512
PREFILL_SLICE_S = 0.25
# a forward has a fixed cost too: fewer tokens would mostly pay that; and above the row counts
# that run compiled (gdn.COMPILE_MAX_ROWS), where each new count would trace a graph. Small
# enough that a slice between the running streams' rounds costs them about one round
# (docs/performance.md)
MIN_PREFILL_SLICE = 40
# a slice while others decode is sized to the median of their last few turns of rounds: one
# long turn (a round of wide looked-up blocks) does not double the next slice
TURNS_KEPT = 5
# A prompt of at most this many drafted blocks' tokens, arriving while others decode in shared
# rounds, rides in their rounds whole (a block's rows a round) instead of a prefill between
# them: its first token comes a round or two later, the others' streams never pause for it.
RIDE_ROUNDS = 4
# A round of newcomers' prompt tails alone (nobody decoding yet) waits at most this long for
# requests still being prepared (tokenized): a burst of clients then starts in one round, every
# tail in one forward, not the first prompt alone and the others a round later. Nobody's next
# token waits: the newcomers' first tokens at most this much, against a round they save.
BURST_WAIT_S = 0.01
# Threads that prepare requests (the tokenizer releases the GIL): two, so one huge prompt
# being tokenized does not hold up every other request's admission.
PREPARE_THREADS = 2


_NOT_LOGGED = contextlib.nullcontext()


class End:
    """Ticket item: the request is over (compare with isinstance: survives pickling)."""


END = End()


@dataclass
class Ticket:
    """The client's handle on one request in the scheduler, from `submit` to its end: its output
    queue (written by the worker thread, read by its handler), cancel flag and deadline. It
    holds the request as given, then the verifier's `Prepared` made from it (a reference: the
    request is not converted again until the verifier turns it into an engine Sequence)."""

    request: GenerateRequest
    mode: str = "streaming"
    deadline: float | None = None  # time.time() after which the request stops
    cancelled: threading.Event = field(default_factory=threading.Event)
    # where the worker thread puts the items: a queue the handler reads, or any object with
    # `put` (the verifier actor's socket sink, cluster/events.py)
    items: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    prepared: Prepared | None = None  # once a preparing thread made it

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def cancel(self) -> None:
        self.cancelled.set()

    def expired(self) -> bool:
        return self.cancelled.is_set() or (
            self.deadline is not None and time.time() > self.deadline
        )

    def next_batch(self, timeout: float | None = None) -> list:
        """Block for one item, then take whatever else is ready (Chunk | Exception | END)."""
        out = [self.items.get(timeout=timeout)]
        while not isinstance(out[-1], (End, BaseException)):
            try:
                out.append(self.items.get_nowait())
            except queue.Empty:
                break
        return out

    def __iter__(self):
        while True:
            item = self.items.get()
            if isinstance(item, End):
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    """Round-robin over up to `max_active` open requests; up to `max_queue` more wait.
    `load()` builds the verifier ON the worker thread: MLX streams belong to the thread that
    created them, so the thread that loads the models is the one that runs them."""

    def __init__(
        self,
        load,
        max_active: int = 8,
        max_queue: int = 64,
        prefill_slice: int = PREFILL_SLICE,
        prefill_slice_s: float = PREFILL_SLICE_S,
        max_batch: int = 1,
    ):
        self.max_batch = max(1, max_batch)  # requests whose rounds share one forward
        self._parked = threading.Event()
        self.max_active, self.max_queue = max(1, max_active), max(0, max_queue)
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._active: dict[str, tuple[Active, Ticket]] = {}
        self._preparing: set[str] = set()  # accepted, being tokenized: not yet _waiting
        self._opening: set[str] = set()  # admitted, being begun: not _waiting, not _active
        self._prefilling: dict[str, tuple[Active, Ticket]] = {}  # prompt tokens still to run
        self.prefill_slice = max(1, prefill_slice)
        self.prefill_slice_s = prefill_slice_s
        self._token_cost: dict[str, float] = {}  # request id -> seconds a token, its last slice
        self._last_token_cost: float | None = None  # any request's: for a first slice
        self._turns: deque[float] = deque(maxlen=TURNS_KEPT)  # the decoding requests' last turns
        self._tickets: dict[str, Ticket] = {}
        self._accepting = True
        self._stopped = False
        self.counters = {"cancelled": 0, "rejected": 0, "failed": 0, "finished": 0}
        # when set (a deque, by a bench): one (start, end, kind, detail) per piece of the
        # worker's work, on the monotonic clock, to say what filled a stream's gap (a round's
        # detail: [requests in it, tokens it committed])
        self.work_log: deque | None = None
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="sanctum-prep")
        self._mlx = MlxThread(load, lambda _: self._loop(), "sanctum-mlx", "the models")

    @classmethod
    def for_settings(cls, load, settings: ServeSettings) -> Scheduler:
        """The scheduler `sanctum serve` runs: its bounds and prefill slices from `settings`."""
        return cls(
            load,
            settings.max_active,
            settings.max_queue,
            settings.prefill_slice,
            settings.prefill_slice_ms / 1000.0,
            settings.max_batch,
        )

    @property
    def verifier(self):
        """The verifier `load` built (None until it has)."""
        return self._mlx.loaded

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the verifier is loaded; raises if loading failed."""
        self._mlx.wait_ready(timeout)

    # ---- handler side ------------------------------------------------------------------------
    def submit(
        self,
        req: GenerateRequest,
        mode: str = "streaming",
        deadline: float | None = None,
        sink=None,
    ) -> Ticket:
        """Accept `req` (its preparation starts on another thread); its items go to the returned
        ticket's queue, or to `sink.put`."""
        ticket = Ticket(
            req, mode, deadline, items=sink if sink is not None else queue.SimpleQueue()
        )
        with self._cv:
            if not self._accepting:
                raise Unavailable("the server is draining; no new requests")
            if req.request_id in self._tickets:
                raise InvalidRequest("request_id", f"{req.request_id!r} is already in use")
            if self._load() >= self.max_active + self.max_queue:
                self.counters["rejected"] += 1
                counts = self._counts()
                raise QueueFull(
                    f"queue full: {counts['active']} requests in progress and "
                    f"{counts['waiting']} waiting (at most {self.max_active} in progress and "
                    f"{self.max_queue} waiting); retry later"
                )
            self._preparing.add(req.request_id)
            self._tickets[req.request_id] = ticket
        self._prepare_pool.submit(self._prepare, ticket)
        return ticket

    def _prepare(self, ticket: Ticket) -> None:
        """On a preparing thread: tokenize, then queue the ticket for the model's thread."""
        rid = ticket.request_id
        with contextlib.suppress(RuntimeError):  # a failed load: answered below
            self._mlx.wait_ready()
        if self.verifier is None:
            return self._finish(rid, ticket, Unavailable("the models failed to load"))
        try:
            prepared = self.verifier.prepare(ticket.request)
        except InvalidRequest as exc:
            return self._finish(rid, ticket, exc)
        except Exception as exc:
            return self._fail(rid, None, ticket, exc, "in preparation")
        with self._cv:
            self._preparing.discard(rid)
            if self._stopped:  # the worker thread may be parked for good: end it here
                ticket.items.put(Unavailable("the server is shutting down"))
                self._tickets.pop(rid, None)
                return
            ticket.prepared = prepared
            self._waiting.append(ticket)
            self._cv.notify()

    def cancel(self, request_id: str) -> bool:
        with self._cv:
            ticket = self._tickets.get(request_id)
            if ticket is None:
                return False
            ticket.cancel()
            self._cv.notify()
            return True

    def stats(self) -> dict:
        with self._cv:
            return {**self._counts(), **self.counters}

    def _counts(self) -> dict:
        """Requests in progress (begun, prefilling or decoding) and waiting (being prepared,
        or queued for a slot): the same figures in stats and in QueueFull's message."""
        active = len(self._active) + len(self._opening) + len(self._prefilling)
        return {"active": active, "waiting": len(self._waiting) + len(self._preparing)}

    def stop_accepting(self) -> None:
        with self._cv:
            self._accepting = False

    def idle(self) -> bool:
        with self._cv:
            return self._load() == 0

    def _load(self) -> int:
        counts = self._counts()
        return counts["active"] + counts["waiting"]

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel everything; the worker thread closes the open requests, then parks."""
        with self._cv:
            self._accepting = False
            for t in self._tickets.values():
                t.cancel()
            self._stopped = True
            self._cv.notify()
        self._prepare_pool.shutdown(wait=False)
        if self._mlx.serving:
            self._parked.wait(timeout)

    # ---- worker side -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._waiting or self._active or self._prefilling):
                    self._cv.wait()
                if self._stopped and not (self._active or self._waiting or self._prefilling):
                    # parked, not ended: with mlx 0.32 (Linux) the process aborts at exit
                    # ("terminate called without an active exception") when the MLX thread
                    # has exited, or is still running, as the interpreter finalizes
                    self._parked.set()
                    self._cv.wait_for(lambda: False)
            # one slice of each prompt being prefilled, then one round of each decoding request:
            # a long prompt delays the others' next tokens by a slice, not by all of it
            self._admit()
            self._prefill_slices(list(self._prefilling))
            if self._waiting and self._active:
                # those that came during the slices join this round (a short prompt rides in
                # it) rather than the next: a burst of clients starts in one round, not two
                self._prefill_slices(self._admit())
            if self.max_batch > 1 and self._burst_forming():
                self._prefill_slices(self._admit())
            t0 = time.perf_counter()
            if self.max_batch > 1:
                self._rounds_batched()
            else:
                for request_id in list(self._active):
                    self._reap_cancelled()
                    if request_id in self._active:
                        with self._logged("round", detail := [1, 0]):
                            detail[1] = self._round(request_id)
            if self._active:  # the decoding requests' turn: what a prefill slice may add to it
                self._turns.append(time.perf_counter() - t0)

    def _admit(self) -> list[str]:
        """Open waiting requests while fewer than `max_active` are open; their ids."""
        with self._cv:
            admit = []
            busy = len(self._active) + len(self._prefilling)
            while self._waiting and busy + len(admit) < self.max_active:
                admit.append(self._waiting.popleft())
            self._opening.update(t.request_id for t in admit)
        for ticket in admit:
            with self._logged("open", ticket.request_id):
                self._open(ticket)
        return [t.request_id for t in admit]

    def _prefill_slices(self, request_ids: list[str]) -> None:
        """A slice of each of these requests' prompts (those still prefilling)."""
        for request_id in request_ids:
            self._reap_cancelled()
            if request_id in self._prefilling:
                left = self._prefilling[request_id][0].prompt_left
                with self._logged("prefill", (request_id, left)):
                    self._prefill(request_id)

    def _rounds_batched(self) -> None:
        """One round of every decoding request, up to `max_batch` of them in each shared
        round (one drafter forward, one target forward: Verifier.step_batch)."""
        ids = list(self._active)
        for g in range(0, len(ids), self.max_batch):
            self._reap_cancelled()
            group = [r for r in ids[g : g + self.max_batch] if r in self._active]
            if len(group) == 1:
                with self._logged("round", detail := [1, 0]):
                    detail[1] = self._round(group[0])
            elif group:  # (the work log's detail: requests in the round, tokens it committed)
                with self._logged("round", detail := [len(group), 0]):
                    detail[1] = self._round_batch(group)

    def _logged(self, kind: str, detail):
        """A context that times a piece of the worker's work into `work_log`, when one is set
        (else one that does nothing: every round passes here)."""
        return _NOT_LOGGED if self.work_log is None else self._timed(kind, detail)

    @contextlib.contextmanager
    def _timed(self, kind: str, detail):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.work_log.append((t0, time.monotonic(), kind, detail))

    def _finish(self, request_id: str, ticket: Ticket, item=END) -> None:
        with self._cv:
            self._active.pop(request_id, None)
            self._prefilling.pop(request_id, None)
            self._opening.discard(request_id)
            self._preparing.discard(request_id)
            self._tickets.pop(request_id, None)
            self._token_cost.pop(request_id, None)
        ticket.items.put(item)

    def _reap_cancelled(self) -> None:
        """Close every request that was cancelled or ran out of time: no further round."""
        for request_id, (act, ticket) in list(self._active.items()):
            if ticket.expired():
                self._close(act)
                self.counters["cancelled"] += 1
                self._finish(request_id, ticket)
        for request_id, (act, ticket) in list(self._prefilling.items()):
            if ticket.expired():  # nothing to save: the prompt was not even read to the end
                self._close(act, save=False)
                self.counters["cancelled"] += 1
                self._finish(request_id, ticket)

    def _close(self, act: Active, save: bool = True) -> None:
        try:
            self.verifier.close(act, save=save)
        except Exception:
            log.exception("closing request %s failed", act.req.request_id)

    def _open(self, ticket: Ticket) -> None:
        rid = ticket.request_id
        if ticket.expired():
            self.counters["cancelled"] += 1
            return self._finish(rid, ticket)
        try:
            act = self.verifier.begin(ticket.prepared, ticket.mode)
        except InvalidRequest as exc:
            return self._finish(rid, ticket, exc)
        except Exception as exc:
            return self._fail(rid, None, ticket, exc, "at open")
        with self._cv:  # one step from "opening" to "prefilling": never counted twice
            self._prefilling[rid] = (act, ticket)
            self._opening.discard(rid)

    def _fail(
        self, request_id: str, act: Active | None, ticket: Ticket, exc: Exception, where: str
    ) -> None:
        """A request broke inside the engine: free its sequence if it has one (its cache is not
        saved), tell its caller (InternalError; the other requests go on)."""
        log.exception("request %s failed %s", request_id, where)
        if act is not None:
            self._close(act, save=False)
        self.counters["failed"] += 1
        self._finish(request_id, ticket, InternalError(f"{exc.__class__.__name__}: {exc}"))

    def _slice(self, request_id: str) -> int:
        """Prompt tokens for the request's next slice: PREFILL_SLICE, or what fits the time:
        `prefill_slice_s`, and while other requests decode no longer than their turn of rounds
        takes (the median of their last few), so a slice at most doubles the gap between their
        chunks."""
        cost = self._token_cost.get(request_id, self._last_token_cost)
        if not cost:
            return self.prefill_slice
        budget = self.prefill_slice_s
        if self._active and self._turns:
            budget = min(budget, statistics.median(self._turns))
        fits = int(budget / cost)
        return max(min(MIN_PREFILL_SLICE, self.prefill_slice), min(self.prefill_slice, fits))

    def _prefill(self, request_id: str) -> None:
        act, ticket = self._prefilling[request_id]
        budget = self._slice(request_id)
        left = act.prompt_left
        # while other requests decode in shared rounds, the prompt's last tokens ride in their
        # forwards (none of their own between two of the others' rounds): a short prompt
        # (RIDE_ROUNDS blocks) all of it, a round's block at a time; a longer one its last block.
        # So too in a burst (others arriving with it): their tails ride together, one forward
        # for all, not a prefill each (a tail alone in its round is prefilled there, as here)
        ride = 0
        if self.max_batch > 1 and (self._active or self._others_coming(request_id)):
            ride = self.verifier.ride_width
            ride = left if left <= RIDE_ROUNDS * ride else ride
        t0 = time.perf_counter()
        try:
            chunk = self.verifier.prefill_some(act, budget, ride)
        except Exception as exc:
            return self._fail(request_id, act, ticket, exc, "in prefill")
        tokens = left - act.prompt_left
        if tokens > 0:
            cost = (time.perf_counter() - t0) / tokens
            self._token_cost[request_id] = self._last_token_cost = cost
        if chunk is None:
            if act.riding:  # its first chunk comes from its first round
                with self._cv:
                    self._active[request_id] = (act, ticket)
                    self._prefilling.pop(request_id, None)
            return  # more of the prompt next time round
        ticket.items.put(chunk)
        if act.finished:
            self._close(act)
            self.counters["finished"] += 1
            return self._finish(request_id, ticket)
        with self._cv:
            self._active[request_id] = (act, ticket)
            self._prefilling.pop(request_id, None)

    def _burst_forming(self) -> bool:
        """True once requests being prepared wait to be opened, when every open request is a
        newcomer whose prompt tail rides its first round; waits for them at most BURST_WAIT_S."""
        with self._cv:
            if not (self._preparing and self._active):
                return False
            if any(not act.riding for act, _ in self._active.values()):
                return False
            self._cv.wait_for(lambda: not self._preparing or self._stopped, BURST_WAIT_S)
            return bool(self._waiting)

    def _others_coming(self, request_id: str) -> bool:
        """Whether requests other than this one are being prepared, wait, or are being
        opened or prefilled: they may share this one's first round."""
        with self._cv:
            return bool(
                self._preparing
                or self._waiting
                or self._opening
                or set(self._prefilling) - {request_id}
            )

    def _round(self, request_id: str) -> int:
        """One round of one request; returns the tokens it committed."""
        act, ticket = self._active[request_id]
        try:
            chunk: Chunk = self.verifier.step(act)
        except Exception as exc:
            self._fail(request_id, act, ticket, exc, "in a round")
            return 0
        self._after_round(request_id, act, ticket, chunk)
        return len(chunk.token_ids)

    def _round_batch(self, request_ids: list[str]) -> int:
        """One shared round of the requests; returns the tokens it committed."""
        entries = [self._active[r] for r in request_ids]
        try:
            chunks = self.verifier.step_batch([act for act, _ in entries])
        except Exception as exc:  # which request broke it is unknown: each is told
            for request_id, (act, ticket) in zip(request_ids, entries):
                self._fail(request_id, act, ticket, exc, "in a batched round")
            return 0
        for request_id, (act, ticket), chunk in zip(request_ids, entries, chunks):
            self._after_round(request_id, act, ticket, chunk)
        return sum(len(chunk.token_ids) for chunk in chunks if chunk is not None)

    def _after_round(
        self, request_id: str, act: Active, ticket: Ticket, chunk: Chunk | None
    ) -> None:
        if chunk is None:  # a prompt tail riding in shared rounds: its first chunk comes later
            return
        ticket.items.put(chunk)
        if act.finished:
            self._close(act)
            self.counters["finished"] += 1
            self._finish(request_id, ticket)
