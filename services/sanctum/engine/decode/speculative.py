"""The decode loop: prefill, then DFlash rounds (draft a block, verify it in one target forward,
accept, roll back the rest), or plain one-token steps when there is no drafter.

Host syncs: a greedy plain step queues the next step's forward on the lazy token before it
reads this one (mlx-lm's generate_step does the same), so the host builds step n+1 while the
device computes step n; when the request then stops, that forward is undone, so the cache holds
exactly the committed tokens. A round syncs once, on acceptance: the drafts are not awaited
before the verify graph is built, and the rollback is queued, not awaited (`Decoder.profile`
syncs each phase instead, for a round split that measures device time). On a GPU a greedy
round also drafts the next block before that sync, on the acceptance as the device computes it
(`Decoder.draft_ahead`), so the device drafts while the host builds the next verify.

The verifier side runs this loop; the drafter body is reached through a `DraftPeer`, which is a
plain object in one process (`LocalDraftPeer`) or a proxy to a drafter actor in the cluster:
this module does not know which.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ..kernels import cuda
from ..model.drafter import Drafter, DraftHead
from ..model.target import Target, VerifyTape, cache_offset
from .lookup import MIN_MATCH, TokenIndex
from .peer import MAX_PENDING_TAP_ROWS, DraftPeer, DraftUnavailable, LocalDraftPeer
from .sampling import (
    ACCEPT_RULES,
    SamplingParams,
    accept_block,
    accept_greedy,
    accept_sampled,
    greedy_acceptance,
    greedy_tokens,
    probabilities,
    sample,
)
from .taps import TapLog

log = logging.getLogger("sanctum.engine")


@dataclass
class RoundStats:
    """One decode step, in the seed's vocabulary: `bs=8 accepted=7 committed=8`."""

    bs: int  # block size; 1 for a plain step
    accepted: int  # drafts accepted by the target
    committed: int  # tokens this step added to the completion
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    other_s: float = 0.0
    gated: bool = False  # a plain step the speculation gate took instead of a round
    looked_up: bool = False  # the block's drafts were read from the sequence (engine/lookup.py)

    def line(self, completion_tokens: int) -> str:
        return (
            f"bs={self.bs} accepted={self.accepted} committed={self.committed} "
            f"completion_tokens={completion_tokens}"
        )


@dataclass
class Step:
    tokens: list[int]  # newly committed completion tokens
    stats: RoundStats | None  # None for the token that comes out of prefill
    finish_reason: str | None = None  # "stop" | "length" once finished


GREEDY = SamplingParams()
MIN_WIDTH = 2  # the smallest block adaptive width drafts (an anchor and one draft)
# the widest looked-up block: a looked-up block accepted whole is followed by one twice as wide
# (copied text goes on), up to this; any rejection goes back to the drafter's width
LOOKUP_MAX_WIDTH = 32
# The speculation gate (Decoder.min_tau): a sequence whose recent rounds commit fewer tokens than
# a round costs in plain steps takes plain steps for a while, then tries rounds again. Lossless
# either way (each step or round samples from the target's own conditionals), and decided by
# the sequence's own history alone, so it gates the same alone or in a batch.
GATE_WARMUP = 2  # rounds before a sequence's mean counts; after a plain stretch one round
GATE_SMOOTHING = 0.3  # weight of the latest round in the running mean of tokens per round
GATE_PLAIN_STEPS = 16  # the first stretch of plain steps; doubled at each trip that follows
GATE_PLAIN_MAX = 256
# (completion so far, new tokens) -> how many of the new tokens to keep, and whether to stop
StopCheck = Callable[[list[int], list[int]], tuple[int, bool]]


@dataclass
class Sequence:
    """One request's live state on the verifier, and what the request fixed for all its rounds."""

    seq_id: str
    cache: list  # target caches, one per layer
    # the tokens the cache holds, in order (and the anchor too while `ahead` is set)
    cached_tokens: list[int]
    taps: TapLog  # the drafter's context rows: what it has, what is pending, what is saved
    sampling: SamplingParams = GREEDY
    max_tokens: int = 64
    eos_ids: frozenset[int] = frozenset()
    stop_check: StopCheck | None = None  # stop sequences
    anchor: int | None = None  # last committed token, not yet run through the target
    completion: list[int] = field(default_factory=list)
    draft_open: bool = False
    finished: str | None = None
    last_tape: VerifyTape | None = None  # the latest verify pass (a later truncation can reuse it)
    prefetch: Prefetch | None = None  # the next block's draft, already asked of a pipelined peer
    next_block: NextBlock | None = None  # the next block's drafts, drafted ahead (Decoder)
    ahead: Ahead | None = None  # the anchor's plain step, already queued on the device
    width: int | None = None  # the block it drafts now (adaptive width); None: the decoder's
    # the speculation gate: running mean of tokens per round, rounds seen, plain steps left
    # in the current stretch, stretches in a row
    tau_mean: float | None = None
    gate_rounds: int = 0
    plain_left: int = 0
    gate_trips: int = 0
    # its tokens for the lookup of repeated text, whether this round's drafts came from it, and
    # the rows of its next looked-up block (None: the drafter's width; doubled while accepted)
    lookup: TokenIndex = field(default_factory=TokenIndex)
    looked_up: bool = False
    lookup_width: int | None = None

    @property
    def pending_taps(self) -> list[mx.array]:
        """The context rows the drafter has not been sent yet ([C, n_taps * H], or none)."""
        rows = self.taps.unsent()
        return [] if rows is None else [rows]


