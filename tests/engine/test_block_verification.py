"""Block verification, exact over small trees of conditionals: the target's distribution
kept, at least the token rule's acceptance; the acceptance-rule setting, and the benches that
compare the rules (`bench tau`) and bound them (`bench tau-ceiling`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest


def _tree(rng, depth: int, vocab: int, conc: float, zeros: bool = False) -> dict:
    """prefix (tuple) -> a next-token distribution, for every prefix of up to `depth` tokens;
    `zeros`: some tokens impossible (p = 0) where they would be drafted."""
    import itertools

    out = {}
    for d in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            dist = rng.dirichlet(np.ones(vocab) * conc)
            if zeros and rng.random() < 0.4:
                dist[rng.integers(vocab)] = 0.0
                dist /= dist.sum()
            out[prefix] = dist
    return out


def _one_iteration_then_target(p: dict, q: dict, n: int, vocab: int, rule: str):
    """Exact distribution of the first n + 1 tokens when one verify iteration of `n` drafts
    (drafted from q) runs and the target continues; and the expected count of accepted drafts.
    rule: "block" (sampling.block_acceptance) or "token"."""
    import itertools

    from sanctum.engine.decode.sampling import block_acceptance

    out: dict = {}
    expected = 0.0

    def cont(prefix, prob):  # the target samples the rest of the n + 1 tokens
        if len(prefix) == n + 1:
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        for x in range(vocab):
            if p[prefix][x] > 0:
                cont(prefix + (x,), prob * p[prefix][x])

    for drafts in itertools.product(range(vocab), repeat=n):
        prob_q = np.prod([q[drafts[:i]][drafts[i]] for i in range(n)])
        if prob_q == 0:
            continue
        P = np.stack([p[drafts[:i]] for i in range(n + 1)]).astype(np.float32)
        Q = np.stack([q[drafts[:i]] for i in range(n)]).astype(np.float32)
        if rule == "block":
            h, residual = block_acceptance(mx.array(drafts), mx.array(Q), mx.array(P))
            h, residual = np.array(h, np.float64), np.array(residual, np.float64)
            stop = [h[i] * np.prod(1 - h[i + 1 :]) for i in range(n + 1)]  # P(keep exactly i)
            res = [residual[i] for i in range(n)]
        else:
            ratio = np.minimum(1.0, P[np.arange(n), drafts] / Q[np.arange(n), drafts])
            reach = np.concatenate([[1.0], np.cumprod(ratio)])  # P(the first i accepted)
            stop = [reach[i] * (1 - ratio[i]) for i in range(n)] + [reach[n]]
            res = [np.maximum(P[i] - Q[i], 0.0) for i in range(n)]
        for i, s in enumerate(stop):
            if s <= 0:
                continue
            expected += prob_q * s * i
            nxt = P[n] if i == n else res[i] / res[i].sum()
            for y in range(vocab):
                if nxt[y] > 0:
                    cont(drafts[:i] + (y,), prob_q * s * nxt[y])
    return out, expected


@pytest.mark.parametrize("n,vocab,conc,zeros", [(1, 4, 0.7, False), (2, 3, 0.5, False),
                                                (3, 3, 0.8, True), (4, 2, 0.4, True)])  # fmt: skip
def test_block_verification_keeps_the_target_distribution_exactly(n, vocab, conc, zeros):
    """Over every draft block: one block-verification iteration, then the target, gives each
    sequence of n + 1 tokens exactly the target's probability; and it accepts at least as many
    drafts as the token rule in expectation."""
    import itertools

    rng = np.random.default_rng(n * 10 + vocab)
    p = _tree(rng, n, vocab, conc, zeros)
    q = _tree(rng, n - 1, vocab, conc)
    got, block_len = _one_iteration_then_target(p, q, n, vocab, "block")
    _, token_len = _one_iteration_then_target(p, q, n, vocab, "token")
    for seq in itertools.product(range(vocab), repeat=n + 1):
        want = np.prod([p[seq[:i]][seq[i]] for i in range(n + 1)])
        assert abs(got.get(seq, 0.0) - want) < 2e-6, (seq, got.get(seq), want)
    assert block_len >= token_len - 1e-6  # strictly more in the paper's example (below)


def test_block_verification_accepts_the_papers_example_exactly():
    """The paper's example: context-free models on {a, b}, target (1/3, 2/3), drafter (2/3,
    1/3), two drafts: the token rule accepts 10/9 drafts on average, block verification 11/9."""
    p = {k: np.array([1 / 3, 2 / 3]) for k in [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]}
    q = {k: np.array([2 / 3, 1 / 3]) for k in [(), (0,), (1,)]}
    _, token_len = _one_iteration_then_target(p, q, 2, 2, "token")
    _, block_len = _one_iteration_then_target(p, q, 2, 2, "block")
    assert abs(token_len - 10 / 9) < 1e-6 and abs(block_len - 11 / 9) < 1e-6


def test_bench_tau_compares_the_acceptance_rules_in_one_run(pair):
    """`sanctum bench tau --accept-rules block,token`: sampled tau and tok/s of both rules over
    the same seeded prompts, beside the greedy figures; a rule it does not know is refused."""
    import argparse

    from sanctum.bench.decode import tau

    args = argparse.Namespace(model=pair[0], drafter=pair[1], block_size=None, bits=None,
                              kv_mode=None, contexts="0", block_sizes="4", temperatures="1.0",
                              num_prompts=2, max_tokens=12, seed=0,
                              accept_rules="block,token", min_tau="auto")  # fmt: skip
    (row,) = tau(args)
    assert row["greedy_outputs_identical"]
    for key in ("tau_t1_b4", "tau_t1_b4_token", "speculative_tok_s_t1_b4_token", "plain_tok_s_t1"):
        assert row[key] is not None and row[key] > 0, key
    assert row["sampled_min_tau"] >= 1.0
    assert 0.0 <= row["lookup_share_b4"] <= 1.0
    with pytest.raises(ValueError, match="--accept-rules"):
        tau(argparse.Namespace(**{**vars(args), "accept_rules": "block,nope"}))


def test_the_acceptance_rule_setting_is_checked():
    from sanctum.engine.decode.generate import generate
    from sanctum.settings import serve_settings

    assert serve_settings(env={}).accept_rule == "block"
    assert serve_settings(env={"SANCTUM_ACCEPT_RULE": "token"}).accept_rule == "token"
    with pytest.raises(ValueError, match="SANCTUM_ACCEPT_RULE"):
        serve_settings(env={"SANCTUM_ACCEPT_RULE": "best"})
    with pytest.raises(ValueError, match="accept_rule"):
        next(generate(None, [1], accept_rule="best"))


def test_tau_ceilings_are_exact_on_a_target_that_remembers_one_token():
    """`bench tau-ceiling`'s estimators on a target whose next token depends on the previous
    one only (a Markov chain): a drafter seeing the previous token could match it exactly, so
    that ceiling accepts every row; the rows-independent one equals its exact value, the
    accepted paths' weights carried row by row through the chain."""
    from sanctum.bench.ceiling import _walks

    P = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.2, 0.7]])

    class Markov:
        def model(self, tokens, cache=None):
            return mx.log(mx.array(P, mx.float32))[tokens[:, -1]][:, None]

    rows, anchor = 5, 0
    (independent, previous), _ = _walks(Markov(), [], anchor, 1.0, rows, 4096, mx.random.key(3))
    assert min(previous) > 0.999
    marginal, w, exact = np.eye(3)[anchor], None, []
    for _ in range(rows):
        marginal = marginal @ P  # the row's marginal: the anchor's chain k steps on
        w = marginal if w is None else (w[:, None] * np.minimum(P, marginal[None])).sum(0)
        exact.append(w.sum())
    assert exact[0] == pytest.approx(1.0) and exact[-1] < 0.6
    np.testing.assert_allclose(independent, exact, atol=0.03)


