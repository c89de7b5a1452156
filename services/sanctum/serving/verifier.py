"""The verifier role: a request from text to committed chunks on the target, resuming from the
prompt cache and saving back to it, speculating through a drafter peer when there is one.

Ray-free and gRPC-free: the cluster's verifier actor wraps this object, and inline mode uses it
as is. Its peers (drafter body, ladder store) are plain objects or actor proxies; it cannot tell.
Requests are prepared (validated, tokenized, chat rendered: no MLX, any thread), opened, stepped
one round at a time (so a scheduler can interleave them) and closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ..cache.ladder import choose_rungs, make_entry, prefill_stops, restore_into
from ..cache.store import ResumePlan
from ..engine.decode.decoder import Decoder
from ..engine.decode.generate import make_key
from ..engine.decode.peer import DraftPeer
from ..engine.decode.policy import DecodePolicy
from ..engine.decode.rounds import BatchDecoder
from ..engine.decode.sampling import acceptance_length
from ..engine.decode.sequence import Sequence
from ..engine.model.drafter import Drafter
from ..engine.model.target import Target, VerifyTape
from ..tokenizer import Reencoder, TextStream, message_starts, render_chat
from .requests import (
    Chunk,
    GenerateRequest,
    Limits,
    Usage,
    check_prompt_length,
    longest_token_chars,
    validate,
)
from .stats import Counters

log = logging.getLogger("sanctum.verifier")


@dataclass
class ReencodingWatch:
    """Where the next turn's prompt will stop matching this request's entry, and the recurrent
    state there (a rung at save time).

    A chat client sends the reply back as text, and the next turn's template re-encodes it.
    A generated token sequence is often not the tokenizer's own encoding of its text (a model
    may emit "\n   " where the encoder gives "\n" + "   "), so the next prompt leaves the entry
    at the first such place, inside the completion, where no rung sits: the resume would fall
    back to the prompt boundary. After each round the completion is re-encoded; at the first
    difference that later text can no longer change, the state comes from one of the last two
    rounds (any row of a verify tape, or a plain step's end). The re-encoding covers only the
    text since the last settled piece boundary (Reencoder), so the watch runs to the end."""

    prompt_len: int
    reencoder: Reencoder
    recent: list = field(default_factory=list)  # the last rounds' (start, end, tape | state)
    done: bool = False
    position: int | None = None  # cached tokens of the next turn's common prefix
    state: list | None = None  # the GDN states there

    def observe(self, decoder: Decoder, seq: Sequence, before: int, step) -> None:
        after, state = decoder.committed_state(seq)  # a queued plain step is not committed
        if step.stats is not None and step.stats.bs > 1 and seq.last_tape is not None:
            self.recent.append((before, after, seq.last_tape))
        else:
            self.recent.append((after, after, state))
        del self.recent[:-2]  # the state of rows committed before these rounds is gone
        first = self.reencoder.first_difference(seq.completion, final=seq.finished is not None)
        self.done = first is not None or seq.finished is not None or self.reencoder.exhausted
        if first is None:
            return
        position = self.prompt_len + first
        for start, end, saved in self.recent:
            if isinstance(saved, VerifyTape) and start <= position <= end:
                self.position, self.state = position, saved.recurrent_state_at(position - start)
            elif position == end:
                self.position, self.state = position, saved
            else:
                continue
            return


@dataclass(frozen=True)
class Prepared:
    """A request after its text work (validated, tokenized, chat rendered), done by
    `Verifier.prepare` on any thread, without MLX. It waits on its scheduler `Ticket` for a
    decoding slot; then its `Active` holds it for the request's life, so the request and its
    prompt are converted once and referenced from then on, never copied."""

    req: GenerateRequest
    prompt_ids: list[int]
    message_starts: list[int]
    started: float  # time.perf_counter() when preparation began (TTFT counts from there)


@dataclass
class Active:
    """One open request's live state on the model's thread, from `Verifier.begin` to `close`:
    its engine `Sequence` (the request's one conversion into the engine's terms), text stream,
    random key, usage so far and cache plan. What it was asked is its `prepared`'s."""

    prepared: Prepared
    seq: Sequence
    stream: TextStream
    key: mx.array
    usage: Usage
    plan: ResumePlan
    captured: dict = field(default_factory=dict)  # rung position -> GDN states from prefill
    stops: tuple = ()  # where prefill must pause to capture a rung (absolute positions)
    watch: ReencodingWatch | None = None  # chat requests with a cache: see ReencodingWatch
    spec_rounds: int = 0  # speculative rounds (their block sizes may differ: adaptive width)

    @property
    def req(self) -> GenerateRequest:
        return self.prepared.req

    @property
    def finished(self) -> bool:
        return self.seq.finished is not None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill (a riding tail's too)."""
        return len(self.prepared.prompt_ids) - len(self.seq.cached_tokens)

    @property
    def riding(self) -> bool:
        """Its prompt's tail waits to run in its first round (`Verifier.prefill_some`'s
        `ride`): it takes rounds, and its first chunk comes from the first."""
        return self.seq.tail is not None


class Verifier:
    """Owns the target, its live caches, and the decode loop."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        peer: DraftPeer | None = None,
        store=None,
        ladder_depth: int = 4,
        kv_mode: str = "fp16",
        block_size: int | None = None,
        max_tokens_limit: int = 4096,
        ladder_bytes: int = 0,
        policy: DecodePolicy | None = None,
    ):
        self.target = target
        self.decoder = BatchDecoder(target, drafter, peer, block_size, policy)
        self.store = store
        self.ladder_depth = ladder_depth
        self.ladder_bytes = ladder_bytes  # rung bytes per conversation (0: by depth alone)
        self.kv_mode = kv_mode
        self.limits = Limits(
            target.vocab_size,
            target.max_context,
            max_tokens_limit,
            longest_token_chars(target.tokenizer),
        )
        self.eos_ids = set(target.tokenizer.eos_token_ids)
        self.counters = Counters()  # since start: read by Stats (serving_stats)
        self.model_id = str(target.path) if target.path else f"model-{id(target):x}"
        self.warmed: dict[int, float] = {}  # batch size -> seconds its shared rounds took at load

    def model_key(self, kv_mode: str) -> str:
        return f"{self.model_id}|{kv_mode}"

    # ---- request lifecycle ---------------------------------------------------------------
    def tokenize(self, req: GenerateRequest) -> tuple[list[int], list[int]]:
        """Prompt token ids, and message start positions (for chat requests)."""
        tok = self.target.tokenizer
        if req.prompt_ids is not None:
            return list(req.prompt_ids), []
        if req.messages is not None:
            messages = [dict(m) for m in req.messages]
            text = render_chat(tok, messages)
            ids = tok.encode(text, add_special_tokens=False)
            return ids, message_starts(tok, messages, ids)
        return tok.encode(req.prompt, add_special_tokens=False), []

    def open(self, req: GenerateRequest, mode: str = "sync") -> tuple[Active, Chunk]:
        """Validate, resume from the cache, prefill (stopping at rungs), commit the first token."""
        act = self.begin(self.prepare(req), mode)
        chunk = None
        while chunk is None:
            chunk = self.prefill_some(act)
        return act, chunk

    def prepare(self, req: GenerateRequest) -> Prepared:
        """Validate and tokenize (render a chat, find its message starts): text work only, no
        MLX and no shared state, so any thread may run it and the model's thread never waits on
        a large prompt. Raises InvalidRequest."""
        started = time.perf_counter()
        validate(req, self.limits)
        prompt_ids, starts = self.tokenize(req)
        check_prompt_length(len(prompt_ids), req, self.limits)
        return Prepared(req, prompt_ids, starts, started)

    def begin(self, prep: Prepared, mode: str = "sync") -> Active:
        """Resume a prepared request from the cache (on the model's thread); the prompt's
        remaining tokens are then prefilled by `prefill_some` (in slices, so a scheduler can run
        other requests' rounds between)."""
        req, prompt_ids, starts = prep.req, prep.prompt_ids, prep.message_starts
        kv = req.kv_mode or self.kv_mode
        cached = self.store is not None and req.use_cache
        stream = TextStream(self.target.tokenizer, list(req.stop))
        # the request's constants, on its sequence: the sampling parameters built (and checked) once
        seq = self.decoder.new_sequence(
            req.request_id,
            kv,
            req.sampling(),
            req.max_tokens,
            self.eos_ids,
            stream.check,
            keep_taps=cached,
        )
        plan = ResumePlan(0, 0)
        if cached:
            plan = self._plan(kv, prompt_ids)
        if plan.resumed_at:
            restore_into(self.target, seq.cache, plan)
            seq.cached_tokens = list(prompt_ids[: plan.resumed_at])
            if plan.taps is not None and self.decoder.head is not None:
                seq.taps.add(plan.taps)
            else:  # not saved with the entry: the drafter's context starts here
                seq.taps.start_at(plan.resumed_at)
        usage = Usage(
            prompt_tokens=len(prompt_ids),
            cached_tokens=plan.resumed_at,
            cache_hit_ratio=round(plan.resumed_at / len(prompt_ids), 4),
            requested_lcp=plan.requested_lcp,
            resumed_at=plan.resumed_at,
            kv=kv,
            mode=mode,
        )
        act = Active(prep, seq, stream, make_key(req.seed), usage, plan)
        if cached:  # (a request that is not saved takes no rungs: its prefill never pauses)
            act.stops = prefill_stops(self.ladder_depth, len(prompt_ids), plan.resumed_at, starts)
        if cached and req.messages is not None:
            act.watch = ReencodingWatch(len(prompt_ids), Reencoder(self.target.tokenizer))
        log.info(
            "ladder resume: kv=%s mode=%s prompt_tokens=%d requested_lcp=%d resumed_at=%d "
            "recovered=%d prefix_cached=%d cache_hit_ratio=%.4f",
            kv,
            mode,
            len(prompt_ids),
            plan.requested_lcp,
            plan.resumed_at,
            plan.resumed_at,
            plan.resumed_at,
            usage.cache_hit_ratio,
        )
        self.counters.opened(len(prompt_ids), plan.resumed_at)
        return act

    @property
    def ride_width(self) -> int:
        """The most prompt tokens a request may leave to its first round (`prefill_some`'s
        `ride`): a drafted block's rows, so a tail never widens a shared round; 0 when rounds
        are plain steps."""
        d = self.decoder
        return d.block_size if d.peer is not None and d.block_size > 1 else 0

    def prefill_some(self, act: Active, budget: int | None = None, ride: int = 0) -> Chunk | None:
        """Prefill up to `budget` more prompt tokens (None: all); once the prompt is done,
        commit the first token and return its chunk (None while prompt tokens remain).
        `ride`: stop up to that many tokens short of the prompt's end and leave them to the
        request's first rounds (`Decoder.ride`, `act.riding`; the prompt cache's rungs are
        captured there as here): a scheduler that runs them in shared rounds saves the other
        requests a forward; its first chunk comes from `step` or `step_batch`."""
        seq, prompt_ids = act.seq, act.prepared.prompt_ids
        done, n = len(seq.cached_tokens), len(prompt_ids)
        end = n if budget is None else min(n, done + budget)

        def capture(position: int) -> None:  # prefill paused at a rung: its GDN states
            act.captured[position] = self.target.recurrent_state(seq.cache)

        tail_at = max(n - ride, done) if ride > 0 else n
        if tail_at < n:
            end = min(end, tail_at)
            if end > done:
                self.decoder.prefill(seq, prompt_ids[done:end], act.stops, capture, False)
            if end == tail_at:
                self.decoder.ride(seq, prompt_ids[tail_at:], act.stops, capture)
            return None
        last = end == n
        logits = self.decoder.prefill(seq, prompt_ids[done:end], act.stops, capture, last)
        if end < len(prompt_ids):
            return None
        act.key, sub = mx.random.split(act.key)
        return self._first(act, self.decoder.start(seq, logits, sub))

    def step(self, act: Active) -> Chunk:
        """One round (speculative, or one plain token; a riding request's tail and first
        token)."""
        act.key, sub = mx.random.split(act.key)
        if act.riding:
            return self._first(act, self.decoder.step(act.seq, sub))
        before = self.decoder.committed_state(act.seq)[0]
        return self._after_step(act, before, self.decoder.step(act.seq, sub))

    def step_batch(self, acts: list[Active]) -> list[Chunk | None]:
        """One round of each request, all in one shared round (BatchDecoder.step_batch): each
        request's chunk is the one `step` would give it; None for a riding request whose
        prompt tail goes on in the next round (its key is then split again there, so its
        first token is drawn with the key it is drawn with alone)."""
        keys, subs = zip(*(mx.random.split(act.key) for act in acts))
        firsts = [act.riding for act in acts]  # their steps, if any token, are first tokens
        befores = [
            None if f else self.decoder.committed_state(a.seq)[0] for a, f in zip(acts, firsts)
        ]
        steps = self.decoder.step_batch([act.seq for act in acts], list(subs))
        chunks = []
        for act, key, first, before, step in zip(acts, keys, firsts, befores, steps):
            if act.riding:  # its tail goes on: no token yet, its key not used
                chunks.append(None)
                continue
            act.key = key
            chunks.append(self._first(act, step) if first else self._after_step(act, before, step))
        return chunks

    def _first(self, act: Active, step) -> Chunk:
        """The chunk of a request's first token, committed after its prompt."""
        act.usage.ttft_s = round(time.perf_counter() - act.prepared.started, 6)
        return self._chunk(act, step)

    def _after_step(self, act: Active, before: int, step) -> Chunk:
        if act.watch is not None and not act.watch.done:
            act.watch.observe(self.decoder, act.seq, before, step)
        s = step.stats
        act.usage.rounds += 1
        self.counters.add_round(s)
        if s.bs > 1:
            act.usage.drafted_tokens += s.bs - 1
            act.usage.accepted_tokens += s.accepted
            act.usage.lookup_rounds += s.looked_up
            act.spec_rounds += 1
        log.debug(
            "%s completion_tokens=%d", s.line(len(act.seq.completion)), len(act.seq.completion)
        )
        return self._chunk(act, step)

    def close(self, act: Active, save: bool = True) -> None:
        """Free the sequence; save its cache as a new entry (its state is consistent after any
        finished or cancelled round)."""
        save = save and not act.riding  # a prompt not read to its end: nothing to save
        self.decoder.close(act.seq)
        if save and self.store is not None and act.req.use_cache and act.seq.cached_tokens:
            try:
                self._save(act)
            except Exception:
                log.exception("prompt cache: saving the entry failed; the request is unaffected")

    def generate(self, req: GenerateRequest, mode: str = "sync") -> Iterator[Chunk]:
        """Open, step to the end, close: the whole request in this thread."""
        act, chunk = self.open(req, mode)
        try:
            yield chunk
            while not act.finished:
                yield self.step(act)
        finally:
            self.close(act)

    # ---- internals -------------------------------------------------------------------------
    def _plan(self, kv: str, prompt_ids: list[int]) -> ResumePlan:
        try:
            return self.store.plan(self.model_key(kv), prompt_ids)
        except Exception:
            log.warning("prompt cache unavailable; serving uncached", exc_info=True)
            return ResumePlan(0, 0)

    def _save(self, act: Active) -> None:
        seq, prep = act.seq, act.prepared
        end = len(seq.cached_tokens)
        captured = {**act.captured, end: self.target.recurrent_state(seq.cache)}
        next_turn_end = act.watch.position if act.watch is not None else None
        if next_turn_end is not None:
            captured[next_turn_end] = act.watch.state
        rungs = choose_rungs(
            self.ladder_depth,
            len(prep.prompt_ids),
            end,
            prep.message_starts,
            captured,
            act.plan.rungs,
            next_turn_end,
            self.ladder_bytes,
        )
        taps = seq.taps.all()
        if taps is not None and taps.shape[0] != end:
            taps = None  # incomplete history (e.g. resumed without taps): the drafter restarts cold
        kv = act.usage.kv
        entry = make_entry(
            self.target,
            seq.cache,
            self.model_key(kv),
            kv,
            seq.cached_tokens,
            rungs,
            taps,
            len(prep.prompt_ids),
        )
        self.store.put(entry)

    def _chunk(self, act: Active, step) -> Chunk:
        text = act.stream.push(step.tokens)
        s = step.stats
        usage = act.usage
        usage.completion_tokens = len(act.seq.completion)
        chunk = Chunk(
            text,
            list(step.tokens),
            drafted=(s.bs - 1) if s and s.bs > 1 else 0,
            accepted=s.accepted if s else 0,
        )
        if step.finish_reason is not None:
            chunk.text += act.stream.finish()
            chunk.finish_reason = step.finish_reason
            usage.tau = round(acceptance_length(usage.accepted_tokens, act.spec_rounds) or 0.0, 4)
            usage.elapsed_s = round(time.perf_counter() - act.prepared.started, 6)
            chunk.usage = usage
            self.counters.finished(usage)
        return chunk
