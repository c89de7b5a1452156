"""The drafting half of a Decoder: the next block's drafts, from wherever they come. In order:
a block read from the sequence's own tokens (lookup.py), a block drafted ahead on the previous
round's acceptance, a block a pipelined peer drafted meanwhile (a prefetch), or a block drafted
now; then the head's logits and the proposal (greedy drafts, or sampled ones with their q).

`Drafting` holds no state of its own: `Decoder` sets the target, drafter head, config, peer,
policy and block size it reads.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..kernels import cuda
from ..model.target import cache_offset
from .peer import DraftUnavailable
from .sampling import SamplingParams, greedy_acceptance, probabilities, sample
from .sequence import NextBlock, Prefetch, Sequence


class Drafting:
    """Decoder's drafting methods (see the module docstring)."""

    def _open_draft(self, seq: Sequence) -> None:
        if not seq.draft_open:
            if self.peer.open(seq.seq_id):  # a fresh session: the context goes again
                seq.taps.resend()
            seq.draft_open = True

    def width(self, seq: Sequence) -> int:
        """The block size `seq` drafts this round."""
        return seq.width or self.block_size

    def _block_embeds(self, anchor: int | mx.array, size: int) -> mx.array:
        """[L, H]: the anchor's embedding, then L-1 mask embeddings (`anchor`: a token, or
        one as an array [1] not evaluated yet)."""
        ids = anchor if isinstance(anchor, mx.array) else mx.array([anchor])
        anchor_embed = self.target.embed_tokens(ids)
        return mx.concatenate([anchor_embed, mx.repeat(self.mask_embed, size - 1, 0)])

    def _blocks_embeds(self, anchors: list[int], size: int) -> mx.array:
        """[N, L, H]: `_block_embeds` of N anchors at once (one embedding lookup)."""
        anchor_embeds = self.target.embed_tokens(mx.array(anchors))[:, None]  # [N, 1, H]
        N, _, H = anchor_embeds.shape
        masks = mx.broadcast_to(self.mask_embed[None], (N, size - 1, H))
        return mx.concatenate([anchor_embeds, masks], axis=1)

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
        if self.policy.profile:
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
        greedy sequences whose last `lookup_min` tokens repeat (engine/decode/lookup.py). As many as
        the drafter's, or more after looked-up blocks accepted whole (`lookup_width`) while the
        earlier text goes on that far."""
        if not self.policy.lookup_min or not seq.sampling.greedy or seq.anchor is None:
            return None
        if seq.lookup_width is not None:
            found = self._continuation(seq, seq.lookup_width - 1)
            if found is not None:
                return found
            seq.lookup_width = None  # the repeat ends sooner: the drafter's width again
        return self._continuation(seq, self.width(seq) - 1)

    def _continuation(self, seq: Sequence, count: int):
        return seq.lookup.continuation(seq.cached_tokens, seq.anchor, count, self.policy.lookup_min)

    def _draft_piece(self, name: str, *outputs) -> None:
        """With `profile`: evaluate `outputs` and add the time since the last piece to
        `draft_pieces[name]` (for the body of an in-process drafter, "body_build" is the host
        building its graph and "body" the evaluation after)."""
        if not self.policy.profile:
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
