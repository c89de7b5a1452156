"""Batched rounds (shared rounds): several sequences' blocks verified in one target forward give
every sequence exactly the tokens it gets served alone, whatever the mix of prompt lengths,
KV formats, acceptance, early ends (EOS, max_tokens) and seeded sampling."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from helpers import NO_GATE
from mlx_lm.models.cache import QuantizedKVCache
from sanctum.engine.decode import rounds
from sanctum.engine.decode.batch import verify_batch
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.policy import DecodePolicy
from sanctum.engine.decode.rounds import BatchDecoder
from sanctum.engine.decode.sampling import SamplingParams
from sanctum.engine.model.attention import _SPLIT_ATTENTION, attention_over
from sanctum.engine.model.target import DequantizedView, cache_offset
from test_engine import load_pair, tokens_of

PROMPTS = [
    "def fibonacci(n):\n    ",
    "x = 1",
    "import os\nimport sys\n\nclass Foo:\n    def __init__(self, a, b):\n        self.a = a\n",
    "for i in range(10):\n    print(i)\n",
]


ADAPTIVE = DecodePolicy(adaptive=True)


class ScriptedBatchDecoder(BatchDecoder):
    """Proposes each sequence's known continuation, corrupted at a scripted row per round (row
    L-1 or more: none), so every acceptance count is exercised, differently in each sequence."""

    def __init__(
        self, target, drafter, references: dict, scripts: dict, block_size=None, policy=None
    ):
        super().__init__(target, drafter, LocalDraftPeer(drafter), block_size, policy)
        self.references, self.scripts = references, scripts

    def _draft(self, seq, params, key):
        n, L = len(seq.completion), self.width(seq)
        drafts = list(self.references[seq.seq_id][n : n + L - 1])
        drafts += [0] * (L - 1 - len(drafts))
        j = next(self.scripts[seq.seq_id])
        if j < L - 1:
            drafts[j] = (drafts[j] + 1) % self.target.vocab_size
        return mx.array(drafts), None

    def _draft_all(self, seqs, keys):
        return [self._draft(seq, seq.sampling, key) for seq, key in zip(seqs, keys)]


def solo(target, drafter, prompt, n, kv="fp16", eos=(), sampling=None, block=None):
    ids = target.tokenizer.encode(prompt)
    steps = generate(
        target,
        ids,
        drafter=drafter,
        max_tokens=n,
        kv_mode=kv,
        eos_ids=set(eos),
        sampling=sampling,
        block_size=block,
    )
    return tokens_of(steps)


def run_batch(decoder, target, specs):
    """specs: (seq_id, prompt, max_tokens, kv, eos, sampling); every open sequence steps in
    one `step_batch` per round, leaving the batch when it finishes. Returns tokens by seq_id
    and the batch widths seen."""
    seqs, keys, out = [], {}, {}
    for seq_id, prompt, n, kv, eos, sampling in specs:
        sampling = sampling or SamplingParams()
        seq = decoder.new_sequence(seq_id, kv, sampling, n, eos)
        key = make_key(sampling.seed)
        logits = decoder.prefill(seq, target.tokenizer.encode(prompt))
        key, sub = mx.random.split(key)
        out[seq_id] = list(decoder.start(seq, logits, sub).tokens)
        keys[seq_id] = key
        if seq.finished is None:
            seqs.append(seq)
    widths = []
    while seqs:
        subs = []
        for seq in seqs:
            keys[seq.seq_id], sub = mx.random.split(keys[seq.seq_id])
            subs.append(sub)
        widths.append(len(seqs))
        for seq, step in zip(seqs, decoder.step_batch(seqs, subs)):
            out[seq.seq_id] += step.tokens
            assert cache_offset(seq.cache) == len(seq.cached_tokens)
        for seq in [s for s in seqs if s.finished is not None]:
            decoder.close(seq)
        seqs = [s for s in seqs if s.finished is None]
    return out, widths


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
@pytest.mark.parametrize("tape", ["chunk", "row_states"])
def test_batched_rollback_equals_a_rollback_per_sequence(make_pair, monkeypatch, kind, tape):
    """`Target.rollback_batch` after a shared verify (fp16 and 8-bit KV, a padded block) leaves
    every cache exactly as a rollback per sequence does, for every mix of keeps, on both kinds
    of GDN tape; the sequences' own tapes still roll back further afterwards."""
    from sanctum.engine.kernels import gdn_cuda
    from sanctum.engine.model import gdn

    if tape == "row_states":  # the CUDA kernel's taped variant, through its pure-MLX stand-in
        monkeypatch.setattr(gdn, "BLOCK_KERNEL", gdn_cuda.reference)
        monkeypatch.setattr(gdn, "BLOCK_KERNEL_KEEPS_ROWS", True)
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
        kept = [t.row_states if tape == "row_states" else t.chunk_parts for t in batch_tape.gdn]
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


