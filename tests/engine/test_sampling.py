"""Sampling keeps the target's distribution: the speculative rejection rule, statistically."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from sanctum.engine.decode.decoder import Decoder
from sanctum.engine.decode.generate import make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.sampling import SamplingParams, accept_sampled, probabilities
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import load_target
from sanctum.tiny import make_tiny_drafter, make_tiny_target

VOCAB = 16


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against expected probabilities (cells with tiny expectation
    merged), via the regularized upper incomplete gamma (no scipy needed)."""
    import math

    n = counts.sum()
    exp = probs * n
    order = np.argsort(exp)
    obs_m, exp_m, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:  # merge the smallest cells until each expects >= 5
        acc_o += counts[i]
        acc_e += exp[i]
        if acc_e >= 5:
            obs_m.append(acc_o)
            exp_m.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0 and exp_m:
        obs_m[-1] += acc_o
        exp_m[-1] += acc_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_m, exp_m))
    dof = len(exp_m) - 1
    # survival function of chi2(dof) at stat: Q(dof/2, stat/2)
    a, x = dof / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    if x < a + 1:  # series for P, then Q = 1 - P
        term = total = 1.0 / a
        k = a
        for _ in range(500):
            k += 1
            term *= x / k
            total += term
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a)))
    f, c, d = 1e-300, 1e-300, 0.0  # continued fraction for Q (Lentz)
    b = x + 1 - a
    c, d = 1 / 1e-300, 1 / b
    f = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / d if d != 0 else 1e300
        c = b + an / c
        delta = c * d
        f *= delta
        if abs(delta - 1) < 1e-12:
            break
    return f * math.exp(-x + a * math.log(x) - math.lgamma(a))


def test_rejection_rule_reproduces_target_distribution():
    """Synthetic p and q per row: the first committed token follows p[0], whatever q is."""
    rng = np.random.default_rng(0)
    rows = 4
    p = rng.dirichlet(np.ones(VOCAB) * 0.7, size=rows + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(VOCAB) * 0.7, size=rows).astype(np.float32)
    P, Q = mx.array(p), mx.array(q)
    key = mx.random.key(1)
    n = 6000
    counts = np.zeros(VOCAB)
    accepted_any = 0
    for _ in range(n):
        key, k_draft, k_acc = mx.random.split(key, 3)
        drafts = mx.random.categorical(mx.log(Q), key=k_draft)
        acc, bonus = accept_sampled(drafts, Q, P, k_acc)
        first = int(drafts[0]) if acc > 0 else bonus
        counts[first] += 1
        accepted_any += acc > 0
    assert chi_square_p(counts, p[0]) > 1e-3
    assert chi_square_p(counts, q[0]) < 1e-6  # and not the drafter's
    assert 0.1 * n < accepted_any < 0.95 * n  # both the accept and the resample paths ran


@pytest.fixture(scope="module")
def tiny_vocab_pairs(tmp_path_factory):
    """A hybrid target on a 16-token vocabulary with a DFlash and a DFlash 2 drafter."""
    out = tmp_path_factory.mktemp("v16")
    target_dir = make_tiny_target(out / "target", "hybrid", seed=3, vocab_size=VOCAB)
    target = load_target(target_dir)
    drafters = {}
    for kind in ("dflash", "dflash2"):
        path = make_tiny_drafter(out / kind, target_dir, kind, seed=4, block_size=4)
        drafters[kind] = load_drafter(path, target)
    return target, drafters


