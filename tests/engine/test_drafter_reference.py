"""The drafter against the DFlash authors' own MLX implementation (`dflash` 0.1.0 on PyPI,
`dflash/model_mlx.py`), installed as a test oracle by `make setup`: shared random weights in the
published layouts, many rounds whose context outgrows the sliding window, context appended a few
rows at a time as in real rounds.

How the comparison is fair (docs/design/drafter.md): the reference's incremental sliding cache
returns keys in rotated order while its mask assumes time order, so every round it gets a fresh
cache and the whole context; ours runs incrementally, exactly as it serves. Its `load_draft`
fetches through the hub, so the test points that fetch at the local folder: both loaders read the
same config.json as is.
"""

from __future__ import annotations

import json

import dflash.model_mlx as reference  # the oracle: `make setup` installs dflash==0.1.0
import mlx.core as mx
import numpy as np
import pytest
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.model.drafter import ContextCache, load_drafter
from sanctum.engine.model.drafter import body as drafter_module
from sanctum.engine.model.target import load_target
from sanctum.tiny import DRAFTER_LAYOUTS, drafter_config, write_random_drafter


@pytest.fixture(scope="module")
def target(make_pair):
    target_dir, _ = make_pair("hybrid", "dflash")
    return target_dir, load_target(target_dir)


def _reference_drafter(path, monkeypatch, target_model):
    monkeypatch.setattr(reference, "snapshot_download", lambda *a, **k: str(path))
    model = reference.load_draft(str(path))
    model.set_dtype(mx.float32)  # ours runs float32 on the CPU
    return model.bind(target_model)


@pytest.mark.parametrize("step", [None, 8, 0])
@pytest.mark.parametrize("layout", sorted(DRAFTER_LAYOUTS))
def test_drafter_equals_reference(layout, step, target, tmp_path, monkeypatch):
    """`step` 8: sliding contexts pad to buckets of 8 rows (ContextCache.STEP), so the compiled
    stack runs at several padded shapes before the windows fill, and still agrees. None: the
    default (one bucket of the whole window). 0: no padding (PAD_TO_BUCKETS off: op by op
    until the windows are full)."""
    if step:
        monkeypatch.setattr(ContextCache, "STEP", step)
    monkeypatch.setattr(drafter_module, "PAD_TO_BUCKETS", step != 0)
    target_dir, tgt = target
    raw = DRAFTER_LAYOUTS[layout](drafter_config("dflash", target_dir, block_size=8, layers=2))
    path = write_random_drafter(tmp_path / layout, raw, seed=3)
    assert json.loads((path / "config.json").read_text()) == raw  # read as published
    ours = load_drafter(path, tgt)
    ref = _reference_drafter(path, monkeypatch, tgt.model)
    cfg, L = ours.cfg, ours.block_size
    assert L == (16 if layout == "dflash2" else 8)  # DFlash 2: block_size inside dflash_config
    window = cfg.sliding_window or 10**9

    rng = np.random.default_rng(7)
    total = 40 + 5 * L + (cfg.sliding_window or 0)
    tokens = rng.integers(10, tgt.vocab_size, total).astype(np.int32)
    _, taps = tgt.forward(mx.array(tokens), tgt.make_cache(), cfg.target_layer_ids)  # [S, W]
    peer = LocalDraftPeer(ours)
    peer.open("s")
    mask = [cfg.mask_token_id] * (L - 1)
    start, seen, rounds, past_window = 9, 0, 0, 0
    buckets = set()
    while start + L <= total:
        anchor = int(tokens[start])
        embeds = tgt.embed_tokens(mx.array([anchor] + mask))  # [L, H]
        hidden = peer.draft("s", taps[seen:start], embeds, start)  # [L-1, H]
        seen = start
        buckets |= {c.bucket() for c in peer.caches["s"] if c.window is not None}
        logits = ours.head.logits(hidden)

        ref_hidden = ref.hidden_states(
            mx.array([[anchor] + mask]), taps[None, :start], ref.make_cache(), logits_start=1
        )
        ref_logits = ref.compute_logits(ref_hidden).astype(mx.float32)[0]
        scale = mx.abs(ref_logits).max().item()
        assert mx.allclose(logits, ref_logits, atol=2e-5 * max(1.0, scale), rtol=1e-4).item(), (
            f"round {rounds} at {start}: max |diff| {mx.abs(logits - ref_logits).max().item():.3g}"
        )
        if cfg.is_v2:
            ours_picks = ours.head.select(hidden, logits, anchor, 0.0)[0]
            ref_picks = ref.candidate_selector.select(
                ref_hidden, ref.compute_logits(ref_hidden), mx.array([anchor]), 0.0
            )[0][0]
            assert ours_picks.tolist() == ref_picks.tolist(), f"round {rounds}"
            # what a greedy round runs: the compiled selection
            compiled = ours.head.select_greedy(hidden[None], logits[None], mx.array([anchor]))
            assert compiled[0].tolist() == ref_picks.tolist(), f"round {rounds} (compiled)"
        else:
            assert mx.argmax(logits, -1).tolist() == mx.argmax(ref_logits, -1).tolist()
        past_window += start > window
        start += int(rng.integers(1, L + 1))  # accepted + 1 rows join the context
        rounds += 1
    assert rounds >= 12
    if cfg.sliding_window:
        assert past_window >= 5  # most of the rounds are longer than the window
    # all sliding: once every window is full the layers ran as one compiled graph (and agreed)
    all_sliding = all(t == "sliding_attention" for t in cfg.layer_types)
    assert ("_stack" in ours.body.__dict__) == all_sliding
    if all_sliding and step:
        assert len(buckets) >= 2  # padded shapes below the window, then the window itself


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("kernel", [2, 3])
def test_dynamic_conv_equals_repeat_and_zero_padded_shifts(kernel, dtype):
    """DFlash 2's convolution, computed with grouped broadcasts and 0/1 shift matrices (no
    copies, on a GPU a draft's launches), gives bit for bit what the plain reading gives: each
    weight repeated over its channel group, each row's predecessors zero-padded before the
    block."""
    B, L, H, group = 2, 6, 32, 8
    conv = drafter_module.DynamicConv(H, kernel, group)
    rng = np.random.default_rng(0)
    conv.base_kernel = mx.array(rng.standard_normal((2, kernel, H)), dtype=dtype)
    conv.kernel_projection.weight = mx.array(
        rng.standard_normal(conv.kernel_projection.weight.shape), dtype=dtype
    )
    x = mx.array(rng.standard_normal((B, L, H)), dtype=dtype)
    dyn = conv.kernels(x)
    full = conv.base_kernel + mx.repeat(
        conv.kernel_projection(x).reshape(B, L, 2, kernel, H // group), group, axis=-1
    )  # [B, L, 2, K, H]
    for which in (0, 1):
        want = full[:, :, which, 0] * x
        for o in range(1, kernel):
            shifted = mx.concatenate([mx.zeros((B, o, H), dtype), x[:, : L - o]], axis=1)
            want = want + full[:, :, which, o] * shifted
        got = conv.apply(x, dyn, which)
        assert got.dtype == dtype
        assert mx.array_equal(got, want).item(), which
