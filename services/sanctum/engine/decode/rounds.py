"""Batched rounds: one round of each of N sequences, their blocks drafted in one drafter body
forward and verified in one target forward (engine/decode/batch.py). Each sequence keeps its own
caches, key, block and acceptance, so what it commits is what `Decoder.step` commits for it
alone; a sequence that cannot draft takes a plain step without holding back the others.

Knows nothing about scheduling, Ray or gRPC.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..kernels import cuda
from ..model.target import cache_offset
from .batch import verify_batch
from .decoder import Decoder
from .peer import DraftUnavailable
from .policy import LOOKUP_MAX_WIDTH
from .sampling import greedy_acceptance_batch
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
        tails = []  # indices of the sequences whose prompt's tail runs now (`Decoder.ride`)
        for i, seq in enumerate(seqs):
            if seq.tail is not None:
                tails.append(i)
            elif self.take_gated_step(seq):
                plain.append(i)
            else:
                groups.setdefault(self.width(seq), []).append(i)
        if groups or tails:  # a round others draft or tails run in: a gated greedy sequence
            # drafts too, since its plain step would pay the round's padded rows for one token
            # (greedy output is the same either way; a seeded sample's draws are not, so
            # sampled ones stay plain)
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
        if drafted or len(tails) > 1 or (tails and plain):
            # the tails ride together even where nothing drafts (say the drafter is down):
            # each one's own prefill, one after another, cost the others a forward each
            gated = [(i, seqs[i], keys[i]) for i in plain]
            riders = [(i, seqs[i], keys[i]) for i in tails]
            self._verify_all(drafted, time.perf_counter() - t0, steps, gated, riders)
            for i, seq, *_ in drafted:
                self._watch(seq, steps[i])
        else:
            self._plain_steps(seqs, keys, plain, steps)
        for i in tails:  # a tail alone in its round: its own prefill, as `step` runs it
            if i not in steps:
                steps[i] = self.step(seqs[i], keys[i])
        return [steps[i] for i in range(len(seqs))]

    def warm(self, sizes, rounds: int = 2, kv_mode: str = "fp16") -> dict[int, float]:
        """Shared rounds at each batch size in `sizes` (>= 2) on throwaway greedy sequences of
        different lengths, then one shared plain step; with lookup on, rounds of every
        looked-up width a block can grow to (`lookup_widths`) at each size, one sequence's
        included. What a server runs once at load, so that the graphs of each size and width
        (compiled layers traced per shape; on a GPU their kernels built) exist before a
        second, fifth or eighth stream joins or the streams copy text, instead of stalling
        every running stream in that round. Returns seconds per size."""
        if self.peer is None or self.block_size <= 1:
            return {}
        prompt = self.target.tokenizer.encode("def warm(values):\n    return sorted(values)[:8]\n")
        widths = self.lookup_widths()
        spent = {}
        for n in sorted({int(n) for n in sizes if int(n) >= (1 if widths else 2)}):
            t0 = time.perf_counter()
            seqs = [
                self.new_sequence(f"warm-{n}-{i}", kv_mode, max_tokens=1 << 30) for i in range(n)
            ]
            keys = [mx.random.key(i) for i in range(n)]
            try:
                for i, seq in enumerate(seqs):  # lengths differ: ragged caches, as served
                    self.start(seq, self.prefill(seq, prompt[: 1 + i % len(prompt)]), keys[i])
                if n > 1:
                    for _ in range(rounds):
                        self.step_batch(seqs, keys)
                    self._plain_steps(seqs, keys, list(range(n)), {})
                for width in widths:
                    for _ in range(rounds):
                        for seq in seqs:
                            _look_up_next(seq, width)
                        if n > 1:
                            self.step_batch(seqs, keys)
                        else:
                            self.step(seqs[0], keys[0])
                mx.synchronize()
            finally:
                for seq in seqs:
                    self.close(seq)
            spent[n] = time.perf_counter() - t0
        return spent

    def lookup_widths(self) -> list[int]:
        """The widths past the drafter's that a looked-up block grows to (policy.next_width:
        doubling while accepted whole), none with lookup off: a round of sequences that all
        copy text verifies blocks that wide."""
        if not self.policy.lookup_min:
            return []
        widths, width = [], self.block_size
        while min(LOOKUP_MAX_WIDTH, 2 * width) > width:
            width = min(LOOKUP_MAX_WIDTH, 2 * width)
            widths.append(width)
        return widths

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
        tokens = mx.stack(
            [
                self._token(logits, seq.sampling, keys[i])
                for i, seq, (logits, *_) in zip(idx, group, outs)
            ]
        ).tolist()  # one read for all
        for i, seq, (logits, taps, _), token in zip(idx, group, outs, tokens):
            steps[i] = self._settle_plain(seq, logits, taps, keys[i], t0, True, token)
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

    def _verify_all(
        self, drafted: list, draft_s: float, steps: dict, gated: list, riders: list = ()
    ) -> None:
        """Verify every drafted block in one target forward, settle each sequence, then roll
        all of them back together (`Target.rollback_batch`). The `gated` sequences (index,
        seq, key) take their plain steps in the same forward, as blocks of their anchor alone:
        a forward of their own cost a round's fixed part again (on a GPU all its launches),
        where a block of one row costs its padded rows; the rollback keeps that row. The
        `riders` (index, seq, key) run their prompt tails in it, as blocks of those tokens, all
        kept, each at most as wide as the widest drafted block (no row padded for it; a longer
        tail goes on in the next rounds, its step committing nothing until it ends): a first
        token comes from its tail's last row, as `start` takes it."""
        t1 = time.perf_counter()
        riders = list(riders)
        blocks = [drafts for _, _, drafts, *_ in drafted]
        # with no drafted block, the tails run a drafter block's rows: the shapes of any round
        widest = 1 + max((block.shape[0] for block in blocks), default=self.block_size - 1)
        blocks += [
            mx.array(seq.tail[1 : _tail_rows(seq, widest)], mx.int32) for _, seq, _ in riders
        ]
        extra = riders + gated  # no drafts to accept: a token from each one's last row
        anchors = [seq.anchor for _, seq, *_ in drafted] + [seq.tail[0] for _, seq, _ in riders]
        anchors += [seq.anchor for _, seq, _ in gated]
        widths = [1 + block.shape[0] for block in blocks] + [1] * len(gated)
        L = cuda.verify_width(max(widths), len(widths))
        padded = assemble_blocks(anchors, blocks, L)  # [N, L]
        caches = [seq.cache for _, seq, *_ in drafted + extra]
        starts = [cache_offset(c) for c in caches]
        outs, tape = verify_batch(self.target, padded, caches, self.tap_ids, widths)
        if self.policy.profile:
            mx.eval([logits for logits, _, _ in outs])
        t2 = time.perf_counter()
        reads, tokens = self._accept_all(drafted, extra, padded, outs, widths)
        # the shared phases' wall time, split over the batch (the forward is awaited in the read)
        draft_s, verify_s = draft_s / max(1, len(drafted)), (time.perf_counter() - t1) / len(widths)
        extra_outs = outs[len(drafted) :]
        self._deferred = []
        try:
            for (i, seq, drafts, q, k_acc), w, out, read in zip(drafted, widths, outs, reads):
                stats = RoundStats(w, 0, 0, draft_s, verify_s)
                stats.looked_up = seq.looked_up
                steps[i] = self._conclude(seq, None, drafts, q, out, k_acc, stats, None, read)
            for (i, seq, _), (_, taps, _), token, start, rows in zip(
                riders, extra_outs, tokens, starts[len(drafted) :], widths[len(drafted) :]
            ):
                steps[i] = self._settle_tail(seq, rows, taps, start, token)
            deferred = self._deferred
        finally:
            self._deferred = None
        for (i, seq, key), (logits, taps, _), token in zip(
            gated, extra_outs[len(riders) :], tokens[len(riders) :]
        ):
            steps[i] = self._settle_plain(seq, logits, taps, key, t2, True, token)
            steps[i].stats.verify_s = verify_s
        self._prefetch_together(deferred)  # the drafter works while the caches roll back
        settled = [steps[i] for i, *_ in drafted]
        t2 = time.perf_counter()
        # a drafted block keeps its committed rows; a tail's part and a plain step, all of theirs
        keeps = [len(step.tokens) for step in settled] + widths[len(drafted) :]
        self._queue_rollback(self.target.rollback_batch(caches, tape, keeps))
        for _, seq, _ in riders:  # a stop's callback sees the cache as `prefill` leaves it there
            if seq.on_tail_stop is not None and len(seq.cached_tokens) in seq.tail_stops:
                seq.on_tail_stop(len(seq.cached_tokens))
        rollback_s = (time.perf_counter() - t2) / len(widths)
        for step in settled + [steps[i] for i, *_ in gated]:
            step.stats.rollback_s = rollback_s

    def _settle_tail(self, seq: Sequence, rows: int, taps, start: int, token: int) -> Step:
        """A rider's first `rows` tail tokens after the shared forward (their taps, the cache
        offset they started at, the token the last row gave): in the cache and the taps, as
        `prefill` leaves them; once the tail ends, its first token committed, as `start`
        commits it. Before that, a step of no tokens."""
        part, rest = seq.tail[:rows], seq.tail[rows:]
        self._prompt_read(seq, part, taps)
        seq.tail = rest or None
        return Step([], None) if rest else self._first_token(seq, token, start + rows)

    def _accept_all(self, drafted, extra, blocks, outs, widths) -> tuple[list, list[int]]:
        """The acceptance of every block of a shared round in one evaluation and one host read:
        (count, bonus, block ids) of each drafted block, and the token after the last row of
        each `extra` sequence (index, seq, key: a riding tail or a gated plain step, after the
        drafted ones in `outs`). Greedy blocks are judged together; sampled ones each with its
        own key, as alone."""
        N, L = blocks.shape
        num_drafted = len(drafted)
        if any(seq.sampling.greedy for _, seq, *_ in drafted):
            run, bonus = greedy_acceptance_batch(blocks, [out[0] for out in outs], widths)
        else:  # (read from `singles` below)
            run = bonus = mx.zeros((N,), mx.int32)
        singles = []  # [] arrays: each sampled block's (count, token), then each extra's token
        for (_, seq, drafts, q, k_acc), (logits, _, _) in zip(drafted, outs):
            if not seq.sampling.greedy:
                singles += self._sampled_acceptance(drafts, q, logits, seq.sampling, k_acc)
        for (_, seq, key), (logits, _, _) in zip(extra, outs[num_drafted:]):
            singles.append(self._token(logits, seq.sampling, key))
        parts = [mx.concatenate([run[:, None], bonus[:, None], blocks], axis=1).reshape(-1)]
        if singles:
            parts.append(mx.stack(singles).astype(mx.int32))
        flat = (mx.concatenate(parts) if len(parts) > 1 else parts[0]).tolist()
        table = [flat[n * (L + 2) : (n + 1) * (L + 2)] for n in range(N)]
        extra = iter(flat[N * (L + 2) :])
        reads = []
        for (_, seq, *_), row, w in zip(drafted, table, widths):
            count, token = (row[0], row[1]) if seq.sampling.greedy else (next(extra), next(extra))
            reads.append((count, token, row[2 : 2 + w]))
        return reads, list(extra)

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
                embeds = self._blocks_embeds([seq.anchor for seq in seqs], width)
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
            embeds = self._blocks_embeds([s.anchor for s in seqs], self.width(seqs[0]))  # [N, L, H]
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
        greedy = [n for n, s in enumerate(seqs) if s.sampling.greedy]
        if len(greedy) > 1:  # the greedy drafts of all blocks in one pass
            every = len(greedy) == N
            rows = None if every else mx.array(greedy)
            chosen = logits if every else logits[rows]
            if self.cfg.is_v2:  # DFlash 2's selections
                anchors = mx.array([seqs[n].anchor for n in greedy])
                tokens = self.head.select_greedy(hidden if every else hidden[rows], chosen, anchors)
            else:
                tokens = mx.argmax(chosen, axis=-1)
            # one split of the flat rows: each block's drafts [L-1] without a node of its own
            for n, drafts in zip(greedy, mx.split(tokens.reshape(-1), len(greedy))):
                out[n] = (drafts, None)
        for n, (seq, key) in enumerate(zip(seqs, keys)):
            seq.taps.sent = seq.taps.end
            if out[n] is None:
                out[n] = self._propose(seq, hidden[n], logits[n], seq.sampling, key)
        return out


