"""The draft layer's CUDA kernels (engine/draft_cuda.py) as the drafter routes to them, with
pure-MLX stand-ins on this CPU: a body that takes them drafts what the MLX path drafts, eagerly and
through the compiled stack over the context buffers, across rounds whose context outgrows the
sliding window; and the checks catch kernels that break the reference's rules. The kernels
themselves are checked on the GPU (test_cuda.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from sanctum.engine.kernels import draft_cuda, fused
from sanctum.engine.model.drafter import body as dr
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import load_target


def traceable_attention(qkv, q_norm, k_norm, keys, values, start, bounds, spec, inv_freq):
    """`block_attention`'s contract by MLX ops that trace (no host reads, as a kernel inside
    the compiled stack): the whole buffer, its rows outside begin..end and beyond the window
    masked out."""
    B, L, _ = qkv.shape
    Hq, Hk, D = spec.heads, spec.kv_heads, spec.head_dim
    q, k, v = mx.split(qkv, [Hq * D, (Hq + Hk) * D], axis=-1)
    offset = start.reshape(())

    def norm_rope(t, heads, weight):
        t = mx.fast.rms_norm(t.reshape(B, L, heads, D), weight, spec.eps).transpose(0, 2, 1, 3)
        return mx.fast.rope(
            t, D, traditional=False, base=spec.rope_base, scale=spec.rope_scale, offset=offset
        )

    q, k = norm_rope(q, Hq, q_norm), norm_rope(k, Hk, k_norm)
    v = v.reshape(B, L, Hk, D).transpose(0, 2, 1, 3)
    rows, c = mx.arange(L)[:, None], mx.arange(keys.shape[2])[None]
    seen = (c >= bounds[0]) & (c < bounds[1])
    if spec.window is not None:
        seen = seen & (rows + bounds[1] - c < spec.window)
    own = mx.arange(L)[None] <= rows if spec.causal else mx.ones((L, L), mx.bool_)
    mask = mx.concatenate([mx.broadcast_to(seen, (L, keys.shape[2])), own], axis=1)
    k, v = mx.concatenate([keys, k], axis=2), mx.concatenate([values, v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, Hq * D)


@pytest.fixture(scope="module")
def bf16_pair(make_pair):
    target_dir, drafter_dir = make_pair("hybrid", "dflash2")
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target)
    fused.unfuse(drafter.body)  # the tiny checkpoint is float32; the kernels take bfloat16
    drafter.body.set_dtype(mx.bfloat16)
    fused.fuse_drafter(drafter.body)
    return target, drafter


def _rounds(body, kernels: bool, seed: int = 0) -> list[np.ndarray]:
    """Drafts over rounds of a few context rows each (66 in all: past the tiny layout's window
    of 16), on a fresh cache; the body's outputs as float32."""
    body.use_kernels(attention=kernels, conv=kernels)
    rng = np.random.default_rng(seed)
    cache = body.make_cache()
    tap_width = body.fc.weight.shape[1]
    hidden = body.cfg.hidden_size
    start, outs = 0, []
    for rows in (20, 3, 7, 1, 30, 5):
        start += rows
        taps = mx.array(rng.normal(size=(1, rows, tap_width)), mx.bfloat16)
        embeds = mx.array(rng.normal(size=(1, 8, hidden)), mx.bfloat16)
        outs.append(np.array(body(embeds, start, taps, cache).astype(mx.float32)))
    body.use_kernels(attention=False, conv=False)
    return outs


def _counting(fn, calls: list):
    def wrapped(*args, **kw):
        calls.append(fn.__name__)
        return fn(*args, **kw)

    wrapped.__name__ = fn.__name__
    return wrapped