@pytest.mark.parametrize(
    "kind,params,scale",
    [("dflash", SamplingParams(1.0), 1.0), ("dflash", SamplingParams(0.8, top_k=8, top_p=0.9), 1.0),
     ("dflash2", SamplingParams(0.5), 1.0), ("dflash2", SamplingParams(1.0), 1.0),
     ("dflash", SamplingParams(1.0), 0.6), ("dflash2", SamplingParams(0.7), 1.6)],
)  # fmt: skip
def test_speculative_sampling_follows_target_not_drafter(tiny_vocab_pairs, kind, params, scale):
    """End to end on a 16-token vocabulary: the first token of a speculative round, given a
    fixed anchor, follows the target's (processed) distribution, not the drafter's (DFlash 2:
    through its selector, over its sampling pool), also when the drafter proposes at a scaled
    temperature (`draft_temperature_scale`)."""
    target, drafters = tiny_vocab_pairs
    drafter = _scaled(drafters[kind], scale)
    decoder = Decoder(target, drafter, LocalDraftPeer(drafter))
    prompt = [6, 7, 8, 9, 10, 11]
    anchor = 12
    seq = decoder.new_sequence("stat", sampling=params, max_tokens=100)
    decoder.prefill(seq, prompt)
    prompt_taps = replace(seq.taps, chunks=list(seq.taps.chunks))
    p = np.array(probabilities(_next_logits(target, prompt + [anchor]), params))[0]
    seq.anchor = anchor
    _, q = decoder._draft(seq, params, make_key(0))  # the drafter's distribution for row 1
    q = np.array(q)[0]
    n = 1500
    counts = np.zeros(VOCAB)
    key = make_key(5)
    for _ in range(n):
        key, sub = mx.random.split(key)
        seq.anchor, seq.completion, seq.finished = anchor, [], None
        seq.taps = replace(prompt_taps, chunks=list(prompt_taps.chunks))
        seq.draft_open = False  # reopen: the drafter starts from the same context each time
        step = decoder.step(seq, sub)
        counts[step.tokens[0]] += 1
        target.rollback(seq.cache, seq.last_tape, 0)
    assert chi_square_p(counts, p) > 1e-3
    assert chi_square_p(counts, np.maximum(q, 1e-9) / np.maximum(q, 1e-9).sum()) < 1e-6


def _scaled(drafter, scale: float):
    return replace(drafter, cfg=replace(drafter.cfg, draft_temperature_scale=scale))


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_draft_temperature_scale_flattens_the_proposal(tiny_vocab_pairs, kind):
    """The proposal at request temperature T and scale s is the drafter's at T x s: a scale
    above 1 spreads q (its entropy rises), and greedy drafting ignores the scale."""
    target, drafters = tiny_vocab_pairs
    hidden = mx.random.normal((3, drafters[kind].cfg.hidden_size), key=mx.random.key(2))
    logits = drafters[kind].head.logits(hidden)

    def proposal(scale, params):
        decoder = Decoder(target, _scaled(drafters[kind], scale), None)
        seq = decoder.new_sequence("q", sampling=params)
        seq.anchor = 12
        return decoder._propose(seq, hidden, logits, params, make_key(3))

    def entropy(q):
        q = np.array(q)
        return float(-(q * np.log(np.maximum(q, 1e-30))).sum(-1).mean())

    _, q1 = proposal(1.0, SamplingParams(0.5))
    _, q2 = proposal(2.0, SamplingParams(0.5))
    _, q_ref = proposal(1.0, SamplingParams(1.0))  # 0.5 x 2 = 1.0
    assert entropy(q2) > entropy(q1) + 0.05
    assert np.allclose(np.array(q2), np.array(q_ref), atol=1e-6)
    greedy1, none1 = proposal(1.0, SamplingParams())
    greedy2, _ = proposal(2.0, SamplingParams())
    assert none1 is None and np.array_equal(np.array(greedy1), np.array(greedy2))


def test_calibration_scores_the_engines_proposal(tiny_vocab_pairs):
    """`train calibrate` rates the q the engine proposes: DFlash 2's first block row (after the
    anchor) through `calibrate.proposal` equals `DraftHead.select`'s at T x scale."""
    from sanctum.train.calibrate import proposal

    target, drafters = tiny_vocab_pairs
    head = drafters["dflash2"].head
    hidden = mx.random.normal((1, drafters["dflash2"].cfg.hidden_size), key=mx.random.key(4))
    logits = head.logits(hidden)
    rows = {"hidden": hidden, "logits": logits, "prev": mx.array([12])}
    cand, q = proposal(head.candidate_selector, rows, 0.7, 1.3)
    _, cand_e, q_e = head.select(hidden, logits, 12, 0.7 * 1.3, make_key(0))
    dense = np.zeros(VOCAB)
    dense[np.array(cand[0])] = np.array(q[0])
    dense_e = np.zeros(VOCAB)
    dense_e[np.array(cand_e[0])] = np.array(q_e[0])
    assert np.allclose(dense, dense_e, atol=1e-5)


