"""The target's side of a shared round: one verify forward over several sequences' blocks
(split attention, a block padded to the batch's width) gives each sequence its solo logits,
taps and caches, and one batched rollback leaves each cache as a rollback per sequence."""

from __future__ import annotations

import mlx.core as mx
import pytest
from batching import PROMPTS
from mlx_lm.models.cache import QuantizedKVCache
from sanctum.engine.decode.batch import verify_batch
from sanctum.engine.model.attention import _SPLIT_ATTENTION, attention_over
from sanctum.engine.model.target import DequantizedView, cache_offset
from test_engine import load_pair


@pytest.mark.parametrize("kind", ["hybrid", "dense", "moe", "next"])
@pytest.mark.parametrize("dequantize_q8,fused_qkv", [(False, False), (True, False), (False, True)])
def test_split_attention_equals_mlx_lm_module_per_sequence(
    make_pair, kind, dequantize_q8, fused_qkv
):
    """The batched projections + per-sequence cache part give each sequence what mlx-lm's own
    module gives it on its own cache (ragged lengths, fp16 and 8-bit KV, q/k/v fused or not),
    caches included."""
    from sanctum.engine.kernels import fused
    from sanctum.engine.model.target import load_target

    if fused_qkv:  # an own copy: the shared one keeps mlx-lm's layers
        target = load_target(make_pair(kind, "dflash")[0])
    else:
        target, _ = load_pair(make_pair, kind, "dflash")
    i = target._first_attn
    attn = target.layers[i].self_attn
    assert type(attn) in _SPLIT_ATTENTION  # the split, not the whole-module fallback
    assert fused.fuse(attn, fused.QKV) if fused_qkv else not fused.is_fused(attn, fused.QKV)
    N, L, H = 4, 8, target.hidden_size
    kvs, lengths = ["fp16", "q8", "q8", "fp16"], [5, 0, 70, 33]

    def caches():  # the same ragged history in each copy, written by the module itself
        out = []
        for n, (kv, length) in enumerate(zip(kvs, lengths)):
            c = target.make_cache(kv)[i]
            if length:
                attn(mx.random.normal((1, length, H), key=mx.random.key(n)), "causal", c)
            out.append(DequantizedView(c) if dequantize_q8 and kv == "q8" else c)
        return out

    x = mx.random.normal((N, L, H), key=mx.random.key(99))
    solo_caches, batch_caches = caches(), caches()
    want = [attn(x[n : n + 1], "causal", c) for n, c in enumerate(solo_caches)]
    got = attention_over(attn, x, ["causal"] * N, batch_caches)
    for n, (a, b) in enumerate(zip(solo_caches, batch_caches)):
        # the projections over N * L rows may differ from L rows' in the last bit, which can
        # move an 8-bit key one quantization step
        atol = 1e-4 if kvs[n] == "q8" else 1e-5
        assert mx.allclose(got[n : n + 1], want[n], atol=atol, rtol=1e-5), f"sequence {n}"
        a, b = getattr(a, "cache", a), getattr(b, "cache", b)  # under a DequantizedView
        assert a.offset == b.offset == lengths[n] + L
        for (ka, step), (kb, _) in zip(_kv(a), _kv(b)):
            assert mx.abs(ka - kb).max().item() <= step + 1e-5, f"sequence {n} cache"
    # a module type without a split runs whole, once per sequence: mlx-lm's own output
    whole = attention_over(lambda *a: attn(*a), x, ["causal"] * N, caches())
    assert all(mx.array_equal(whole[n : n + 1], want[n]) for n in range(N))


def _kv(c) -> list[tuple[mx.array, float]]:
    """A KV cache's keys and values so far (dequantized if 8-bit), each with its largest
    quantization step (0 for fp16)."""
    if isinstance(c, QuantizedKVCache):
        return [
            (mx.dequantize(*t, group_size=c.group_size, bits=c.bits)[..., : c.offset, :],
             t[1].max().item())
            for t in (c.keys, c.values)
        ]  # fmt: skip
    return [(c.keys[..., : c.offset, :], 0.0), (c.values[..., : c.offset, :], 0.0)]


