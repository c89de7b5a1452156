"""The multi-turn prompt cache: the seed scenario (three chat turns under one prefill chunk) must
resume warm for Q8 and FP16, sync and streaming, alike; a resumed request equals a cold one."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from sanctum.cache.ladder import MIN_SPREAD_GAP, choose_rungs, prefill_stops, restore_into
from sanctum.cache.store import CacheEntry, PromptStore
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import load_target
from sanctum.serving.requests import GenerateRequest
from sanctum.serving.verifier import Verifier

SYSTEM = {"role": "system", "content": "You are a careful Python assistant."}


@pytest.fixture(scope="module")
def pair(make_pair):
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


def make_verifier(pair, store=None, kv="fp16", depth=4):
    target, drafter = pair
    store = store if store is not None else PromptStore(1 << 30)
    return Verifier(target, drafter, LocalDraftPeer(drafter), store, ladder_depth=depth, kv_mode=kv)


def run(verifier, messages, mode="sync", use_cache=True, max_tokens=12):
    req = GenerateRequest(messages=tuple(messages), max_tokens=max_tokens, use_cache=use_cache)
    if mode == "sync":
        chunks = list(verifier.generate(req, mode))
    else:
        chunks = []
        for chunk in verifier.generate(req, mode):  # consumed as it streams
            chunks.append(chunk)
    tokens = [t for c in chunks for t in c.token_ids]
    return tokens, "".join(c.text for c in chunks), chunks[-1].usage


def three_turns(verifier, mode):
    """The seed's scenario: a reasoning reply whose <think> block the template drops next turn."""
    messages = [SYSTEM, {"role": "user", "content": "Write a function that adds two numbers."}]
    results = []
    for turn in range(3):
        tokens, text, usage = run(verifier, messages, mode)
        cold_tokens, _, _ = run(verifier, messages, mode, use_cache=False)
        results.append((tokens, cold_tokens, usage))
        reply = f"<think>\nreasoning {turn}: {text}\n</think>\n\ndef add(a, b):\n    return a + b"
        messages = messages + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Now handle turn {turn + 2} with type hints."},
        ]
    return results


@pytest.mark.parametrize("kv", ["fp16", "q8"])
@pytest.mark.parametrize("mode", ["sync", "streaming"])
def test_seed_scenario_resumes_warm(pair, kv, mode):
    results = three_turns(make_verifier(pair, kv=kv), mode)
    first = results[0][2]
    assert first.resumed_at == 0 and first.cache_hit_ratio == 0
    for tokens, cold_tokens, usage in results:
        assert usage.prompt_tokens < 2048  # a single prefill chunk: no chunk boundary to resume at
        assert tokens == cold_tokens  # resumed output == cold output, token for token
        assert usage.kv == kv and usage.mode == mode
    for _, _, usage in results[1:]:
        # the template dropped the <think> block: the prefix ends right after the previous
        # turn's generation prompt, where a rung sits, so the resume reaches the LCP itself
        assert usage.resumed_at > 0
        assert usage.resumed_at == usage.requested_lcp
        assert usage.cached_tokens == usage.resumed_at
        assert usage.cache_hit_ratio == pytest.approx(
            usage.resumed_at / usage.prompt_tokens, abs=1e-4
        )


