"""The device paths end to end on this machine's CPU: the Metal path ("metal" forced, mlx-lm's
ops form of the GDN kernel standing in for the Metal kernel, which needs an Apple GPU) decodes
as the CPU path does. On each: greedy speculative == plain greedy == mlx-lm's greedy, drafting
ahead as the path does by default; a resumed request == a cold one; a shared round == each
sequence alone. The rounds draft the known continuation with one token wrong at a row that
cycles (`KnowingDecoder`), so that they accept every count and roll back to every row. Each
test also counts the device-dependent branches that ran (`branches`), so that a forced path
cannot quietly take the other's."""

from __future__ import annotations

import itertools
from collections import Counter

import mlx.core as mx
import pytest
from batching import step_until_done
from mlx_lm.models.cache import make_prompt_cache
from sanctum import settings
from sanctum.cache.store import PromptStore
from sanctum.engine.decode.drafting import Drafting
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.rounds import BatchDecoder
from sanctum.engine.kernels import cpu, platform, sdpa
from sanctum.engine.model import gdn
from sanctum.engine.model import target as target_module
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import Target, cache_offset, load_target
from sanctum.serving.requests import GenerateRequest
from sanctum.serving.verifier import Verifier

# Exactness is the CPU's: on a GPU a verify block can part from plain steps at a near-tie
# (docs/design/round.md), and "cpu" forced there would ask LAPACK of the GPU.
pytestmark = pytest.mark.skipif(platform.detect() != "cpu", reason="runs on MLX's CPU device")

PATHS = ("cpu", "metal")
# The branches each path takes and the other must not (what `branches` counts).
OWN = {
    "cpu": {"chunked gdn", "lapack inverse", "rollback from the chunk", "grouped attention",
            "compiled softmax"},
    "metal": {"gdn ops stand-in", "rollback re-run", "layers handed on", "drafted ahead"},
}  # fmt: skip
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Foo:\n", "x = 1", "while True:"]


@pytest.fixture(params=PATHS)
def on_path(request, make_pair, monkeypatch):
    """(path, target, drafter): the tiny hybrid pair loaded and run with `path` forced; the
    default settings for drafting ahead, whatever the environment says."""
    path = request.param
    cpu.prepare()  # the process's CPU JIT, decided for its real device before any path is forced
    # a hand-on every 4 layers: at 16 the tiny target's 8 layers would never hand on
    monkeypatch.setattr(target_module, "ASYNC_LAYERS", 4)
    # compiled GDN graphs are keyed by module id, not path: none traced on another path is reused
    gdn._compiled.clear()
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    with settings.use_device(draft_ahead="auto"), platform.forced(path):
        target = load_target(target_dir)
        yield path, target, load_drafter(drafter_dir, target)
    gdn._compiled.clear()


@pytest.fixture
def branches(monkeypatch):
    """Counts of the device-dependent branches taken, by the names in OWN. The Metal kernel
    itself must never run here (no Apple GPU)."""
    seen = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    def no_metal(*args, **kwargs):
        raise AssertionError("the Metal GDN kernel was called on a machine without Metal")

    monkeypatch.setattr(gdn, "gated_delta_kernel", no_metal)
    monkeypatch.setattr(gdn, "gated_delta_ops", counted("gdn ops stand-in", gdn.gated_delta_ops))
    monkeypatch.setattr(sdpa, "grouped_attention", counted("grouped attention", sdpa.grouped_attention))  # fmt: skip
    monkeypatch.setattr(cpu, "shifted_exp", counted("compiled softmax", cpu.shifted_exp))

    chunked = gdn.chunked_gated_delta

    def chunked_gated_delta(*args, lapack=False, **kwargs):
        seen["chunked gdn"] += 1
        seen["lapack inverse"] += lapack
        return chunked(*args, lapack=lapack, **kwargs)

    monkeypatch.setattr(gdn, "chunked_gated_delta", chunked_gated_delta)

    recurrent_at = gdn.GDNTape.recurrent_at

    def rolled_back(self, keep):
        if keep > 0 and self.inputs is not None:
            seen["rollback re-run"] += 1
        elif keep > 0 and self.chunk_parts is not None:
            seen["rollback from the chunk"] += 1
        return recurrent_at(self, keep)

    monkeypatch.setattr(gdn.GDNTape, "recurrent_at", rolled_back)

    # a hand-on: an async_eval from inside Target.hand_on
    handing, async_eval, hand_on = [], mx.async_eval, Target.hand_on

    def counted_async_eval(*args):
        seen["layers handed on"] += bool(handing)
        return async_eval(*args)

    def counted_hand_on(self, layer_id, h):
        handing.append(layer_id)
        try:
            hand_on(self, layer_id, h)
        finally:
            handing.pop()

    monkeypatch.setattr(mx, "async_eval", counted_async_eval)
    monkeypatch.setattr(Target, "hand_on", counted_hand_on)

    draft_next = Drafting._draft_next

    def counted_draft_next(self, *args):
        acceptance = draft_next(self, *args)
        seen["drafted ahead"] += acceptance is not None
        return acceptance

    monkeypatch.setattr(Drafting, "_draft_next", counted_draft_next)
    return seen