@pytest.mark.parametrize("kind", ["hybrid", "next"])
@pytest.mark.parametrize("tape", ["chunk", "row_states"])
def test_a_block_padded_at_its_end_verifies_and_rolls_back_as_alone(
    make_pair, monkeypatch, kind, tape
):
    """A narrower block padded to the batch's width: its real rows' logits and taps are the
    solo verify's, and a rollback to any keep <= its width drops the padded rows' KV and GDN
    states (the next token's logits are a fresh forward's), on both kinds of GDN tape."""
    from sanctum.engine.kernels import gdn_cuda
    from sanctum.engine.model import gdn

    if tape == "row_states":  # the CUDA kernel's taped variant, through its pure-MLX stand-in
        monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
        monkeypatch.setattr(gdn, "BLOCK_KERNEL_KEEPS_ROWS", True)
    target, _ = load_pair(make_pair, kind, "dflash")
    taps = (1, 3)
    ids = [target.tokenizer.encode(p) for p in PROMPTS[:2]]
    narrow, wide = [11, 52, 7], [5, 9, 100, 31, 2, 77, 8, 40]
    for keep in (0, 1, 3):
        solo_cache = target.make_cache()
        target.prefill(ids[0], solo_cache)
        want_logits, want_taps, _ = target.verify(mx.array(narrow), solo_cache, taps)
        caches = [target.make_cache(), target.make_cache()]
        for c, prompt in zip(caches, ids):
            target.prefill(prompt, c)
        blocks = mx.array([narrow + [0] * 5, wide])
        ((logits, got_taps, vtape), _), _ = verify_batch(target, blocks, caches, taps, [3, 8])
        assert logits.shape[0] == got_taps.shape[0] == vtape.num_rows == 3
        kept = [t.row_states if tape == "row_states" else t.chunk_parts for t in vtape.gdn]
        assert vtape.gdn and all(k is not None for k in kept)
        assert mx.allclose(logits, want_logits, atol=1e-4, rtol=1e-4)
        assert mx.allclose(got_taps, want_taps, atol=1e-4, rtol=1e-4)
        target.rollback(caches[0], vtape, keep)
        assert cache_offset(caches[0]) == len(ids[0]) + keep
        got, _ = target.forward(mx.array([7]), caches[0])
        want, _ = target.forward(mx.array(ids[0] + narrow[:keep] + [7]), target.make_cache())
        assert mx.allclose(got[-1], want[-1], atol=1e-4, rtol=1e-4), f"keep {keep}"


# keeps of four sequences whose third block is 5 rows padded to 8
KEEP_MIXES = [
    (8, 8, 5, 8),  # all accepted: only the padded block has rows to drop
    (3, 3, 3, 3),  # one keep: one op for all
    (0, 1, 4, 8),  # all different: the state before the pass, a no-op
    (2, 5, 2, 5),  # two keeps of two sequences each
    (1, 1, 0, 1),
    (0, 0, 0, 0),
]