@pytest.fixture(scope="module")
def trained_pair():
    """The shipped default pair: it writes real text, which a random tiny model does not."""
    from sanctum.settings import default_pair

    target_dir, drafter_dir = default_pair()
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_reply_sent_back_as_text_resumes_at_the_lcp(trained_pair, kv):
    """Without <think> blocks the next prompt re-encodes the reply's text, which often differs
    from the generated tokens partway in (the model emits "\n   " where the encoder gives "\n" +
    "   "): the resume must still reach the LCP, from a rung placed there while decoding, not
    fall back to the prompt boundary."""
    verifier = make_verifier(trained_pair, kv=kv)
    code = "```python\ndef add(a, b):\n    return a + b\n```"
    messages = [SYSTEM, {"role": "user", "content": f"Review this code:\n{code}"}]
    inside = 0  # turns whose prefix ended strictly inside the previous completion
    previous = None  # (prompt tokens, completion tokens) of the previous turn
    for turn in range(4):
        tokens, text, usage = run(verifier, messages, max_tokens=32)
        if previous is not None:
            assert usage.resumed_at == usage.requested_lcp  # not short of it
            cold_tokens, _, _ = run(verifier, messages, use_cache=False, max_tokens=32)
            assert tokens == cold_tokens
            inside += previous[0] < usage.requested_lcp < sum(previous) - 1
        previous = (usage.prompt_tokens, len(tokens))
        messages = messages + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And now turn {turn + 2}."},
        ]
    assert inside >= 2  # the case this is about was exercised, not only the prompt boundary


def test_seed_scenario_identical_across_kv_and_mode(pair):
    """Q8/FP16 x sync/streaming share one code path: same resume positions every turn."""
    seen = {}
    for kv in ("fp16", "q8"):
        for mode in ("sync", "streaming"):
            results = three_turns(make_verifier(pair, kv=kv), mode)
            seen[(kv, mode)] = [
                (u.prompt_tokens, u.requested_lcp, u.resumed_at, u.cached_tokens)
                for _, _, u in results
            ]
    assert len(set(map(tuple, seen.values()))) == 1, seen


def test_resumed_logits_match_cold_prefill(pair):
    """FP16: tight tolerance. Q8: a stated one (8-bit KV quantizes each token the same way in both
    paths; the residual comes from chunk-shape-dependent float sums)."""
    target, drafter = pair
    ids = target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)
    for kv, tol in (("fp16", 1e-4), ("q8", 1e-3)):
        verifier = make_verifier(pair, kv=kv)
        list(verifier.generate(GenerateRequest(prompt_ids=tuple(ids[:40]), max_tokens=4)))
        plan = verifier.store.plan(verifier.model_key(kv), ids)
        assert plan.resumed_at == 40  # the prompt-boundary rung of the first request
        cache = target.make_cache(kv)
        restore_into(target, cache, plan)
        warm, _ = target.prefill(ids[40:], cache)
        cold, _ = target.prefill(ids, target.make_cache(kv))
        np.testing.assert_allclose(np.array(warm), np.array(cold), atol=tol, rtol=tol)


def test_rung_exactly_at_lcp_and_one_token_recomputed(pair):
    target, _ = pair
    verifier = make_verifier(pair)
    ids = list(range(10, 60))
    list(verifier.generate(GenerateRequest(prompt_ids=tuple(ids), max_tokens=3)))
    # a prompt sharing exactly the first 50 tokens: the rung at 50 is exactly the LCP
    plan = verifier.store.plan(verifier.model_key("fp16"), ids + [61, 62])
    assert plan.requested_lcp >= 50 and plan.resumed_at == 50
    # the very same prompt again: its last token must be recomputed (its logits are needed),
    # so the resume stops at the deepest rung strictly below the prompt length
    plan = verifier.store.plan(verifier.model_key("fp16"), ids)
    assert 0 < plan.resumed_at < 50