def assert_took(seen: Counter, path: str, names=None) -> None:
    """`path`'s own branches (`names` of them, default all) ran; none of the other path's did."""
    other = next(p for p in PATHS if p != path)
    assert {n: seen[n] for n in names or OWN[path] if not seen[n]} == {}, "not taken"
    assert {n: seen[n] for n in OWN[other] if seen[n]} == {}, "the other path's"


class KnowingDecoder(BatchDecoder):
    """Drafts the known continuation (`texts[seq_id]`, or `texts[None]` for any sequence: the
    prompt, then plain greedy decoding's tokens), one token wrong at a row that cycles through
    the block (row L-1: none wrong), so that rounds accept every count. The block's place is
    the cache's offset; drafted ahead, the offset that the acceptance not computed yet gives."""

    def __init__(self, target, drafter, texts: dict):
        super().__init__(target, drafter, LocalDraftPeer(drafter))
        pad = [0] * self.block_size
        self.texts = {k: mx.array(list(v) + pad) for k, v in texts.items()}
        self.wrong_rows = itertools.cycle(range(self.block_size))
        self._at = None  # (sequence id, the next block's anchor position: an int or a lazy one)

    def _propose(self, seq, hidden, logits, params, key):
        self._at = (seq.seq_id, cache_offset(seq.cache))
        return super()._propose(seq, hidden, logits, params, key)

    def _draft_batch(self, seqs, keys):
        # a shared round selects all greedy drafts in one pass: script each sequence's after it
        out = super()._draft_batch(seqs, keys)
        for n, seq in enumerate(seqs):
            if out[n] is not None and seq.sampling.greedy:
                self._at = (seq.seq_id, cache_offset(seq.cache))
                out[n] = (self._greedy_drafts(None, None, None), None)
        return out

    def _draft_next(self, seq, drafts, verified):
        self._at = (seq.seq_id, verified[2].start)
        return super()._draft_next(seq, drafts, verified)

    def _lazy_accept(self, drafts, logits):
        run, bonus = super()._lazy_accept(drafts, logits)
        seq_id, start = self._at
        self._at = (seq_id, start + run + 1)  # where the cache will end after the rollback
        return run, bonus

    def _greedy_drafts(self, hidden, logits, anchor):
        seq_id, offset = self._at
        text = self.texts[seq_id if seq_id in self.texts else None]
        rows = mx.arange(self.block_size - 1)
        drafts = mx.take(text, offset + 1 + rows)  # the tokens after the anchor (text[offset])
        wrong = rows == next(self.wrong_rows)
        return mx.where(wrong, (drafts + 1) % self.target.vocab_size, drafts)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def plain_greedy(target, ids: list[int], n: int, kv: str = "fp16") -> list[int]:
    return tokens_of(generate(target, ids, max_tokens=n, kv_mode=kv, eos_ids=set()))


