"""A shared round's own per-sequence work done for all sequences at once (engine/decode/rounds.py):
the blocks assembled in one gather, the drafter's block embeddings in one lookup, and every
sequence's acceptance judged in one graph, read in one evaluation and one host transfer. Each
equals what the sequence gets alone, and the graph does not grow with the number of sequences."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from sanctum.bench.opcount import count_ops, graph_ops
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.policy import DecodePolicy
from sanctum.engine.decode.rounds import BatchDecoder, assemble_blocks
from sanctum.engine.decode.sampling import (
    SamplingParams,
    accept_block,
    accept_sampled,
    block_rule_acceptance,
    greedy_acceptance,
    greedy_acceptance_batch,
    greedy_tokens,
    token_rule_acceptance,
)

PROMPTS = [
    "def fibonacci(n):\n    ",
    "x = 1",
    "import os\nimport sys\n\nclass Foo:\n    def __init__(self, a, b):\n        self.a = a\n",
    "for i in range(10):\n    print(i)\n",
]


def _ragged_blocks(widths, vocab=64, seed=0):
    """Per block: logits [w, V] (bf16, near ties likely) and drafts [w-1] that follow the greedy
    picks up to a row that differs (or all of them)."""
    rng = np.random.default_rng(seed)
    anchors, drafts, logits = [], [], []
    for n, w in enumerate(widths):
        lg = mx.array(rng.normal(size=(w, vocab)).astype(np.float32)).astype(mx.bfloat16)
        picks = greedy_tokens(lg).astype(mx.int32).tolist()
        d = picks[: w - 1]
        wrong = n % (w + 1)
        if wrong < w - 1:
            d[wrong] = (d[wrong] + 1) % vocab
        anchors.append(int(rng.integers(vocab)))
        drafts.append(mx.array(d, mx.uint32 if n % 2 else mx.int32))
        logits.append(lg)
    return anchors, drafts, logits


@pytest.mark.parametrize("pad", [0, 3])
def test_blocks_acceptance_equals_each_block_alone(pad):
    """Ragged widths (padded at their end, also past the widest), every accepted count: the
    batch's counts and bonus tokens are each block's own `greedy_acceptance`."""
    widths = [8, 2, 5, 8, 3, 8, 1 + 7, 4]
    anchors, drafts, logits = _ragged_blocks(widths)
    L = max(widths) + pad
    blocks = assemble_blocks(anchors, drafts, L)
    # the blocks as each sequence built its own: anchor + drafts, zero-padded
    for n, (a, d) in enumerate(zip(anchors, drafts)):
        own = [a] + d.tolist()
        assert blocks[n].tolist() == own + [0] * (L - len(own))
    run, bonus = greedy_acceptance_batch(blocks, logits, widths)
    alone = [greedy_acceptance(d, lg) for d, lg in zip(drafts, logits)]
    assert run.tolist() == [int(r.item()) for r, _ in alone]
    assert bonus.tolist() == [int(b.item()) for _, b in alone]
    assert len(set(run.tolist())) > 3  # several counts exercised


def test_blocks_assembled_with_anchors_alone_at_the_end():
    """Gated sequences' blocks are their anchor alone, after the drafted ones."""
    blocks = assemble_blocks([5, 6, 7], [mx.array([1, 2, 3])], 4)
    assert blocks.tolist() == [[5, 1, 2, 3], [6, 0, 0, 0], [7, 0, 0, 0]]
    assert blocks.dtype == mx.int32


@pytest.mark.parametrize("rule", ["token", "block"])
def test_unevaluated_sampled_rules_draw_what_the_eager_rules_draw(rule):
    """The acceptance a shared round reads with the others' draws, key for key, what
    `accept_sampled` / `accept_block` draw alone (every count, the bonus and the residual)."""
    eager = accept_sampled if rule == "token" else accept_block
    lazy = token_rule_acceptance if rule == "token" else block_rule_acceptance
    rng = np.random.default_rng(1)
    counts = set()
    for s in range(60):
        n, V = int(rng.integers(0, 6)), 12
        P = mx.softmax(mx.array(rng.normal(size=(n + 1, V)) * 2).astype(mx.float32), axis=-1)
        Q = mx.softmax(mx.array(rng.normal(size=(n, V)) * 2).astype(mx.float32), axis=-1)
        if s % 3 == 0:
            Q = P[:n]  # p == q: every draft kept, the bonus from p
        key = mx.random.key(s)
        drafts = mx.random.categorical(mx.log(Q), key=mx.random.key(1000 + s)) if n else Q[:, 0]
        drafts = drafts.astype(mx.uint32)
        want = eager(drafts, Q, P, key)
        a, t = lazy(drafts, Q, P, key)
        assert (int(a.item()), int(t.item())) == want, s
        counts.add(want[0])
    assert len(counts) > 3


