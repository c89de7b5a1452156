"""The target side of a shared round: its verify (attention over N KV caches, GDN write-back,
the outputs) and its rollback build graphs whose size does not grow with the number of
sequences, and give each sequence what the per-sequence path gives it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from sanctum.bench.opcount import flat_arrays, graph_ops
from sanctum.engine.decode import batch
from sanctum.engine.decode.batch import verify_batch
from sanctum.engine.model import attention
from test_engine import load_pair

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


def _caches(target, lengths: list[int]) -> list[list]:
    """Prefilled caches of ragged lengths (one past a KV buffer step: capacities differ)."""
    ids = target.tokenizer.encode(PROMPT * 40)
    out = []
    for n, length in enumerate(lengths):
        cache = target.make_cache()
        target.prefill(ids[n : n + length], cache)
        out.append(cache)
    return out


def _held(caches: list[list]) -> list[mx.array]:
    out = []
    for cache in caches:
        for c in cache:
            if c.is_trimmable():
                out += [c.keys, c.values]
            else:
                out += [a for a in c.cache if a is not None]
    return out


def _blocks(N: int, L: int = 8) -> mx.array:
    return (mx.arange(N * L).reshape(N, L) * 7 + 3) % 200


def _verify_nodes(target, lengths, widths=None) -> tuple[int, int]:
    """Op nodes of a shared verify (outputs and caches written) and of its rollback, in the
    second round (the first widens the shorter KV buffers to the batch's capacity, once)."""
    caches = _caches(target, lengths)
    N = len(lengths)
    _, tape = verify_batch(target, _blocks(N), caches, (1, 3), widths)
    target.rollback_batch(caches, tape, [0] * N)
    mx.eval(_held(caches))
    outs, tape = verify_batch(target, _blocks(N), caches, (1, 3), widths)
    arrays = [a for logits, taps, _ in outs for a in (logits, taps)] + _held(caches)
    verify = sum(graph_ops(*arrays).values())
    mx.eval(arrays)
    keeps = [(3 * n) % 9 for n in range(N)]  # all different, 0 included
    if widths:
        keeps = [min(k, w) for k, w in zip(keeps, widths)]
    states = target.rollback_batch(caches, tape, keeps)
    return verify, sum(graph_ops(*flat_arrays(states), *_held(caches)).values())


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_shared_verify_and_rollback_nodes_do_not_grow_with_sequences(make_pair, kind):
    target, _ = load_pair(make_pair, kind, "dflash")
    two = _verify_nodes(target, [30, 270])
    six = _verify_nodes(target, [30, 270, 9, 41, 300, 12], [8, 5, 8, 3, 8, 8])
    assert six == two, (two, six)
    assert (two[1] > 0) == any(target.is_gdn)  # a dense target's rollback only trims


@pytest.mark.parametrize("kind", ["hybrid", "next", "dense"])
def test_shared_attention_equals_the_per_sequence_path(make_pair, monkeypatch, kind):
    """Ragged offsets and KV capacities (a buffer widened to the batch's): each sequence's
    logits, taps and KV rows are what the per-sequence attention gives it."""
    target, _ = load_pair(make_pair, kind, "dflash")
    lengths, widths = [30, 270, 9, 300], [8, 3, 8, 6]

    def run():
        caches = _caches(target, lengths)
        outs, _ = verify_batch(target, _blocks(4), caches, (1, 3), widths)
        mx.eval([a for o in outs for a in o[:2]], _held(caches))
        return outs, caches

    got, got_caches = run()
    assert isinstance(
        batch._attention_masks(target, mx.zeros((4, 8, 1)), got_caches), attention.SharedKV
    )
    monkeypatch.setattr(batch, "shared_kv", lambda *a: None)
    want, want_caches = run()
    for n, ((gl, gt, _), (wl, wt, _)) in enumerate(zip(got, want)):
        assert gl.shape == wl.shape == (widths[n], wl.shape[-1])
        assert mx.allclose(gl, wl, atol=1e-5, rtol=1e-5), f"sequence {n}"
        assert mx.allclose(gt, wt, atol=1e-5, rtol=1e-5), f"sequence {n}"
        assert mx.array_equal(gl.argmax(-1), wl.argmax(-1))
    first = target._first_attn  # its inputs are the same: its KV rows to the bit (RoPE too)
    for n, (a, b) in enumerate(zip(got_caches, want_caches)):
        for i, (ca, cb) in enumerate(zip(a, b)):
            if not ca.is_trimmable():
                continue
            assert ca.offset == cb.offset == lengths[n] + 8
            for x, y in ((ca.keys, cb.keys), (ca.values, cb.values)):
                x, y = x[..., : ca.offset, :], y[..., : cb.offset, :]
                if i == first:
                    assert mx.array_equal(x, y), f"sequence {n}, layer {i}"
                assert mx.allclose(x, y, atol=1e-5, rtol=1e-5), f"sequence {n}, layer {i}"
