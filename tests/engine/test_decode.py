"""The decode path's exactness: the pipelined plain step exact when a request stops (EOS,
max_tokens, stop string, cancel) and with a prompt cache; attention over 8-bit KV through
dequantized copies (MLX CUDA's fallback) equal to the quantized path; the fused-GDN
dispatch (CUDA) driven on the CPU by a pure-MLX stand-in; the other CUDA-only paths forced
on the CPU. (A bf16 model: test_bf16_decode.py.)"""

from __future__ import annotations

from argparse import Namespace

import mlx.core as mx
import numpy as np
import pytest
import sanctum.engine.model.gdn as gdn
from mlx_lm.generate import generate_step
from mlx_lm.models.gated_delta import gated_delta_ops
from sanctum.engine.decode.decoder import Decoder
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.sampling import SamplingParams
from sanctum.engine.kernels import cuda, gdn_cuda
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import cache_offset, load_target

PROMPT = "def fibonacci(n):\n    "


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.fixture(scope="module")
def pair(make_pair):
    target_dir, drafter_dir = make_pair("hybrid", "dflash2")
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


def run(decoder, target, ids, n, eos=(), stop_check=None, kv="fp16"):
    seq = decoder.new_sequence("s", kv, SamplingParams(), n, eos, stop_check)
    key = make_key(0)
    steps = [decoder.start(seq, decoder.prefill(seq, ids), key)]
    while seq.finished is None:
        steps.append(decoder.step(seq, key))
    return seq, steps


def assert_cache_exact(target, seq, ids):
    """The cache holds exactly `cached_tokens` (prompt + completion, but the anchor unless an
    EOS followed it), as a fresh forward over them would: no queued step left in it."""
    assert seq.ahead is None
    n = len(seq.cached_tokens)
    assert n in (len(ids) + len(seq.completion) - 1, len(ids) + len(seq.completion))
    assert seq.cached_tokens == (ids + seq.completion)[:n] and cache_offset(seq.cache) == n
    live, _ = target.forward(mx.array([7]), seq.cache)
    fresh, _ = target.forward(mx.array(seq.cached_tokens + [7]), target.make_cache())
    np.testing.assert_allclose(np.array(live[-1]), np.array(fresh[-1]), atol=1e-4, rtol=1e-4)


def test_plain_step_runs_ahead_and_stops_exactly(pair, monkeypatch):
    from sanctum.tokenizer import TextStream

    target, _ = pair
    ids = target.tokenizer.encode(PROMPT)
    queued = []
    original = Decoder._queue_step
    monkeypatch.setattr(Decoder, "_queue_step", lambda self, seq, tok: queued.append(1)
                        or original(self, seq, tok))  # fmt: skip
    ref = tokens_of(run(Decoder(target), target, ids, 48)[1])
    assert len(queued) >= 46  # every step after the first was queued before it was read
    want = [int(t) for t, _ in generate_step(mx.array(ids), target.model, max_tokens=48)]
    assert ref == want
    eos = next(t for t in ref[5:] if t not in ref[:5])
    for kwargs, expect, reason in [
        ({"eos": {eos}}, ref[: ref.index(eos)], "stop"),  # EOS: the queued step is undone
        ({}, ref[:13], "length"),  # max_tokens: nothing queued past it
    ]:
        n = 13 if reason == "length" else 48
        seq, steps = run(Decoder(target), target, ids, n, **kwargs)
        assert tokens_of(steps) == expect and steps[-1].finish_reason == reason
        assert_cache_exact(target, seq, ids)
    text = target.tokenizer.decode(ref[:30])
    stop = next((text[i : i + 3] for i in range(8, 24) if text[i : i + 3].strip()
                 and "\ufffd" not in text[: i + 3] and text.find(text[i : i + 3]) == i), None)  # fmt: skip
    if stop is not None:
        stream = TextStream(target.tokenizer, [stop])
        seq, steps = run(Decoder(target), target, ids, 48, stop_check=stream.check)
        out = "".join(stream.push(s.tokens) for s in steps) + stream.finish()
        assert out == text[: text.find(stop)] and steps[-1].finish_reason == "stop"
        assert_cache_exact(target, seq, ids)
    # cancelled between steps: close undoes the queued step
    decoder = Decoder(target)
    seq = decoder.new_sequence("c", max_tokens=48)
    decoder.start(seq, decoder.prefill(seq, ids), make_key(0))
    for _ in range(5):
        decoder.step(seq, make_key(0))
    assert seq.ahead is not None and cache_offset(seq.cache) == len(seq.cached_tokens) + 1
    decoder.close(seq)
    assert_cache_exact(target, seq, ids)


