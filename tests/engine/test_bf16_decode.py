"""A bf16 model's decode path: no silent widening (prefill, verify, rollback, KV, taps,
drafter, saved prompt-cache states, the fused-GDN kernel's path through its pure-MLX
stand-in); plain greedy equal to mlx-lm's greedy decode, also past one prefill chunk."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
import sanctum.engine.model.gdn as gdn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache
from sanctum.engine.decode.generate import generate
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.kernels import gdn_cuda
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import cache_offset, load_target

PROMPT = "def fibonacci(n):\n    "


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.fixture(scope="module")
def bf16_pair(make_pair, tmp_path_factory):
    """The tiny hybrid pair saved in bf16, loaded in bf16 on the CPU too (keep_dtype)."""
    root = tmp_path_factory.mktemp("bf16")
    for src in make_pair("hybrid", "dflash2"):
        shutil.copytree(src, root / src.name)
        f = root / src.name / "model.safetensors"
        weights = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in mx.load(str(f)).items()}  # fmt: skip
        mx.save_safetensors(str(f), weights, metadata={"format": "pt"})
    target = load_target(root / "target", keep_dtype=True)
    return target, load_drafter(root / "drafter", target, keep_dtype=True)


def _floats(cache) -> list:
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.append(("conv", c[0].dtype))
        elif isinstance(c, QuantizedKVCache):
            out += [("kv_scales", c.keys[1].dtype), ("kv_biases", c.values[2].dtype)]
        else:
            out += [("keys", c.keys.dtype), ("values", c.values.dtype)]
    return out


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_bf16_model_never_widens(bf16_pair, kv):
    """Everything the decode path keeps or hands on stays bf16; only the recurrent state is
    float32 (by design: mlx-lm's too)."""
    from sanctum.cache.store import PromptStore
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.verifier import Verifier

    target, drafter = bf16_pair
    assert target.dtype == mx.bfloat16
    ids = target.tokenizer.encode(PROMPT * 3)
    taps_ids = drafter.cfg.target_layer_ids
    cache = target.make_cache(kv)
    logits, taps = target.prefill(ids, cache, taps_ids)
    bf16 = mx.bfloat16

    def check(where):
        assert all(d == bf16 for _, d in _floats(cache)), (where, _floats(cache))
        assert all(s.dtype == mx.float32 for _, s in target.recurrent_state(cache)), where

    assert logits.dtype == bf16 and all(t.dtype == bf16 for t in taps)
    check("prefill")
    block = mx.array([5, 6, 7, 8, 9, 10, 11, 12])
    logits, vtaps, tape = target.verify(block, cache, taps_ids)
    assert logits.dtype == bf16 and vtaps.dtype == bf16
    check("verify")
    target.rollback(cache, tape, 3)
    check("rollback")
    peer = LocalDraftPeer(drafter)
    peer.open("s")
    embeds = target.embed_tokens(mx.array([3] + [drafter.cfg.mask_token_id] * 7))
    hidden = peer.draft("s", vtaps[:4], embeds, cache_offset(cache))
    assert hidden.dtype == bf16 and all(c.keys.dtype == bf16 for c in peer.caches["s"])
    # the prompt cache saves what the live cache holds: bf16 KV, float32 state, bf16 taps
    store = PromptStore(1 << 30)
    verifier = Verifier(target, drafter, peer, store, kv_mode=kv)
    list(verifier.generate(GenerateRequest(prompt=PROMPT, max_tokens=12)))
    (entry,) = store.entries()
    assert all(a.dtype in (bf16, mx.uint32) for layer in entry.kv for a in layer)
    assert entry.rungs and all(c.dtype == bf16 for s in entry.rungs.values() for c, _ in s)
    assert entry.taps is not None and entry.taps.dtype == bf16


@pytest.mark.parametrize("prompt", [PROMPT, "import os\nclass A:", "hello world"])
def test_bf16_plain_greedy_equals_mlx_lm(bf16_pair, prompt):
    target, _ = bf16_pair
    ids = target.tokenizer.encode(prompt)
    want = [int(t) for t, _ in generate_step(mx.array(ids), target.model, max_tokens=40)]
    assert tokens_of(generate(target, ids, max_tokens=40, eos_ids=set())) == want


def test_bf16_long_prompt_equals_mlx_lm_with_its_prefill(bf16_pair, monkeypatch):
    """A prompt past one chunk: the chunked prefill's float32 sums differ from mlx-lm's token
    loop in the last bits; with the prefill computed as mlx-lm does, the decode is its own."""
    target, _ = bf16_pair
    ids = [int(t) for t in np.random.default_rng(3).integers(10, 400, size=150)]
    want = [int(t) for t, _ in generate_step(mx.array(ids), target.model, max_tokens=24)]
    monkeypatch.setattr(gdn, "MLX_LM_PREFILL", True)
    assert tokens_of(generate(target, ids, max_tokens=24, eos_ids=set())) == want


def test_block_kernel_path_keeps_bf16(bf16_pair, monkeypatch):
    """The kernel takes q, k, v and beta in the activations' dtype and gives y in it (it sums
    in float32 inside), so a bf16 model's verify tapes and hands on bf16, with no cast kernels
    around the launch, and the recurrent state stays float32."""
    target, drafter = bf16_pair
    monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
    cache = target.make_cache()
    target.prefill(target.tokenizer.encode(PROMPT), cache)
    logits, taps, tape = target.verify(mx.arange(5, 13), cache, drafter.cfg.target_layer_ids)
    assert logits.dtype == taps.dtype == mx.bfloat16
    assert all(t.inputs[0].dtype == mx.bfloat16 for t in tape.gdn)  # taped as the kernel takes it
    target.rollback(cache, tape, 3)
    assert all(c.dtype == mx.bfloat16 and s.dtype == mx.float32
               for c, s in target.recurrent_state(cache))  # fmt: skip