@dataclass
class Ahead:
    """A greedy plain step queued before the previous one was read: the anchor's forward."""

    token: mx.array  # [] lazy: the greedy token it yields
    states: list  # GDN (conv, state) before it, to undo it (attention KV: trimmed by one)


@dataclass
class NextBlock:
    """The next round's drafts, drafted on this round's acceptance before the host read it."""

    drafts: mx.array  # [L-1], maybe not evaluated yet
    width: int
    start: int | None = None  # the anchor's position, once the acceptance is read


@dataclass
class Prefetch:
    """A draft submitted ahead of its round."""

    handle: object  # the peer's
    sent_before: int  # the taps' `sent` before it: its context rows are pending again if it fails
    start: int  # the anchor's position it was asked for
    anchor: int


class Decoder:
    """Runs a sequence on the target, speculatively when a drafter head and peer are given."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        peer: DraftPeer | None = None,
        block_size: int | None = None,
    ):
        self.target = target
        self.head: DraftHead | None = drafter.head if drafter else None
        self.cfg = drafter.cfg if drafter else None
        self.peer = peer if drafter else None
        self.block_size = int(block_size or (drafter.block_size if drafter else 1))
        self.tap_ids = tuple(self.cfg.target_layer_ids) if self.cfg else ()
        # taps kept for the drafter's next call: a sliding drafter never sees more than its
        # window, so a long prompt hands it (and sends across processes) only that many rows
        seen = self.cfg.context_rows_needed() if self.cfg else None
        self.max_pending_rows = min(MAX_PENDING_TAP_ROWS, seen or MAX_PENDING_TAP_ROWS)
        self.pipelined = bool(getattr(self.peer, "pipelined", False)) and self.block_size > 1
        self.profile = False  # sync after each phase of a round (accurate split, slower)
        # with `profile`: seconds of each piece of each draft (`_draft_piece`)
        self.draft_pieces: dict[str, list[float]] = {}
        self._piece_t = 0.0  # when the last piece ended
        # adaptive width: a sequence whose drafts keep failing drafts smaller blocks (down to
        # MIN_WIDTH), and grows back to block_size as they are accepted; its own history alone
        # decides, so a sequence drafts the same widths alone or in a batch
        self.adaptive = False
        # sampled drafts: "block" verification (at least the token rule's acceptance) or the
        # "token" rule (sampling.py); greedy drafts always by the argmax match
        self.accept_rule = "block"
        # the speculation gate's thresholds, greedy and sampled: tokens a round must commit, on
        # average, to beat plain steps (what a round costs in plain steps here, sampled rounds
        # costing more: `measure_break_even`); 0: off
        self.min_tau = 0.0
        self.min_tau_sampled = 0.0
        # draft ahead (greedy rounds, a drafter in this process): a round drafts the next block
        # on its acceptance as the device computes it, queued behind the verify, before the
        # host reads it, so that a GPU drafts while the host builds the next verify (and the
        # draft's host time hides behind the verify's device time); DRAFT_AHEAD says where
        self.draft_ahead = draft_ahead_default(target, self.peer)
        # greedy rounds whose last `lookup_min` committed tokens repeat an earlier stretch of
        # the sequence propose what followed it there instead of drafting (engine/lookup.py;
        # SANCTUM_LOOKUP_MIN); 0: off
        self.lookup_min = lookup_min_default()
        if self.cfg is not None:
            self.mask_embed = target.embed_tokens(mx.array([self.cfg.mask_token_id]))  # [1, H]

    # ---- sequence lifecycle ------------------------------------------------------------
    def new_sequence(
        self,
        seq_id: str,
        kv_mode: str = "fp16",
        sampling: SamplingParams = GREEDY,
        max_tokens: int = 64,
        eos_ids: Iterable[int] = (),
        stop_check: StopCheck | None = None,
        keep_taps: bool = False,
    ) -> Sequence:
        """An empty sequence with its request's constants; `keep_taps`: keep every tap row
        (the prompt cache saves them)."""
        taps = TapLog(self.max_pending_rows, keep_all=keep_taps)
        return Sequence(
            seq_id,
            self.target.make_cache(kv_mode),
            [],
            taps,
            sampling,
            max_tokens,
            frozenset(eos_ids),
            stop_check,
        )

    def prefill(
        self,
        seq: Sequence,
        tokens: list[int],
        stops: tuple[int, ...] = (),
        on_stop=None,
        final: bool = True,
    ) -> mx.array:
        """Run `tokens` on top of what the cache holds; returns last-row logits [1, V].
        `final`: these tokens end the prompt (its last token then runs alone, as in mlx-lm)."""
        logits, taps = self.target.prefill(
            tokens, seq.cache, self.tap_ids, stops, on_stop, split_last=final
        )
        seq.cached_tokens.extend(tokens)
        if self.head is not None:
            seq.taps.add(taps)
        return logits

    def start(self, seq: Sequence, logits: mx.array, key: mx.array) -> Step:
        """Commit the first token from the prefill logits."""
        token = self._sample_one(logits, seq.sampling, key)
        step = self._commit(seq, [token], None, stats=None)
        self._prefetch(seq, cache_offset(seq.cache))
        if self._runs_ahead(seq.sampling) and seq.finished is None:
            seq.ahead = self._queue_step(seq, mx.array([seq.anchor]))
        return step

    def step(self, seq: Sequence, key: mx.array) -> Step:
        """One round: speculative when possible (and not gated), else one plain token."""
        if self.peer is not None and self.block_size > 1:
            if self.take_gated_step(seq):
                return self._plain_step(seq, key, gated=True)
            try:
                step = self._speculative_round(seq, key)
                self._watch(seq, step)
                return step
            except DraftUnavailable:
                seq.draft_open = False  # the next round reopens it on a restarted drafter
        if self._runs_ahead(seq.sampling):
            return self._plain_step_ahead(seq)
        return self._plain_step(seq, key)

    def take_gated_step(self, seq: Sequence) -> bool:
        """True (and one step of the stretch used up) while the speculation gate has `seq`
        take plain steps."""
        if seq.plain_left <= 0:
            return False
        seq.plain_left -= 1
        return True

    def _watch(self, seq: Sequence, step: Step) -> None:
        """The speculation gate, after a round of `seq`: below the threshold's tokens a round
        on average, a stretch of plain steps, longer at each trip in a row. A stretch ends in
        one round, which updates the mean and so decides the next stretch."""
        threshold = self.min_tau if seq.sampling.greedy else self.min_tau_sampled
        if threshold <= 0 or step.stats is None or step.stats.bs <= 1:
            return
        x = step.stats.accepted + 1.0
        mean = x if seq.tau_mean is None else seq.tau_mean + GATE_SMOOTHING * (x - seq.tau_mean)
        seq.tau_mean, seq.gate_rounds = mean, seq.gate_rounds + 1
        if seq.gate_rounds < GATE_WARMUP:
            return
        if mean >= threshold:
            seq.gate_trips = 0
            return
        seq.plain_left = min(GATE_PLAIN_MAX, GATE_PLAIN_STEPS << seq.gate_trips)
        seq.gate_trips += 1
        seq.next_block = None  # drafted ahead, not wanted now
        if seq.prefetch is not None:  # a block drafted for the next round: not wanted now
            self.peer.discard(seq.prefetch.handle)  # (its context rows stay with the drafter)
            seq.prefetch = None

    def committed_state(self, seq: Sequence) -> tuple[int, list[tuple[mx.array, mx.array]]]:
        """(tokens, GDN states) of the committed cache, without a queued step undone."""
        if seq.ahead is not None:
            return cache_offset(seq.cache) - 1, seq.ahead.states
        return cache_offset(seq.cache), self.target.recurrent_state(seq.cache)

    def close(self, seq: Sequence) -> None:
        self._undo_ahead(seq)
        seq.next_block = None
        if seq.prefetch is not None:
            self.peer.discard(seq.prefetch.handle)
            seq.prefetch = None
        if self.peer is not None and seq.draft_open:
            try:
                self.peer.close(seq.seq_id)
            except DraftUnavailable:
                pass
        seq.draft_open = False

    # ---- internals ---------------------------------------------------------------------
    def _sample_one(self, logits: mx.array, params: SamplingParams, key: mx.array) -> int:
        if params.greedy:
            return int(greedy_tokens(logits[-1:])[0].item())
        return int(sample(probabilities(logits[-1:], params), key)[0].item())

    def _commit(
        self, seq: Sequence, new: list[int], stop_check: StopCheck | None, stats: RoundStats | None
    ) -> Step:
        """Apply EOS, max_tokens and `stop_check` to `new`; returns the step."""
        keep, reason = len(new), None
        for j, t in enumerate(new):
            if t in seq.eos_ids:
                keep, reason = j, "stop"
                break
        budget = seq.max_tokens - len(seq.completion)
        if keep >= budget:
            keep, reason = budget, reason or "length"
        if stop_check is not None and keep > 0:
            n, stop = stop_check(seq.completion, new[:keep])
            if stop:
                keep, reason = n, "stop"
        kept = new[:keep]
        seq.completion.extend(kept)
        if kept:
            seq.anchor = kept[-1]
        if reason is not None:
            seq.finished = reason
        if stats is not None:
            stats.committed = len(kept)
        return Step(kept, stats, reason)

    def _plain_step(self, seq: Sequence, key: mx.array, gated: bool = False) -> Step:
        t0 = time.perf_counter()
        logits, taps = self.target.forward(mx.array([seq.anchor]), seq.cache, self.tap_ids)
        return self._settle_plain(seq, logits, taps, key, t0, gated)

    def _settle_plain(
        self, seq: Sequence, logits, taps, key: mx.array, t0: float, gated: bool = False
    ) -> Step:
        """A plain step after its forward (the anchor's logits and taps, started at `t0`):
        sample, keep the taps for the drafter, commit. `gated`: taken by the speculation gate."""
        token = self._sample_one(logits, seq.sampling, key)
        seq.cached_tokens.append(seq.anchor)
        if taps is not None:
            seq.taps.add(taps)
        t1 = time.perf_counter()
        stats = RoundStats(1, 0, 0, gated=gated)
        step = self._commit(seq, [token], seq.stop_check, stats)
        step.stats.verify_s, step.stats.other_s = t1 - t0, time.perf_counter() - t1
        return step

    def _runs_ahead(self, params: SamplingParams) -> bool:
        # sampling would need the next step's key before the caller gives it
        return self.head is None and params.greedy

    def _queue_step(self, seq: Sequence, token: mx.array) -> Ahead:
        """Build the forward of `token` ([1], may be lazy) on the cache and queue it."""
        states = self.target.recurrent_state(seq.cache)
        logits, _ = self.target.forward(token, seq.cache)
        nxt = greedy_tokens(logits)[-1]
        mx.async_eval(nxt)
        return Ahead(nxt, states)

    def _undo_ahead(self, seq: Sequence) -> None:
        if seq.ahead is not None:
            self.target.truncate(seq.cache, cache_offset(seq.cache) - 1, seq.ahead.states)
            seq.ahead = None

    def _plain_step_ahead(self, seq: Sequence) -> Step:
        """A greedy plain step whose forward is already queued; queues the next one (on the lazy
        token) before reading this one. A next step the commit does not want is undone."""
        t0 = time.perf_counter()
        ahead, seq.ahead = seq.ahead, None
        if ahead is None:
            ahead = self._queue_step(seq, mx.array([seq.anchor]))
        seq.cached_tokens.append(seq.anchor)
        nxt = None
        if len(seq.completion) + 1 < seq.max_tokens:  # else this token ends the request
            nxt = self._queue_step(seq, ahead.token[None])
        token = int(ahead.token.item())
        t1 = time.perf_counter()
        step = self._commit(seq, [token], seq.stop_check, RoundStats(1, 0, 0))
        if nxt is not None:
            seq.ahead = nxt  # its input is the token just committed, the new anchor
            if seq.finished is not None:
                self._undo_ahead(seq)
        step.stats.verify_s, step.stats.other_s = t1 - t0, time.perf_counter() - t1
        return step

    def _open_draft(self, seq: Sequence) -> None:
        if not seq.draft_open:
            if self.peer.open(seq.seq_id):  # a fresh session: the context goes again
                seq.taps.resend()
            seq.draft_open = True

    def width(self, seq: Sequence) -> int:
        """The block size `seq` drafts this round."""
        return seq.width or self.block_size

    def _adapt(self, seq: Sequence, width: int, accepted: int) -> None:
        if accepted + 1 < width // 2 and width > MIN_WIDTH:
            seq.width = max(MIN_WIDTH, width // 2)
        elif accepted == width - 1 and width < self.block_size:
            seq.width = min(self.block_size, width * 2)

    def _block_embeds(self, anchor: int | mx.array, size: int) -> mx.array:
        """[L, H]: the anchor's embedding, then L-1 mask embeddings (`anchor`: a token, or
        one as an array [1] not evaluated yet)."""
        ids = anchor if isinstance(anchor, mx.array) else mx.array([anchor])
        anchor_embed = self.target.embed_tokens(ids)
        return mx.concatenate([anchor_embed, mx.repeat(self.mask_embed, size - 1, 0)])

    def _prefetch(self, seq: Sequence, start: int) -> None:
        """Ask a pipelined peer for the next block now (anchor at `start`), to collect it at the
        next round; the caller goes on (rollback, streaming) while the drafter computes."""
        if not self.pipelined or seq.finished is not None or seq.prefetch is not None:
            return
        if self._lookup(seq) is not None:  # the next block is read from the sequence
            return
        try:
            self._open_draft(seq)
            embeds = self._block_embeds(seq.anchor, self.width(seq))
            handle = self.peer.submit(seq.seq_id, seq.taps.unsent(), embeds, start)
        except DraftUnavailable:
            seq.draft_open = False
            return  # the taps stay pending; the next round drafts (or steps plainly) as usual
        seq.prefetch = Prefetch(handle, seq.taps.sent, start, seq.anchor)
        seq.taps.sent = seq.taps.end

    def _collect_prefetch(self, seq: Sequence, start: int) -> mx.array | None:
        """The prefetched block's hidden states, or None when there is none."""
        pf, seq.prefetch = seq.prefetch, None
        if pf is None:
            return None
        if pf.start != start or pf.anchor != seq.anchor:  # cannot happen; never draft on it
            self.peer.discard(pf.handle)
            seq.taps.sent = pf.sent_before
            self.peer.close(seq.seq_id)  # its context now holds rows the cache may not
            # reopened by the next draft (the output is the same: the target decides)
            seq.draft_open = False
            raise DraftUnavailable("prefetched draft does not match the sequence; redrafting")
        try:
            return self.peer.collect(pf.handle)
        except DraftUnavailable:
            seq.taps.sent = pf.sent_before  # not seen by any drafter: send them again
            raise

    def _draft(self, seq: Sequence, params: SamplingParams, key: mx.array):
        """Propose L-1 tokens; returns (drafts [L-1], q [L-1, V] or None when greedy)."""
        # a block drafted ahead, if it is still for this position (a shared round since, in
        # rounds.py, drafted its own)
        block, seq.next_block = seq.next_block, None
        read = self._read_block(seq)
        if read is not None:
            # the drafter is not asked: the context rows it lacks go with its next block
            if seq.prefetch is not None:  # (`_prefetch` looks up first: cannot happen)
                self.peer.discard(seq.prefetch.handle)  # its context rows stay with the drafter
                seq.prefetch = None
            return read
        if block is not None and block.start == cache_offset(seq.cache):
            return block.drafts, None
        if self.profile:
            self._piece_t = time.perf_counter()
        start = cache_offset(seq.cache)
        hidden = self._collect_prefetch(seq, start)
        if hidden is None:
            self._open_draft(seq)
            block_embeds = self._block_embeds(seq.anchor, self.width(seq))
            unsent = seq.taps.unsent()
            self._draft_piece("inputs", block_embeds, unsent)
            hidden = self.peer.draft(seq.seq_id, unsent, block_embeds, start)  # [L-1, H]
            seq.taps.sent = seq.taps.end
            self._draft_piece("body_build")
        self._draft_piece("body", hidden)
        logits = self.head.logits(cuda.pad_rows(hidden))[: hidden.shape[0]]  # [L-1, V]
        self._draft_piece("head", logits)
        drafts, q = self._propose(seq, hidden, logits, params, key)
        self._draft_piece("select", drafts)
        return drafts, q

    def _read_block(self, seq: Sequence) -> tuple[mx.array, None] | None:
        """(drafts, no q) read from the sequence itself (`_lookup`), or None when the drafter
        drafts this round; marks the round `seq.looked_up` either way."""
        found = self._lookup(seq)
        seq.looked_up = found is not None
        return None if found is None else (mx.array(found), None)

    def _lookup(self, seq: Sequence):
        """The next block's drafts read from the sequence itself (int32, numpy), or None:
        greedy sequences whose last `lookup_min` tokens repeat (engine/lookup.py). As many as
        the drafter's, or more after looked-up blocks accepted whole (`lookup_width`) while the
        earlier text goes on that far."""
        if not self.lookup_min or not seq.sampling.greedy or seq.anchor is None:
            return None
        if seq.lookup_width is not None:
            found = self._continuation(seq, seq.lookup_width - 1)
            if found is not None:
                return found
            seq.lookup_width = None  # the repeat ends sooner: the drafter's width again
        return self._continuation(seq, self.width(seq) - 1)

    def _continuation(self, seq: Sequence, count: int):
        return seq.lookup.continuation(seq.cached_tokens, seq.anchor, count, self.lookup_min)

    def _draft_piece(self, name: str, *outputs) -> None:
        """With `profile`: evaluate `outputs` and add the time since the last piece to
        `draft_pieces[name]` (for the body of an in-process drafter, "body_build" is the host
        building its graph and "body" the evaluation after)."""
        if not self.profile:
            return
        mx.eval([a for a in outputs if a is not None])
        now = time.perf_counter()
        self.draft_pieces.setdefault(name, []).append(now - self._piece_t)
        self._piece_t = now

    def _propose(self, seq: Sequence, hidden, logits, params: SamplingParams, key: mx.array):
        """Draft tokens from the body's hidden states [L-1, H] and their logits [L-1, V].
        When sampling, the proposal q is the drafter's at the request's temperature times the
        config's `draft_temperature_scale`; the rejection rule keeps p's distribution for any q."""
        temp = 0.0 if params.greedy else params.temperature * self.cfg.draft_temperature_scale
        if params.greedy:
            return self._greedy_drafts(hidden, logits, mx.array([seq.anchor])), None
        if self.cfg.is_v2:
            drafts, cand, cand_q = self.head.select(hidden, logits, seq.anchor, temp, key)
            q = mx.put_along_axis(mx.zeros(logits.shape, mx.float32), cand, cand_q, axis=-1)
            return drafts, q
        q = probabilities(logits, SamplingParams(temp, params.top_p, params.top_k))
        return sample(q, key), q

    def _greedy_drafts(self, hidden, logits, anchor: mx.array) -> mx.array:
        """Greedy drafts [L-1] after `anchor` ([1], maybe not evaluated): DFlash 2's selection
        or DFlash's argmax."""
        if self.cfg.is_v2:
            return self.head.select_greedy(hidden[None], logits[None], anchor)[0]
        return mx.argmax(logits, axis=-1)

    def _accept(self, drafts, q, logits, params, key) -> tuple[int, int]:
        """(accepted drafts, bonus token) by the greedy rule, or by `accept_rule`."""
        if params.greedy:
            return accept_greedy(drafts, logits)
        rule = accept_block if self.accept_rule == "block" else accept_sampled
        return rule(drafts, q, probabilities(logits, params), key)

    def _speculative_round(self, seq: Sequence, key: mx.array) -> Step:
        k_draft, k_accept = mx.random.split(key)
        t0 = time.perf_counter()
        drafts, q = self._draft(seq, seq.sampling, k_draft)
        if self.profile:
            mx.eval(drafts)
        elif self.target.async_layers:  # a GPU drafts while Python builds the verify
            mx.async_eval(drafts)
        t1 = time.perf_counter()
        block = mx.concatenate([mx.array([seq.anchor]), drafts.astype(mx.int32)])
        verified = self.target.verify(block, seq.cache, self.tap_ids)
        t2 = time.perf_counter()
        acceptance = self._draft_next(seq, drafts, verified) if self._drafts_ahead(seq) else None
        t3 = time.perf_counter()
        stats = RoundStats(block.shape[0], 0, 0, t1 - t0 + t3 - t2, t2 - t1)
        stats.looked_up = seq.looked_up
        return self._settle(seq, block, drafts, q, verified, k_accept, stats, acceptance)

    def _drafts_ahead(self, seq: Sequence) -> bool:
        """Whether this round drafts the next block before its acceptance is read: greedy, a
        peer in this process, every context row sent (so the verified rows are all it lacks)."""
        return (
            self.draft_ahead
            and not self.profile
            and seq.sampling.greedy
            and seq.draft_open
            and seq.taps.sent == seq.taps.end
        )

    def _draft_next(self, seq: Sequence, drafts, verified) -> tuple[mx.array, mx.array] | None:
        """Draft the next block on this round's acceptance as the device will compute it: the
        anchor is the bonus token, the context gains the accepted rows and the anchor's (their
        count not read yet: the peer's `settle` in `_conclude`). Queued behind the verify, after
        the acceptance itself, so that reading it does not wait for this draft. Returns the
        acceptance (count, bonus), unevaluated; None if the peer could not take the block."""
        logits, taps, tape = verified
        run, bonus = self._lazy_accept(drafts, logits)
        mx.async_eval(run, bonus)
        keep = run + 1
        embeds = self._block_embeds(bonus.reshape(1), self.width(seq))
        try:
            hidden = self.peer.draft_ahead(
                seq.seq_id, taps, tape.start, keep, embeds, tape.start + keep
            )
        except DraftUnavailable:
            seq.draft_open = False  # reopened (and the context sent again) by the next draft
            return None
        logits = self.head.logits(cuda.pad_rows(hidden))[: hidden.shape[0]]
        next_drafts = self._greedy_drafts(hidden, logits, bonus.reshape(1))
        mx.async_eval(next_drafts)
        seq.next_block = NextBlock(next_drafts, self.width(seq))
        return run, bonus

    def _lazy_accept(self, drafts, logits) -> tuple[mx.array, mx.array]:
        """The greedy acceptance (count, bonus token), unevaluated (`_draft_next`)."""
        return greedy_acceptance(drafts, logits)

    def _settle(
        self, seq, block, drafts, q, verified, k_accept, stats: RoundStats, acceptance=None
    ) -> Step:
        """The round after its verify: accept, commit, hand the taps on, roll back."""
        step = self._conclude(seq, block, drafts, q, verified, k_accept, stats, acceptance)
        t0 = time.perf_counter()
        self._queue_rollback(self.target.rollback(seq.cache, seq.last_tape, len(step.tokens)))
        stats.rollback_s = time.perf_counter() - t0
        return step

    def _conclude(
        self, seq, block, drafts, q, verified, k_accept, stats: RoundStats, acceptance=None
    ) -> Step:
        """The round after its verify up to the rollback: accept, commit, hand the taps on,
        prefetch. The cache is then rolled back to the anchor and the committed tokens but the
        last (the next anchor): `len(step.tokens)` rows of the block. `acceptance`: the
        unevaluated (count, bonus) a block was drafted ahead on (`_draft_next`)."""
        logits, taps, tape = verified
        seq.last_tape = tape
        t1 = time.perf_counter()
        if acceptance is not None:
            accepted, bonus = (int(a.item()) for a in acceptance)
        else:
            accepted, bonus = self._accept(drafts, q, logits, seq.sampling, k_accept)
        t2 = time.perf_counter()
        block_ids = block.tolist()
        stats.accepted = accepted
        stats.verify_s += t2 - t1  # the acceptance waits on the verify
        step = self._commit(seq, block_ids[1 : accepted + 1] + [bonus], seq.stop_check, stats)
        keep = len(step.tokens)
        seq.cached_tokens.extend(block_ids[:keep])
        t3 = time.perf_counter()
        seq.taps.add(taps[:keep])
        if acceptance is not None and seq.draft_open:  # the drafter holds these rows already
            self.peer.settle(seq.seq_id, keep)
            seq.taps.sent = seq.taps.end
            seq.next_block.start = tape.start + keep
        if stats.looked_up:  # before the prefetch, which looks the next block up
            whole = accepted == stats.bs - 1
            seq.lookup_width = min(LOOKUP_MAX_WIDTH, 2 * stats.bs) if whole else None
        elif self.adaptive:  # before the prefetch: the next block has the new width
            self._adapt(seq, stats.bs, accepted)
        if seq.next_block is not None and (
            seq.finished is not None or seq.next_block.width != self.width(seq)
        ):
            seq.next_block = None  # drafted ahead, not wanted
        self._prefetch(seq, tape.start + keep)  # the drafter starts on the next block meanwhile
        stats.draft_s += time.perf_counter() - t3
        stats.other_s = t3 - t2
        return step

    def _queue_rollback(self, states: list[mx.array]) -> None:
        # the next round's graph builds on these; only a profile waits for them here
        (mx.eval if self.profile else mx.async_eval)(states)


