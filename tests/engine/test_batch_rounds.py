"""Batched rounds (shared rounds): several sequences' blocks verified in one target forward give
every sequence exactly the tokens it gets served alone, whatever the mix of prompt lengths,
KV formats, acceptance, early ends (EOS, max_tokens) and seeded sampling."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from batching import (
    ADAPTIVE,
    PROMPTS,
    ScriptedBatchDecoder,
    assert_as_alone,
    run_batch,
    solo,
    step_until_done,
)
from helpers import NO_GATE, assert_greedy_equal
from sanctum.engine.decode import rounds
from sanctum.engine.decode.batch import verify_batch
from sanctum.engine.decode.generate import make_key
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.decode.rounds import BatchDecoder
from sanctum.engine.decode.sampling import SamplingParams
from sanctum.engine.kernels.cuda import is_cuda
from test_engine import load_pair


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
        assert_as_alone(target, drafter, p, n, got[f"s{i}"], kv, f"sequence {i}")


@pytest.mark.parametrize(
    "kind,tape",
    [
        ("hybrid", "chunk"),
        ("next", "chunk"),
        ("hybrid", "gather"),
        ("hybrid", "views"),
        ("hybrid", "rerun"),
    ],  # fmt: skip
)
def test_batch_with_every_acceptance_and_eos_inside_an_accepted_run(
    make_pair, monkeypatch, kind, tape
):
    """Every keep from 0 to the whole block, an EOS inside an accepted run, max_tokens
    mid-block: each sequence's tokens are its plain run's; through the GDN kernel's pure-MLX
    stand-in, "gather": the kept rows' states gathered for all sequences at once, "views": its
    rows of states rolled back as slices, kept across later rounds;
    "rerun": no rows kept, the kernel run again over each sequence's kept rows, all at once."""
    if tape != "chunk":
        from sanctum.engine.kernels import gdn_cuda
        from sanctum.engine.model import gdn

        monkeypatch.setattr(gdn, "BLOCK_KERNEL_KEEPS_ROWS", True)
        monkeypatch.setattr(gdn, "SHARED_ROLLBACK", tape)
        rollback, calls, reruns = gdn.GDNBatchTape.rollback, [], []
        monkeypatch.setattr(
            gdn.GDNBatchTape,
            "rollback",
            lambda tape, keeps: calls.append(len(keeps)) or rollback(tape, keeps),
        )

        def kernel(*args, keep_rows=False, rows=None):
            shared = args[0].shape[0] > 1
            assert not (keep_rows and shared and tape == "rerun"), "a shared pass kept its rows"
            reruns.append(rows)
            return gdn_cuda.reference(*args, keep_rows=keep_rows, rows=rows)

        monkeypatch.setattr(gdn, "BLOCK_KERNEL", kernel)
        if tape == "views":

            def no_gather(*_):
                raise AssertionError("the kept states were gathered, not sliced")

            monkeypatch.setattr(gdn.GDNBatchTape, "_states_at", no_gather)
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
    if tape != "chunk":  # the shared path rolled several sequences back at once
        assert max(calls) > 1
    if tape == "rerun":  # ... by one re-run a layer over several sequences' kept rows
        assert max(len(r) for r in reruns if r is not None) > 1


def test_seeded_sampling_in_a_batch_equals_the_seed_alone(make_pair):
    if is_cuda():  # a shared verify's logits differ from a solo one's in the last bits there,
        pytest.skip("which can move a sample across a boundary: equality is the CPU's")
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
        assert_as_alone(target, drafter, p, 20, got[f"s{i}"], what=f"sequence {i}")


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
    for i, p in enumerate(PROMPTS[:3]):
        ids = target.tokenizer.encode(p)
        assert_greedy_equal(target, ids, refs[f"s{i}"], got[f"s{i}"], f"sequence {i}")
    if is_cuda():  # the scripts accept by the plain run's tokens: past a near tie, the widths
        return  # follow the tokens taken there
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


def test_padded_drafts_of_a_batch_run_in_one_call_and_equal_alone(make_pair, tmp_path, monkeypatch):
    """Before the windows fill (PAD_TO_BUCKETS), contexts of different buckets (here of 8 rows)
    pad to the largest and the compiled stack runs once for the whole batch: every block's
    hidden states equal drafting it alone op by op, unpadded, in the batch's order."""
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
    assert calls == [4]  # one call for all four, whatever their buckets
    for n in range(4):
        assert mx.allclose(together[n], alone[n], atol=1e-5).item(), f"sequence {n}"


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