@pytest.mark.parametrize(
    "kind,drafter_kind",
    [("hybrid", "dflash"), ("hybrid", "dflash2"), ("dense", "dflash"), ("moe", "dflash2"),
     ("next", "dflash")],
)  # fmt: skip
def test_batch_greedy_equals_solo_for_mixed_lengths_and_kv(make_pair, kind, drafter_kind):
    target, drafter = load_pair(make_pair, kind, drafter_kind)
    kvs = ["fp16", "q8", "fp16", "q8"]
    lengths = [24, 17, 30, 9]  # the short ones leave the batch early
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    specs = [
        (f"s{i}", p, n, kv, (), None) for i, (p, n, kv) in enumerate(zip(PROMPTS, lengths, kvs))
    ]
    got, widths = run_batch(decoder, target, specs)
    assert max(widths) == 4 and min(widths) < 4
    for i, (p, n, kv) in enumerate(zip(PROMPTS, lengths, kvs)):
        assert got[f"s{i}"] == solo(target, drafter, p, n, kv), f"sequence {i}"


@pytest.mark.parametrize("kind", ["hybrid", "next"])
def test_batch_with_every_acceptance_and_eos_inside_an_accepted_run(make_pair, kind):
    target, drafter = load_pair(make_pair, kind, "dflash")
    L = 8
    kvs = ["fp16", "q8", "fp16", "q8"]
    refs = {f"s{i}": solo(target, None, p, 64, kvs[i]) for i, p in enumerate(PROMPTS)}
    # s1 stops on an EOS inside a fully accepted block; s2 on max_tokens mid-block
    eos_pos = next(j for j in range(9, 40) if refs["s1"][j] not in refs["s1"][:j])
    eos = {refs["s1"][eos_pos]}
    scripts = {
        "s0": itertools.cycle(range(L)),
        "s1": itertools.repeat(L - 1),
        "s2": itertools.cycle([3, 7, 0, 5]),
        "s3": itertools.cycle(range(L - 1, -1, -1)),
    }
    decoder = ScriptedBatchDecoder(target, drafter, refs, scripts, block_size=L)
    specs = [
        ("s0", PROMPTS[0], 48, "fp16", (), None),
        ("s1", PROMPTS[1], 60, "q8", eos, None),
        ("s2", PROMPTS[2], 13, "fp16", (), None),
        ("s3", PROMPTS[3], 40, "q8", (), None),
    ]
    got, widths = run_batch(decoder, target, specs)
    assert widths[0] == 4
    assert got["s0"] == refs["s0"][:48]
    assert got["s1"] == refs["s1"][:eos_pos]
    assert got["s2"] == refs["s2"][:13]
    assert got["s3"] == refs["s3"][:40]


def test_seeded_sampling_in_a_batch_equals_the_seed_alone(make_pair):
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    params[2] = SamplingParams(temperature=1.0, top_k=20, seed=3)
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    specs = [(f"s{i}", PROMPTS[i], 24, "fp16", (), p) for i, p in enumerate(params)]
    got, _ = run_batch(decoder, target, specs)
    for i, p in enumerate(params):
        assert got[f"s{i}"] == solo(target, drafter, PROMPTS[i], 24, sampling=p), f"seed {p.seed}"