def test_queued_plain_steps_leave_the_prompt_cache_as_unqueued_ones(monkeypatch):
    """Chat turns with a prompt cache and no drafter: the committed state the re-encoding watch
    and the save see is the same with queued (pipelined) steps as without, so every turn
    resumes at the same place with the cold request's output."""
    from sanctum.cache.store import PromptStore
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.verifier import Verifier
    from sanctum.settings import default_pair

    target = load_target(default_pair()[0])
    seen = {}
    for queued in (True, False):
        if not queued:
            monkeypatch.setattr(Decoder, "_runs_ahead", lambda self, params: False)
        verifier = Verifier(target, None, None, PromptStore(1 << 30), ladder_depth=4)
        messages = [
            {"role": "user", "content": "Review this code:\ndef add(a, b):\n    return a+b"}
        ]
        seen[queued] = []
        for turn in range(3):
            out = {}
            for use_cache in (False, True):
                req = GenerateRequest(messages=tuple(messages), max_tokens=32, use_cache=use_cache)
                chunks = list(verifier.generate(req))
                out[use_cache] = [t for c in chunks for t in c.token_ids], chunks[-1].usage
            assert out[True][0] == out[False][0]
            u = out[True][1]
            seen[queued].append((out[True][0], u.requested_lcp, u.resumed_at))
            messages += [{"role": "assistant", "content": target.tokenizer.decode(out[True][0])},
                         {"role": "user", "content": f"And now turn {turn + 2}."}]  # fmt: skip
        assert all(resumed > 0 for _, _, resumed in seen[queued][1:])
    assert seen[True] == seen[False]
    monkeypatch.undo()
    # mid-request, the committed state is the unqueued decoder's
    ids = target.tokenizer.encode(PROMPT)
    states = {}
    for queued in (True, False):
        decoder = Decoder(target)
        if not queued:
            decoder._runs_ahead = lambda params: False
        seq = decoder.new_sequence("s", max_tokens=40)
        decoder.start(seq, decoder.prefill(seq, ids), make_key(0))
        for _ in range(6):
            decoder.step(seq, make_key(0))
        assert (seq.ahead is not None) == queued
        states[queued] = decoder.committed_state(seq)
        decoder.close(seq)
    assert states[True][0] == states[False][0]
    for (c1, s1), (c2, s2) in zip(states[True][1], states[False][1]):
        np.testing.assert_array_equal(np.array(c1), np.array(c2))
        np.testing.assert_array_equal(np.array(s1), np.array(s2))


def test_q8_dequantized_attention_equals_quantized(pair, monkeypatch):
    """MLX CUDA's fallback (dequantized K/V into the plain SDPA) against the quantized SDPA on
    the CPU: logits within the Q8 tolerance (2e-2), the same greedy output, plain and
    speculative. SANCTUM_Q8_ATTENTION selects it on any device."""

    assert not cuda.q8_dequantized()  # auto: quantized off CUDA
    monkeypatch.setenv("SANCTUM_Q8_ATTENTION", "dequantized")
    assert cuda.q8_dequantized()
    monkeypatch.setenv("SANCTUM_Q8_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="SANCTUM_Q8_ATTENTION"):
        cuda.q8_dequantized()
    target, drafter = pair
    ids = target.tokenizer.encode(PROMPT)
    got = {}
    try:
        for deq in (False, True):
            target.dequantize_q8 = deq
            cache = target.make_cache("q8")
            l1, _ = target.forward(mx.array(ids), cache)
            l2, _, tape = target.verify(mx.array([5, 6, 7, 8, 9, 10, 11, 12]), cache, ())
            target.rollback(cache, tape, 4)
            l3, _ = target.forward(mx.array([3]), cache)
            plain = tokens_of(generate(target, ids, max_tokens=32, kv_mode="q8", eos_ids=set()))
            spec = tokens_of(generate(target, ids, drafter=drafter, max_tokens=32, kv_mode="q8",
                                      eos_ids=set()))  # fmt: skip
            got[deq] = [np.array(x) for x in (l1, l2, l3)] + [plain, spec]
    finally:
        target.dequantize_q8 = False
    for a, b in zip(got[False][:3], got[True][:3]):
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)
    assert got[False][3] == got[True][3] == got[True][4]