def test_ladder_positions_and_inheritance():
    # a prompt that fits one chunk still gets its boundary rung
    assert prefill_stops(4, 53, 0) == (13, 26, 53) or 53 in prefill_stops(4, 53, 0)
    assert prefill_stops(4, 53, 0)[-1] == 53
    assert prefill_stops(1, 53, 0) == (53,)
    # spread rungs keep MIN_SPREAD_GAP tokens from the resume point and from each other: a
    # short prompt's prefill (or riding tail) does not pause every few tokens
    assert prefill_stops(4, 10, 0) == (10,)
    for length, resumed in [(31, 0), (32, 0), (50, 20), (200, 7), (1000, 0)]:
        stops = (resumed, *prefill_stops(4, length, resumed))
        assert min(b - a for a, b in zip(stops, stops[1:])) >= MIN_SPREAD_GAP
        assert stops[-1] == length
    assert len(prefill_stops(4, 1000, 0)) == 3
    stops = prefill_stops(4, 100, 40, message_starts=[10, 45, 80])
    assert 100 in stops and 80 in stops and 45 in stops and all(40 < s <= 100 for s in stops)
    st = [("c", "s")]
    chosen = choose_rungs(
        4, 100, 120, [45, 80], {100: st, 80: st, 45: st, 120: st}, {40: st, 20: st}
    )
    assert set(chosen) == {100, 120, 80, 45}
    chosen = choose_rungs(6, 100, 120, [80], {100: st, 80: st, 120: st}, {40: st, 20: st})
    assert {20, 40} <= set(chosen)  # inherited rungs are kept while depth allows


def test_a_request_not_saved_takes_no_rungs(pair):
    # its cache is never stored: prefill (or a riding tail) need not pause at rung positions
    verifier = make_verifier(pair)
    ids = tuple(range(10, 110))
    for use_cache, want in [(True, prefill_stops(4, 100, 0)), (False, ())]:
        req = GenerateRequest(prompt_ids=ids, max_tokens=3, use_cache=use_cache)
        act = verifier.begin(verifier.prepare(req))
        assert act.stops == want and (want or not use_cache)
        verifier.close(act, save=False)


def test_new_entry_inherits_rungs_below_resume(pair):
    verifier = make_verifier(pair, depth=7)
    ids = list(range(10, 250))  # (long enough for 5 spread rungs MIN_SPREAD_GAP apart)
    list(verifier.generate(GenerateRequest(prompt_ids=tuple(ids[:150]), max_tokens=3)))
    old = verifier.store.entries()[0]
    list(verifier.generate(GenerateRequest(prompt_ids=tuple(ids), max_tokens=3)))
    new = max(verifier.store.entries(), key=lambda e: len(e.tokens))
    assert new is not old
    inherited = sorted(p for p in old.rungs if p <= 150)
    assert len(inherited) >= 5
    # depth 7 = prompt end + completion end + the 5 latest inherited rungs
    assert set(inherited[-5:]) <= set(new.rungs) and {240, len(new.tokens)} <= set(new.rungs)


def _entry(n_tokens, start=0, model="m|fp16"):
    kv = [(mx.zeros((1, 2, n_tokens, 8)), mx.zeros((1, 2, n_tokens, 8)))]
    rungs = {n_tokens: [(mx.zeros((1, 3, 4)), mx.ones((1, 2, 4, 4)))]}
    return CacheEntry(model, "fp16", np.arange(start, start + n_tokens, dtype=np.int32), kv, rungs)


def test_eviction_by_bytes():
    size = _entry(100).nbytes
    store = PromptStore(max_bytes=int(size * 2.5))
    ids = [store.put(_entry(100, start=1000 * i)) for i in range(3)]
    assert len(store) == 2 and store.nbytes <= store.max_bytes
    assert store.stats["evictions"] == 1
    assert ids[0] not in {e.entry_id for e in store.entries()}  # least recently used went first
    store.plan("m|fp16", list(range(1000, 1101)))  # touch entry 1: now the most recent
    store.put(_entry(100, start=5000))
    assert {e.tokens[0] for e in store.entries()} == {1000, 5000}
    assert store.put(_entry(1000)) is None  # larger than the whole store: refused, not stored