def test_scheduler_batches_concurrent_requests_each_as_served_alone(make_pair):
    """Inline serving with SANCTUM_MAX_BATCH=4: concurrent requests (different prompt lengths
    and KV formats, one resumed from the prompt cache, one seeded sample, one cancelled
    mid-stream) share rounds, and each gets exactly what it gets served alone."""
    import threading

    from sanctum.serving.inline import InlineBackend, RoundDelay
    from sanctum.serving.requests import GenerateRequest
    from sanctum.settings import serve_settings

    target_dir, drafter_dir = (str(p) for p in make_pair("hybrid", "dflash2"))
    settings = serve_settings(target_dir, drafter_dir, cache_dir="none", max_batch=4, env=NO_GATE)
    backend = InlineBackend(settings, RoundDelay(0.02))
    warm = GenerateRequest(prompt=PROMPTS[2], max_tokens=6)
    requests = [
        GenerateRequest(prompt=PROMPTS[0], max_tokens=30, use_cache=False),
        GenerateRequest(prompt=PROMPTS[1], max_tokens=12, kv_mode="q8", use_cache=False),
        GenerateRequest(prompt=PROMPTS[2] + "        return a", max_tokens=20),  # resumes
        GenerateRequest(prompt=PROMPTS[3], max_tokens=25, temperature=0.8, seed=7, use_cache=False),
    ]
    try:
        backend.ready(60)
        sched = backend.scheduler
        widths = []
        step_batch = sched.verifier.step_batch

        def counted(acts):
            widths.append(len(acts))
            return step_batch(acts)

        sched.verifier.step_batch = counted

        def served(tickets):
            out = {}

            def read(ticket):
                chunks = list(ticket)
                out[ticket.request_id] = ([t for c in chunks for t in c.token_ids], chunks[-1])

            threads = [threading.Thread(target=read, args=(t,)) for t in tickets]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            return out

        def fresh(req):  # the same request under a new id
            return GenerateRequest(**{**req.__dict__, "request_id": req.request_id + "-b"})

        list(sched.submit(warm))
        alone = {}
        for req in requests:
            alone.update(served([sched.submit(req)]))
        assert not widths  # one request at a time: no shared round
        backend.clear_cache()
        list(sched.submit(fresh(warm)))
        batch = [fresh(r) for r in requests]
        cancelled = sched.submit(GenerateRequest(prompt=PROMPTS[0], max_tokens=3000))
        tickets = [sched.submit(r) for r in batch]
        first = cancelled.items.get(timeout=60)  # its first chunk: then cancel it mid-stream
        sched.cancel(cancelled.request_id)
        together = served(tickets)
        rest = list(cancelled)
        assert first.token_ids and len(rest) < 3000
        assert max(widths, default=0) == 4
        for req, again in zip(requests, batch):
            tokens, last = together[again.request_id]
            assert tokens == alone[req.request_id][0], req.prompt
            assert last.finish_reason == alone[req.request_id][1].finish_reason
        resumed = together[batch[2].request_id][1].usage
        assert (
            resumed.resumed_at > 0
            and resumed.resumed_at == alone[requests[2].request_id][1].usage.resumed_at
        )
    finally:
        backend.close()


def test_a_drafter_that_is_down_turns_the_batch_into_plain_steps(make_pair):
    from sanctum.engine.decode.peer import DraftUnavailable

    target, drafter = load_pair(make_pair, "hybrid", "dflash")

    class Flaky(LocalDraftPeer):
        calls = 0

        def draft_batch(self, *args):
            Flaky.calls += 1
            if Flaky.calls % 2:
                raise DraftUnavailable("restarting")
            return super().draft_batch(*args)

    decoder = BatchDecoder(target, drafter, Flaky(drafter))
    specs = [(f"s{i}", p, 20, "fp16", (), None) for i, p in enumerate(PROMPTS[:3])]
    got, _ = run_batch(decoder, target, specs)
    assert Flaky.calls > 2
    for i, p in enumerate(PROMPTS[:3]):
        assert got[f"s{i}"] == solo(target, drafter, p, 20), f"sequence {i}"


