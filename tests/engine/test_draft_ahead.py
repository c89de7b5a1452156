"""Drafting ahead (`Decoder.draft_ahead`): a round drafts the next block on its acceptance as the
device computes it, before the host reads it. Pinned here: the drafter's body reads the same
context that way as when the rows are appended once known (every layout, every count, past the
window and past a buffer regrowth), and a decode drafting ahead proposes, accepts and emits
exactly what the synchronous rounds do."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from sanctum.engine.decode.decoder import Decoder
from sanctum.engine.decode.generate import make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.policy import DecodePolicy, draft_ahead_default
from sanctum.engine.decode.sampling import SamplingParams, greedy_tokens
from sanctum.engine.kernels import cuda
from sanctum.engine.model.drafter import ContextCache, load_drafter
from sanctum.engine.model.target import load_target
from sanctum.tiny import DRAFTER_LAYOUTS, drafter_config, write_random_drafter

# Exactness is the CPU's (float32, the same kernels whatever the rows): on CUDA the product and
# attention kernels differ with the row count, so there a decode that drafts ahead can part from
# one that does not at a near-tie, as any verify can part from plain decoding
# (docs/design/round.md); `bench speculative` and `bench cuda` judge the GPU's output.
# There the body's check runs with a tolerance for those last bits, far below the change a
# block read at the wrong place makes (docs/performance.md). The CPU's exact check is the one
# that also catches a single row misread.
exact = pytest.mark.skipif(cuda.is_cuda(), reason="exact equality holds on the CPU")
CUDA_TOLERANCE = 2e-3  # of the output's largest magnitude

LAYOUTS = ["tiny-dflash", "tiny-dflash2", *sorted(DRAFTER_LAYOUTS)]


def _drafter(make_pair, tmp_path, layout):
    kind = layout.removeprefix("tiny-") if layout.startswith("tiny-") else "dflash"
    target_dir, drafter_dir = make_pair("hybrid", kind)
    target = load_target(target_dir)
    if layout in DRAFTER_LAYOUTS:
        raw = DRAFTER_LAYOUTS[layout](drafter_config("dflash", target_dir))
        drafter_dir = write_random_drafter(tmp_path / layout, raw)
    return target, load_drafter(drafter_dir, target)


def test_unsettled_rows_are_counted_by_the_bounds_then_settled():
    sync, ahead = ContextCache(window=5), ContextCache(window=5)
    rows = mx.random.normal((1, 2, 3, 4))
    sync.append(rows, rows)
    ahead.append(rows, rows)
    block = mx.random.normal((1, 2, 4, 4))
    ahead.append_unsettled(block, block, mx.array(3, mx.int32))
    sync.append(block[:, :, :3], block[:, :, :3])
    assert ahead.bounds().tolist() == sync.bounds().tolist()  # before the host knows the count
    ahead.settle(3)
    assert (ahead.begin, ahead.end) == (sync.begin, sync.end)
    np.testing.assert_array_equal(np.array(ahead.fetch()[0]), np.array(sync.fetch()[0]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_body_drafting_ahead_reads_the_context_as_appended(make_pair, tmp_path, layout):
    """Rounds of a body: one cache gets each round's accepted rows once known (`__call__`), the
    other all the block's rows with the count unevaluated (`ahead`, then `settle`). Same hidden
    states, over ~300 context rows: past every window and the buffers' first regrowth."""
    target, drafter = _drafter(make_pair, tmp_path, layout)
    body, L = drafter.body, drafter.block_size
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    rng = np.random.default_rng(0)
    sync, ahead = body.make_cache(), body.make_cache()
    first = mx.array(rng.normal(size=(1, 30, width)).astype(np.float32))
    embeds = mx.array(rng.normal(size=(1, L, drafter.cfg.hidden_size)).astype(np.float32))
    mx.eval(body(embeds, 30, first, sync), body(embeds, 30, first, ahead))
    start = 30
    for count in itertools.islice(itertools.cycle([1, L, 3, 5, 2, L - 1, 4]), 70):
        taps = mx.array(rng.normal(size=(1, L, width)).astype(np.float32))
        want = body(embeds, start + count, taps[:, :count], sync)
        got = body.ahead(
            embeds, mx.array(start + count, mx.int32), taps, start, mx.array(count, mx.int32), ahead
        )
        if cuda.is_cuda():
            scale = mx.abs(want).max().item()
            err = mx.abs(got - want).max().item() / scale
            print(f"{layout} count {count}: max |ahead - sync| / max |sync| = {err:.2e}")
            assert err < CUDA_TOLERANCE
        else:
            np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)
        for c in ahead:
            c.settle(count)
        start += count
    assert all(c.end - c.begin == s.end - s.begin for c, s in zip(ahead, sync))
    assert max(c.end for c in ahead) > ContextCache.STEP  # a buffer was regrown on the way


