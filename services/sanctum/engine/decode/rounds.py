"""Batched rounds: one round of each of N sequences, their blocks drafted in one drafter body
forward and verified in one target forward (engine/decode/batch.py). Each sequence keeps its own
caches, key, block and acceptance, so what it commits is what `Decoder.step` commits for it
alone; a sequence that cannot draft takes a plain step without holding back the others.

Knows nothing about scheduling, Ray or gRPC.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..kernels import cuda
from ..model.target import cache_offset
from .batch import verify_batch
from .decoder import Decoder
from .peer import DraftUnavailable
from .sequence import Prefetch, RoundStats, Sequence, Step


class BatchDecoder(Decoder):
    """A Decoder that can also step several sequences in one round (`step_batch`)."""

    # set during a shared round's settling: the sequences whose next block a pipelined peer
    # should draft, asked for together once all are settled (one call, one drafter forward)
    _deferred: list | None = None

    def step_batch(self, seqs: list[Sequence], keys: list[mx.array]) -> list[Step]:
        """One round of each sequence: the blocks of one width (all of them, unless adaptive
        width shrank some) drafted in one drafter forward, and all blocks verified in ONE
        target forward (the narrower ones padded at their end). Each sequence's output is what
        `step` gives it alone: its own key, width, acceptance, commit and rollback. Sampled
        sequences the speculation gate has step plainly take their plain steps in that forward
        too (greedy ones draft: below); sequences that cannot draft now (a drafter that is
        down) take a plain step instead. With `profile`, each phase is awaited before the next
        (the drafts, the verify's logits, the rollback), so the stats split the round exactly."""
        if self.peer is None or self.block_size <= 1 or len(seqs) < 2:
            return [self.step(seq, key) for seq, key in zip(seqs, keys)]
        steps: dict[int, Step] = {}
        groups: dict[int, list[int]] = {}  # width -> indices of the sequences drafting it
        plain = []  # indices of the sequences the speculation gate has step plainly
        for i, seq in enumerate(seqs):
            if self.take_gated_step(seq):
                plain.append(i)
            else:
                groups.setdefault(self.width(seq), []).append(i)
        if groups:  # a round others draft: a gated greedy sequence drafts too, since its plain
            # step would pay the round's padded rows for one token (greedy output is the same
            # either way; a seeded sample's draws are not, so sampled ones stay plain)
            for i in [i for i in plain if seqs[i].sampling.greedy]:
                seqs[i].plain_left = 0  # its stretch ends in this round, as alone it would
                groups.setdefault(self.width(seqs[i]), []).append(i)
            plain = [i for i in plain if not seqs[i].sampling.greedy]
        t0 = time.perf_counter()
        drafted = []  # (index, seq, drafts [width-1], q, accept key)
        for idx in groups.values():
            drafted += self._draft_group([seqs[i] for i in idx], [keys[i] for i in idx], idx, steps)
        drafted = self._cap_looked_up(drafted)
        if self.policy.profile:
            mx.eval([drafts for _, _, drafts, *_ in drafted])
        elif self.target.async_layers and drafted:  # a GPU drafts while Python builds the verify
            mx.async_eval([drafts for _, _, drafts, *_ in drafted])
        if drafted:
            gated = [(i, seqs[i], keys[i]) for i in plain]
            self._verify_all(drafted, time.perf_counter() - t0, steps, gated)
            for i, seq, *_ in drafted:
                self._watch(seq, steps[i])
        else:
            self._plain_steps(seqs, keys, plain, steps)
        return [steps[i] for i in range(len(seqs))]

    @staticmethod
    def _cap_looked_up(drafted: list) -> list:
        """Looked-up blocks no wider than the widest drafted block of the round, when one is
        drafted: the verify pads every block to the widest, and on a CPU a shared verify is
        bound by its rows, so a wide looked-up block would cost each other sequence its padding
        (docs/performance.md). All looked up:
        each its own width. A shorter block of the same continuation: the output is the same."""
        drafter_width = max((d.shape[0] for _, s, d, *_ in drafted if not s.looked_up), default=0)
        if not drafter_width:
            return drafted
        return [
            (i, s, d[:drafter_width] if s.looked_up else d, *rest) for i, s, d, *rest in drafted
        ]

    def _plain_steps(self, seqs, keys, idx: list[int], steps: dict) -> None:
        """The plain steps of the gated sequences `idx` in a round where none drafts, in one
        target forward ([N, 1]; one sequence: `_plain_step`): each samples its token with its
        own key, as `step` does."""
        if len(idx) <= 1:
            for i in idx:
                steps[i] = self._plain_step(seqs[i], keys[i], gated=True)
            return
        t0 = time.perf_counter()
        group = [seqs[i] for i in idx]
        anchors = mx.array([[seq.anchor] for seq in group])
        caches = [seq.cache for seq in group]
        outs, _ = verify_batch(self.target, anchors, caches, self.tap_ids, taped=False)
        for i, seq, (logits, taps, _) in zip(idx, group, outs):
            steps[i] = self._settle_plain(seq, logits, taps, keys[i], t0, gated=True)
            steps[i].stats.verify_s /= len(idx)  # the shared forward's time, split

    def _draft_group(self, seqs, keys, idx, steps: dict) -> list:
        """Draft the blocks of one width group in one drafter forward; a sequence that cannot
        draft takes its plain step (into `steps`) now."""
        drafted = []
        split = [mx.random.split(key) for key in keys]  # (draft key, accept key), as in `step`
        proposals = self._draft_all(seqs, [k[0] for k in split])
        for i, seq, key, proposal, (_, k_acc) in zip(idx, seqs, keys, proposals, split):
            if proposal is None:  # as in `step`: a plain step, the drafter reopens later
                steps[i] = self._plain_step(seq, key)
            else:
                drafted.append((i, seq, *proposal, k_acc))
        return drafted

    def _verify_all(self, drafted: list, draft_s: float, steps: dict, gated: list) -> None:
        """Verify every drafted block in one target forward, settle each sequence, then roll
        all of them back together (`Target.rollback_batch`). The `gated` sequences (index,
        seq, key) take their plain steps in the same forward, as blocks of their anchor alone:
        a forward of their own cost a round's fixed part again (on a GPU all its launches),
        where a block of one row costs its padded rows; the rollback keeps that row."""
        t1 = time.perf_counter()
        blocks = [
            mx.concatenate([mx.array([seq.anchor]), drafts.astype(mx.int32)])
            for _, seq, drafts, _, _ in drafted
        ] + [mx.array([seq.anchor]) for _, seq, _ in gated]
        widths = [b.shape[0] for b in blocks]
        L = cuda.verify_width(max(widths), len(blocks))
        padded = mx.stack([mx.pad(b, (0, L - b.shape[0])) for b in blocks])  # [N, L]
        caches = [seq.cache for _, seq, *_ in drafted + gated]
        outs, tape = verify_batch(self.target, padded, caches, self.tap_ids, widths)
        if self.policy.profile:
            mx.eval([logits for logits, _, _ in outs])
        # the shared phases' wall time, split over the batch
        draft_s, verify_s = draft_s / len(drafted), (time.perf_counter() - t1) / len(blocks)
        self._deferred = []
        try:
            for (i, seq, drafts, q, k_acc), block, out in zip(drafted, blocks, outs):
                stats = RoundStats(block.shape[0], 0, 0, draft_s, verify_s)
                stats.looked_up = seq.looked_up
                steps[i] = self._conclude(seq, block, drafts, q, out, k_acc, stats)
            deferred = self._deferred
        finally:
            self._deferred = None
        for (i, seq, key), (logits, taps, _) in zip(gated, outs[len(drafted) :]):
            steps[i] = self._settle_plain(seq, logits, taps, key, time.perf_counter(), gated=True)
            steps[i].stats.verify_s = verify_s
        self._prefetch_together(deferred)  # the drafter works while the caches roll back
        settled = [steps[i] for i, *_ in drafted]
        t2 = time.perf_counter()
        keeps = [len(step.tokens) for step in settled] + [1] * len(gated)  # a plain step's row
        self._queue_rollback(self.target.rollback_batch(caches, tape, keeps))
        rollback_s = (time.perf_counter() - t2) / len(blocks)
        for step in settled + [steps[i] for i, *_ in gated]:
            step.stats.rollback_s = rollback_s

    def _prefetch(self, seq: Sequence, start: int) -> None:
        if self._deferred is not None and self.pipelined and hasattr(self.peer, "submit_batch"):
            self._deferred.append((seq, start))
        else:
            super()._prefetch(seq, start)

    def _prefetch_together(self, asked: list) -> None:
        """`_prefetch` for a shared round's sequences: one call per block width (the blocks
        are stacked), each sequence collecting its part next round as a prefetch of its own."""
        groups: dict[int, list] = {}
        for seq, start in asked:
            if seq.finished is None and seq.prefetch is None and self._lookup(seq) is None:
                groups.setdefault(self.width(seq), []).append((seq, start))
        for width, group in groups.items():
            if len(group) == 1:
                super()._prefetch(*group[0])
                continue
            seqs = [seq for seq, _ in group]
            try:
                for seq in seqs:
                    self._open_draft(seq)
                embeds = mx.stack([self._block_embeds(seq.anchor, width) for seq in seqs])
                parts = self.peer.submit_batch(
                    [seq.seq_id for seq in seqs],
                    [seq.taps.unsent() for seq in seqs],
                    embeds,
                    [start for _, start in group],
                )
            except DraftUnavailable:
                for seq in seqs:  # the taps stay pending; the next round drafts as usual
                    seq.draft_open = False
                continue
            for (seq, start), part in zip(group, parts):
                seq.prefetch = Prefetch(part, seq.taps.sent, start, seq.anchor)
                seq.taps.sent = seq.taps.end

    def _draft_all(self, seqs: list[Sequence], keys: list[mx.array]) -> list:
        """(drafts, q) of each sequence, or None where it cannot draft now: one drafter body
        forward and one head matmul for all when the peer drafts batches (in this process),
        but for the sequences whose block is read from their own tokens (`Decoder._lookup`)."""
        draft_batch = getattr(self.peer, "draft_batch", None)
        if draft_batch is None or self.pipelined:
            out = []
            for seq, key in zip(seqs, keys):
                try:
                    out.append(self._draft(seq, seq.sampling, key))
                except DraftUnavailable:
                    seq.draft_open = False
                    out.append(None)
            return out
        out: list = [None] * len(seqs)
        asked = []  # the sequences the drafter drafts for: those whose block is not looked up
        for n, seq in enumerate(seqs):
            out[n] = self._read_block(seq)
            if out[n] is None:
                asked.append(n)
        if asked:
            drafted = self._draft_batch([seqs[n] for n in asked], [keys[n] for n in asked])
            for n, proposal in zip(asked, drafted):
                out[n] = proposal
        return out

    def _draft_batch(self, seqs: list[Sequence], keys: list[mx.array]) -> list:
        """`_draft_all` through the peer's `draft_batch`: one body forward for all `seqs`."""
        draft_batch = self.peer.draft_batch
        try:
            for seq in seqs:
                self._open_draft(seq)
            embeds = mx.stack(
                [self._block_embeds(s.anchor, self.width(s)) for s in seqs]
            )  # [N, L, H]
            taps = [seq.taps.unsent() for seq in seqs]
            hidden = draft_batch(
                [seq.seq_id for seq in seqs], taps, embeds, [cache_offset(s.cache) for s in seqs]
            )  # [N, L-1, H]
        except DraftUnavailable:
            for seq in seqs:
                seq.draft_open = False
            return [None] * len(seqs)
        N, R, H = hidden.shape
        logits = self.head.logits(cuda.pad_rows(hidden.reshape(N * R, H)))[: N * R]
        logits = logits.reshape(N, R, -1)  # [N, L-1, V]
        out: list = [None] * N
        greedy = [n for n, s in enumerate(seqs) if s.sampling.greedy] if self.cfg.is_v2 else []
        if len(greedy) > 1:  # DFlash 2's greedy selections of all blocks in one pass
            rows = mx.array(greedy)
            anchors = mx.array([seqs[n].anchor for n in greedy])
            tokens = self.head.select_greedy(hidden[rows], logits[rows], anchors)
            for j, n in enumerate(greedy):
                out[n] = (tokens[j], None)
        for n, (seq, key) in enumerate(zip(seqs, keys)):
            seq.taps.sent = seq.taps.end
            if out[n] is None:
                out[n] = self._propose(seq, hidden[n], logits[n], seq.sampling, key)
        return out
