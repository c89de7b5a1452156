"""How a Decoder decides, fixed when it is made (`DecodePolicy`), and each decision in one place:
the speculation gate, adaptive width, the lookup of repeated text, drafting ahead.

Every decision is lossless (the target verifies whatever is proposed) and taken from the
sequence's own history alone, so a sequence decides the same alone, in a batch, inline or in
the cluster. Design: docs/design/round.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ... import settings
from .lookup import MIN_MATCH
from .sequence import Sequence

MIN_WIDTH = 2  # the smallest block adaptive width drafts (an anchor and one draft)
# the widest looked-up block: a looked-up block accepted whole is followed by one twice as wide
# (copied text goes on), up to this; any rejection goes back to the drafter's width
LOOKUP_MAX_WIDTH = 32
# The speculation gate: a sequence whose recent rounds commit fewer tokens than a round costs
# in plain steps takes plain steps for a while, then tries rounds again.
GATE_WARMUP = 2  # rounds before a sequence's mean counts; after a plain stretch one round
GATE_SMOOTHING = 0.3  # weight of the latest round in the running mean of tokens per round
GATE_PLAIN_STEPS = 16  # the first stretch of plain steps; doubled at each trip that follows
GATE_PLAIN_MAX = 256


@dataclass(frozen=True)
class DecodePolicy:
    """What a Decoder does besides the plain round, fixed at construction."""

    # sync after each phase of a round (an exact split of its time, slower)
    profile: bool = False
    # a sequence whose drafts keep failing drafts smaller blocks (down to MIN_WIDTH), and grows
    # back to the block size as they are accepted
    adaptive: bool = False
    # sampled drafts: "block" verification or the "token" rule (sampling.py); greedy drafts
    # always by the argmax match
    accept_rule: str = "block"
    # the speculation gate's thresholds, greedy and sampled: tokens a round must commit on
    # average to beat plain steps (generate.py `gate_threshold`); 0: off
    min_tau: float = 0.0
    min_tau_sampled: float = 0.0
    # greedy rounds draft the next block on their acceptance before the host reads it (a GPU
    # drafts while the host builds the next verify); None: `draft_ahead_default`
    draft_ahead: bool | None = None
    # greedy rounds whose last `lookup_min` committed tokens repeat an earlier stretch propose
    # what followed it (lookup.py); 0: off; None: `lookup_min_default`
    lookup_min: int | None = None


def lookup_min_default(env: Mapping[str, str] | None = None) -> int:
    """DecodePolicy.lookup_min by default: SANCTUM_LOOKUP_MIN (of `env`, else the settings in
    force), else lookup.py's MIN_MATCH."""
    given = settings.device_settings(env) if env is not None else settings.device()
    raw = given.lookup_min or str(MIN_MATCH)
    value = int(raw) if raw.isdigit() else -1
    if value < 0:
        raise ValueError(f"SANCTUM_LOOKUP_MIN must be an integer >= 0 (0: off), got {raw!r}")
    return value


def draft_ahead_default(target, peer) -> bool:
    """SANCTUM_DRAFT_AHEAD: "auto" drafts ahead where the target hands its layers to a GPU as
    it builds them (on the CPU one thread would build the draft and compute the verify one
    after the other anyway), "on", "off"; only a peer in this process drafts ahead."""
    mode = settings.device().draft_ahead
    if mode == "off" or not hasattr(peer, "draft_ahead"):
        return False
    return mode == "on" or bool(target.async_layers)


def resolved(policy: DecodePolicy, target, peer) -> DecodePolicy:
    """`policy` with its defaults (None) decided for this target and peer."""
    ahead = draft_ahead_default(target, peer) if policy.draft_ahead is None else policy.draft_ahead
    lookup = lookup_min_default() if policy.lookup_min is None else policy.lookup_min
    return replace(policy, draft_ahead=ahead, lookup_min=lookup)


# ---- the speculation gate ---------------------------------------------------------------


def take_gated_step(seq: Sequence) -> bool:
    """True (and one step of the stretch used up) while the gate has `seq` take plain steps."""
    if seq.plain_left <= 0:
        return False
    seq.plain_left -= 1
    return True


def watch_round(policy: DecodePolicy, seq: Sequence, accepted: int) -> bool:
    """After a round of `seq` with `accepted` drafts: below the threshold's tokens a round on
    average, a stretch of plain steps, longer at each trip in a row. A stretch ends in one
    round, which updates the mean and so decides the next stretch. True when a stretch starts
    (work drafted for the next round is then not wanted)."""
    threshold = policy.min_tau if seq.sampling.greedy else policy.min_tau_sampled
    if threshold <= 0:
        return False
    x = accepted + 1.0
    mean = x if seq.tau_mean is None else seq.tau_mean + GATE_SMOOTHING * (x - seq.tau_mean)
    seq.tau_mean, seq.gate_rounds = mean, seq.gate_rounds + 1
    if seq.gate_rounds < GATE_WARMUP:
        return False
    if mean >= threshold:
        seq.gate_trips = 0
        return False
    seq.plain_left = min(GATE_PLAIN_MAX, GATE_PLAIN_STEPS << seq.gate_trips)
    seq.gate_trips += 1
    return True


# ---- block width: adaptive, and looked-up blocks ------------------------------------------


def next_width(
    policy: DecodePolicy, seq: Sequence, block_size: int, bs: int, accepted: int, looked_up: bool
) -> None:
    """After a round of width `bs` that accepted `accepted` drafts, the widths of the next:
    a looked-up block accepted whole is followed by one twice as wide (copied text goes on);
    with adaptive width, a drafted block halves below half accepted and doubles when whole."""
    if looked_up:
        whole = accepted == bs - 1
        seq.lookup_width = min(LOOKUP_MAX_WIDTH, 2 * bs) if whole else None
    elif policy.adaptive:
        if accepted + 1 < bs // 2 and bs > MIN_WIDTH:
            seq.width = max(MIN_WIDTH, bs // 2)
        elif accepted == bs - 1 and bs < block_size:
            seq.width = min(block_size, bs * 2)


# ---- drafting ahead ---------------------------------------------------------------------


def drafts_ahead(policy: DecodePolicy, seq: Sequence) -> bool:
    """Whether this round drafts the next block before its acceptance is read: greedy, a peer
    in this process, every context row sent (so the verified rows are all it lacks)."""
    return (
        policy.draft_ahead
        and not policy.profile
        and seq.sampling.greedy
        and seq.draft_open
        and seq.taps.sent == seq.taps.end
    )
