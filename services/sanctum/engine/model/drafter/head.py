"""The drafter head: the LM head over a draft block, and DFlash 2's candidate selection."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...kernels import platform
from . import body
from .config import DrafterConfig

# When sampling, DFlash 2's selector re-scores the body's top this many tokens, not its trained
# top-k (16): a token the target samples is often outside the top 16, where q would be zero and
# the draft always rejected (the rejection rule takes whatever q the drafts were drawn from, so
# any pool is lossless). Greedy keeps the trained top-k, the reference's. On the default pair
# (`sanctum bench tau --contexts 0,1024 --num-prompts 8 --block-sizes 8 --temperatures 0.7,1`,
# contexts 0 / 1K): T 0.7 tau 2.36 / 2.23 with 16, 2.59 / 2.53 with 128, 2.46 / 2.59 with 256;
# T 1: 1.70 / 1.65, 2.01 / 2.06, 1.91 / 2.04 (the body's whole distribution, as DFlash drafts:
# 2.11 / 1.99 and 2.19 / 1.98).
SAMPLING_CANDIDATES = 128


# On a GPU, above this vocabulary the top-k runs in two stages (`top_candidates`).
TWO_STAGE_VOCAB = 32768
CHUNK = 1024


def chunk_length(vocab: int) -> int:
    """The two-stage top-k's chunk: the largest divisor of the vocabulary from CHUNK / 2 to
    CHUNK (Qwen3.5's 248,320 = 256 x 970), so that no padding is filled and concatenated every
    draft; CHUNK where there is none."""
    return next((c for c in range(CHUNK, CHUNK // 2 - 1, -1) if vocab % c == 0), CHUNK)


def top_candidates(logits: mx.array, k: int, two_stage: bool | None = None) -> mx.array:
    """The indices of the k largest logits of each row ([..., V] -> [..., k], in no order).

    `two_stage` (default: on a GPU, over a vocabulary above TWO_STAGE_VOCAB): each chunk of
    `chunk_length` logits its own top k, then the top k of those. It is exact (a row's top k
    are each in their chunk's top k); on a GPU, where a partition of a 248K-long row sorts it,
    sorting short rows is far cheaper. By default on the CPU, where MLX's partition is costly
    per element, the rows are pruned first (`_top_by_chunk_max`)."""
    V = logits.shape[-1]
    if two_stage is None:
        on_cpu = platform.current().is_cpu
        if on_cpu and (size := _pruning_chunk(V, k)):
            return _top_by_chunk_max(logits, k, size)
        two_stage = not on_cpu and V > TWO_STAGE_VOCAB
    if not two_stage or k > CHUNK:
        return mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    size = chunk_length(V)
    chunks = -(-V // size)
    if (pad := chunks * size - V) > 0:
        fill = mx.full((*logits.shape[:-1], pad), -mx.inf, logits.dtype)
        logits = mx.concatenate([logits, fill], axis=-1)
    split = logits.reshape(*logits.shape[:-1], chunks, size)
    local = mx.argpartition(-split, k - 1, axis=-1)[..., :k]  # [..., chunks, k]
    values = mx.take_along_axis(split, local, axis=-1).reshape(*logits.shape[:-1], chunks * k)
    index = (local + mx.arange(chunks)[:, None] * size).reshape(values.shape)
    best = mx.argpartition(-values, k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(index, best, axis=-1)


def _pruning_chunk(vocab: int, k: int) -> int | None:
    """`_top_by_chunk_max`'s chunk for a top k over `vocab`, or None where pruning would not
    pay (too few chunks) or the chunks would not divide the row. 32 for a greedy top 16, 16
    for sampling's 128 (the faster choice on the CPU: docs/performance.md)."""
    size = 32 if k <= 32 else 16
    return size if vocab % size == 0 and vocab // size >= 4 * k else None


def _top_by_chunk_max(logits: mx.array, k: int, size: int) -> mx.array:
    """The top k of each row after pruning it to the k chunks of `size` logits with the
    largest maxima: a row's top k all lie in those chunks (the k-th largest chunk maximum is
    at most the k-th largest logit, since each of those chunks holds a logit at least that
    large; a chunk left out has a smaller maximum, or an equal one, and then a logit it holds
    ties the k-th). So one partition runs over k * size logits, not the whole row: the same
    set, up to which of tied logits it holds."""
    lead, V = logits.shape[:-1], logits.shape[-1]
    split = logits.reshape(*lead, V // size, size)
    chunks = mx.argpartition(-split.max(axis=-1), k - 1, axis=-1)[..., :k]  # [..., k]
    kept = mx.take_along_axis(split, chunks[..., None], axis=-2).reshape(*lead, k * size)
    local = mx.argpartition(-kept, k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(chunks, local // size, axis=-1) * size + local % size


class CandidateSelector(nn.Module):
    """DFlash 2: re-rank each row's top-k candidates by a low-rank (previous, next) bigram score."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    # The score of candidate c after previous token p, at a row with hidden state h:
    #   logit(c) + <successor(c), predecessor(p) * W h>
    # inference (DraftHead) and training (train/blocks.py) both compute it from these three.

    def project(self, hidden: mx.array) -> mx.array:
        """W h, in float32: [..., H] -> [..., rank]."""
        return self.hidden_projection(hidden).astype(mx.float32)

    def context(self, prev: mx.array, projected: mx.array) -> mx.array:
        """predecessor(p) * W h: previous tokens `prev` [...] against `projected` rows
        (broadcast): [..., rank]."""
        return self.predecessor_codebook[prev].astype(mx.float32) * projected

    def scores(self, context: mx.array, cand: mx.array, cand_logits: mx.array) -> mx.array:
        """Candidates `cand` [..., k] (their logits `cand_logits`) scored after each of P
        contexts [..., P, rank]: [..., P, k]."""
        succ = self.successor_codebook[cand].astype(mx.float32)  # [..., k, rank]
        return cand_logits[..., None, :] + context @ succ.swapaxes(-1, -2)


def _walk_rows(first: mx.array, after: mx.array, rows: int, choose) -> mx.array:
    """One block's picks, rows left to right ([rows]): row 0 chooses among `first` [k], row
    r > 0 among `after[r - 1]` [k prev, k] given row r - 1's pick; `choose(scores, r)` picks
    (an argmax, or a draw)."""
    picks, scores = [], first
    for r in range(rows):
        if r > 0:
            scores = after[r - 1][picks[-1]]  # [k]: given the previous row's pick
        picks.append(choose(scores, r))
    return mx.stack(picks)


class DraftHead(nn.Module):
    """Turns the body's hidden states into draft tokens (and their draft distribution q)."""

    def __init__(self, cfg: DrafterConfig, lm_head):
        super().__init__()
        self.cfg = cfg
        object.__setattr__(self, "lm_head", lm_head)  # the target's: bound, not our parameter
        if cfg.is_v2:
            self.candidate_selector = CandidateSelector(cfg)

    def logits(self, hidden: mx.array) -> mx.array:
        """[R, H] -> [R, V] with the config's multiplier and soft-cap."""
        logits = self.lm_head(hidden).astype(mx.float32)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if cap := self.cfg.final_logit_softcapping:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def select(
        self, hidden: mx.array, logits: mx.array, anchor: int, temperature: float, key=None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """DFlash 2 selection, rows left to right.

        Returns (tokens [R], candidate ids [R, k], candidate probabilities q [R, k]); greedy
        (temperature 0) takes the argmax and q is one-hot on it. Sampling draws row r with the
        r-th of `key`'s R splits (`key` required).
        """
        R = hidden.shape[0]
        anchors = mx.array([anchor])
        if temperature > 0:
            # its keys made outside the graph, so that one graph serves every key (mx.random's
            # implicit key would be a constant of the trace)
            if key is None:
                raise ValueError("a sampled selection needs a key")
            keys = mx.random.split(key, R)
            temp = mx.array(temperature, mx.float32)
            if not body.COMPILE_DRAFTS:
                return self._select_sampled(hidden, logits, anchors, temp, keys)
            # one compiled graph per block height: op by op, Python would build a graph of
            # hundreds of nodes every round
            fn = self.__dict__.get("_compiled_sampled")
            if fn is None:  # the selector's weights are captured at the first trace
                fn = self.__dict__["_compiled_sampled"] = mx.compile(self._select_sampled)
            return fn(hidden, logits, anchors, temp, keys)
        cand, first, after = self._candidate_scores(
            hidden[None], logits[None], anchors, self.cfg.selector_top_k
        )
        cand, first, after = cand[0], first[0], after[0]
        idx = _walk_rows(first, after, R, lambda scores, r: mx.argmax(scores))[:, None]
        tokens = mx.take_along_axis(cand, idx, axis=-1)[:, 0]
        # q one-hot on each pick
        return tokens, cand, (mx.arange(cand.shape[-1])[None] == idx).astype(mx.float32)

    def _select_sampled(self, hidden, logits, anchors, temperature, keys):
        """`select` at `temperature` > 0 ([] float32) with one key a row (`keys` [R, 2])."""
        cand, first, after = self._candidate_scores(
            hidden[None], logits[None], anchors, SAMPLING_CANDIDATES
        )
        cand, first, after = cand[0], first[0], after[0]
        probs = []

        def draw(scores, r):
            probs.append(mx.softmax(scores / temperature))
            return mx.random.categorical(mx.log(probs[-1] + 1e-30), key=keys[r])

        idx = _walk_rows(first, after, hidden.shape[0], draw)[:, None]
        return mx.take_along_axis(cand, idx, axis=-1)[:, 0], cand, mx.stack(probs)

    def select_greedy(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        """`select` at temperature 0 for N blocks at once (a shared round, or one block):
        hidden [N, R, H], logits [N, R, V], anchors [N] -> tokens [N, R], each row's pick given
        its own block's previous pick, as `select` makes it alone. One compiled graph per
        (N, R): op by op its R gathers and argmaxes are that many kernel launches and graph
        nodes built in Python, a round's host time on a GPU."""
        if not body.COMPILE_DRAFTS:
            return self._select_greedy(hidden, logits, anchors)
        fn = self.__dict__.get("_compiled_select")
        if fn is None:  # the selector's weights are captured at the first trace (inference)
            fn = self.__dict__["_compiled_select"] = mx.compile(self._select_greedy)
        return fn(hidden, logits, anchors)

    def _select_greedy(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        N, R = hidden.shape[:2]
        cand, scores, after = self._candidate_scores(
            hidden, logits, anchors, self.cfg.selector_top_k
        )
        # each row's best candidate after every possible predecessor, in one argmax; the walk
        # is then one gather a row (an argmax and a gather a row took twice the kernels)
        best = mx.argmax(after, axis=-1) if R > 1 else None  # [N, R-1, k prev]
        picks = [mx.argmax(scores, axis=-1)]
        for r in range(1, R):
            picks.append(mx.take_along_axis(best[:, r - 1], picks[-1][:, None], axis=1)[:, 0])
        return mx.take_along_axis(cand, mx.stack(picks, axis=1)[..., None], axis=-1)[..., 0]

    def _candidate_scores(self, hidden, logits, anchors, top_k: int):
        """Blocks [N, R, H] / [N, R, V] after `anchors` [N]: (candidates [N, R, k], row 0's
        scores [N, k], rows 1..R-1's scores for every previous candidate [N, R-1, k, k])."""
        sel = self.candidate_selector
        k = min(max(top_k, self.cfg.selector_top_k), logits.shape[-1])
        cand = top_candidates(logits, k)  # [N, R, k]
        cand_logits = mx.take_along_axis(logits, cand, axis=-1)
        proj = sel.project(hidden)  # [N, R, rank]
        # Every row's scores for every possible predecessor: row 0 follows the anchor, row
        # r > 0 one of row r-1's k candidates ([R-1, k prev, k]). The left-to-right choice is
        # then a gather and an argmax (or a draw) a row.
        first = sel.scores(sel.context(anchors, proj[:, 0])[:, None], cand[:, 0], cand_logits[:, 0])
        after = sel.scores(
            sel.context(cand[:, :-1], proj[:, 1:, None]), cand[:, 1:], cand_logits[:, 1:]
        )
        return cand, first[:, 0], after