def test_bench_tau_ceiling_reports_both_ceilings_beside_the_drafter(pair):
    """`sanctum bench tau-ceiling` on the tiny pair: row 1 always accepted by both ceilings,
    acceptance falling row by row, every tau within 1..block; near-greedy, both ceilings reach
    the block (a point mass is its own marginal); a greedy temperature is refused."""
    import argparse

    from sanctum.bench.ceiling import run

    args = argparse.Namespace(model=pair[0], drafter=pair[1], block_size=4, bits=None,
                              kv_mode=None, contexts="0", temperatures="1.0,0.001",
                              num_prompts=2, samples=8, positions="0,3", max_tokens=12,
                              seed=0)  # fmt: skip
    sampled, sharp = run(args)
    for row in (sampled, sharp):
        assert row["positions"] == 4 and row["block_size"] == 4
        for key in ("accepted_rows_independent", "accepted_previous_token", "accepted_drafter"):
            acc = row[key]
            assert len(acc) == 3 and all(a >= b for a, b in zip(acc, acc[1:])), key
        assert row["accepted_rows_independent"][0] == row["accepted_previous_token"][0] == 1.0
        for key in ("tau_ceiling_rows_independent", "tau_ceiling_previous_token"):
            assert 1.0 <= row[key] <= 4.0, key
    assert sharp["tau_ceiling_rows_independent"] > 3.99
    assert sharp["tau_ceiling_previous_token"] > 3.99
    with pytest.raises(ValueError, match="--temperatures"):
        run(argparse.Namespace(**{**vars(args), "temperatures": "0"}))