def test_block_kernel_check_accepts_the_reference_and_catches_a_bad_one():
    assert gdn_cuda.check(gdn_cuda.reference, 2, 4, 32, 32, mx.float32) is None
    assert gdn_cuda.check(gdn_cuda.reference, 2, 4, 32, 32, mx.bfloat16) is None
    assert gdn_cuda.check(gdn_cuda.reference, 2, 4, 32, 32, mx.float32, keep_rows=False) is None

    def off_by_a_bit(q, k, v, g, beta, state, rows=None):
        if rows is not None:  # (a right re-run)
            return gdn_cuda.reference(q, k, v, g, beta, state, rows=rows)
        y, s = gated_delta_ops(q, k, v, g, beta, state)
        return y * 1.1, s

    assert "max |dy|" in gdn_cuda.check(off_by_a_bit, 2, 4, 32, 32, mx.float32, keep_rows=False)

    def rows_off(*args, keep_rows=False, rows=None):  # right y and final state, a wrong middle row
        out = gdn_cuda.reference(*args, keep_rows=keep_rows, rows=rows)
        return (
            (*out[:2], out[2] + 1e-2 * mx.arange(out[2].shape[1])[:, None, None, None])
            if keep_rows
            else out
        )

    assert "max |dstate|" in gdn_cuda.check(rows_off, 2, 4, 32, 32, mx.float32)

    def rerun_off(*args, keep_rows=False, rows=None):  # a re-run that runs one row too many
        if rows is not None:
            rows = [min(r + 1, args[0].shape[1]) for r in rows]
        return gdn_cuda.reference(*args, keep_rows=keep_rows, rows=rows)

    assert "re-run of 0 rows" in gdn_cuda.check(rerun_off, 2, 4, 32, 32, mx.float32)
    assert gdn_cuda.supported(16, 48, 128, 128) and not gdn_cuda.supported(16, 48, 100, 128)


def test_block_kernel_dispatch_rolls_back_exactly(pair, monkeypatch):
    """With a block kernel installed (the CUDA path; here a pure-MLX stand-in), a verify keeps
    the recurrence inputs and a rollback re-runs the kernel over the kept rows: every keep
    matches a fresh forward, and speculative greedy still equals plain greedy."""
    target, drafter = pair
    monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
    ids = target.tokenizer.encode(PROMPT)
    block = [int(t) for t in np.random.default_rng(0).integers(10, 400, size=8)]
    for keep in (0, 1, 3, 8):
        cache = target.make_cache()
        target.prefill(ids, cache)
        _, _, tape = target.verify(mx.array(block), cache, drafter.cfg.target_layer_ids)
        assert all(t.inputs is not None and t.chunk_parts is None for t in tape.gdn)
        target.rollback(cache, tape, keep)
        got, _ = target.forward(mx.array([7]), cache)
        want, _ = target.forward(mx.array(ids + block[:keep] + [7]), target.make_cache())
        np.testing.assert_allclose(np.array(got[-1]), np.array(want[-1]), atol=1e-4, rtol=1e-4)
    plain = tokens_of(generate(target, ids, max_tokens=32, eos_ids=set()))
    assert tokens_of(generate(target, ids, drafter=drafter, max_tokens=32, eos_ids=set())) == plain