def test_draft_temperature_scale_is_checked_at_load():
    from sanctum.engine.model.checkpoint import CheckpointError
    from sanctum.engine.model.drafter.config import DrafterConfig

    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128,
           "vocab_size": 16, "block_size": 4,
           "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5}}  # fmt: skip
    assert DrafterConfig.from_dict(raw).draft_temperature_scale == 1.0
    scaled = DrafterConfig.from_dict({**raw, "draft_temperature_scale": 1.3})
    assert scaled.draft_temperature_scale == 1.3
    for bad in (0, -1.0, "1.3", True):
        with pytest.raises(CheckpointError, match="draft_temperature_scale"):
            DrafterConfig.from_dict({**raw, "draft_temperature_scale": bad})


def _next_logits(target, ids):
    logits, _ = target.forward(mx.array(ids), target.make_cache())
    return logits[-1:]


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_dflash2_samples_from_a_wider_pool_than_it_picks_greedily(tiny_vocab_pairs, temperature):
    """Greedy, DFlash 2's selector picks among its trained top-k (the reference's rule); when
    sampling, q covers the body's top SAMPLING_CANDIDATES (here the whole 16-token vocabulary),
    and is a distribution on each row."""
    from sanctum.engine.model.drafter import SAMPLING_CANDIDATES

    target, drafters = tiny_vocab_pairs
    drafter = drafters["dflash2"]
    top_k = drafter.cfg.selector_top_k
    assert top_k < VOCAB <= SAMPLING_CANDIDATES
    hidden = mx.random.normal((3, drafter.cfg.hidden_size), key=mx.random.key(1))
    logits = drafter.head.logits(hidden)
    tokens, cand, q = drafter.head.select(hidden, logits, 12, temperature, make_key(0))
    assert cand.shape == (3, top_k if temperature == 0 else VOCAB)
    assert np.allclose(np.array(q).sum(-1), 1.0, atol=1e-5)
    if temperature > 0:
        assert ((np.array(q) > 0).sum(-1) > top_k).all()  # mass beyond the trained top-k


@pytest.mark.parametrize("rows", [1, 3])
def test_dflash2_greedy_selection_of_a_batch_equals_each_alone(tiny_vocab_pairs, rows):
    """`DraftHead.select_greedy` over N blocks picks what `select` picks for each alone."""
    _, drafters = tiny_vocab_pairs
    head = drafters["dflash2"].head
    hidden = mx.random.normal((4, rows, drafters["dflash2"].cfg.hidden_size), key=mx.random.key(6))
    logits = head.logits(hidden.reshape(4 * rows, -1)).reshape(4, rows, -1)
    anchors = [12, 3, 7, 12]
    together = head.select_greedy(hidden, logits, mx.array(anchors))
    for n, anchor in enumerate(anchors):
        alone, _, _ = head.select(hidden[n], logits[n], anchor, 0.0)
        assert np.array_equal(np.array(together[n]), np.array(alone)), f"block {n}"


@pytest.mark.parametrize("vocab", [248320, 40001])
@pytest.mark.parametrize("k", [16, 128])
def test_two_stage_top_candidates_are_the_top_k(vocab, k):
    """The GPU's two-stage top-k (per chunk, then over the chunks' picks) picks the same set as
    one partition of the whole row: Qwen3.5's vocabulary in chunks that divide it, 40001 (no
    divisor near CHUNK) with its last chunk padded."""
    from sanctum.engine.model.drafter.head import CHUNK, chunk_length, top_candidates

    assert chunk_length(vocab) == {248320: 970, 40001: CHUNK}[vocab]

    logits = mx.random.normal((2, 3, vocab), key=mx.random.key(vocab + k))
    got = np.sort(np.array(top_candidates(logits, k, two_stage=True)), axis=-1)
    want = np.sort(np.argsort(-np.array(logits), axis=-1)[..., :k], axis=-1)
    assert got.shape == (2, 3, k)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("vocab", [8192, 248320, 1000])
