"""Decoding in this process (`generate`), and what a round costs against plain steps here
(`measure_break_even`, the speculation gate's "auto" threshold: `gate_threshold`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator

import mlx.core as mx

from ..model.drafter import Drafter
from ..model.target import Target
from .decoder import Decoder
from .peer import DraftUnavailable, LocalDraftPeer
from .policy import DecodePolicy
from .sampling import ACCEPT_RULES, SamplingParams
from .sequence import GREEDY, Step, StopCheck

log = logging.getLogger("sanctum.engine")


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
    `lookup_min`: drafts read from repeated text (`DecodePolicy.lookup_min`; None: its default)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if accept_rule not in ACCEPT_RULES:
        raise ValueError(f"accept_rule must be one of {ACCEPT_RULES}, got {accept_rule!r}")
    sampling = sampling or SamplingParams()
    policy = DecodePolicy(
        profile=profile,
        accept_rule=accept_rule,
        min_tau=min_tau,
        min_tau_sampled=min_tau,
        lookup_min=lookup_min,
    )
    peer = LocalDraftPeer(drafter) if drafter else None
    decoder = Decoder(target, drafter, peer, block_size, policy)
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