class CycledDecoder(Decoder):
    """Acceptance forced to cycle through every count (the drafts need not match the target's),
    so that drafting ahead is checked at each; records every round's drafts."""

    def __init__(self, target, drafter, ahead: bool):
        super().__init__(
            target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(draft_ahead=ahead)
        )
        self.counts = itertools.cycle(range(self.block_size))
        self.drafted: list[list[int]] = []

    def _forced(self, drafts, logits) -> int:
        self.drafted.append(drafts.tolist())
        return next(self.counts)

    def _accept(self, drafts, q, logits, params, key):
        n = self._forced(drafts, logits)
        return n, int(greedy_tokens(logits)[n].item())

    def _lazy_accept(self, drafts, logits):
        n = self._forced(drafts, logits)
        return mx.array(n, mx.int32), greedy_tokens(logits)[n].astype(mx.int32)


def _decode(decoder, prompt, n, eos=frozenset()):
    seq = decoder.new_sequence("s", "fp16", SamplingParams(), n, eos)
    key = make_key(0)
    steps = [decoder.start(seq, decoder.prefill(seq, prompt), key)]
    while seq.finished is None:
        steps.append(decoder.step(seq, key))
    decoder.close(seq)
    return [t for s in steps for t in s.tokens], [s.stats.accepted for s in steps[1:]]


@exact
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decoder_drafting_ahead_drafts_what_synchronous_rounds_draft(make_pair, tmp_path, layout):
    target, drafter = _drafter(make_pair, tmp_path, layout)
    prompt = target.tokenizer.encode("def fibonacci(n):\n    ")
    runs = {}
    for ahead in (False, True):
        decoder = CycledDecoder(target, drafter, ahead)
        runs[ahead] = (*_decode(decoder, prompt, 10 * drafter.block_size), decoder.drafted)
    assert runs[True] == runs[False]
    assert set(runs[True][1]) == set(range(drafter.block_size))


@pytest.fixture(scope="module")
def default_pair():
    from sanctum.settings import default_pair

    target_dir, drafter_dir = default_pair()
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


PROMPTS = [
    "def fibonacci(n):\n",
    'import os\n\n\ndef walk(path):\n    """Yield every file under path."""\n',
    '<|im_start|>user\ndef mean(values):\n    """The arithmetic mean."""<|im_end|>\n'
    "<|im_start|>assistant\n",
]


@exact
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_drafting_ahead_equals_plain_greedy_and_synchronous_rounds(default_pair, prompt):
    """The trained pair, real acceptance: with and without drafting ahead the same tokens (the
    target's own greedy decode) and the same acceptance every round; also where the request
    ends inside a block (max_tokens 37, the EOS), with adaptive widths and with the gate on."""
    target, drafter = default_pair
    ids = target.tokenizer.encode(prompt)
    eos = frozenset(target.tokenizer.eos_token_ids)
    plain = _decode(Decoder(target), ids, 96, eos)[0]
    for n, adaptive, min_tau in ((96, False, 0.0), (37, False, 0.0), (96, True, 3.0)):
        runs = []
        for ahead in (False, True):
            policy = DecodePolicy(draft_ahead=ahead, adaptive=adaptive, min_tau=min_tau)
            decoder = Decoder(target, drafter, LocalDraftPeer(drafter), policy=policy)
            runs.append(_decode(decoder, ids, n, eos))
        assert runs[0] == runs[1]
        assert runs[1][0] == plain[:n]
        if n == 96 and not adaptive:
            assert max(runs[1][1]) >= 4  # the drafts were really accepted