def test_warm_runs_each_batch_size_and_lookup_width_once_and_leaves_the_decoder_as_it_was(
    make_pair,
):
    """A server's warm-up at load: shared rounds at every size it will serve, and rounds of
    every width a looked-up block grows to at every size (one sequence's too), on throwaway
    sequences that are all closed after (nothing left open on the drafter); the decoder then
    serves a batch exactly as alone. With lookup off, no widths and no size of one."""
    target, drafter = load_pair(make_pair, "hybrid", "dflash")
    peer = LocalDraftPeer(drafter)
    decoder = BatchDecoder(target, drafter, peer)
    L = decoder.block_size
    assert decoder.lookup_widths() == [w for w in (2 * L, 4 * L, 8 * L) if w <= 32]
    traced = []
    real_batch, real_verify = rounds.verify_batch, target.verify
    rounds.verify_batch = lambda t, blocks, *a, **k: (
        traced.append(blocks.shape) or real_batch(t, blocks, *a, **k)
    )
    target.verify = lambda blocks, *a, **k: (
        traced.append((1, *blocks.shape)) or real_verify(blocks, *a, **k)
    )
    try:
        spent = decoder.warm([1, 3, 2])
        off = decoder.with_policy(lookup_min=0)
        spent_off = off.warm([1, 2])
    finally:
        rounds.verify_batch = real_batch
        del target.verify
    assert sorted(spent) == [1, 2, 3] and all(s > 0 for s in spent.values())
    assert sorted(spent_off) == [2]
    for n in (1, 2, 3):  # each size verified blocks of each looked-up width
        for w in decoder.lookup_widths():
            assert (n, w) in {tuple(s[:2]) for s in traced}, (n, w, traced)
    assert {s[0] for s in traced if s[1] == L} >= {2, 3}  # drafted blocks of each shared size
    assert peer.caches == {}
    specs = [(f"s{i}", p, 12, "fp16", (), None) for i, p in enumerate(PROMPTS[:3])]
    got, _ = run_batch(decoder, target, specs)
    for i, p in enumerate(PROMPTS[:3]):
        assert_as_alone(target, drafter, p, 12, got[f"s{i}"], what=f"sequence {i}")


@pytest.mark.parametrize("kind", ["hybrid", "next"])
def test_prompt_tails_ride_shared_rounds_and_decode_as_alone(make_pair, kind):
    """Newcomers join running sequences with their prompts' last tokens left to their first
    rounds (`Decoder.ride`): the tails run in the rounds' one target forward (no forward of
    their own), a block's rows a round (a longer tail over several rounds, committing nothing
    until it ends), their first tokens come from their last rows, and every sequence, the
    newcomers' seeded sample and 8-bit KV included, decodes exactly as alone."""
    target, drafter = load_pair(make_pair, kind, "dflash2")
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    L = decoder.block_size
    sampled = SamplingParams(temperature=0.8, seed=5)
    running = [("r0", PROMPTS[0], 40, "fp16"), ("r1", PROMPTS[3], 40, "q8")]
    joining = [  # (seq_id, prompt, tokens, kv, sampling, tail length)
        ("j0", PROMPTS[2], 20, "fp16", None, 5),
        ("j1", PROMPTS[1], 20, "q8", sampled, 100),  # the whole prompt
        ("j2", PROMPTS[2] + "        pass", 20, "fp16", None, 3 * L - 2),  # three rounds
    ]
    out, keys, seqs = {}, {}, []
    for seq_id, prompt, n, kv in running:
        seq = decoder.new_sequence(seq_id, kv, SamplingParams(), n)
        keys[seq_id], sub = mx.random.split(make_key(None))
        out[seq_id] = list(
            decoder.start(seq, decoder.prefill(seq, encode(target, prompt)), sub).tokens
        )
        seqs.append(seq)
    for seq_id, prompt, n, kv, sampling, tail in joining:
        ids = encode(target, prompt)
        seq = decoder.new_sequence(seq_id, kv, sampling or SamplingParams(), n)
        cut = max(0, len(ids) - tail)
        if cut:
            decoder.prefill(seq, ids[:cut], final=False)
        decoder.ride(seq, ids[cut:])
        keys[seq_id] = make_key(sampling.seed if sampling else None)
        out[seq_id] = []
        seqs.append(seq)
    forwards, firsts = [], {}  # each shared forward's [N, L]; the round of each first token
    real = rounds.verify_batch
    rounds.verify_batch = lambda t, blocks, *a, **k: (
        forwards.append(blocks.shape) or real(t, blocks, *a, **k)
    )
    real_prefill, decoder.prefill = decoder.prefill, None  # none may run
    try:
        step_until_done(
            decoder,
            seqs,
            keys,
            out,
            on_step=lambda seq, step: (
                firsts.setdefault(seq.seq_id, len(forwards))
                if step.tokens and seq.seq_id[0] == "j"
                else None
            ),
        )
    finally:
        rounds.verify_batch, decoder.prefill = real, real_prefill
    assert forwards[0] == (5, L)  # every tail in the first round's forward, none wider
    assert firsts == {"j0": 1, "j1": 1, "j2": 3}
    for seq_id, prompt, n, kv in running:
        assert_as_alone(target, drafter, prompt, n, out[seq_id], kv, seq_id)
    for seq_id, prompt, n, kv, sampling, _ in joining:
        assert out[seq_id] == solo(target, drafter, prompt, n, kv, sampling=sampling), seq_id