@pytest.mark.parametrize("kind", ["hybrid", "next"])
@pytest.mark.parametrize("tape", ["chunk", "gather", "views", "rerun"])
def test_batched_rollback_equals_a_rollback_per_sequence(make_pair, monkeypatch, kind, tape):
    """`Target.rollback_batch` after a shared verify (fp16 and 8-bit KV, a padded block) leaves
    every cache exactly as a rollback per sequence does, for every mix of keeps, on every kind
    of GDN tape: the chunk's parts, or the block kernel's rows' states gathered or taken as
    slices, or its inputs run again over the kept rows (gdn.SHARED_ROLLBACK); the sequences'
    own tapes still roll back further afterwards."""
    from sanctum.engine.kernels import gdn_cuda
    from sanctum.engine.model import gdn

    if tape != "chunk":  # the CUDA kernel, through its pure-MLX stand-in
        monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
        monkeypatch.setattr(gdn, "BLOCK_KERNEL_KEEPS_ROWS", True)
        monkeypatch.setattr(gdn, "SHARED_ROLLBACK", tape)
    target, _ = load_pair(make_pair, kind, "dflash")
    kvs, widths = ["fp16", "q8", "fp16", "q8"], [8, 8, 5, 8]
    blocks = mx.array([[5, 9, 100, 31, 2, 77, 8, 40], [11, 52, 7, 7, 90, 3, 61, 12],
                       [13, 4, 200, 18, 6, 0, 0, 0], [21, 21, 21, 30, 44, 1, 9, 150]])  # fmt: skip
    ids = [target.tokenizer.encode(p) for p in PROMPTS]

    def verified():
        caches = [target.make_cache(kv) for kv in kvs]
        for c, prompt in zip(caches, ids):
            target.prefill(prompt, c)
        outs, batch_tape = verify_batch(target, blocks, caches, (1, 3), widths)
        return caches, [t for _, _, t in outs], batch_tape

    for keeps in KEEP_MIXES:
        want, want_tapes, _ = verified()
        for c, t, keep in zip(want, want_tapes, keeps):
            target.rollback(c, t, keep)
        got, got_tapes, batch_tape = verified()
        field = {"chunk": "chunk_parts", "rerun": "kernel_inputs"}.get(tape, "row_states")
        kept = [getattr(t, field) for t in batch_tape.gdn]
        assert batch_tape.gdn and all(k is not None for k in kept)
        target.rollback_batch(got, batch_tape, list(keeps))
        _assert_same_caches(got, want, keeps)
        for caches, tapes in ((got, got_tapes), (want, want_tapes)):
            for c, t, keep in zip(caches, tapes, keeps):
                target.rollback(c, t, keep // 2)
        _assert_same_caches(got, want, keeps)


def _assert_same_caches(got: list, want: list, keeps) -> None:
    for n, (a, b) in enumerate(zip(got, want)):
        assert cache_offset(a) == cache_offset(b), f"sequence {n}, keeps {keeps}"
        for i, (ca, cb) in enumerate(zip(a, b)):
            for x, y in zip(_arrays(ca), _arrays(cb), strict=True):
                assert mx.array_equal(x, y), f"sequence {n}, layer {i}, keeps {keeps}"


def _arrays(c) -> list[mx.array]:
    """What a layer's cache holds: GDN conv and recurrent state, attention KV (8-bit: packed
    values, scales, biases) up to its offset."""
    if not c.is_trimmable():
        return [c[0], c[1]]
    parts = [t for kv in (c.keys, c.values) for t in (kv if isinstance(kv, tuple) else (kv,))]
    return [t[..., : c.offset, :] for t in parts]


def test_steady_shared_passes_take_the_last_ones_stacked_caches_as_they_are(make_pair, monkeypatch):
    """A shared verify hands each cache its row of the stacked KV and GDN states; after a
    shared rollback the next shared verify over the same caches takes those stacked buffers
    as they are (no copy of every sequence's KV and states) and leaves every cache, logit and
    tap as stacking them afresh does, bit for bit. A solo forward lets one sequence's caches
    go (model/stacks.py): the next shared pass stacks afresh, with the same results."""
    from sanctum.engine.decode import batch
    from sanctum.engine.model import attention, stacks

    target, _ = load_pair(make_pair, "hybrid", "dflash")
    ids = [target.tokenizer.encode(p) for p in PROMPTS[:3]]
    blocks = mx.array([[5, 9, 100, 31, 2, 77, 8, 40], [11, 52, 7, 7, 90, 3, 61, 12],
                       [13, 4, 200, 18, 6, 0, 0, 0]])  # fmt: skip
    real = (attention._restack, batch.restacked)

    def run(reuse: bool):
        taken = []  # per layer call: whether it took the last pass's buffers
        restack, restacked = real if reuse else (lambda *a: None, lambda *a: None)
        monkeypatch.setattr(attention, "_restack", lambda *a: taken.append(r := restack(*a)) or r)
        monkeypatch.setattr(batch, "restacked", lambda *a: taken.append(r := restacked(*a)) or r)
        caches = [target.make_cache("fp16") for _ in ids]
        for c, prompt in zip(caches, ids):
            target.prefill(prompt, c)
        outs, rounds = [], []
        for keeps in ([3, 8, 1], [8, 2, 5], None, [4, 4, 4]):
            if keeps is None:  # sequence 1 steps alone once
                outs.append(target.forward(mx.array([7]), caches[1], (1, 3))[0])
                assert stacks.TAG not in vars(caches[1][0]) and stacks.TAG not in vars(caches[1][1])
                continue
            taken.clear()
            verified, tape = verify_batch(target, blocks, caches, (1, 3))
            outs += [t for logits, taps, _ in verified for t in (logits, taps)]
            target.rollback_batch(caches, tape, keeps)
            rounds.append(sum(t is not None for t in taken))
        mx.eval(outs, caches)
        return outs, caches, rounds

    got, got_caches, got_rounds = run(reuse=True)
    want, want_caches, want_rounds = run(reuse=False)
    layers = len(target.layers)
    # the first pass and the one after the solo step stack afresh; the second takes every layer's
    assert got_rounds == [0, layers, 0] and want_rounds == [0, 0, 0]
    assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True))
    _assert_same_caches(got_caches, want_caches, "steady")