def test_eager_kernels_draft_what_the_mlx_path_drafts(bf16_pair, monkeypatch):
    """Eagerly, with the MLX path's own ops standing in for the kernels, every layer's attention
    and convolutions go through them and the drafts are bit for bit the MLX path's."""
    body = bf16_pair[1].body
    calls: list = []
    monkeypatch.setattr(draft_cuda, "attention_supported", lambda spec, rows: True)  # D 32
    monkeypatch.setattr(dr, "COMPILE_DRAFTS", False)
    monkeypatch.setattr(
        draft_cuda, "block_attention", _counting(draft_cuda.reference_attention, calls)
    )
    monkeypatch.setattr(draft_cuda, "dynamic_conv", _counting(draft_cuda.reference_conv, calls))
    want = _rounds(body, kernels=False)
    assert calls == []
    got = _rounds(body, kernels=True)
    layers = len(body.layers)
    assert calls.count("reference_attention") == 6 * layers
    assert calls.count("reference_conv") == 6 * 4 * layers  # four a DFlash 2 layer
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_compiled_stack_reads_the_context_buffers(bf16_pair, monkeypatch):
    """With the kernels on, the layer stack runs compiled over each layer's whole context buffer
    and its bounds (no padding, no mask), full-attention layers too, and drafts what the MLX
    path drafts (to bfloat16 rounding: the stand-in attends over the whole buffer, masked)."""
    body = bf16_pair[1].body
    monkeypatch.setattr(draft_cuda, "attention_supported", lambda spec, rows: True)  # D 32
    monkeypatch.setattr(dr, "COMPILE_DRAFTS", True)
    monkeypatch.setattr(draft_cuda, "block_attention", traceable_attention)
    monkeypatch.setattr(draft_cuda, "dynamic_conv", draft_cuda.reference_conv)
    want = _rounds(body, kernels=False)
    traced = []
    real = body._compiled_stack

    def spy(context=dr.FetchedContext):
        traced.append(context.__name__)
        return real(context)

    monkeypatch.setattr(body, "_compiled_stack", spy)
    got = _rounds(body, kernels=True)
    assert traced == ["BufferContext"] * 6
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=0.05 * np.abs(w).max(), rtol=0)


def test_training_and_a_body_without_kernels_use_mlx_ops(bf16_pair):
    body = bf16_pair[1].body
    assert all("_kernel" not in layer.self_attn.__dict__ for layer in body.layers)
    body.use_kernels(attention=True, conv=True)
    assert all("_kernel" in layer.self_attn.__dict__ for layer in body.layers)
    body.use_kernels(attention=False, conv=False)
    assert all("_conv_kernel" not in layer.__dict__ for layer in body.layers)


_SPEC = draft_cuda.AttentionSpec(
    heads=4, kv_heads=2, head_dim=64, window=24, causal=False, eps=1e-6, scale=0.125,
    rope_base=1e6,
)  # fmt: skip


def test_attention_check_passes_the_mlx_path_and_catches_broken_rules():
    ref = draft_cuda.reference_attention
    assert draft_cuda.check_attention(ref, _SPEC, compiled=False) is None

    def no_window(*args):
        *rest, spec, inv_freq = args
        return ref(*rest, draft_cuda.AttentionSpec(**{**spec.__dict__, "window": None}), inv_freq)

    def causal(*args):
        *rest, spec, inv_freq = args
        return ref(*rest, draft_cuda.AttentionSpec(**{**spec.__dict__, "causal": True}), inv_freq)

    for wrong in (no_window, causal):
        assert "max error" in draft_cuda.check_attention(wrong, _SPEC, compiled=False)


def test_conv_check_passes_the_mlx_path_and_catches_a_wrong_kernel():
    assert draft_cuda.check_conv(draft_cuda.reference_conv, 128, 2, 16, compiled=False) is None

    def other_half(x, dyn, base, which, group, residual=None):
        return draft_cuda.reference_conv(x, dyn, base, 1 - which, group, residual)

    assert "max error" in draft_cuda.check_conv(other_half, 128, 2, 16, compiled=False)


def test_supported_shapes():
    assert draft_cuda.attention_supported(_SPEC, 16)
    seed = draft_cuda.AttentionSpec(32, 8, 128, 2048, False, 1e-6, 128**-0.5, 1e7)
    assert draft_cuda.attention_supported(seed, 8) and draft_cuda.attention_supported(seed, 16)
    assert not draft_cuda.attention_supported(
        draft_cuda.AttentionSpec(4, 2, 32, 16, True, 1e-6, 0.2, 1e6), 8
    )  # a head of 32: its RoPE pairs are not in one lane