class _Repeats:
    """A warm-up sequence's stand-in for its TokenIndex (lookup.py): every round finds a
    continuation (its anchor repeated), so the round verifies a looked-up block."""

    @staticmethod
    def continuation(tokens, anchor: int, count: int, min_match: int) -> np.ndarray:
        return np.full(count, anchor, np.int32)


def _look_up_next(seq: Sequence, width: int) -> None:
    """Have a warm-up sequence's next round verify a looked-up block of `width` rows: its
    lookup always finds one that wide, and the speculation gate, which would have a sequence
    that rejects every round step plainly, is kept in its warm-up."""
    seq.lookup, seq.lookup_width = _Repeats(), width
    seq.gate_rounds = seq.plain_left = 0


def _tail_rows(seq: Sequence, widest: int) -> int:
    """The rows of `seq`'s prompt tail a shared round runs: at most `widest`, and ending at
    its next stop."""
    at = len(seq.cached_tokens)
    stops = [s - at for s in seq.tail_stops if s > at]
    return min([len(seq.tail), widest] + stops)


def assemble_blocks(anchors: list[int], drafts: list[mx.array], width: int) -> mx.array:
    """[N, width] int32: each sequence's anchor then its drafts, zero-padded at its end (the
    anchors past `len(drafts)` stand alone), gathered from one flat array of all the rows."""
    N = len(anchors)
    if drafts:
        common = drafts[0].dtype  # token ids: any integer type holds them exactly
        flat = mx.concatenate([d.astype(common) for d in drafts]).astype(mx.int32)
        flat = mx.concatenate([mx.array(anchors + [0], mx.int32), flat])
    else:
        flat = mx.array(anchors + [0], mx.int32)
    index = np.full((N, width), N, np.int32)  # the zero after the anchors
    index[:, 0] = np.arange(N)
    first = N + 1
    for n, d in enumerate(drafts):
        index[n, 1 : 1 + d.shape[0]] = np.arange(first, first + d.shape[0])
        first += d.shape[0]
    return flat[mx.array(index)]
