"""Drafts read from the sequence itself (engine/lookup.py): the search against a brute-force one,
and the decoder's rounds with it: the continuation is what the target verifies, the output is
plain decoding's, and a sequence proposes the same blocks alone and in a shared round.

The tiny random pairs' text (512 tokens, no loops) rarely repeats even two tokens, so the
decoding tests lower `lookup_min` to 1: a round looks its block up wherever its anchor occurred
before. The default's effect is measured by the benches (docs/performance.md)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from batching import PROMPTS
from helpers import assert_greedy_equal
from sanctum.engine.decode.generate import generate, make_key
from sanctum.engine.decode.lookup import MAX_MATCH, TokenIndex
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.policy import DecodePolicy, lookup_min_default
from sanctum.engine.decode.rounds import BatchDecoder
from sanctum.engine.kernels.cuda import is_cuda
from test_engine import load_pair, tokens_of


def brute_force(history: list[int], count: int, min_match: int):
    """The continuation by definition: among earlier positions j of the last token with `count`
    tokens after them, the longest match of the tokens ending there with the sequence's end
    (capped at MAX_MATCH), the latest of those; None below `min_match`."""
    n, best, best_j = len(history), 0, None
    for j in range(n - count):
        if history[j] != history[-1]:
            continue
        m = 0
        while m < MAX_MATCH and j - m >= 0 and history[j - m] == history[n - 1 - m]:
            m += 1
        if m >= best:
            best, best_j = m, j
    if best_j is None or best < min_match:
        return None
    return history[best_j + 1 : best_j + 1 + count]


def test_continuation_equals_a_brute_force_search_as_the_sequence_grows():
    rng = np.random.default_rng(0)
    for trial in range(60):
        vocab = int(rng.integers(2, 6))  # few symbols: repeats of every length
        index, tokens = TokenIndex(), []
        min_match, count = int(rng.integers(1, 10)), int(rng.integers(1, 8))
        for _ in range(40):  # rounds: a few tokens committed each, then the next lookup
            tokens.extend(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 9))))
            anchor = int(rng.integers(0, vocab))
            got = index.continuation(tokens, anchor, count, min_match)
            want = brute_force(tokens + [anchor], count, min_match)
            assert (got is None) == (want is None), (trial, len(tokens))
            if want is not None:
                assert got.tolist() == want, (trial, len(tokens))
    # periodic text (a loop) matches at every length: capped, the latest full continuation
    tokens = [1, 2, 3] * 40
    got = TokenIndex().continuation(tokens, 1, 7, 8)
    assert got.tolist() == brute_force(tokens + [1], 7, 8) == [2, 3, 1, 2, 3, 1, 2]


def test_the_longest_repeat_wins_then_the_latest():
    seq = [9, 5, 6, 7, 40, 41, 8, 6, 7, 50, 51, 5, 6, 7, 60, 61, 0]
    # "5 6 7" ends at 3 and at 13 (longest: 3 tokens), "6 7" alone at 8
    got = TokenIndex().continuation(seq + [5, 6], 7, 2, 2)
    assert got.tolist() == [60, 61]  # the latest of the two longest
    seq = [1, 5, 6, 7, 40, 41, 2, 6, 7, 50, 51, 3, 5, 6]
    assert TokenIndex().continuation(seq, 7, 2, 3).tolist() == [40, 41]  # longer (3) beats later
    assert TokenIndex().continuation(seq, 7, 2, 4) is None


def test_a_repeat_without_count_tokens_after_it_is_not_proposed():
    seq = [4, 1, 2, 3, 4, 1, 2]
    assert TokenIndex().continuation(seq, 3, 3, 3).tolist() == [4, 1, 2]
    assert TokenIndex().continuation(seq, 3, 5, 3) is None  # only 4 tokens follow the repeat


def test_a_new_token_list_is_indexed_afresh():
    index = TokenIndex()
    first = [1, 2, 3, 4, 1, 2]
    assert index.continuation(first, 3, 1, 3).tolist() == [4]
    resumed = [7, 2, 3, 9, 7, 2]  # a sequence resumed from the cache gets a new list
    assert index.continuation(resumed, 3, 1, 3).tolist() == [9]
    grown = list(range(3000)) + [5, 6]  # past the buffer's first size
    assert index.continuation(grown, 7, 3, 3).tolist() == [8, 9, 10]


def test_the_setting_is_checked():
    assert lookup_min_default({}) == 8
    assert lookup_min_default({"SANCTUM_LOOKUP_MIN": "0"}) == 0
    for bad in ("-1", "eight", "2.5"):
        with pytest.raises(ValueError, match="SANCTUM_LOOKUP_MIN"):
            lookup_min_default({"SANCTUM_LOOKUP_MIN": bad})
    from sanctum.settings import serve_settings

    assert serve_settings(env={"SANCTUM_LOOKUP_MIN": "0"}).lookup_min == 0
    with pytest.raises(ValueError, match="SANCTUM_LOOKUP_MIN"):
        serve_settings(env={"SANCTUM_LOOKUP_MIN": "-3"})


@pytest.mark.parametrize("drafter_kind", ["dflash", "dflash2"])
def test_looked_up_rounds_verify_the_continuation_and_decode_as_plain(
    make_pair, monkeypatch, drafter_kind
):
    target, drafter = load_pair(make_pair, "hybrid", drafter_kind)
    blocks, verify = [], target.verify

    def recording_verify(block, *args, **kwargs):  # the blocks the target is asked to verify
        blocks.append(block.tolist())
        return verify(block, *args, **kwargs)

    monkeypatch.setattr(target, "verify", recording_verify)
    prompt = PROMPTS[2]
    ids = target.tokenizer.encode(prompt)
    plain = tokens_of(generate(target, ids, max_tokens=64, eos_ids=set()))
    for lookup_min in (0, 1):
        blocks.clear()
        steps = list(generate(target, ids, drafter=drafter, max_tokens=64, eos_ids=set(),
                              lookup_min=lookup_min))  # fmt: skip
        assert_greedy_equal(target, ids, plain, tokens_of(steps), lookup_min)
        rounds = [s for s in steps if s.stats is not None]
        assert len(rounds) == len(blocks)
        looked = [r.stats.looked_up for r in rounds]
        assert any(looked) == bool(lookup_min), looked
        history = list(ids) + tokens_of(steps[:1])
        for step, block in zip(rounds, blocks):
            if step.stats.looked_up:  # the block is the anchor and what followed its repeat
                assert block[1:] == brute_force(history, len(block) - 1, lookup_min)
            else:
                assert brute_force(history, len(block) - 1, lookup_min or 10**9) is None
            history += step.tokens


def test_lookup_in_a_shared_round_proposes_and_commits_as_alone(make_pair):
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    lengths = [40, 24, 33]
    alone = []
    for prompt, n in zip(PROMPTS, lengths):
        steps = list(generate(target, target.tokenizer.encode(prompt), drafter=drafter,
                              max_tokens=n, eos_ids=set(), lookup_min=1))  # fmt: skip
        alone.append((tokens_of(steps), [s.stats.looked_up for s in steps[1:]]))
    decoder = BatchDecoder(
        target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(lookup_min=1)
    )
    seqs, keys, got = [], [], []
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        seq = decoder.new_sequence(f"s{i}", max_tokens=n)
        logits = decoder.prefill(seq, target.tokenizer.encode(prompt))
        key, sub = mx.random.split(make_key(None))
        seqs.append(seq)
        keys.append(key)
        got.append((list(decoder.start(seq, logits, sub).tokens), []))
    live = list(range(len(seqs)))
    shared = 0
    while live:
        subs = []
        for i in live:
            keys[i], sub = mx.random.split(keys[i])
            subs.append(sub)
        steps = decoder.step_batch([seqs[i] for i in live], subs)
        shared += len(live) > 1 and sum(s.stats.looked_up for s in steps) not in (0, len(live))
        for i, step in zip(live, steps):
            got[i][0].extend(step.tokens)
            got[i][1].append(step.stats.looked_up)
        live = [i for i in live if seqs[i].finished is None]
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        if is_cuda():  # each run against plain greedy, up to its first near tie
            ids = target.tokenizer.encode(prompt)
            plain = tokens_of(generate(target, ids, max_tokens=n, eos_ids=set()))
            for run in (alone[i][0], got[i][0]):
                assert_greedy_equal(target, ids, plain, run, f"sequence {i}")
        else:
            assert got[i] == alone[i], f"sequence {i}"
    assert shared  # rounds where some sequences looked up their block while others drafted


class OracleLookup(BatchDecoder):
    """Looks each sequence's blocks up in its known greedy output (`references`), except at the
    completion positions in `wrong`: so a looked-up block is accepted whole unless it covers a
    wrong position, as on text the target copies, and looked-up blocks grow past the drafter's
    width and fall back to it."""

    def __init__(self, target, drafter, references: dict, wrong: dict):
        super().__init__(
            target, drafter, LocalDraftPeer(drafter), policy=DecodePolicy(lookup_min=1)
        )
        self.references, self.wrong = references, wrong

    def _continuation(self, seq, count):
        ref, n = self.references[seq.seq_id], len(seq.completion)
        out = list(ref[n : n + count])
        for j in range(count):
            if n + j in self.wrong.get(seq.seq_id, ()):
                out[j] = (out[j] + 1) % self.target.vocab_size
        return np.array(out, np.int32)


def _open(decoder, target, seq_id, prompt, n, eos=()):
    seq = decoder.new_sequence(seq_id, max_tokens=n, eos_ids=eos)
    logits = decoder.prefill(seq, target.tokenizer.encode(prompt))
    key, sub = mx.random.split(make_key(None))
    return seq, key, list(decoder.start(seq, logits, sub).tokens)


@pytest.mark.parametrize("kind", ["hybrid", "next"])
def test_looked_up_blocks_grow_while_accepted_whole_alone_and_shared(make_pair, kind):
    target, drafter = load_pair(make_pair, kind, "dflash2")
    plain = {
        f"s{i}": tokens_of(
            generate(target, target.tokenizer.encode(p), max_tokens=140, eos_ids=set())
        )
        for i, p in enumerate(PROMPTS[:3])
    }
    # s0 copies throughout; s1's copy breaks at 30 and 75; s2 stops on an EOS inside a wide
    # looked-up block; s3 (no reference) drafts as usual beside them
    eos_at = next(j for j in range(70, 120) if plain["s2"][j] not in plain["s2"][:j])
    specs = [("s0", PROMPTS[0], 100, ()), ("s1", PROMPTS[1], 97, ()),
             ("s2", PROMPTS[2], 130, (plain["s2"][eos_at],)), ("s3", PROMPTS[3], 6, ())]  # fmt: skip
    wrong = {"s1": {30, 75}}

    def decoder():
        d = OracleLookup(target, drafter, plain, wrong)
        d._continuation = lambda seq, count, base=d._continuation: (
            base(seq, count) if seq.seq_id in plain else None
        )
        return d

    alone = {}
    for seq_id, prompt, n, eos in specs:
        d = decoder()
        seq, key, out = _open(d, target, seq_id, prompt, n, eos)
        widths = []
        while seq.finished is None:
            key, sub = mx.random.split(key)
            step = d.step(seq, sub)
            out += step.tokens
            widths.append((step.stats.bs, step.stats.looked_up))
        alone[seq_id] = out, widths
    ids = {seq_id: target.tokenizer.encode(prompt) for seq_id, prompt, *_ in specs}
    for seq_id, n in (("s0", 100), ("s1", 97), ("s2", eos_at)):
        assert_greedy_equal(target, ids[seq_id], plain[seq_id][:n], alone[seq_id][0], seq_id)
    assert [w for w, _ in alone["s0"][1][:4]] == [8, 16, 32, 32]  # anchor + 7, 15, 31 copied
    assert 8 in [w for w, _ in alone["s1"][1][3:]]  # back to the drafter's width after a miss
    assert not any(looked for _, looked in alone["s3"][1])

    def shared(specs):
        d = decoder()
        opened = [_open(d, target, seq_id, prompt, n, eos) for seq_id, prompt, n, eos in specs]
        seqs, keys = [s for s, _, _ in opened], [k for _, k, _ in opened]
        got = {s.seq_id: (out, []) for s, _, out in opened}
        live = list(range(len(seqs)))
        while live:
            subs = []
            for i in live:
                keys[i], sub = mx.random.split(keys[i])
                subs.append(sub)
            drafting = any(seqs[i].seq_id == "s3" for i in live)
            for i, step in zip(live, d.step_batch([seqs[i] for i in live], subs)):
                got[seqs[i].seq_id][0].extend(step.tokens)
                got[seqs[i].seq_id][1].append((step.stats.bs, step.stats.looked_up, drafting))
            live = [i for i in live if seqs[i].finished is None]
        return got

    if is_cuda():  # a shared verify's products round last bits unlike a solo one's there
        s3 = tokens_of(generate(target, ids["s3"], max_tokens=6, eos_ids=set()))
        reference = {
            "s0": plain["s0"][:100],
            "s1": plain["s1"][:97],
            "s2": plain["s2"][:eos_at],
            "s3": s3,
        }

    def same_as_alone(got: dict) -> None:
        """Each shared run's tokens are its solo run's (on CUDA: plain greedy's up to its
        first near tie, as the solo run's are)."""
        for seq_id, (out, _) in got.items():
            if is_cuda():
                assert_greedy_equal(target, ids[seq_id], reference[seq_id], out, seq_id)
            else:
                assert out == alone[seq_id][0], seq_id

    # every block looked up: each as wide as alone (on CUDA the widths follow the tokens, which
    # may part from the solo run's after a near tie)
    got = shared(specs[:3])
    same_as_alone(got)
    if not is_cuda():
        assert {k: [w[:2] for w in ws] for k, (_, ws) in got.items()} == {
            k: v[1] for k, v in alone.items() if k != "s3"
        }
    # beside a sequence that drafts, looked-up blocks are no wider than its block (the verify
    # pads every block to the widest): the same tokens in more rounds
    got = shared(specs)
    same_as_alone(got)
    for seq_id, (_, widths) in got.items():
        assert all(bs <= 8 for bs, _, drafting in widths if drafting), seq_id
    if not is_cuda():
        assert any(bs == 32 for bs, _, drafting in got["s1"][1] if not drafting)