def test_acceptance_graph_does_not_grow_with_the_sequences():
    """The acceptance of 2 and of 8 blocks: the same nodes (logits already computed)."""

    def nodes(n):
        anchors, drafts, logits = _ragged_blocks([8] * n, seed=n)
        drafts = [d.astype(mx.uint32) for d in drafts]  # as a drafter's argmax gives them
        mx.eval(drafts, logits)
        blocks = assemble_blocks(anchors, drafts, 8)
        return sum(graph_ops(*greedy_acceptance_batch(blocks, logits, [8] * n)).values())

    assert nodes(2) == nodes(8)


@pytest.fixture(scope="module")
def default_pair():
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.engine.model.target import load_target
    from sanctum.settings import default_pair

    target_dir, drafter_dir = default_pair()
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


def test_block_embeds_of_all_sequences_equal_each_alone(default_pair):
    target, drafter = default_pair
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    anchors = [3, 17, 3, 250]
    together = decoder._blocks_embeds(anchors, 8)
    alone = mx.stack([decoder._block_embeds(a, 8) for a in anchors])
    assert together.dtype == alone.dtype
    assert mx.array_equal(together, alone).item()


def _start(decoder, target, prompts, n, sampling):
    seqs, keys = [], []
    for i, (prompt, params) in enumerate(zip(prompts, sampling)):
        seq = decoder.new_sequence(f"s{i}", "fp16", params, n)
        key = make_key(params.seed)
        logits = decoder.prefill(seq, target.tokenizer.encode(prompt))
        key, sub = mx.random.split(key)
        decoder.start(seq, logits, sub)
        seqs.append(seq)
        keys.append(key)
    return seqs, keys


@pytest.mark.parametrize("num", [2, 4])
def test_a_shared_round_reads_once(default_pair, num):
    """A greedy shared round: one evaluation for the verify and every acceptance, one host
    read, whatever the number of sequences (the rollback is queued, not read)."""
    target, drafter = default_pair
    decoder = BatchDecoder(
        target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(lookup_min=0)
    )
    seqs, keys = _start(decoder, target, PROMPTS[:num], 64, [SamplingParams()] * num)
    decoder.step_batch(seqs, keys)  # a first round: compiled graphs built
    with count_ops() as tally:
        steps = decoder.step_batch(seqs, [mx.random.split(k)[1] for k in keys])
    assert all(step.stats.bs > 1 for step in steps)
    assert tally.evals_by_phase["accept"] == 1
    assert tally.reads == 1


@pytest.mark.parametrize("accept_rule", ["block", "token"])
def test_mixed_greedy_and_sampled_round_equals_each_alone(default_pair, accept_rule):
    """Greedy and seeded sampled sequences of ragged prompts in shared rounds, with either
    sampled rule: each commits what it commits alone."""
    target, drafter = default_pair
    sampling = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=20, seed=5),
    ]
    decoder = BatchDecoder(
        target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(accept_rule=accept_rule)
    )
    seqs, keys = _start(decoder, target, PROMPTS, 32, sampling)
    got = {seq.seq_id: list(seq.completion) for seq in seqs}
    while seqs:
        subs = []
        for n in range(len(seqs)):
            keys[n], sub = mx.random.split(keys[n])
            subs.append(sub)
        for seq, step in zip(seqs, decoder.step_batch(seqs, subs)):
            got[seq.seq_id] += step.tokens
        keys = [k for k, s in zip(keys, seqs) if s.finished is None]
        seqs = [s for s in seqs if s.finished is None]
    for i, (prompt, params) in enumerate(zip(PROMPTS, sampling)):
        steps = generate(
            target,
            target.tokenizer.encode(prompt),
            drafter=drafter,
            sampling=params,
            max_tokens=32,
            accept_rule=accept_rule,
        )
        assert got[f"s{i}"] == [t for s in steps for t in s.tokens], f"s{i}"