@pytest.mark.skipif(
    cuda.is_cuda(),
    reason="the stand-in's 1e-4 agreement with a fresh prefill is the CPU's; on CUDA "
    "tests/engine/test_cuda.py's end-to-end check rolls the real kernel's rows back",
)
def test_block_kernel_row_states_roll_back_exactly(pair, monkeypatch):
    """A block kernel that keeps every row's state (the CUDA kernel's taped variant): a verify
    tapes those states, a rollback to any keep takes one (no re-run) and matches a fresh
    forward; the batched verify tapes them per sequence; speculative greedy equals plain."""
    from sanctum.engine.decode.batch import verify_batch

    target, drafter = pair
    monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
    monkeypatch.setattr(gdn, "BLOCK_KERNEL_KEEPS_ROWS", True)
    ids = target.tokenizer.encode(PROMPT)
    block = [int(t) for t in np.random.default_rng(0).integers(10, 400, size=8)]
    taps = drafter.cfg.target_layer_ids
    for keep in (0, 1, 3, 7):
        cache = target.make_cache()
        target.prefill(ids, cache)
        _, _, tape = target.verify(mx.array(block), cache, taps)
        assert all(t.row_states is not None and t.inputs is None for t in tape.gdn)
        target.rollback(cache, tape, keep)
        got, _ = target.forward(mx.array([7]), cache)
        want, _ = target.forward(mx.array(ids + block[:keep] + [7]), target.make_cache())
        np.testing.assert_allclose(np.array(got[-1]), np.array(want[-1]), atol=1e-4, rtol=1e-4)
    caches = [target.make_cache(), target.make_cache()]
    for c, n in zip(caches, (len(ids), len(ids) - 5)):
        target.prefill(ids[:n], c)
    outs, _ = verify_batch(target, mx.array([block, block[::-1]]), caches, taps)
    for c, (_, _, tape), n, blk in zip(
        caches, outs, (len(ids), len(ids) - 5), (block, block[::-1])
    ):
        assert all(t.row_states.shape[0] == 1 for t in tape.gdn)
        target.rollback(c, tape, 4)
        got, _ = target.forward(mx.array([7]), c)
        want, _ = target.forward(mx.array(ids[:n] + blk[:4] + [7]), target.make_cache())
        np.testing.assert_allclose(np.array(got[-1]), np.array(want[-1]), atol=1e-4, rtol=1e-4)
    plain = tokens_of(generate(target, ids, max_tokens=32, eos_ids=set()))
    assert tokens_of(generate(target, ids, drafter=drafter, max_tokens=32, eos_ids=set())) == plain


@pytest.mark.parametrize("views", [True, False])
def test_a_row_state_rollback_keeps_that_row_and_the_prompt_cache_its_own_copy(
    pair, monkeypatch, views
):
    """A rollback through a row-state tape leaves the kept row's state, as a view of the rows
    (gdn.ROLLBACK_VIEWS) or a copy; a rung stored from it holds its own memory: once the cache
    and the tape are gone, clearing the store frees less than the verify's rows of states."""
    import gc

    from sanctum.cache.ladder import snapshot_kv
    from sanctum.cache.store import CacheEntry, PromptStore

    target, drafter = pair
    monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
    monkeypatch.setattr(gdn, "BLOCK_KERNEL_KEEPS_ROWS", True)
    monkeypatch.setattr(gdn, "ROLLBACK_VIEWS", views)
    ids = target.tokenizer.encode(PROMPT)
    block = [int(t) for t in np.random.default_rng(1).integers(10, 400, size=8)]
    cache = target.make_cache()
    target.prefill(ids, cache)
    _, _, tape = target.verify(mx.array(block), cache, drafter.cfg.target_layer_ids)
    mx.eval(target.rollback(cache, tape, 3))
    for t in tape.gdn:
        assert mx.array_equal(t.cache[1], t.row_states[:, 2])
    rows = sum(t.row_states.nbytes for t in tape.gdn)
    store = PromptStore(1 << 30)
    tokens = np.array(ids + block[:3], np.int32)
    rung = {len(tokens): target.recurrent_state(cache)}
    store.put(CacheEntry("m|fp16", "fp16", tokens, snapshot_kv(target, cache), rung))
    del cache, tape, rung, t
    gc.collect()
    held = mx.get_active_memory()
    store.clear()
    gc.collect()
    assert 0 < held - mx.get_active_memory() < rows


def test_draft_head_rows_padded_to_eight_on_cuda(pair, monkeypatch):
    """On CUDA the L-1 draft rows go through the 4-bit LM head padded to 8 rows (a matrix
    kernel, not L-1 one-row ones); the drafts and the output are unchanged."""

    target, drafter = pair
    ids = target.tokenizer.encode(PROMPT)
    want = tokens_of(generate(target, ids, drafter=drafter, max_tokens=32, eos_ids=set()))
    x = mx.ones((7, 4))
    assert cuda.pad_rows(x) is x  # not CUDA here
    monkeypatch.setattr(cuda, "is_cuda", lambda: True)
    assert cuda.pad_rows(x).shape == (8, 4) and cuda.pad_rows(mx.ones((16, 4))).shape == (16, 4)
    got = tokens_of(generate(target, ids, drafter=drafter, max_tokens=32, eos_ids=set()))
    assert got == want