@pytest.mark.parametrize("k", [16, 128])
def test_cpu_pruned_top_candidates_are_the_top_k(vocab, k):
    """The CPU's default top-k (rows pruned to the chunks with the largest maxima first) picks
    the same set as one partition of the whole row; where logits tie at the k-th value, the
    same values. A vocabulary the chunks do not divide (1000) takes one partition."""
    from sanctum.engine.model.drafter.head import _pruning_chunk, top_candidates

    assert (_pruning_chunk(vocab, k) is None) == (vocab == 1000)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)  # the device top_candidates decides by
    try:
        logits = mx.random.normal((2, 7, vocab), key=mx.random.key(vocab + k))
        got = np.sort(np.array(top_candidates(logits, k)), axis=-1)
        want = np.sort(np.argsort(-np.array(logits), axis=-1)[..., :k], axis=-1)
        assert np.array_equal(got, want)
        # few distinct values: many ties at the k-th, in chunks whose maxima tie too
        ties = mx.floor(logits * 2)
        picked = np.take_along_axis(np.array(ties), np.array(top_candidates(ties, k)), axis=-1)
        best = -np.sort(-np.array(ties), axis=-1)[..., :k]
        assert np.array_equal(np.sort(picked, axis=-1), np.sort(best, axis=-1))
    finally:
        mx.set_default_device(device)