# Decoder.draft_ahead by default: "auto" on a GPU (where the target hands its layers to the
# device as it builds them, Target.async_layers), "on", "off" (SANCTUM_DRAFT_AHEAD). On the CPU
# one thread would build the draft and compute the verify one after the other anyway.
DRAFT_AHEAD = os.environ.get("SANCTUM_DRAFT_AHEAD", "auto")


def lookup_min_default(env=os.environ) -> int:
    """Decoder.lookup_min by default: SANCTUM_LOOKUP_MIN, else engine/lookup.py's MIN_MATCH."""
    raw = env.get("SANCTUM_LOOKUP_MIN") or str(MIN_MATCH)
    value = int(raw) if raw.isdigit() else -1
    if value < 0:
        raise ValueError(f"SANCTUM_LOOKUP_MIN must be an integer >= 0 (0: off), got {raw!r}")
    return value


def draft_ahead_default(target: Target, peer: DraftPeer | None) -> bool:
    if DRAFT_AHEAD == "off" or not hasattr(peer, "draft_ahead"):
        return False
    return DRAFT_AHEAD == "on" or bool(target.async_layers)


def make_key(seed: int | None) -> mx.array:
    return mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))


def measure_break_even(
    decoder: Decoder, sampling: SamplingParams = GREEDY, runs: int = 4, passes: int = 3
) -> float:
    """What one speculative round of `decoder` costs in plain steps here, both with `sampling`:
    the tokens a round must commit, on average, to beat plain decoding. Timed on a probe
    sequence: `runs` rounds, then `runs` plain steps, once untimed (compiled graphs) and then
    `passes` times in turn; each kind's fastest pass counts, so that other work on the machine
    during one pass (a server starts beside other programs) does not set the gate for the
    server's lifetime. 0.0 without a drafter."""
    if decoder.peer is None or decoder.block_size <= 1:
        return 0.0
    text = "def probe(values):\n    return [v * 2 for v in values if v]\n\n" * 3
    seq = decoder.new_sequence("break-even-probe", sampling=sampling, max_tokens=1 << 30)
    key = make_key(0)
    try:
        decoder.start(seq, decoder.prefill(seq, decoder.target.tokenizer.encode(text)), key)

        def timed(one) -> float:
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(runs):
                one(seq, key)
            mx.synchronize()
            return (time.perf_counter() - t0) / runs

        kinds = (decoder._speculative_round, decoder._plain_step)
        for one in kinds:  # warm-up
            timed(one)
        rounds, steps = zip(*([timed(one) for one in kinds] for _ in range(passes)))
        return min(rounds) / min(steps)
    finally:
        decoder.close(seq)