def test_kernel_verdict_comes_from_a_child_process_and_is_remembered(tmp_path, monkeypatch):
    """cuda.verdict runs gdn_cuda's check in a child (here, off CUDA, it reports why the kernel
    cannot run) and remembers the answer per MLX version and kernel source."""
    import subprocess

    monkeypatch.setenv("SANCTUM_HOME", str(tmp_path))
    first = cuda.verdict((2, 4, 32, 32), mx.float32)
    assert first is not None and "T=1" in first  # no CUDA here: the check says so
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran the check again"))
    assert cuda.verdict((2, 4, 32, 32), mx.float32) == first
    assert (tmp_path / "cuda-checks.json").is_file()
    # kernels built another way (engine/kernels/build.py's NVRTC, not MLX's) are checked anew
    from sanctum.engine.kernels import build

    monkeypatch.setattr(build, "_compiler", [Namespace(version="nvrtc 13.0 sm_90")])
    ran = []

    def run(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"verdict": null}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    assert cuda.verdict((2, 4, 32, 32), mx.float32) is None and len(ran) == 1


def test_async_hand_on_leaves_outputs_unchanged(pair):
    """On a GPU a forward starts the device every few layers (Target.async_layers) and a round
    starts its drafts before building the verify: forced on here, output is unchanged."""
    target, drafter = pair
    ids = target.tokenizer.encode(PROMPT)
    want = tokens_of(generate(target, ids, drafter=drafter, max_tokens=24, eos_ids=set()))
    target.async_layers = 1
    try:
        got = tokens_of(generate(target, ids, drafter=drafter, max_tokens=24, eos_ids=set()))
        plain = tokens_of(generate(target, ids, max_tokens=24, eos_ids=set()))
    finally:
        target.async_layers = 0
    assert got == want == plain


def test_drop_compiled_traces_the_forward_again(pair):
    """A forward's compiled graphs keep what they were traced with (a swapped kernel would go
    unseen: bench seed's before/after of one); after `drop_compiled` the layers are traced
    again, and the outputs are unchanged."""
    target, _ = pair
    layer = target.layers[target._first_gdn]
    original, traced = type(layer.mlp), []

    class Counting(original):
        def __call__(self, x):
            traced.append(x.shape)
            return super().__call__(x)

    cache = target.make_cache()
    target.prefill(target.tokenizer.encode(PROMPT), cache)
    offset, states = cache_offset(cache), target.recurrent_state(cache)

    def step():
        logits, _ = target.forward(mx.array([7]), cache)
        mx.eval(logits)
        target.truncate(cache, offset, states)
        return np.array(logits)

    want = step()
    layer.mlp.__class__ = Counting
    try:
        step()
        assert traced == []  # replayed
        target.drop_compiled()
        got = step()
        assert traced
        n = len(traced)
        step()
        assert len(traced) == n  # compiled again, replayed again
    finally:
        layer.mlp.__class__ = original
        target.drop_compiled()
    np.testing.assert_array_equal(got, want)


def test_host_made_causal_mask_attends_as_causal(monkeypatch):
    """On CUDA a multi-row pass takes its causal mask as a boolean array made once on the host
    (cuda.attention_mask), not MLX's "causal" (built again in every attention layer there):
    the attention is the same, a decode step keeps no mask, and off CUDA "causal" stays."""
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    past = mx.random.normal((1, 2, 37, 64), key=mx.random.key(0))
    cache.update_and_fetch(past, past)
    rows = mx.zeros((1, 8, 16))
    assert cuda.attention_mask(rows, cache) == "causal"  # this CPU
    monkeypatch.setattr(cuda, "is_cuda", lambda: True)
    mask = cuda.attention_mask(rows, cache)
    assert mask.shape == (8, 45) and mask.dtype == mx.bool_
    assert cuda.attention_mask(rows[:, :1], cache) is None
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
               enumerate([(1, 4, 8, 64), (1, 2, 45, 64), (1, 2, 45, 64)], 1))  # fmt: skip
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.array_equal(got, want).item()