def mlx_lm_greedy(target, ids: list[int], n: int) -> list[int]:
    """Greedy decoding through mlx-lm's own model and caches."""
    cache = make_prompt_cache(target.model)
    logits = target.model(mx.array(ids)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = target.model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def decode_alone(decoder, ids: list[int], n: int, seq_id="s", kv="fp16"):
    """(tokens, accepted drafts of each round) of one sequence stepped alone."""
    seq = decoder.new_sequence(seq_id, kv, max_tokens=n)
    key = make_key(0)
    steps = [decoder.start(seq, decoder.prefill(seq, ids), key)]
    while seq.finished is None:
        steps.append(decoder.step(seq, key))
    decoder.close(seq)
    return tokens_of(steps), [s.stats.accepted for s in steps[1:]]


def test_each_path_decides_its_own_branches(on_path):
    path, target, drafter = on_path
    metal = path == "metal"
    assert platform.current().path == path and not platform.current().metal_kernels
    assert gdn._kernel_for(32) == metal  # mlx-lm's Metal dispatch: every shape, steps too
    assert gdn._lapack() == sdpa.grouped_rows(8) == (not metal)
    assert (target.async_layers > 0) == metal
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    assert decoder.policy.draft_ahead == metal  # drafting ahead: on by default on a GPU


def test_greedy_speculative_equals_plain_and_mlx_lm(on_path, branches):
    path, target, drafter = on_path
    ids = target.tokenizer.encode(PROMPTS[0])
    plain = plain_greedy(target, ids, 48)
    assert plain == mlx_lm_greedy(target, ids, 48)
    # the drafter's own drafts (a random drafter: each round accepts none)
    assert tokens_of(generate(target, ids, drafter=drafter, max_tokens=48, eos_ids=set())) == plain
    tokens, accepted = decode_alone(KnowingDecoder(target, drafter, {None: ids + plain}), ids, 48)
    assert tokens == plain
    assert set(range(drafter.block_size)) <= set(accepted)  # every rollback, and none
    assert_took(branches, path)


def test_resumed_request_equals_cold(on_path, branches):
    """The second request continues the first's prompt and completion: it resumes from a rung
    stored after a round's rollback, and decodes what the same request decodes cold."""
    path, target, drafter = on_path
    verifier = Verifier(target, drafter, LocalDraftPeer(drafter), PromptStore(1 << 30))

    def run(ids, use_cache=True):
        verifier.decoder = KnowingDecoder(target, drafter, {None: ids + plain_greedy(target, ids, 24)})  # fmt: skip
        req = GenerateRequest(prompt_ids=tuple(ids), max_tokens=24, use_cache=use_cache)
        chunks = list(verifier.generate(req))
        return [t for c in chunks for t in c.token_ids], chunks[-1].usage

    ids = target.tokenizer.encode(PROMPTS[1])
    first, usage = run(ids)
    assert usage.resumed_at == 0 and usage.accepted_tokens > 0
    follow = ids + first + target.tokenizer.encode("    def run(self):")
    warm, usage = run(follow)
    assert usage.resumed_at > len(ids)  # past the first prompt: the completion's rung
    assert warm == run(follow, use_cache=False)[0] == plain_greedy(target, follow, 24)
    assert_took(branches, path)


def test_shared_round_equals_each_alone(on_path, branches):
    """Sequences of several prompt lengths and KV formats stepped together (`step_batch`: one
    verify and one rollback for all, each its own count) decode what each decodes alone."""
    path, target, drafter = on_path
    kvs, lengths = ["fp16", "q8", "fp16", "q8"], [28, 14, 32, 8]  # the short ones leave early
    prompts = {f"s{i}": target.tokenizer.encode(p) for i, p in enumerate(PROMPTS)}
    plain = {s: plain_greedy(target, ids, n, kv) for (s, ids), n, kv in zip(prompts.items(), lengths, kvs)}  # fmt: skip
    decoder = KnowingDecoder(target, drafter, {s: prompts[s] + plain[s] for s in prompts})
    seqs, got, keys = [], {}, {}
    for (seq_id, ids), kv, n in zip(prompts.items(), kvs, lengths):
        seq = decoder.new_sequence(seq_id, kv, max_tokens=n)
        logits = decoder.prefill(seq, ids)
        keys[seq_id], sub = mx.random.split(make_key(0))
        got[seq_id] = list(decoder.start(seq, logits, sub).tokens)
        seqs.append(seq)
    accepted = set()
    widths = step_until_done(decoder, seqs, keys, got, lambda _, s: accepted.add(s.stats.accepted))
    assert max(widths) == 4 and min(widths) < 4
    assert set(range(drafter.block_size)) <= accepted
    # the shared rounds so far (they do not draft ahead): the path's verify and rollback
    assert_took(branches, path, OWN[path] - {"drafted ahead"})
    for (seq_id, ids), kv, n in zip(prompts.items(), kvs, lengths):
        alone = decode_alone(decoder, ids, n, seq_id, kv)[0]
        assert got[seq_id] == alone == plain[seq_id], seq_id
    assert_took(branches, path)


def test_the_metal_kernel_runs_only_on_an_apple_gpu(monkeypatch, branches):
    """On a Mac whose MLX runs on its CPU the Metal kernel cannot run either: the metal path
    takes the ops form there too (mlx-lm's rule), as on a machine without Metal."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    B, T, Hk, Hv, D = 1, 3, 2, 4, 32
    q, k = mx.random.normal((2, B, T, Hk, D))
    v = mx.random.normal((B, T, Hv, D))
    log_g, beta = -mx.random.uniform(shape=(B, T, Hv)), mx.random.uniform(shape=(B, T, Hv))
    with platform.forced("metal"):
        assert not platform.current().metal_kernels
        gdn.recurrence(q, k, v, log_g, beta, mx.zeros((B, Hv, D, D)))
    assert branches["gdn ops stand-in"] == 1
