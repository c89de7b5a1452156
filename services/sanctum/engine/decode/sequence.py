"""A request's live state on the verifier (`Sequence`), what one round or step gives back
(`Step`, `RoundStats`), and the work a sequence holds between rounds (a block drafted ahead, a
prefetched draft, a queued plain step). Plain data: the Decoder changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..model.target import VerifyTape
from .lookup import TokenIndex
from .sampling import SamplingParams
from .taps import TapLog


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
    looked_up: bool = False  # the block's drafts were read from the sequence (decode/lookup.py)

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
    # the prompt's last tokens, left to run in the sequence's first round (`Decoder.ride`)
    # instead of a prefill of their own; None once run
    tail: list[int] | None = None
    tail_stops: tuple[int, ...] = ()  # positions its tail's forwards end at (`prefill`'s stops)
    on_tail_stop: Callable[[int], None] | None = None  # called at each, as `prefill` calls it
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