def test_persistence_round_trip(pair, tmp_path):
    target, _ = pair
    verifier = make_verifier(pair, store=PromptStore(1 << 30, tmp_path))
    ids = list(range(10, 70))
    tokens, _, _ = run_ids(verifier, ids)
    reloaded = PromptStore(1 << 30, tmp_path)
    assert len(reloaded) == 1
    (a,), (b,) = verifier.store.entries(), reloaded.entries()
    assert np.array_equal(a.tokens, b.tokens) and set(a.rungs) == set(b.rungs)
    for x, y in zip(a.kv, b.kv):
        assert all(mx.array_equal(u, v) for u, v in zip(x, y))
    warm = make_verifier(pair, store=reloaded)
    tokens2, _, usage = run_ids(warm, ids + [71, 72])
    assert usage.resumed_at == 60
    cold, _, _ = run_ids(make_verifier(pair), ids + [71, 72], use_cache=False)
    assert tokens2 == cold


def run_ids(verifier, ids, use_cache=True):
    chunks = list(
        verifier.generate(GenerateRequest(prompt_ids=tuple(ids), max_tokens=8, use_cache=use_cache))
    )
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        chunks[-1].usage,
    )


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage_meta", "missing_tensors"])
def test_corrupt_cache_file_is_skipped(tmp_path, caplog, damage):
    store = PromptStore(1 << 30, tmp_path)
    good = store.put(_entry(50, start=0))
    bad = store.put(_entry(50, start=100))
    tensors, meta = tmp_path / f"{bad}.safetensors", tmp_path / f"{bad}.msgpack"
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-40])
    elif damage == "flip":
        raw = bytearray(tensors.read_bytes())
        raw[-5] ^= 0xFF
        tensors.write_bytes(bytes(raw))
    elif damage == "garbage_meta":
        meta.write_bytes(b"\x00not msgpack at all")
    else:
        tensors.unlink()
    with caplog.at_level(logging.WARNING, logger="sanctum.cache"):
        reloaded = PromptStore(1 << 30, tmp_path)
    assert [e.entry_id for e in reloaded.entries()] == [good]
    assert reloaded.stats["skipped_files"] == 1 and "skipping" in caplog.text
    assert reloaded.plan("m|fp16", list(range(0, 51))).resumed_at == 50  # still serves
    assert reloaded.plan("m|fp16", list(range(100, 151))).resumed_at == 0  # never poisoned


def test_cache_files_are_private(tmp_path):
    """Access: the entries hold conversations in clear, so the directory is 0700 and every file
    0600; files an older version left readable are tightened when the store opens the directory."""
    import os
    import stat

    directory = tmp_path / "cache"
    store = PromptStore(1 << 30, directory)
    store.put(_entry(50))
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(directory) == 0o700
    files = list(directory.iterdir())
    assert len(files) == 2 and all(mode(f) == 0o600 for f in files)
    for f in files:
        os.chmod(f, 0o644)
    os.chmod(directory, 0o755)
    assert len(PromptStore(1 << 30, directory)) == 1
    assert mode(directory) == 0o700 and all(mode(f) == 0o600 for f in directory.iterdir())


def test_bench_multiturn_resumes_every_turn_at_its_lcp(make_pair):
    """`sanctum bench multiturn` on the tiny pair: each turn resumes where the conversation's
    cache leaves off, a warm reply equals the cold one (the bench asserts it), and each row
    carries the turn's tau, looked-up rounds and decode rate."""
    import argparse

    from sanctum.bench.multiturn import multiturn

    target_dir, drafter_dir = (str(p) for p in make_pair("hybrid", "dflash"))
    args = argparse.Namespace(model=target_dir, drafter=drafter_dir, block_size=None, bits=None,
                              kv_mode=None, turns=3, max_tokens=8, ladder=None, branch=False)  # fmt: skip
    rows = multiturn(args)
    assert [r["turn"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["resumed_at"] == r["requested_lcp"] and r["tau"] >= 1.0
        assert 0 <= r["lookup_rounds"] <= r["rounds"] and r["decode_tok_s"] > 0
    assert rows[-1]["requested_lcp"] > rows[0]["prompt_tokens"]
