"""The Decoder: runs a sequence on the target, speculatively when a drafter head and peer are
given. A round drafts a block, verifies it in one target forward, accepts, commits and rolls
the rest back; without a drafter (or gated) a step is one plain token. Its policy is fixed at
construction (policy.py); design and host syncs: docs/design/round.md.

Host syncs: a greedy plain step queues the next step's forward on the lazy token before it
reads this one, so the host builds step n+1 while the device computes step n; when the request
then stops, that forward is undone, so the cache holds exactly the committed tokens. A round
syncs once, on acceptance (`policy.profile` syncs each phase instead, for an exact split).

The drafter body is reached through a `DraftPeer`, a plain object in one process
(`LocalDraftPeer`) or a proxy to a drafter actor: this module does not know which.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import replace

import mlx.core as mx

from ..model.drafter import Drafter, DraftHead
from ..model.target import Target, cache_offset
from .drafting import Drafting
from .peer import MAX_PENDING_TAP_ROWS, DraftPeer, DraftUnavailable
from .policy import (
    DecodePolicy,
    drafts_ahead,
    next_width,
    resolved,
    take_gated_step,
    watch_round,
)
from .sampling import (
    SamplingParams,
    accept_block,
    accept_greedy,
    accept_sampled,
    block_rule_acceptance,
    greedy_tokens,
    probabilities,
    sample,
    token_rule_acceptance,
)
from .sequence import GREEDY, Ahead, RoundStats, Sequence, Step, StopCheck
from .taps import TapLog


class Decoder(Drafting):
    """Runs a sequence on the target, speculatively when a drafter head and peer are given."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        peer: DraftPeer | None = None,
        block_size: int | None = None,
        policy: DecodePolicy | None = None,
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
        self.policy = resolved(policy or DecodePolicy(), target, self.peer)
        # with `policy.profile`: seconds of each piece of each draft (`_draft_piece`)
        self.draft_pieces: dict[str, list[float]] = {}
        self._piece_t = 0.0  # when the last piece ended
        if self.cfg is not None:
            self.mask_embed = target.embed_tokens(mx.array([self.cfg.mask_token_id]))  # [1, H]

    def with_policy(self, **changes) -> Decoder:
        """This decoder (the same target, drafter and peer) with `changes` to its policy: for a
        value measured on a decoder, such as the gate's "auto" threshold."""
        other = copy.copy(self)
        other.policy = replace(self.policy, **changes)
        other.draft_pieces = {}
        return other

    # the policy values serving reports
    min_tau = property(lambda self: self.policy.min_tau)
    min_tau_sampled = property(lambda self: self.policy.min_tau_sampled)
    lookup_min = property(lambda self: self.policy.lookup_min)

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
        self._prompt_read(seq, tokens, taps)
        return logits

    def _prompt_read(self, seq: Sequence, tokens: list[int], taps) -> None:
        """`tokens` of the prompt are in the cache now; their taps are kept for the drafter."""
        seq.cached_tokens.extend(tokens)
        if self.head is not None:
            seq.taps.add(taps)

    def start(self, seq: Sequence, logits: mx.array, key: mx.array) -> Step:
        """Commit the first token from the prefill logits."""
        token = self._sample_one(logits, seq.sampling, key)
        return self._first_token(seq, token, cache_offset(seq.cache))

    def _first_token(self, seq: Sequence, token: int, position: int) -> Step:
        """Commit the first token, sampled after the prompt's rows (which end at `position`);
        the drafter may start on the first block."""
        step = self._commit(seq, [token], None, stats=None)
        self._prefetch(seq, position)
        if self._runs_ahead(seq.sampling) and seq.finished is None:
            seq.ahead = self._queue_step(seq, mx.array([seq.anchor]))
        return step

    def ride(self, seq: Sequence, tokens: list[int], stops: tuple[int, ...] = (), on_stop=None):
        """Leave the prompt's last `tokens` (after what the cache holds) to the sequence's
        first rounds: alone, `step` prefills them and starts (as `prefill` + `start` would);
        in shared rounds they run in the rounds' target forwards beside the others' blocks
        (BatchDecoder), so a newcomer's short prompt costs the running sequences no forward
        of its own. `stops`, `on_stop`: as `prefill` takes them (a forward ends at each stop,
        then `on_stop(position)` sees the cache there)."""
        if not tokens or seq.anchor is not None:
            raise ValueError("a tail is the prompt's last tokens, before the first token")
        seq.tail, seq.tail_stops, seq.on_tail_stop = list(tokens), tuple(stops), on_stop

    def step(self, seq: Sequence, key: mx.array) -> Step:
        """One round: speculative when possible (and not gated), else one plain token; for a
        sequence with a prompt tail (`ride`), its prefill and first token."""
        if seq.tail is not None:
            tail, seq.tail = seq.tail, None
            logits = self.prefill(seq, tail, seq.tail_stops, seq.on_tail_stop)
            return self.start(seq, logits, key)
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
        take plain steps (policy.py)."""
        return take_gated_step(seq)

    def _watch(self, seq: Sequence, step: Step) -> None:
        """The speculation gate after a round of `seq`; a plain stretch drops the next block
        drafted or asked for already."""
        if step.stats is None or step.stats.bs <= 1:
            return
        if watch_round(self.policy, seq, step.stats.accepted):
            seq.next_block = None
            if seq.prefetch is not None:  # (its context rows stay with the drafter)
                self.peer.discard(seq.prefetch.handle)
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
        return int(self._token(logits, params, key).item())

    def _token(self, logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
        """`_sample_one` unevaluated: the token [] after the last row of `logits`."""
        if params.greedy:
            return greedy_tokens(logits[-1:])[0]
        return sample(probabilities(logits[-1:], params), key)[0]

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
        self,
        seq: Sequence,
        logits,
        taps,
        key: mx.array,
        t0: float,
        gated: bool = False,
        token: int | None = None,
    ) -> Step:
        """A plain step after its forward (the anchor's logits and taps, started at `t0`):
        sample, keep the taps for the drafter, commit. `gated`: taken by the speculation gate;
        `token`: already sampled (a shared round reads all its sequences' tokens at once)."""
        if token is None:
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

    def _accept(self, drafts, q, logits, params, key) -> tuple[int, int]:
        """(accepted drafts, bonus token) by the greedy rule, or by `accept_rule`."""
        if params.greedy:
            return accept_greedy(drafts, logits)
        rule = accept_block if self.policy.accept_rule == "block" else accept_sampled
        return rule(drafts, q, probabilities(logits, params), key)

    def _sampled_acceptance(self, drafts, q, logits, params, key) -> tuple[mx.array, mx.array]:
        """`_accept` of a sampled block, unevaluated: (count [], next token []), the same draws."""
        if self.policy.accept_rule == "block":
            rule = block_rule_acceptance
        else:
            rule = token_rule_acceptance
        return rule(drafts, q, probabilities(logits, params), key)

    def _speculative_round(self, seq: Sequence, key: mx.array) -> Step:
        k_draft, k_accept = mx.random.split(key)
        t0 = time.perf_counter()
        drafts, q = self._draft(seq, seq.sampling, k_draft)
        if self.policy.profile:
            mx.eval(drafts)
        elif self.target.async_layers:  # a GPU drafts while Python builds the verify
            mx.async_eval(drafts)
        t1 = time.perf_counter()
        block = mx.concatenate([mx.array([seq.anchor]), drafts.astype(mx.int32)])
        verified = self.target.verify(block, seq.cache, self.tap_ids)
        t2 = time.perf_counter()
        ahead = drafts_ahead(self.policy, seq)
        acceptance = self._draft_next(seq, drafts, verified) if ahead else None
        t3 = time.perf_counter()
        stats = RoundStats(block.shape[0], 0, 0, t1 - t0 + t3 - t2, t2 - t1)
        stats.looked_up = seq.looked_up
        return self._settle(seq, block, drafts, q, verified, k_accept, stats, acceptance)

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
        self,
        seq,
        block,
        drafts,
        q,
        verified,
        k_accept,
        stats: RoundStats,
        acceptance=None,
        read: tuple[int, int, list[int]] | None = None,
    ) -> Step:
        """The round after its verify up to the rollback: accept, commit, hand the taps on,
        prefetch. The cache is then rolled back to the anchor and the committed tokens but the
        last (the next anchor): `len(step.tokens)` rows of the block. `acceptance`: the
        unevaluated (count, bonus) a block was drafted ahead on (`_draft_next`); `read`:
        (count, bonus, block ids) a shared round read already for all its sequences."""
        logits, taps, tape = verified
        seq.last_tape = tape
        t1 = time.perf_counter()
        if read is not None:
            accepted, bonus, block_ids = read
        elif acceptance is not None:
            accepted, bonus = (int(a.item()) for a in acceptance)
        else:
            accepted, bonus = self._accept(drafts, q, logits, seq.sampling, k_accept)
        t2 = time.perf_counter()
        if read is None:
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
        # before the prefetch, which drafts (or looks up) the next block at its new width
        next_width(self.policy, seq, self.block_size, stats.bs, accepted, stats.looked_up)
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
        (mx.eval if self.policy.profile else mx.async_eval)(states)