def test_adaptive_width_shrinks_a_rejected_sequence_without_holding_back_the_others(
    make_pair, monkeypatch
):
    target, drafter = load_pair(make_pair, "hybrid", "dflash")
    L = 8
    refs = {f"s{i}": solo(target, None, p, 40) for i, p in enumerate(PROMPTS[:3])}
    scripts = {
        "s0": itertools.repeat(0),  # every first draft wrong: its blocks shrink to 2
        "s1": itertools.repeat(L - 1),  # all accepted: stays at 8
        "s2": itertools.cycle([0, 0, 99, 99, 99, 99]),  # shrinks, then grows back
    }
    decoder = ScriptedBatchDecoder(target, drafter, refs, scripts, block_size=L, policy=ADAPTIVE)
    seen: dict = {}
    conclude = decoder._conclude

    def watched(seq, *args):
        step = conclude(seq, *args)
        seen.setdefault(seq.seq_id, []).append(step.stats.bs)
        return step

    decoder._conclude = watched
    verified = []  # the real widths of each target forward's blocks

    def verify(target, blocks, caches, tap_ids, widths=None):
        verified.append(widths)
        return verify_batch(target, blocks, caches, tap_ids, widths)

    monkeypatch.setattr(rounds, "verify_batch", verify)
    rolled_back = []  # each batched rollback's keeps
    rollback_batch = target.rollback_batch

    def rollback(caches, tape, keeps):
        rolled_back.append(keeps)
        return rollback_batch(caches, tape, keeps)

    monkeypatch.setattr(target, "rollback_batch", rollback)
    specs = [(f"s{i}", p, 40, "fp16", (), None) for i, p in enumerate(PROMPTS[:3])]
    got, batch_sizes = run_batch(decoder, target, specs)
    # one target forward and one rollback a shared round, whatever its mix of widths
    assert len(verified) == len(rolled_back) == sum(n > 1 for n in batch_sizes)
    assert any(len(set(k)) > 1 for k in rolled_back)
    assert any(len(set(w)) > 1 for w in verified)
    for i in range(3):
        assert got[f"s{i}"] == refs[f"s{i}"], f"sequence {i}"
    assert seen["s0"][:3] == [8, 4, 2] and set(seen["s0"][2:]) == {2}
    assert set(seen["s1"]) == {8}
    assert 2 in seen["s2"] and 8 in seen["s2"][seen["s2"].index(2) :]


def test_adaptive_width_seeded_sampling_in_a_batch_equals_alone(make_pair):
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    params = [SamplingParams(temperature=1.0, seed=s) for s in (4, 5, 6)]

    def decoder():
        return BatchDecoder(target, drafter, LocalDraftPeer(drafter), policy=ADAPTIVE)

    specs = [(f"s{i}", PROMPTS[i], 30, "fp16", (), p) for i, p in enumerate(params)]
    got, _ = run_batch(decoder(), target, specs)
    for spec in specs:
        alone, _ = run_batch(decoder(), target, [spec])
        assert got[spec[0]] == alone[spec[0]], spec[0]


