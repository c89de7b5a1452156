"""The prompt cache's shared storage: a token prefix's KV and taps are stored once however many
entries extend it, rungs are shared by reference, eviction frees only what no entry references, a
restart keeps the sharing, and no resume ever reads freed or foreign bytes (a fuzz of interleaved
conversations with evictions, every resume's logits against a cold prefill)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from sanctum.cache.ladder import restore_into
from sanctum.cache.pages import PAGE_TOKENS
from sanctum.cache.store import CacheEntry, PromptStore
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import load_target
from sanctum.serving.requests import GenerateRequest
from sanctum.serving.verifier import Verifier

MODEL = "m|fp16"


def synthetic(tokens, rungs=(), prompt_len=0) -> CacheEntry:
    """An entry whose KV, taps and rungs are functions of its token prefix only (as a model's
    are), so that two entries with the same prefix agree there and any foreign byte shows."""
    t = np.asarray(tokens, dtype=np.int32)
    prefix = np.cumsum(t).astype(np.float32)  # a token's value depends on all before it
    col = mx.array(prefix)[None, None, :, None]  # [1, 1, T, 1]
    kv = [
        (
            mx.broadcast_to(col, (1, 2, len(t), 8)) * 1.0,
            mx.broadcast_to(-col, (1, 2, len(t), 8)) * 1.0,
        )
    ]
    taps = mx.broadcast_to(mx.array(prefix)[:, None], (len(t), 6)) * 1.0
    states = {
        p: [(mx.full((1, 3, 4), float(t[:p].sum())), mx.full((1, 2, 4, 4), float(p)))]
        for p in rungs
    }
    return CacheEntry(MODEL, "fp16", t, kv, states, taps, prompt_len=prompt_len)


def check_consistent(store: PromptStore) -> None:
    """Every referenced page and rung is live, every live one referenced, and the byte count is
    the sum of what is live."""
    refs: dict = {}
    for rec in store._records.values():
        for k in [*rec.pages, *rec.rungs.values()]:
            refs[k] = refs.get(k, 0) + 1
    live = {
        **{k: p.refs for k, p in store._pages.items()},
        **{k: r.refs for k, r in store._rungs.items()},
    }
    assert refs == live
    total = sum(p.nbytes for p in store._pages.values()) + sum(
        r.nbytes for r in store._rungs.values()
    )
    total += sum(r.tokens.nbytes for r in store._records.values())
    assert store.nbytes == total <= store.max_bytes


def test_shared_prefix_is_stored_once_and_survives_eviction():
    system = list(range(1, 41))  # 40 shared tokens: two full pages and a half
    a = synthetic(system + list(range(100, 130)), rungs=(40, 70), prompt_len=60)
    b = synthetic(system + list(range(200, 230)), rungs=(40, 70), prompt_len=60)
    store = PromptStore(1 << 30)
    store.put(a)
    store.put(b)  # branches after 40 < a's prompt: a stays
    assert len(store) == 2
    acc = store.accounting()
    assert acc["logical_bytes"] == a.nbytes + b.nbytes
    shared_pages = 40 // PAGE_TOKENS  # full pages of the common prefix
    one_page = 2 * 2 * PAGE_TOKENS * 8 * 4 + PAGE_TOKENS * 6 * 4  # keys, values, taps: float32
    rung = 3 * 4 * 4 + 2 * 4 * 4 * 4
    assert acc["shared_bytes"] == shared_pages * one_page + rung  # and the rung at 40
    assert store.nbytes == a.nbytes + b.nbytes - acc["shared_bytes"]
    check_consistent(store)
    # an unrelated entry pushes the least recently used (a) out; b's shared pages stay
    store.plan(MODEL, b.tokens.tolist() + [7])
    c = synthetic(list(range(500, 520)), rungs=(20,))
    store.max_bytes = store.nbytes + c.nbytes - 1
    store.put(c)
    assert {len(e.tokens) for e in store.entries()} == {70, 20}
    check_consistent(store)
    plan = store.plan(MODEL, b.tokens.tolist() + [7])
    assert plan.resumed_at == 70
    (entry,) = [e for e in store.entries() if len(e.tokens) == 70]
    for x, y in zip(entry.kv[0], b.kv[0], strict=True):
        assert mx.array_equal(x, y).item()
    assert mx.array_equal(entry.taps, b.taps).item()
    assert mx.array_equal(plan.rungs[40][0][0], b.rungs[40][0][0]).item()


def test_same_tokens_after_a_different_prefix_are_not_shared():
    """Pages are keyed by the whole prefix: two entries that differ in their first token only
    hold the same tokens at the same positions after it, yet nothing of theirs is shared."""
    tail = list(range(1, 50))
    x, y = synthetic([500, *tail], rungs=(30, 50)), synthetic([600, *tail], rungs=(30, 50))
    store = PromptStore(1 << 30)
    store.put(x)
    store.put(y)
    assert store.accounting()["shared_bytes"] == 0 and len(store) == 2
    plan = store.plan(MODEL, [600, *tail, 7])
    assert plan.resumed_at == 50
    assert mx.array_equal(plan.kv[0][0], y.kv[0][0]).item()
    assert mx.array_equal(plan.taps, y.taps).item()
    assert mx.array_equal(plan.rungs[30][0][0], y.rungs[30][0][0]).item()


def test_sharing_survives_restart_and_eviction(tmp_path):
    system = list(range(1, 41))
    a = synthetic(system + list(range(100, 130)), rungs=(40, 70), prompt_len=60)
    b = synthetic(system + list(range(200, 230)), rungs=(40, 70), prompt_len=60)
    store = PromptStore(1 << 30, tmp_path)
    a_id, b_id = store.put(a), store.put(b)
    before = store.accounting(), store.nbytes
    reloaded = PromptStore(1 << 30, tmp_path)
    assert (reloaded.accounting(), reloaded.nbytes) == before  # not multiplied by the restart
    check_consistent(reloaded)
    # a goes; its file still holds the prefix pages b references, so it stays until b goes
    reloaded.clear()
    assert not list(tmp_path.iterdir())  # everything freed, files included
    store = PromptStore(1 << 30, tmp_path)
    a_id, b_id = store.put(a), store.put(b)
    store._remove(a_id)
    assert (tmp_path / f"{a_id}.safetensors").exists() and not (
        tmp_path / f"{a_id}.msgpack"
    ).exists()
    again = PromptStore(1 << 30, tmp_path)
    (entry,) = again.entries()
    assert entry.entry_id == b_id and again.nbytes == store.nbytes
    for x, y in zip(entry.kv[0], b.kv[0], strict=True):
        assert mx.array_equal(x, y).item()
    assert again.plan(MODEL, b.tokens.tolist() + [7]).resumed_at == 70
    check_consistent(again)


def test_next_turn_supersedes_and_adopts_rungs_within_budget():
    turn1 = list(range(1, 61))
    e1 = synthetic(turn1, rungs=(20, 40, 50, 60), prompt_len=50)
    # turn 2 resumed at 55 (inside turn 1's completion, where its re-encoding left it)
    turn2 = turn1[:55] + list(range(300, 345))
    e2 = synthetic(turn2, rungs=(55, 80, 90, 100), prompt_len=90)
    rung = sum(a.nbytes for pair in e1.rungs[20] for a in pair)
    store = PromptStore(1 << 30)
    store.put(e1)
    store.put(e2)
    (kept,) = store.entries()
    assert len(kept.tokens) == 100 and store.stats["superseded"] == 1
    # its own four rungs, and two of turn 1's (within the default budget), spread: 20 and 40
    assert sorted(kept.rungs) == [20, 40, 55, 80, 90, 100]
    assert store.accounting()["rung_bytes"] == 6 * rung
    check_consistent(store)
    # the branch: an edit at 45 resumes from the deepest rung at or before it
    assert store.plan(MODEL, turn1[:45] + [999]).resumed_at == 40
    # no warm turn went cold: the next turn resumes at turn 2's end, a retry of turn 2 below
    # its prompt boundary, a retry of turn 1 at its deepest adopted rung
    assert store.plan(MODEL, turn2 + [5, 6]).resumed_at == 100
    assert store.plan(MODEL, turn2[:90]).resumed_at == 80
    assert store.plan(MODEL, turn1[:50]).resumed_at == 40
    # an explicit budget of five rungs keeps one of turn 1's
    small = PromptStore(1 << 30, ladder_bytes=5 * rung)
    small.put(e1)
    small.put(e2)
    (kept,) = small.entries()
    assert len(kept.rungs) == 5 and {55, 80, 90, 100} <= set(kept.rungs)
    # a branch (diverging inside turn 1's prompt) supersedes nothing
    store = PromptStore(1 << 30)
    store.put(e1)
    store.put(synthetic(turn1[:30] + list(range(400, 440)), rungs=(20, 70), prompt_len=60))
    assert len(store) == 2


def test_store_actor_service_keeps_prompt_len_and_sharing(tmp_path):
    """The store actor's service (cluster/store.py): the entry header carries the prompt length,
    so a later turn put through the wire supersedes the earlier one as inline."""
    from sanctum.cluster.store import StoreService
    from sanctum.wire.gen import roles_pb2 as roles
    from sanctum.wire.tensors import flatten, to_numpy

    service = StoreService(PromptStore(1 << 30, tmp_path))
    turn1 = list(range(1, 61))
    for e in (
        synthetic(turn1, rungs=(20, 50, 60), prompt_len=50),
        synthetic(turn1[:55] + list(range(300, 345)), rungs=(55, 90, 100), prompt_len=90),
    ):
        layout, arrays = flatten(e.kv, e.rungs, e.taps)
        header = roles.EntryHeader(
            model_key=MODEL, kv_mode="fp16", tokens=e.tokens.tolist(), layout=layout,
            prompt_len=e.prompt_len,
        )  # fmt: skip
        service.put(header.SerializeToString(), [np.array(to_numpy(a)) for a in arrays])
    (info,) = service.list()
    assert (info.num_tokens, info.prompt_len) == (100, 90)
    assert set(info.rungs) >= {20, 50, 55, 90, 100}
    stats = service.stats()
    assert stats.entries == 1 and stats.superseded == 1
    assert stats.bytes == stats.kv_bytes + stats.taps_bytes + stats.rung_bytes + 100 * 4
    assert len(PromptStore(1 << 30, tmp_path)) == 1


@pytest.fixture(scope="module")
def pair(make_pair):
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


@pytest.mark.parametrize("kv,tol", [("fp16", 1e-4), ("q8", 1e-3)])
def test_fuzz_interleaved_conversations_resume_like_cold(pair, kv, tol, tmp_path):
    """Four conversations (two sharing a system prompt), their turns interleaved at random,
    some turns editing an earlier one, sync and streaming, in a persisted store small enough to
    evict and restarted halfway: every resume's logits equal a cold prefill's, and every output
    the uncached one."""
    target, drafter = pair
    rng = random.Random(17)
    vocab = min(target.vocab_size, 200)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    system = words(24)
    convs = [system + words(10), system + words(12), words(30), words(20)]
    store = PromptStore(1 << 30, tmp_path)
    verifier = Verifier(target, drafter, LocalDraftPeer(drafter), store, 4, kv)
    key = verifier.model_key(kv)
    resumed = branched = 0
    counted = {"evictions": 0, "superseded": 0}
    for step in range(20):
        c = rng.randrange(len(convs))
        prompt = convs[c]
        if step >= 6 and rng.random() < 0.4:  # a branch: edit an earlier turn
            cut = rng.randrange(1, len(prompt))
            if rng.random() < 0.5:  # a new ending
                prompt = prompt[:cut] + words(6)
            else:  # one token changed, everything after it as it was
                prompt = prompt[:cut] + words(1) + prompt[cut + 1 :]
            branched += 1
        # the cold logits first, then the plan the verifier would follow, restored and finished
        cold, _ = target.prefill(prompt, target.make_cache(kv))
        plan = store.plan(key, prompt)
        if plan.resumed_at:
            resumed += 1
            cache = target.make_cache(kv)
            restore_into(target, cache, plan)
            warm, _ = target.prefill(prompt[plan.resumed_at :], cache)
            np.testing.assert_allclose(np.array(warm), np.array(cold), atol=tol, rtol=tol)
        req = GenerateRequest(prompt_ids=tuple(prompt), max_tokens=6)
        chunks = list(verifier.generate(req, "streaming" if step % 2 else "sync"))
        cold_req = GenerateRequest(prompt_ids=tuple(prompt), max_tokens=6, use_cache=False)
        out = [t for ch in chunks for t in ch.token_ids]
        assert out == [t for ch in verifier.generate(cold_req) for t in ch.token_ids]
        convs[c] = prompt + out + words(8)  # the next turn
        check_consistent(store)
        if step == 5:  # from here on the store holds about two conversations: evictions
            store.max_bytes = store.nbytes * 3 // 4
        if step == 12:  # a restart: the same entries, pages and bytes, shared as they were
            counted = {k: counted[k] + store.stats[k] for k in counted}
            reloaded = PromptStore(store.max_bytes, tmp_path)
            assert reloaded.listing() == store.listing() and reloaded.nbytes == store.nbytes
            check_consistent(reloaded)
            store = verifier.store = reloaded
    counted = {k: counted[k] + store.stats[k] for k in counted}
    assert branched >= 2 and resumed >= 6
    assert counted["evictions"] >= 1 and counted["superseded"] >= 3


def test_seed_shape_accounting_before_and_after():
    """bench cache-size at the seed's shapes (a shorter conversation): a store without sharing
    holds every turn whole, the shared one about the last entry alone; the bytes are the store's
    own."""
    from sanctum.bench.cachesize import conversation, seed_shapes

    shapes = seed_shapes()
    assert (shapes["attention_layers"], shapes["gdn_layers"], shapes["taps"]) == (16, 48, 25600)
    entries = conversation("fp16", turns=4, tokens=512, depth=4)
    per_token = 16 * 4 * 256 * 2 * 2 + 5 * 5120 * 2 + 4  # KV, taps, the token id: 64 + 50 KiB
    rung = 48 * (3 * 10240 * 2 + 48 * 128 * 128 * 4)
    last = entries[-1]
    assert last.nbytes == 512 * per_token + len(last.rungs) * rung
    store = PromptStore(1 << 40)
    for e in entries:
        store.put(e)
    assert len(store) == 1 and sum(e.nbytes for e in entries) > 2.5 * store.nbytes
    assert store.nbytes == 512 * per_token + (len(last.rungs) + 2) * rung  # two adopted rungs


def test_older_unshared_files_are_dropped(tmp_path):
    """A directory the previous version wrote (format 1: each entry's tensors whole) is not
    misread: its entries go, files and all, and the store starts empty and serves."""
    import msgpack

    mx.save_safetensors(str(tmp_path / "old.safetensors"), {"kv.0.0": mx.zeros((1, 2, 4, 8))})
    (tmp_path / "old.msgpack").write_bytes(msgpack.packb({"format": 1, "model_key": MODEL}))
    store = PromptStore(1 << 30, tmp_path)
    assert len(store) == 0 and not list(tmp_path.iterdir())
    store.put(synthetic(list(range(1, 30)), rungs=(29,)))
    assert PromptStore(1 << 30, tmp_path).plan(MODEL, list(range(1, 31))).resumed_at == 29


def test_choose_rungs_within_a_byte_budget():
    """The ladder places the prompt boundary first, then the re-encoding rung, the end, message
    starts; a byte budget cuts from the back (never below the prompt boundary)."""
    from sanctum.cache.ladder import choose_rungs

    st = [(mx.zeros((1, 3, 4)), mx.zeros((1, 2, 4, 4)))]  # 176 bytes
    pool = {p: st for p in (40, 80, 100, 110, 120)}
    args = (4, 100, 120, [80], pool, {40: st}, 110)
    assert set(choose_rungs(*args)) == {100, 110, 120, 80}
    assert set(choose_rungs(*args, max_bytes=2 * 176)) == {100, 110}
    assert set(choose_rungs(*args, max_bytes=1)) == {100}


def test_putting_an_entry_again_replaces_it():
    store = PromptStore(1 << 30)
    e = synthetic(list(range(1, 40)), rungs=(20, 39))
    store.put(e)
    size = store.nbytes
    store.put(e)  # the same id
    assert len(store) == 1 and store.nbytes == size
    check_consistent(store)