# the speculation gate's probes: greedy rounds, and sampled ones (which also compute p and q)
GATE_PROBES = (GREEDY, SamplingParams(temperature=1.0, seed=0))


def gate_threshold(setting: str, decoder: Decoder, sampling: SamplingParams = GREEDY) -> float:
    """The speculation gate's threshold for `sampling`'s kind of request (SANCTUM_MIN_TAU): a
    number as set, or ("auto") a round's cost in plain steps measured now, rounded down to a
    quarter (a margin, and mostly the same value run to run); 0.0 when the drafter does not
    answer the probe (one still loading elsewhere: no gate rather than a wait)."""
    if setting != "auto":
        return float(setting)
    try:
        cost = measure_break_even(decoder, sampling)
    except DraftUnavailable:
        log.warning("speculation gate off: the drafter did not answer the break-even probe")
        return 0.0
    gate = math.floor(cost * 4) / 4
    if cost:
        kind = "greedy" if sampling.greedy else "sampled"
        log.info("a %s speculative round costs %.2f plain steps: below tau %.2f, plain steps",
                 kind, cost, gate)  # fmt: skip
    return gate


def generate(
    target: Target,
    prompt_ids: list[int],
    *,
    drafter: Drafter | None = None,
    sampling: SamplingParams | None = None,
    max_tokens: int = 64,
    block_size: int | None = None,
    kv_mode: str = "fp16",
    eos_ids: set[int] | None = None,
    stop_check: StopCheck | None = None,
    profile: bool = False,
    accept_rule: str = "block",
    min_tau: float = 0.0,
    lookup_min: int | None = None,
) -> Iterator[Step]:
    """Decode `prompt_ids` in this process (speculatively when a drafter is given); `profile`:
    sync each phase of a round, for an exact round split; `accept_rule`: how sampled drafts
    are accepted (sampling.ACCEPT_RULES); `min_tau`: the speculation gate (0: off);
    `lookup_min`: drafts read from repeated text (`Decoder.lookup_min`; None: its default)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if accept_rule not in ACCEPT_RULES:
        raise ValueError(f"accept_rule must be one of {ACCEPT_RULES}, got {accept_rule!r}")
    sampling = sampling or SamplingParams()
    decoder = Decoder(target, drafter, LocalDraftPeer(drafter) if drafter else None, block_size)
    decoder.profile = profile
    decoder.accept_rule = accept_rule
    decoder.min_tau = decoder.min_tau_sampled = min_tau
    if lookup_min is not None:
        decoder.lookup_min = lookup_min
    eos = set(target.tokenizer.eos_token_ids) if eos_ids is None else eos_ids
    seq = decoder.new_sequence("local", kv_mode, sampling, max_tokens, eos, stop_check)
    key = make_key(sampling.seed)
    try:
        logits = decoder.prefill(seq, list(prompt_ids))
        key, sub = mx.random.split(key)
        yield decoder.start(seq, logits, sub)
        while seq.finished is None:
            key, sub = mx.random.split(key)
            yield decoder.step(seq, sub)
    finally:
        decoder.close(seq)
