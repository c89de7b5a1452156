"""What the shared-round test modules share: their prompts, a batch decoder that proposes
scripted drafts, and runs of a sequence alone and of a batch."""

from __future__ import annotations

import mlx.core as mx
from helpers import assert_greedy_equal
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.policy import DecodePolicy
from sanctum.engine.decode.rounds import BatchDecoder
from sanctum.engine.decode.sampling import SamplingParams
from sanctum.engine.kernels.cuda import is_cuda
from sanctum.engine.model.target import cache_offset
from test_engine import tokens_of

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


def assert_as_alone(target, drafter, prompt, n, got, kv="fp16", what="") -> None:
    """A greedy sequence decoded in shared rounds: its tokens are those it decodes alone (CPU);
    on CUDA, plain greedy decoding's up to its first near tie (helpers.assert_greedy_equal)."""
    if not is_cuda():
        assert got == solo(target, drafter, prompt, n, kv), what
        return
    ids = target.tokenizer.encode(prompt)
    plain = tokens_of(generate(target, ids, max_tokens=n, kv_mode=kv, eos_ids=set()))
    assert_greedy_equal(target, ids, plain[: len(got)] if len(got) < n else plain, got, what)


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
    return out, step_until_done(decoder, seqs, keys, out)


def step_until_done(decoder, seqs, keys: dict, out: dict, on_step=None) -> list[int]:
    """Every open sequence steps in one `step_batch` per round (each with the next split of its
    own key), its tokens added to `out[seq_id]`, leaving the batch when it finishes; `on_step`
    sees every (sequence, step). Returns the batch widths seen."""
    widths = []
    while seqs:
        subs, nexts = [], []
        for seq in seqs:
            key, sub = mx.random.split(keys[seq.seq_id])
            nexts.append(key)
            subs.append(sub)
        widths.append(len(seqs))
        for seq, step, key in zip(seqs, decoder.step_batch(seqs, subs), nexts):
            if seq.tail is None:  # (a prompt tail going on splits the same key next round)
                keys[seq.seq_id] = key
            out[seq.seq_id] += step.tokens
            if on_step is not None:
                on_step(seq, step)
            assert cache_offset(seq.cache) == len(seq.cached_tokens)
        for seq in [s for s in seqs if s.finished is not None]:
            decoder.close(seq)
        seqs = [s for s in seqs if s.finished is None]
    return widths