def test_accept_block_draws_by_its_weights():
    """`accept_block` samples what `block_acceptance` says: the count of drafts kept follows
    h's stopping probabilities, and a rejected block's next token its residual."""
    from sanctum.engine.decode.sampling import accept_block, block_acceptance

    rng = np.random.default_rng(7)
    n = 3
    P = mx.array(rng.dirichlet(np.ones(VOCAB) * 0.6, size=n + 1).astype(np.float32))
    Q = mx.array(rng.dirichlet(np.ones(VOCAB) * 0.6, size=n).astype(np.float32))
    drafts = mx.array([int(np.argmax(np.array(Q[i]))) for i in range(n)])
    h, residual = (np.array(a, np.float64) for a in block_acceptance(drafts, Q, P))
    stop = np.array([h[i] * np.prod(1 - h[i + 1 :]) for i in range(n + 1)])
    trials = 4000
    kept = np.zeros(n + 1)
    first_after_none = np.zeros(VOCAB)
    key = mx.random.key(3)
    for _ in range(trials):
        key, sub = mx.random.split(key)
        acc, token = accept_block(drafts, Q, P, sub)
        kept[acc] += 1
        if acc == 0:
            first_after_none[token] += 1
    assert chi_square_p(kept, stop / stop.sum()) > 1e-3
    assert chi_square_p(first_after_none, residual[0] / residual[0].sum()) > 1e-3


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("vocab", [8192, 1001, 5])
def test_logsumexp_is_mlxs_to_the_bit(dtype, vocab):
    """The greedy rule's logsumexp (cpu.logsumexp) gives MLX's own bits, on rows of every
    scale, rows all -inf, a +inf logit and masked logits; so do the greedy picks made with it."""
    from sanctum.engine.decode.sampling import greedy_tokens
    from sanctum.engine.kernels.cpu import logsumexp

    for seed in range(12):
        x = mx.random.normal((8, vocab), key=mx.random.key(seed)) * (1 + seed) ** 1.5
        x[1] = -mx.inf
        x[2, vocab // 2] = mx.inf
        x[3, : vocab // 3] = -mx.inf
        x[4] = x[4] + 1e4  # far from 0: the shift matters
        x = x.astype(dtype)
        want = mx.logsumexp(x, axis=-1, keepdims=True)
        got = logsumexp(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        bits = mx.uint16 if dtype != mx.float32 else mx.uint32
        assert mx.array_equal(got.view(bits), want.view(bits)), seed
        ref = mx.argmax(x - want, axis=-1)
        assert greedy_tokens(x).tolist() == ref.tolist(), seed


def test_probabilities_softmax_is_mlxs_within_rounding():
    """On the CPU the target's probabilities take the compiled softmax (cpu.softmax): MLX's
    softmax within float32 rounding, top-k and top-p applied as before."""
    x = mx.random.normal((8, 8192), key=mx.random.key(5)) * 4
    for params in (SamplingParams(0.7), SamplingParams(1.0, top_k=20), SamplingParams(1.3, 0.9)):
        want = mx.softmax(x / params.temperature, axis=-1)
        got = probabilities(x, params)
        kept = got > 0
        assert mx.allclose(got.sum(-1), mx.ones((8,)), atol=1e-5)
        if params.top_k == 0 and params.top_p == 1.0:
            assert mx.allclose(got, want, rtol=1e-6, atol=1e-9)
        else:  # renormalized over what is kept
            assert mx.allclose(
                got,
                mx.where(kept, want, 0) / mx.where(kept, want, 0).sum(-1, keepdims=True),
                rtol=1e-5,
                atol=1e-9,
            )


def test_compiled_sampled_selection_equals_op_by_op(tiny_vocab_pairs, monkeypatch):
    """DFlash 2's sampled selection runs as one compiled graph (one per block height, any key
    and temperature); it draws the same tokens with the same q as its ops run one by one."""
    from sanctum.engine.model.drafter import body as drafter_module

    _, drafters = tiny_vocab_pairs
    head = drafters["dflash2"].head
    hidden = mx.random.normal((5, drafters["dflash2"].cfg.hidden_size), key=mx.random.key(9))
    logits = head.logits(hidden)
    cases = [(0.7, 0, 12), (1.0, 1, 3), (0.35, 2, 12), (1.0, 3, 7)]
    compiled = [head.select(hidden, logits, a, t, make_key(s)) for t, s, a in cases]
    monkeypatch.setattr(drafter_module, "COMPILE_DRAFTS", False)
    for (t, s, a), got in zip(cases, compiled):
        want = head.select(hidden, logits, a, t, make_key(s))
        for g, w in zip(got, want):
            assert np.array_equal(np.array(g), np.array(w)), (t, s, a)
    draws = {
        tuple(np.array(head.select(hidden, logits, 12, 1.0, make_key(s))[0])) for s in range(6)
    }
    assert len(draws) > 1  # the key is an input of the graph, not a constant of its trace
    with pytest.raises(ValueError, match="key"):
        head.select(hidden, logits, 12, 0.7)


def test_accept_block_in_one_sync_draws_what_the_two_step_rule_draws():
    """`accept_block` draws the next token before the host reads the count (one sync a round):
    for every key it returns what reading the count first and then drawing from that row's
    residual (or, every draft kept, from p) returns, at every count 0..n."""
    from sanctum.engine.decode.sampling import accept_block, block_acceptance

    def two_step(drafts, Q, P, key):
        n = drafts.shape[0]
        k_accept, k_fix = mx.random.split(key)
        h, residual = block_acceptance(drafts, Q, P)
        u = mx.random.uniform(shape=(n,), key=k_accept)
        kept = int(mx.where(u < h[1:], mx.arange(1, n + 1), 0).max().item())
        p = P[kept]
        if kept < n:
            total = residual[kept].sum()
            p = mx.where(total > 0, residual[kept] / mx.maximum(total, 1e-30), p)
        return kept, int(mx.random.categorical(mx.log(p[None]), key=k_fix)[0].item())

    rng = np.random.default_rng(11)
    n = 3
    p_np = rng.dirichlet(np.ones(VOCAB) * 0.6, size=n + 1)
    q_np = 0.5 * p_np[:n] + 0.5 * rng.dirichlet(np.ones(VOCAB), size=n)
    P, Q = mx.array(p_np.astype(np.float32)), mx.array(q_np.astype(np.float32))
    seen = set()
    for s in range(300):  # drafts drawn from q, so that every count is reached
        drafts = mx.array([int(rng.choice(VOCAB, p=q)) for q in q_np])
        got = accept_block(drafts, Q, P, mx.random.key(s))
        assert got == two_step(drafts, Q, P, mx.random.key(s)), s
        seen.add(got[0])
    assert seen == set(range(n + 1))
