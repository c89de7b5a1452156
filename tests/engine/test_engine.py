"""The engine's invariants: lossless speculative decoding on hybrid and dense targets, exact
rollback after partial acceptance, and loading of every supported architecture."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from sanctum.engine.decode.decoder import Decoder
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.peer import DraftUnavailable, LocalDraftPeer
from sanctum.engine.decode.sampling import SamplingParams
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import cache_offset, load_target

PROMPT = "def fibonacci(n):\n    "
_loaded: dict = {}


def load_pair(make_pair, kind="hybrid", drafter="dflash", bits=0, block=None):
    key = (kind, drafter, bits, block)
    if key not in _loaded:
        target_dir, drafter_dir = make_pair(kind, drafter)
        target = _loaded.get((kind, "target")) or load_target(target_dir)
        _loaded[(kind, "target")] = target
        _loaded[key] = (target, load_drafter(drafter_dir, target, block_size=block, bits=bits))
    return _loaded[key]


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


_plain: dict = {}


def plain_greedy(target, kind, kv, n=40, prompt=PROMPT) -> list[int]:
    key = (kind, kv, n, prompt)
    if key not in _plain:
        ids = target.tokenizer.encode(prompt)
        _plain[key] = tokens_of(generate(target, ids, max_tokens=n, kv_mode=kv, eos_ids=set()))
    return _plain[key]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
@pytest.mark.parametrize("drafter_kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("block", [2, 8, 16])
@pytest.mark.parametrize("kv", ["fp16", "q8"])
@pytest.mark.parametrize("bits", [0, 4])
def test_speculative_greedy_equals_plain_greedy(make_pair, kind, drafter_kind, block, kv, bits):
    target, drafter = load_pair(make_pair, kind, drafter_kind, bits, block)
    ids = target.tokenizer.encode(PROMPT)
    steps = list(generate(target, ids, drafter=drafter, max_tokens=40, kv_mode=kv, eos_ids=set()))
    assert tokens_of(steps) == plain_greedy(target, kind, kv)
    assert all(s.stats.bs == block for s in steps[1:])


class PipelinedLocalPeer(LocalDraftPeer):
    """A pipelined peer in one process (as the cluster's is): `submit` records the call, `collect`
    runs it. It checks the decoder's bookkeeping: every context row reaches the drafter exactly
    once and in order, whatever was prefetched, collected, failed or discarded."""

    pipelined = True

    def __init__(self, drafter, fail_at=()):
        super().__init__(drafter)
        self.calls, self.fail_at, self.rows = 0, set(fail_at), {}
        self.collected = self.discarded = 0

    def open(self, seq_id):
        if seq_id not in self.caches:  # a session that survives a failure (as a replayed one)
            super().open(seq_id)
            self.rows[seq_id] = 0

    def submit(self, seq_id, new_taps, block_embeds, start):
        self.calls += 1
        return self.calls, (seq_id, new_taps, block_embeds, start)

    def collect(self, handle):
        n, (seq_id, taps, embeds, start) = handle
        if n in self.fail_at:
            raise DraftUnavailable("injected: the drafter went away during this call")
        self.collected += 1
        return self.draft(seq_id, taps, embeds, start)

    def draft(self, seq_id, new_taps, block_embeds, start):
        sent = new_taps.shape[0] if new_taps is not None else 0
        assert start - sent == self.rows[seq_id], "a context row was lost or sent twice"
        self.rows[seq_id] = start
        return super().draft(seq_id, new_taps, block_embeds, start)

    def discard(self, handle):
        self.discarded += 1


@pytest.mark.parametrize("drafter_kind", ["dflash", "dflash2"])
def test_pipelined_peer_prefetch_is_lossless_and_recovers(make_pair, drafter_kind):
    """Drafts asked for a round ahead (the cluster's peer): greedy output still equals plain
    greedy, with calls failing mid-request (those rounds step plainly; their context rows are
    sent again), and a request that ends with a prefetch in flight discards it."""
    target, drafter = load_pair(make_pair, "hybrid", drafter_kind)
    ids = target.tokenizer.encode(PROMPT)
    for fail_at in ((), (2, 5, 6)):
        peer = PipelinedLocalPeer(drafter, fail_at)
        decoder = Decoder(target, drafter, peer)
        assert decoder.pipelined
        seq, steps = run_decoder(decoder, target, ids, 40)
        assert tokens_of(steps) == plain_greedy(target, "hybrid", "fp16")
        plain = [s for s in steps[1:] if s.stats.bs == 1]
        assert len(plain) == len(fail_at)  # each failed call: that round steps plainly
        # every other round used its prefetched draft, but the one after each plain step
        assert peer.collected == len(steps) - 1 - 2 * len(plain)
        # the last round asked for nothing (the request had ended): nothing to discard
        decoder.close(seq)
        assert peer.discarded == 0 and seq.prefetch is None
    # a request closed (cancelled) between rounds drops its prefetched draft
    peer = PipelinedLocalPeer(drafter)
    decoder = Decoder(target, drafter, peer)
    seq = decoder.new_sequence("c", max_tokens=40)
    logits = decoder.prefill(seq, ids)
    decoder.start(seq, logits, make_key(0))
    decoder.step(seq, make_key(0))
    assert seq.prefetch is not None
    decoder.close(seq)
    assert peer.discarded == 1 and seq.prefetch is None


class ScriptedDecoder(Decoder):
    """Proposes the known greedy continuation with one token corrupted at a scripted position
    per round (position L-1 = no corruption), so every acceptance count 0..L-1 is exercised
    against the real target's verify and rollback."""

    def __init__(self, target, drafter, reference, wrong_at, **kw):
        super().__init__(target, drafter, LocalDraftPeer(drafter), **kw)
        self.reference, self.wrong_at = reference, wrong_at

    def _draft(self, seq, params, key):
        n, L = len(seq.completion), self.block_size
        drafts = list(self.reference[n : n + L - 1])
        drafts += [0] * (L - 1 - len(drafts))
        j = next(self.wrong_at)
        if j < L - 1:
            drafts[j] = (drafts[j] + 1) % self.target.vocab_size
        return mx.array(drafts), None


def run_decoder(decoder, target, prompt_ids, n, kv="fp16", eos=frozenset(), stop_check=None):
    seq = decoder.new_sequence("s", kv, SamplingParams(), n, eos, stop_check)
    key = make_key(0)
    logits = decoder.prefill(seq, prompt_ids)
    steps = [decoder.start(seq, logits, key)]
    while seq.finished is None:
        steps.append(decoder.step(seq, key))
    return seq, steps


@pytest.mark.parametrize("kind", ["hybrid", "dense", "next", "moe"])
@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_partial_acceptance_is_lossless_and_cache_matches_fresh_forward(make_pair, kind, kv):
    target, drafter = load_pair(make_pair, kind, "dflash")
    L = 8
    ref = plain_greedy(target, kind, kv, n=64)
    ids = target.tokenizer.encode(PROMPT)
    decoder = ScriptedDecoder(target, drafter, ref, itertools.cycle(range(L)), block_size=L)
    seq, steps = run_decoder(decoder, target, ids, 48, kv)
    assert tokens_of(steps) == ref[:48]
    assert {s.stats.accepted for s in steps[1:]} >= set(range(L))  # 0..7 accepted all seen
    # the live cache holds exactly prompt + committed tokens but the last (the anchor)
    assert seq.cached_tokens == ids + ref[:47]
    assert cache_offset(seq.cache) == len(seq.cached_tokens)
    live, _ = target.forward(mx.array([seq.anchor]), seq.cache)
    fresh_cache = target.make_cache(kv)
    fresh, _ = target.forward(mx.array(seq.cached_tokens + [seq.anchor]), fresh_cache)
    tol = 1e-4 if kv == "fp16" else 2e-2
    np.testing.assert_allclose(np.array(live[-1]), np.array(fresh[-1]), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["hybrid", "next"])
@pytest.mark.parametrize("closed_form", [True, False])
def test_rollback_to_every_row_matches_fresh_forward(make_pair, kind, closed_form, monkeypatch):
    """Verify a block of L rows, roll back to `keep` rows, and compare the next-token logits
    with a fresh forward over exactly the kept tokens; also rolling back twice on one tape.
    closed_form=False pins the recompute path (what Apple GPUs' Metal kernel path takes)."""
    import sanctum.engine.model.gdn as gdn

    if not closed_form:
        monkeypatch.setattr(gdn, "_one_chunk_tape", lambda mod, rows: False)
    target, drafter = load_pair(make_pair, kind, "dflash")
    ids = target.tokenizer.encode(PROMPT)
    block = [int(t) for t in np.random.default_rng(0).integers(10, 400, size=8)]
    for keeps in [(k,) for k in range(9)] + [(6, 2)]:
        cache = target.make_cache()
        target.prefill(ids, cache)
        _, _, tape = target.verify(mx.array(block), cache, drafter.cfg.target_layer_ids)
        for keep in keeps:
            target.rollback(cache, tape, keep)
        assert cache_offset(cache) == len(ids) + keeps[-1]
        got, _ = target.forward(mx.array([7]), cache)
        want, _ = target.forward(mx.array(ids + block[: keeps[-1]] + [7]), target.make_cache())
        np.testing.assert_allclose(np.array(got[-1]), np.array(want[-1]), atol=1e-4, rtol=1e-4)


def test_eos_and_max_tokens_inside_an_accepted_run(make_pair):
    target, drafter = load_pair(make_pair, "hybrid", "dflash")
    ref = plain_greedy(target, "hybrid", "fp16", n=64)
    ids = target.tokenizer.encode(PROMPT)
    L = 8
    # all drafts accepted: the EOS sits inside an accepted run and must end the completion
    eos_pos = 11
    eos = ref[eos_pos]
    if eos in ref[:eos_pos]:
        pytest.skip("the reference repeats the chosen EOS token earlier")
    decoder = ScriptedDecoder(target, drafter, ref, itertools.repeat(L - 1), block_size=L)
    seq, steps = run_decoder(decoder, target, ids, 60, eos={eos})
    assert tokens_of(steps) == ref[:eos_pos]
    assert steps[-1].finish_reason == "stop"
    assert cache_offset(seq.cache) == len(seq.cached_tokens)
    # max_tokens in the middle of a block
    decoder = ScriptedDecoder(target, drafter, ref, itertools.repeat(L - 1), block_size=L)
    seq, steps = run_decoder(decoder, target, ids, 13)
    assert tokens_of(steps) == ref[:13] and steps[-1].finish_reason == "length"
    assert cache_offset(seq.cache) == len(seq.cached_tokens)


def test_stop_sequence_inside_an_accepted_run(make_pair):
    from sanctum.tokenizer import TextStream

    target, drafter = load_pair(make_pair, "hybrid", "dflash")
    ref = plain_greedy(target, "hybrid", "fp16", n=64)
    ids = target.tokenizer.encode(PROMPT)
    text = target.tokenizer.decode(ref[:30])
    stop = text[20:24]
    if not stop.strip() or "\ufffd" in stop or text.find(stop) != 20:
        pytest.skip("no clean stop string in this reference")
    stream = TextStream(target.tokenizer, [stop])
    decoder = ScriptedDecoder(target, drafter, ref, itertools.repeat(7), block_size=8)
    seq, steps = run_decoder(decoder, target, ids, 60, stop_check=stream.check)
    out = "".join(stream.push(s.tokens) for s in steps) + stream.finish()
    assert out == text[:20]
    assert steps[-1].finish_reason == "stop"


def test_dflash2_selector_is_used(make_pair):
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    assert drafter.cfg.is_v2 and "candidate_selector" in drafter.head
    hidden = mx.random.normal((7, target.hidden_size))
    logits = drafter.head.logits(hidden)
    tokens, cand, q = drafter.head.select(hidden, logits, anchor=3, temperature=0.0)
    assert tokens.shape == (7,) and cand.shape == (7, drafter.cfg.selector_top_k)
    # every pick is one of its row's top-k candidates
    assert all(int(tokens[r]) in np.array(cand[r]).tolist() for r in range(7))


@pytest.mark.parametrize("kind", ["hybrid", "moe", "next", "dense"])
def test_real_loader_reads_hf_layout(make_pair, kind):
    """The tiny checkpoint goes through mlx-lm's loader and sanitize: the HF-layout weights
    (zero-centred norms, [C, 1, K] conv) come back as the model that was written."""
    from mlx.utils import tree_flatten
    from sanctum.engine.model.checkpoint import read_config

    target_dir, _ = make_pair(kind, "dflash")
    target = load_target(target_dir)
    assert target.model_type == read_config(target_dir)["model_type"]
    params = dict(tree_flatten(target.model.parameters()))
    norms = [v for k, v in params.items() if k.endswith("input_layernorm.weight")]
    assert norms and all(float(mx.abs(n - 1).max()) < 1e-6 for n in norms)  # ones, after +1
    assert any(target.is_gdn) == (kind != "dense")


@pytest.mark.parametrize("kind", ["hybrid", "moe", "next", "dense"])
def test_target_forward_equals_mlx_lm_model(make_pair, kind):
    """Our layer-by-layer forward (compiled decode steps, taped GDN) computes what mlx-lm's own
    model computes: prefill, a one-token step and a verify block."""
    target, drafter = load_pair(make_pair, kind, "dflash")
    ids = target.tokenizer.encode(PROMPT)
    from mlx_lm.models.cache import make_prompt_cache

    ours, theirs = target.make_cache(), make_prompt_cache(target.model)
    for piece in (ids, [9], [11, 12, 13, 14, 15, 16, 17, 18]):
        want = target.model(mx.array(piece)[None], cache=theirs)[0]
        if len(piece) == 8:
            got, _, _ = target.verify(mx.array(piece), ours, drafter.cfg.target_layer_ids)
        else:
            got, _ = target.forward(mx.array(piece), ours)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [2, 8, 97])
def test_block_conv_equals_mlx_lm_conv(make_pair, rows, dtype):
    """A multi-row pass's causal conv (gdn.block_conv: shifted multiply-adds summed in float32)
    gives what mlx-lm's grouped conv1d gives, op by op and compiled with the SiLU after it: bit
    for bit in bf16; in float32 to its last bits, which OpenBLAS (preloaded: the conv's matrix
    product) sums in another order (bit for bit under MLX's own BLAS)."""
    from sanctum.engine.model.gdn import block_conv

    target, _ = load_pair(make_pair, "hybrid", "dflash")
    mod = target.layers[target.is_gdn.index(True)].linear_attn
    shape = (2, mod.conv_kernel_size - 1 + rows, mod.conv_dim)
    x = mx.random.normal(shape, key=mx.random.key(rows))
    weight = mod.conv1d.weight
    try:
        mod.conv1d.weight = weight.astype(dtype)
        x = x.astype(dtype)
        want = mod.conv1d(x)
        fused = mx.compile(lambda x: nn.silu(block_conv(mod, x)))(x)
        assert block_conv(mod, x).dtype == fused.dtype == dtype
        for got, ref in ((block_conv(mod, x), want), (fused, nn.silu(want))):
            if dtype == mx.bfloat16:
                assert mx.array_equal(got, ref).item()
            else:
                np.testing.assert_allclose(np.array(got), np.array(ref), rtol=2e-6, atol=1e-6)
    finally:
        mod.conv1d.weight = weight


def test_sliding_drafter_gets_only_its_window(make_pair, tmp_path):
    """A drafter whose every layer slides is handed at most sliding_window - 1 context rows, by
    the decoder itself (what crosses to a drafter process), and drafts losslessly after a prompt
    longer than that window."""
    from sanctum.tiny import DRAFTER_LAYOUTS, drafter_config, write_random_drafter

    target_dir, _ = make_pair("hybrid", "dflash")
    target, _ = load_pair(make_pair)
    raw = DRAFTER_LAYOUTS["dflash2"](drafter_config("dflash", target_dir))
    drafter = load_drafter(write_random_drafter(tmp_path / "d2", raw, seed=2), target)
    window = drafter.cfg.sliding_window
    decoder = Decoder(target, drafter, LocalDraftPeer(drafter))
    assert decoder.max_pending_rows == window - 1
    prompt = list(range(10, 10 + 4 * window))
    seq = decoder.new_sequence("s")
    decoder.prefill(seq, prompt)
    assert sum(t.shape[0] for t in seq.pending_taps) == window - 1
    want = tokens_of(generate(target, prompt, max_tokens=30, eos_ids=set()))
    got = generate(target, prompt, drafter=drafter, sampling=SamplingParams(), max_tokens=30,
                   eos_ids=set())  # fmt: skip
    assert tokens_of(got) == want
