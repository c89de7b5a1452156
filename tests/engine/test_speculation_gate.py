"""The speculation gate: below its threshold a sequence steps plainly, then tries again,
with the plain decode's output; in a shared round each gated sequence gets what it gets
alone; the break-even cost it judges by is measured, and its setting checked."""

from __future__ import annotations

import pytest
from batching import PROMPTS, run_batch
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.policy import DecodePolicy
from sanctum.engine.decode.rounds import BatchDecoder
from sanctum.engine.decode.sampling import SamplingParams
from test_engine import load_pair, tokens_of


def test_speculation_gate_steps_plainly_below_its_threshold_and_tries_again(make_pair):
    """The speculation gate: with a threshold no round reaches, a sequence drafts its warm-up
    rounds, then a stretch of plain steps, then one round, then a stretch twice as long...;
    greedy output is the plain decode's all along; at threshold 0 every step is a round."""
    from sanctum.engine.decode import policy as spec

    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    ids = target.tokenizer.encode(PROMPTS[0])
    plain = tokens_of(generate(target, ids, max_tokens=120))
    widths = {}
    for min_tau in (0.0, 99.0):
        d = BatchDecoder(
            target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(min_tau=min_tau)
        )
        seq = d.new_sequence("g", max_tokens=120)
        out = list(d.start(seq, d.prefill(seq, ids), make_key(0)).tokens)
        bs = []
        while seq.finished is None:
            step = d.step(seq, make_key(len(out)))
            out += step.tokens
            bs.append(step.stats.bs)
        assert out == plain
        widths[min_tau] = bs
    assert all(b > 1 for b in widths[0.0])
    gated = widths[99.0]
    w, p = spec.GATE_WARMUP, spec.GATE_PLAIN_STEPS
    assert all(b > 1 for b in gated[:w]) and gated[w : w + p] == [1] * p
    assert gated[w + p] > 1 and gated[w + p + 1 : w + 3 * p + 1] == [1] * (2 * p)
    assert gated[w + 3 * p + 1] > 1


@pytest.mark.parametrize("greedy_gate,sampled_gate", [(4.5, 4.5), (4.5, 0.0), (0.0, 4.5)])
def test_speculation_gate_in_a_batch_equals_alone(make_pair, greedy_gate, sampled_gate):
    """Gated sampled sequences of a shared round take the plain steps they take alone: in the
    drafted blocks' verify forward as blocks of their anchor alone, or, in a round where none
    drafts, several of them in one forward of their own. A gated greedy sequence drafts in a
    round where others draft (its plain step would pay the round's padded rows) and steps
    plainly in one where none does. Seeded sampling and greedy outputs equal to each served
    alone, with the gate tripping: every sequence's, the greedy one's only, or the sampled
    ones' only."""
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")

    def decoder():
        gate = DecodePolicy(min_tau=greedy_gate, min_tau_sampled=sampled_gate)
        return BatchDecoder(target, drafter, LocalDraftPeer(drafter), policy=gate)

    params = [
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(),
        SamplingParams(0.7, seed=9),
    ]
    specs = [(f"s{i}", PROMPTS[i], 48, "fp16", (), p) for i, p in enumerate(params)]
    tripped, together, joined, gated_drafting = [], [], [], []
    d = decoder()
    watch = d._watch
    d._watch = lambda seq, step: (watch(seq, step), tripped.append(seq.plain_left > 0))
    gated_now = set()  # the sequences the gate has step plainly in this round

    def take_gated_step(seq, take=d.take_gated_step):
        gated = take(seq)
        if gated:
            gated_now.add(seq.seq_id)
        return gated

    def step_batch(seqs, keys, step=d.step_batch):
        gated_now.clear()
        return step(seqs, keys)

    d.take_gated_step, d.step_batch = take_gated_step, step_batch
    plain_steps = d._plain_steps
    d._plain_steps = lambda seqs, keys, idx, steps: (
        together.append(len(idx)),
        plain_steps(seqs, keys, idx, steps),
    )
    verify_all = d._verify_all
    d._verify_all = lambda drafted, draft_s, steps, gated, riders=(): (
        joined.append(len(gated)),
        gated_drafting.extend(seq.seq_id for _, seq, *_ in drafted if seq.seq_id in gated_now),
        verify_all(drafted, draft_s, steps, gated, riders),
    )
    got, _ = run_batch(d, target, specs)
    assert any(tripped)
    assert set(gated_drafting) <= {"s1"}  # a gated sampled sequence never drafts
    if greedy_gate and sampled_gate:
        assert max(together) >= 2  # gated sequences stepped in one forward of their own
    elif greedy_gate:
        assert "s1" in gated_drafting  # the greedy one, gated, drafted beside the others
    else:
        assert max(joined) >= 1  # a gated sampled one stepped in the drafted blocks' verify
    for spec in specs:
        alone, _ = run_batch(decoder(), target, [spec])
        assert got[spec[0]] == alone[spec[0]], spec[0]


def test_break_even_is_measured_and_the_gate_setting_checked(make_pair):
    from sanctum.engine.decode.generate import gate_threshold, measure_break_even
    from sanctum.settings import serve_settings

    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    d = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    cost = measure_break_even(d)
    assert 1.0 < cost < 20.0
    assert gate_threshold("auto", d) in [i / 4 for i in range(81)]
    sampled = measure_break_even(d, SamplingParams(temperature=1.0, seed=0))
    assert 1.0 < sampled < 20.0
    assert gate_threshold("2.75", d) == 2.75
    assert measure_break_even(BatchDecoder(target)) == 0.0  # no drafter: nothing to gate
    assert serve_settings(env={}).min_tau == "auto"
    for bad in ("fast", "-1"):
        with pytest.raises(ValueError, match="SANCTUM_MIN_TAU"):
            serve_settings(env={"SANCTUM_MIN_TAU": bad})
