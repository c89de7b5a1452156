"""Fused sibling projections (engine/fused.py): one product for several layers of one input in
multi-row passes, the layers themselves for one row, nothing added to the model's parameters,
and never a stale or gradient-less copy."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from sanctum.engine.kernels import fused
from test_engine import load_pair


class Owner(nn.Module):
    def __init__(self, quantized: bool):
        super().__init__()
        self.gate_proj = nn.Linear(128, 192, bias=False)
        self.up_proj = nn.Linear(128, 64, bias=False)
        if quantized:
            nn.quantize(self, group_size=64, bits=4)


def _params(m: nn.Module) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(m.parameters())}


@pytest.mark.parametrize("quantized", [False, True])
def test_fused_product_equals_the_layers_and_adds_no_parameter(quantized):
    owner = Owner(quantized)
    before = _params(owner)
    xs = {rows: mx.random.normal((1, rows, 128)) for rows in (1, 8)}
    want = {rows: [owner.gate_proj(x), owner.up_proj(x)] for rows, x in xs.items()}
    assert fused.fuse(owner, fused.GATED_MLP)
    after = _params(owner)
    assert before.keys() == after.keys()  # the layers hold views: same names, same values
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    for rows, x in xs.items():
        got = fused.project(owner, fused.GATED_MLP, x)
        assert [g.shape for g in got] == [(1, rows, 192), (1, rows, 64)]
        for g, w in zip(got, want[rows]):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
    with fused.disabled():  # every layer on its own
        assert fused._for(owner, fused.GATED_MLP, xs[8]) is None
    assert fused._for(owner, fused.GATED_MLP, xs[1]) is None  # one row: the layers
    assert fused._for(owner, fused.GATED_MLP, xs[8]) is not None


def test_a_replaced_or_updated_layer_drops_the_stale_fused_copy():
    owner = Owner(False)
    fused.fuse(owner, fused.GATED_MLP)
    x = mx.random.normal((4, 128))
    owner.up_proj.weight = owner.up_proj.weight * 2  # as an optimizer's update would
    np.testing.assert_allclose(
        np.array(fused.project(owner, fused.GATED_MLP, x)[1]),
        np.array(owner.up_proj(x)),
        rtol=1e-6,
    )
    assert not fused.is_fused(owner, fused.GATED_MLP)
    fused.fuse(owner, fused.GATED_MLP)
    owner.gate_proj = nn.Linear(128, 192, bias=False)  # as dequantize_model would
    assert fused._for(owner, fused.GATED_MLP, x) is None


def test_a_fused_model_still_takes_gradients_once_unfused():
    owner = Owner(False)
    fused.fuse(owner, fused.GATED_MLP)
    fused.unfuse(owner)
    x = mx.random.normal((4, 128))

    def loss(params):
        owner.update(params)
        g, u = fused.project(owner, fused.GATED_MLP, x)
        return (g.sum() + u.sum()) ** 2

    grads = mx.grad(loss)(owner.trainable_parameters())
    assert all(mx.abs(v).sum().item() > 0 for _, v in tree_flatten(grads))


def test_target_and_drafter_fuse_at_load_and_verify_as_unfused(make_pair):
    """The hybrid target fuses its GDN input projections and MLPs, the drafter its q/k/v and
    MLPs; a verify block's logits and taps and the drafter's block are those of the layers
    computed one by one (float32 rounding), and greedy decoding is unchanged."""
    from sanctum.engine.decode.generate import generate
    from test_engine import tokens_of

    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    n_gdn = sum(target.is_gdn)
    assert target.fused_groups == n_gdn + target.num_layers  # GDN inputs + every MLP
    assert all(fused.is_fused(layer.mlp, fused.GATED_MLP) for layer in drafter.body.layers)
    assert all(fused.is_fused(layer.self_attn, fused.QKV) for layer in drafter.body.layers)
    ids = target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    taps = tuple(drafter.cfg.target_layer_ids)

    def run():
        cache = target.make_cache()
        target.prefill(ids[:-8], cache, taps)
        logits, tap_rows, _ = target.verify(mx.array(ids[-8:]), cache, taps)
        body_cache = drafter.body.make_cache()
        embeds = target.embed_tokens(mx.array([ids[:8]]))
        hidden = drafter.body(embeds, 8, tap_rows[None, :8], body_cache)
        mx.eval(logits, tap_rows, hidden)
        return [np.array(a) for a in (logits, tap_rows, hidden)]

    with_fused = run()
    with fused.disabled():
        target.drop_compiled()
        alone = run()
        plain = tokens_of(generate(target, ids, drafter=None, max_tokens=24))
    target.drop_compiled()
    for a, b in zip(with_fused, alone):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert tokens_of(generate(target, ids, drafter=drafter, max_tokens=24)) == plain