def test_drafting_ahead_is_on_by_default_only_on_a_gpu_in_one_process(default_pair):
    target, drafter = default_pair
    assert draft_ahead_default(target, LocalDraftPeer(drafter)) == bool(target.async_layers)
    assert not draft_ahead_default(target, None)


@exact
def test_a_block_drafted_ahead_is_not_used_after_a_shared_round(default_pair):
    """A sequence drafts ahead in a solo round, then takes shared rounds (drafted together,
    rounds.py), then solo ones again: the block drafted ahead before the shared rounds is not
    the next block any more. Same tokens and acceptance as the schedule without drafting ahead."""
    from sanctum.engine.decode.rounds import BatchDecoder

    target, drafter = default_pair
    eos = frozenset(target.tokenizer.eos_token_ids)
    runs = []
    for ahead in (False, True):
        decoder = BatchDecoder(
            target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(draft_ahead=ahead)
        )
        key = make_key(0)
        seqs = []
        for i, (prompt, n) in enumerate(((PROMPTS[0], 24), (PROMPTS[1], 80))):
            seq = decoder.new_sequence(f"s{i}", "fp16", SamplingParams(), n, eos)
            decoder.start(seq, decoder.prefill(seq, target.tokenizer.encode(prompt)), key)
            seqs.append(seq)
        a, b = seqs
        got = [decoder.step(b, key) for _ in range(2)]  # solo: drafts ahead
        while a.finished is None and b.finished is None:
            got += decoder.step_batch([a, b], [key, key])  # shared
        while b.finished is None:
            got.append(decoder.step(b, key))  # solo again
        runs.append([(s.tokens, s.stats.accepted) for s in got])
        for seq in seqs:
            decoder.close(seq)
    assert runs[0] == runs[1]


@exact
def test_looked_up_rounds_between_rounds_drafted_ahead(default_pair):
    """Repeated text (engine/lookup.py) in a chat the trained pair answers by restating the
    code: a looked-up round follows one that drafted its block ahead (left unused), and the
    round after it drafts with the context rows the drafter lacks. With and without drafting
    ahead: the same widths (looked-up blocks growing to 32 rows), acceptance and tokens, the
    target's own greedy decode."""
    from sanctum.bench.multiturn import _code_snippets
    from sanctum.tokenizer import render_chat

    target, drafter = default_pair
    code = _code_snippets(1)[0]
    messages = [{"role": "system", "content": "You are a careful Python reviewer."},
                {"role": "user", "content": f"Review this code:\n```python\n{code}\n```"}]  # fmt: skip
    ids = target.tokenizer.encode(render_chat(target.tokenizer, messages), add_special_tokens=False)
    eos = frozenset(target.tokenizer.eos_token_ids)
    runs = []
    for ahead in (False, True):
        decoder = Decoder(
            target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(draft_ahead=ahead)
        )
        seq = decoder.new_sequence("s", "fp16", SamplingParams(), 128, eos)
        key = make_key(0)
        steps = [decoder.start(seq, decoder.prefill(seq, ids), key)]
        while seq.finished is None:
            steps.append(decoder.step(seq, key))
        decoder.close(seq)
        rounds = [(s.stats.bs, s.stats.accepted, s.stats.looked_up) for s in steps[1:]]
        runs.append(([t for s in steps for t in s.tokens], rounds))
    assert runs[0] == runs[1]
    assert runs[0][0] == _decode(Decoder(target), ids, 128, eos)[0]
    assert (32, 31, True) in runs[0][1] and (8, 7, False) in runs[0][1]