def test_prompt_tails_ride_together_where_nothing_drafts(make_pair):
    """A round where no sequence drafts (only newcomers' tails; or beside them a sequence the
    speculation gate has stepping plainly) still runs the tails in one target forward, a
    drafter block's rows wide (the shapes of any round), not a prefill each one after another;
    a gated greedy sequence drafts in it (its plain step would pay the padded rows for one
    token). Every sequence decodes exactly as alone."""
    target, drafter = load_pair(make_pair, "hybrid", "dflash2")
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter))
    L = decoder.block_size
    sampled = SamplingParams(temperature=0.8, seed=3)
    joining = [  # (seq_id, prompt, tokens, sampling, tail length)
        ("j0", PROMPTS[2], 16, None, 5),
        ("j1", PROMPTS[1], 16, sampled, 100),  # the whole prompt
        ("j2", PROMPTS[2] + "        pass", 16, None, 2 * L - 1),  # two rounds
    ]
    for gated_runner in (False, True):
        out, keys, seqs = {}, {}, []
        if gated_runner:  # greedy, with a stretch of plain steps to take
            seq = decoder.new_sequence("r0", "fp16", SamplingParams(), 24)
            keys["r0"], sub = mx.random.split(make_key(None))
            ids = encode(target, PROMPTS[0])
            out["r0"] = list(decoder.start(seq, decoder.prefill(seq, ids), sub).tokens)
            seq.plain_left = 4
            seqs.append(seq)
        for seq_id, prompt, n, sampling, tail in joining:
            ids = encode(target, prompt)
            seq = decoder.new_sequence(seq_id, "fp16", sampling or SamplingParams(), n)
            cut = max(0, len(ids) - tail)
            if cut:
                decoder.prefill(seq, ids[:cut], final=False)
            decoder.ride(seq, ids[cut:])
            keys[seq_id] = make_key(sampling.seed if sampling else None)
            out[seq_id] = []
            seqs.append(seq)
        forwards = []
        real = rounds.verify_batch
        rounds.verify_batch = lambda t, blocks, *a, forwards=forwards, real=real, **k: (
            forwards.append(blocks.shape) or real(t, blocks, *a, **k)
        )
        real_prefill, decoder.prefill = decoder.prefill, None  # none may run
        try:
            step_until_done(decoder, seqs, keys, out)
        finally:
            rounds.verify_batch, decoder.prefill = real, real_prefill
        assert forwards[0] == (len(seqs), L), (gated_runner, forwards)
        if gated_runner:
            assert seqs[0].plain_left == 0  # its stretch ended in that round: it drafted
            assert_as_alone(target, drafter, PROMPTS[0], 24, out["r0"], what="gated runner")
        for seq_id, prompt, n, sampling, _ in joining:
            assert out[seq_id] == solo(target, drafter, prompt, n, sampling=sampling), seq_id


def encode(target, prompt: str) -> list[int]:
    return target.tokenizer.encode(prompt)