def test_blocks_padded_to_the_matrix_kernel_rows_decode_as_unpadded(make_pair, monkeypatch):
    """On CUDA a narrow verify block is padded at its end to 8 rows in all (cuda.verify_width:
    MLX's matrix kernel, which a batch reaches anyway). Forced here on the CPU: every acceptance
    at widths 2-8 (adaptive width) gives the target's greedy output, solo and batched, and the
    padded rows never reach a cache."""
    from sanctum.engine.kernels import cuda

    target, drafter = load_pair(make_pair, "hybrid", "dflash")
    kvs = ["fp16", "q8", "fp16"]
    refs = {f"s{i}": solo(target, None, p, 30, kv) for i, (p, kv) in enumerate(zip(PROMPTS, kvs))}
    pads = []

    def width(w, blocks=1):
        pads.append(max(w, -(-8 // blocks)) - w)
        return w + pads[-1]

    monkeypatch.setattr(cuda, "verify_width", width)
    scripts = {
        "s0": itertools.repeat(0),
        "s1": itertools.cycle([0, 99, 99]),
        "s2": itertools.cycle([1, 0, 6, 99]),
    }
    for specs in ([("s0", PROMPTS[0], 30, "fp16", (), None)],
                  [(f"s{i}", p, 30, kv, (), None) for i, (p, kv) in enumerate(zip(PROMPTS, kvs))]):  # fmt: skip
        decoder = ScriptedBatchDecoder(target, drafter, refs, dict(scripts), 8, ADAPTIVE)
        got, _ = run_batch(decoder, target, specs)
        for seq_id, *_ in specs:
            assert got[seq_id] == refs[seq_id], seq_id
    assert any(p > 0 for p in pads)  # narrow blocks were padded


def test_steady_drafts_of_a_batch_run_as_one_compiled_stack_equal_to_alone(make_pair, tmp_path):
    """An all-sliding drafter (the published DFlash 2 layout) whose sequences' windows are
    full drafts the whole batch in one call of its compiled stack: every block's hidden states
    equal drafting it alone (to float32 rounding: OpenBLAS's products of 48 rows and of 16 can
    round differently, as in the op-by-op batch), and greedy and seeded sampled outputs equal
    alone."""
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.tiny import DRAFTER_LAYOUTS, drafter_config, write_random_drafter

    target_dir, _ = make_pair("hybrid", "dflash")
    target, _ = load_pair(make_pair)
    raw = DRAFTER_LAYOUTS["dflash2"](drafter_config("dflash", target_dir))
    drafter = load_drafter(write_random_drafter(tmp_path / "d2", raw, seed=2), target)
    window = drafter.cfg.sliding_window
    body, peer = drafter.body, LocalDraftPeer(drafter)
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    starts = [window + 5, 2 * window + 1, 3 * window]  # every window full
    taps = [mx.random.normal((s, width), key=mx.random.key(s)) for s in starts]
    embeds = mx.stack([target.embed_tokens(mx.array([3 + n] + [4] * 15)) for n in range(3)])
    for n in range(3):
        peer.open(f"solo{n}")
        peer.open(f"batch{n}")
    alone = [peer.draft(f"solo{n}", taps[n], embeds[n], starts[n]) for n in range(3)]
    calls = []
    stack = body._compiled_stack()
    body.__dict__["_stack"] = lambda *a: calls.append(a[0].shape) or stack(*a)
    together = peer.draft_batch([f"batch{n}" for n in range(3)], taps, embeds, starts)
    assert calls == [(3, 16, body.cfg.hidden_size)]  # one call for the three blocks
    for n in range(3):
        assert mx.allclose(together[n], alone[n], atol=1e-5).item(), f"sequence {n}"
    # end to end: prompts past the window, greedy and seeded sampling, each as alone
    del body.__dict__["_stack"]
    prompts = [p * 6 for p in PROMPTS[:3]]
    params = [
        None,
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, seed=2),
    ]
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    specs = [(f"s{i}", p, 24, "fp16", (), s) for i, (p, s) in enumerate(zip(prompts, params))]
    got, widths = run_batch(decoder, target, specs)
    assert max(widths) == 3
    for i, (p, s) in enumerate(zip(prompts, params)):
        assert got[f"s{i}"] == solo(target, drafter, p, 24, sampling=s), f"sequence {i}"


def test_padded_drafts_of_a_batch_group_by_bucket_and_equal_alone(make_pair, tmp_path, monkeypatch):
    """Before the windows fill (PAD_TO_BUCKETS), each sequence's context pads to a bucket
    (here of 8 rows) and the compiled stack runs once per bucket group: every block's hidden
    states equal drafting it alone op by op, unpadded, in the batch's order."""
    from sanctum.engine.model.drafter import ContextCache, load_drafter
    from sanctum.engine.model.drafter import body as drafter_module
    from sanctum.tiny import DRAFTER_LAYOUTS, drafter_config, write_random_drafter

    target_dir, _ = make_pair("hybrid", "dflash")
    target, _ = load_pair(make_pair)
    raw = DRAFTER_LAYOUTS["dflash2"](drafter_config("dflash", target_dir))
    drafter = load_drafter(write_random_drafter(tmp_path / "d2", raw, seed=2), target)
    window = drafter.cfg.sliding_window
    assert window - 1 > 16  # a context cache keeps window - 1 rows
    body, peer = drafter.body, LocalDraftPeer(drafter)
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    starts = [13, 5, 11, window + 3]  # buckets 16, 8, 16 and the full window
    taps = [mx.random.normal((s, width), key=mx.random.key(s)) for s in starts]
    embeds = mx.stack([target.embed_tokens(mx.array([3 + n] + [4] * 7)) for n in range(4)])
    for n in range(4):
        peer.open(f"solo{n}")
        peer.open(f"batch{n}")
    monkeypatch.setattr(drafter_module, "PAD_TO_BUCKETS", False)
    alone = [peer.draft(f"solo{n}", taps[n], embeds[n], starts[n]) for n in range(4)]
    monkeypatch.setattr(drafter_module, "PAD_TO_BUCKETS", True)
    monkeypatch.setattr(ContextCache, "STEP", 8)
    calls = []
    stack = body._compiled_stack()
    body.__dict__["_stack"] = lambda *a: calls.append(a[0].shape[0]) or stack(*a)
    together = peer.draft_batch([f"batch{n}" for n in range(4)], taps, embeds, starts)
    assert sorted(calls) == [1, 1, 2]  # three bucket groups: {0, 2}, {1}, {3}
    for n in range(4):
        assert mx.allclose(together[n], alone[n], atol=1e-5).item(), f"sequence {n}"


def test_speculation_gate_steps_plainly_below_its_threshold_and_tries_again(make_pair):
    """The speculation gate: with a threshold no round reaches, a sequence drafts its warm-up
    rounds, then a stretch of plain steps, then one round, then a stretch twice as long...;
    greedy output is the plain decode's all along; at threshold 0 every step is a round."""
    from sanctum.engine.decode import policy as spec

    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    ids = target.tokenizer.encode(PROMPTS[0])
    plain = tokens_of(generate(target, ids, max_tokens=120))
    widths = {}
    for min_tau in (0.0, 99.0):
        d = BatchDecoder(
            target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(min_tau=min_tau)
        )
        seq = d.new_sequence("g", max_tokens=120)
        out = list(d.start(seq, d.prefill(seq, ids), make_key(0)).tokens)
        bs = []
        while seq.finished is None:
            step = d.step(seq, make_key(len(out)))
            out += step.tokens
            bs.append(step.stats.bs)
        assert out == plain
        widths[min_tau] = bs
    assert all(b > 1 for b in widths[0.0])
    gated = widths[99.0]
    w, p = spec.GATE_WARMUP, spec.GATE_PLAIN_STEPS
    assert all(b > 1 for b in gated[:w]) and gated[w : w + p] == [1] * p
    assert gated[w + p] > 1 and gated[w + p + 1 : w + 3 * p + 1] == [1] * (2 * p)
    assert gated[w + 3 * p + 1] > 1


@pytest.mark.parametrize("greedy_gate,sampled_gate", [(4.5, 4.5), (4.5, 0.0), (0.0, 4.5)])
def test_speculation_gate_in_a_batch_equals_alone(make_pair, greedy_gate, sampled_gate):
    """Gated sampled sequences of a shared round take the plain steps they take alone: in the
    drafted blocks' verify forward as blocks of their anchor alone, or, in a round where none
    drafts, several of them in one forward of their own. A gated greedy sequence drafts in a
    round where others draft (its plain step would pay the round's padded rows) and steps
    plainly in one where none does. Seeded sampling and greedy outputs equal to each served
    alone, with the gate tripping: every sequence's, the greedy one's only, or the sampled
    ones' only."""
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")

    def decoder():
        gate = DecodePolicy(min_tau=greedy_gate, min_tau_sampled=sampled_gate)
        return BatchDecoder(target, drafter, LocalDraftPeer(drafter), policy=gate)

    params = [
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(),
        SamplingParams(0.7, seed=9),
    ]
    specs = [(f"s{i}", PROMPTS[i], 48, "fp16", (), p) for i, p in enumerate(params)]
    tripped, together, joined, gated_drafting = [], [], [], []
    d = decoder()
    watch = d._watch
    d._watch = lambda seq, step: (watch(seq, step), tripped.append(seq.plain_left > 0))
    gated_now = set()  # the sequences the gate has step plainly in this round

    def take_gated_step(seq, take=d.take_gated_step):
        gated = take(seq)
        if gated:
            gated_now.add(seq.seq_id)
        return gated

    def step_batch(seqs, keys, step=d.step_batch):
        gated_now.clear()
        return step(seqs, keys)

    d.take_gated_step, d.step_batch = take_gated_step, step_batch
    plain_steps = d._plain_steps
    d._plain_steps = lambda seqs, keys, idx, steps: (
        together.append(len(idx)),
        plain_steps(seqs, keys, idx, steps),
    )
    verify_all = d._verify_all
    d._verify_all = lambda drafted, draft_s, steps, gated: (
        joined.append(len(gated)),
        gated_drafting.extend(seq.seq_id for _, seq, *_ in drafted if seq.seq_id in gated_now),
        verify_all(drafted, draft_s, steps, gated),
    )
    got, _ = run_batch(d, target, specs)
    assert any(tripped)
    assert set(gated_drafting) <= {"s1"}  # a gated sampled sequence never drafts
    if greedy_gate and sampled_gate:
        assert max(together) >= 2  # gated sequences stepped in one forward of their own
    elif greedy_gate:
        assert "s1" in gated_drafting  # the greedy one, gated, drafted beside the others
    else:
        assert max(joined) >= 1  # a gated sampled one stepped in the drafted blocks' verify
    for spec in specs:
        alone, _ = run_batch(decoder(), target, [spec])
        assert got[spec[0]] == alone[spec[0]], spec[0]


def test_break_even_is_measured_and_the_gate_setting_checked(make_pair):
    from sanctum.engine.decode.generate import gate_threshold, measure_break_even
    from sanctum.settings import serve_settings

    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    d = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    cost = measure_break_even(d)
    assert 1.0 < cost < 20.0
    assert gate_threshold("auto", d) in [i / 4 for i in range(81)]
    sampled = measure_break_even(d, SamplingParams(temperature=1.0, seed=0))
    assert 1.0 < sampled < 20.0
    assert gate_threshold("2.75", d) == 2.75
    assert measure_break_even(BatchDecoder(target)) == 0.0  # no drafter: nothing to gate
    assert serve_settings(env={}).min_tau == "auto"
    for bad in ("fast", "-1"):
        with pytest.raises(ValueError, match="SANCTUM_MIN_TAU"):
            serve_settings(env={"SANCTUM_MIN_TAU": bad})


def test_bench_batch_steady_times_shared_rounds_and_checks_them_against_plain(
    make_pair, capsys, monkeypatch
):
    """`sanctum bench batch --steady R --phases P`: the engine's shared rounds alone at each
    concurrency (prefilled first, untimed rounds, then R timed, then P with every phase
    awaited: still shared rounds), every sequence's tokens against plain greedy decoding of
    its prompt."""
    import json

    from sanctum.cli import main
    from sanctum.engine.decode import rounds

    shared = []  # the row counts of every shared verify
    real_verify_batch = rounds.verify_batch

    def counted(target, blocks, *args, **kwargs):
        shared.append(blocks.shape[0])
        return real_verify_batch(target, blocks, *args, **kwargs)

    monkeypatch.setattr(rounds, "verify_batch", counted)
    target_dir, drafter_dir = make_pair("hybrid", "dflash2")
    argv = ["bench", "batch", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--steady", "2", "--warm-rounds", "1", "--concurrency", "2", "--json"]  # fmt: skip
    assert main([*argv, "--phases", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shared == [2] * (1 + 2 + 2)  # untimed, timed and synced rounds of the pair: shared
    for row in out["levels"]:
        split = row["phases_ms"]
        assert split["draft"] > 0 and split["verify"] > 0 and split["round"] > 0
        parts = split["draft"] + split["verify"] + split["rollback"] + split["other"]
        assert parts <= split["round"] * 1.01 + 0.05  # pieces of the round, not more
    assert out["mode"] == "steady rounds" and out["rounds"] == 2 and out["warm_rounds"] == 1
    assert [r["concurrency"] for r in out["levels"]] == [1, 2]  # one sequence always measured
    assert out["all_outputs_equal_plain"] and all(r["outputs_equal_plain"] for r in out["levels"])
    for row in out["levels"]:
        assert row["round_ms"] > 0 and row["tokens_per_round"] >= row["concurrency"]
        low, mid, high = row["round_ms_min_median_max"]
        assert 0 < low <= mid <= high and low <= row["round_ms"] <= high + 0.05  # (+ the loop)
        assert row["tau"] >= 1.0  # speculative rounds, not only plain steps
    assert out["levels"][0]["tok_s_vs_one"] == 1.0
    assert main([*argv, "--cluster"]) != 0  # refused, naming the flag
    assert "--cluster" in capsys.readouterr().err
