"""The shared-round benches' own parts: op counting (bench/opcount.py), the round trace
(bench/roundtrace.py), equality up to the first near tie (bench/neartie.py) and `bench batch
--steady` when sequences end inside the measured rounds."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from sanctum.bench.neartie import NEAR_TIE, near_tie_verdict, top_two_margins, worst
from sanctum.bench.opcount import count_ops, graph_ops


def test_count_ops_counts_evaluations_reads_and_the_nodes_handed_over():
    """Explicit evaluations with their graphs' nodes, host reads, and among those the reads
    that evaluated a graph; each node counted once; MLX and numpy restored after."""
    real = (mx.eval, mx.async_eval, mx.array.item, np.array)
    a = mx.array([1.0, 2.0])
    mx.eval(a)
    with count_ops() as tally:
        b = (a * 2 + 1).sum()
        want = sum(graph_ops(b).values())
        mx.eval(b)
        b.item()  # evaluated: a read, not an evaluation
        c = a - 3
        mx.async_eval(c)
        c.tolist()  # queued: waits, computes nothing more
        d = a * a
        extra = sum(graph_ops(d).values())
        np.array(d)  # an implicit evaluation
        (a + 5).sum().item()  # another
    assert want > 0 and extra > 0
    assert tally.evals == 2 and tally.reads == 4 and tally.implicit_evals == 2
    same = [(a - 3), (a + 5).sum()]  # the other two graphs again, to count them
    assert tally.nodes == want + extra + sum(sum(graph_ops(x).values()) for x in same)
    assert sum(tally.nodes_by_phase.values()) == tally.nodes  # not from the engine: "other"
    assert (mx.eval, mx.async_eval, mx.array.item, np.array) == real


def test_near_tie_verdict():
    plain = [5, 6, 7, 8]
    margins = [3.0, 2.0, NEAR_TIE, 4.0]  # a near tie at position 2
    assert near_tie_verdict(plain, margins, [5, 6, 7, 8]) == (4, 2, "equal")
    assert near_tie_verdict(plain, margins, [5, 6, 9, 1]) == (2, 2, "equal-up-to-near-tie")
    assert near_tie_verdict(plain, margins, [5, 6, 7, 1]) == (3, 2, "equal-up-to-near-tie")
    assert near_tie_verdict(plain, margins, [5, 1, 7, 8]) == (1, 2, "differs")
    assert near_tie_verdict(plain, [9.0] * 4, [5, 6, 7, 1]) == (3, None, "differs")
    assert near_tie_verdict(plain, margins, [5, 6, 7]) == (3, 2, "equal-up-to-near-tie")
    assert near_tie_verdict(plain, [9.0] * 4, [5, 6, 7]) == (3, None, "differs")
    assert worst(["equal", "differs", "equal-up-to-near-tie"]) == "differs"
    assert worst([]) == "equal"


def test_top_two_margins_come_from_one_forward(make_pair):
    from sanctum.engine.model.target import load_target

    target = load_target(make_pair("hybrid", "dflash")[0])
    prompt, completion = [3, 4, 5, 6], [7, 8, 9]
    margins = top_two_margins(target, prompt, completion)
    logits, _ = target.forward(mx.array(prompt + completion[:2]), target.make_cache())
    top = mx.sort(logits[len(prompt) - 1 :].astype(mx.float32), axis=-1)[:, -2:]
    assert margins == pytest.approx((top[:, 1] - top[:, 0]).tolist(), abs=1e-5)
    assert top_two_margins(target, prompt, []) == []


def _steady(make_pair, capsys, *flags) -> dict:
    from sanctum.cli import main

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    argv = ["bench", "batch", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--steady", "2", "--warm-rounds", "1", "--concurrency", "2", "--json", *flags]  # fmt: skip
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_batch_steady_counts_ops_and_judges_equality(make_pair, capsys):
    """--count-ops: evaluations and nodes a round at each level, filed by phase and call
    site; on the CPU every output equals plain greedy decoding exactly."""
    out = _steady(make_pair, capsys, "--count-ops", "2")
    assert out["equality"] == "equal" and out["all_outputs_equal_plain"]
    for row in out["levels"]:
        ops = row["ops"]
        assert ops["evals_per_round"] >= 1 and ops["nodes_per_round"] > 0
        assert sum(ops["nodes_by_phase"].values()) == pytest.approx(ops["nodes_per_round"], 0.01)
        assert "rollback" in ops["nodes_by_phase"]
        assert all(v["verdict"] == "equal" for v in row["equality_per_sequence"])
        assert row["sequences_finished"] == 0
    assert out["levels"][0]["ops"]["nodes_vs_one"] == 1.0


def test_bench_batch_steady_with_a_long_context_before_each_prompt(make_pair, capsys, monkeypatch):
    """--context T: each level's prompts come after T held-out tokens and an end-of-text token
    (a different stretch each), and its outputs are judged against plain decoding of those."""
    from sanctum.bench import batch

    opened = []
    real = batch.open_level

    def recorded(*args, **kwargs):
        prompts, seqs, out = real(*args, **kwargs)
        opened.append(prompts)
        return prompts, seqs, out

    monkeypatch.setattr(batch, "open_level", recorded)
    out = _steady(make_pair, capsys, "--context", "96")
    assert out["equality"] == "equal" and len(opened) == 2  # levels 1 and 2
    for prompts in opened:
        assert all(len(p) > 96 for p in prompts)
        assert len({tuple(p[:96]) for p in prompts}) == len(prompts)  # a different stretch each


def test_bench_batch_steady_forces_acceptance(make_pair, capsys):
    """--force-tau 0,3: every level at the real acceptance, then every round, solo and shared,
    committing 3 tokens of each sequence (the test pair's random drafts accept far fewer),
    its outputs said to be unchecked; the real levels are still judged against plain."""
    out = _steady(make_pair, capsys, "--force-tau", "0,3")
    assert out["force_tau"] == [None, 3] and out["all_outputs_equal_plain"]
    real, forced = out["levels"][:2], out["levels"][2:]
    assert [r["force_tau"] for r in real] == [None, None] and real[0]["tau"] < 3
    assert [r["force_tau"] for r in forced] == [3, 3]
    for row in forced:
        assert row["tau"] == 3.0
        assert row["tokens_per_round"] == 3 * row["concurrency"]
        assert row["equality"].startswith("not checked") and row["equality_per_sequence"] == []
    assert forced[0]["tok_s_vs_one"] == 1.0  # each tau's levels against its own one


def test_bench_batch_serves_each_level_in_repeated_passes(make_pair, capsys):
    """--repeats 2: every level served twice (the second pass in reverse), the medians
    reported with each pass's figures and its ratio to its own one stream, and the server's
    median and longest round; every output equal to alone in every pass."""
    from sanctum.cli import main

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    argv = ["bench", "batch", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--concurrency", "1,2", "--max-tokens", "8", "--repeats", "2", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["repeats"] == 2 and out["all_outputs_equal_alone"]
    # greedy on the CPU: every level's outputs equal to plain decoding, not just to alone
    assert out["equality"] == "equal" and out["near_tie_logits"] == NEAR_TIE
    assert all(r["outputs_equal_plain"] and r["equality"] == "equal" for r in out["levels"])
    levels = out["levels"]
    assert [(r["concurrency"], r["max_batch"]) for r in levels] == [(1, 2), (2, 2), (2, 1)]
    for row in levels:
        runs = row["aggregate_tok_s_runs"]
        assert len(runs) == 2 and min(runs) <= row["aggregate_tok_s"] <= max(runs)
        assert len(row["aggregate_vs_one_runs"]) == 2
        each = row["each_request_s_tau"]  # every request's seconds and tau
        assert len(each) == 2 and all(sec > 0 and tau >= 1 for sec, tau in each)
        # the server's rounds, timed in its work log: the longest names its requests
        assert 0 < row["round_ms_median"] <= row["round_ms_max"]
        requests, tokens = row["longest_round"]
        assert 1 <= requests <= row["max_batch"] and tokens >= 0
    assert levels[0]["aggregate_vs_one_runs"] == [1.0, 1.0]
    assert main([*argv[:-3], "--repeats", "0", "--json"]) != 0  # refused


def test_bench_batch_steady_budget_outlives_its_rounds_and_reports_early_ends(
    make_pair, capsys, monkeypatch
):
    """A steady sequence's budget covers every round at the widest block a round can commit
    (a looked-up one); sequences that end anyway sit out, are counted, and no figure divides
    by the zero tokens they make."""
    from sanctum.bench import batch
    from sanctum.engine.decode.policy import LOOKUP_MAX_WIDTH

    assert batch.steady_budget(48, 8) >= 1 + 48 * max(8, LOOKUP_MAX_WIDTH)
    monkeypatch.setattr(batch, "steady_budget", lambda rounds, block: 2)
    out = _steady(make_pair, capsys)
    for row in out["levels"]:
        assert row["sequences_finished"] == row["concurrency"]
        assert row["tokens_per_round"] == 0 and row["tok_s"] == 0
    assert out["levels"][0]["tok_s_vs_one"] is None


def test_round_trace_times_and_counts_each_piece(make_pair, capsys):
    """bench round-trace: every piece of a shared round at each level, with nodes; the
    engine's functions are its own again afterwards."""
    from sanctum.cli import main
    from sanctum.engine.decode import batch

    real = (batch.attention_over, batch._gdn_batch, batch._add_contexts)
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    argv = ["bench", "round-trace", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--concurrency", "3", "--passes", "1", "--warm-rounds", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["concurrency"] for r in out["levels"]] == [1, 3]
    pieces = {"attention", "gdn", "residual_mlp", "lm_head", "verify_rest", "rollback"}
    pieces |= {"drafter_context", "drafter_body", "drafter_head"}
    for row in out["levels"]:
        assert set(row["pieces"]) == pieces
        assert all(p["nodes"] > 0 and p["calls"] >= 1 for p in row["pieces"].values())
    growth = out["growth_vs_one"]
    assert growth["attention"]["nodes"][1] > 1  # its cache part runs once per sequence
    assert (batch.attention_over, batch._gdn_batch, batch._add_contexts) == real
    # ops of the verify between its pieces (norms, embeddings) are its own device time
    assert all(r["pieces"]["verify_rest"]["between_ms"] > 0 for r in out["levels"])


def test_round_trace_splits_the_gdn_layers_and_leaves_them_compiled_after(make_pair, capsys):
    """bench round-trace --gdn-parts: the GDN layers' projections, conv and recurrence (the
    CPU's chunked form) each a piece of their own, inside the layer's; the layers are compiled
    again afterwards."""
    from sanctum.cli import main
    from sanctum.engine.model import gdn

    before = (gdn.COMPILE_MAX_ROWS, gdn._project, gdn.block_conv, gdn.chunked_gated_delta)
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    argv = ["bench", "round-trace", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--concurrency", "2", "--passes", "1", "--warm-rounds", "1", "--gdn-parts", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["gdn_parts"] is True
    for row in out["levels"]:
        pieces = row["pieces"]
        layers = pieces["gdn"]["calls"]
        for part in ("gdn_projections", "gdn_conv", "gdn_chunked"):
            assert pieces[part]["calls"] == layers and pieces[part]["nodes"] > 0, part
        assert pieces["gdn"]["between_ms"] > 0  # its ops before the recurrence (q, k norms...)
    assert (gdn.COMPILE_MAX_ROWS, gdn._project, gdn.block_conv, gdn.chunked_gated_delta) == before


def test_bench_seed_build_only_prints_the_pair(tmp_path, capsys):
    """bench seed --build-only: the seed-shaped checkpoints built once, their dirs printed
    for the other benches' --model / --drafter (deploy/gpu/concurrency.sh)."""
    from sanctum.cli import main

    argv = ["bench", "seed", "--build-only", "--scale", "small", "--layers", "2",
            "--dir", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (tmp_path / out["target"]).joinpath("complete").is_file()
    assert (tmp_path / out["drafter"]).joinpath("complete").is_file()


def test_served_verdicts_say_where_an_output_parts_from_plain_decoding(make_pair):
    """`served_verdicts` judges each level's outputs against plain greedy decoding of the
    served prompt: an output equal to it is "equal"; one changed at position 3 parts there,
    and is "differs" unless the plain run met a near tie by then."""
    from sanctum.bench.batch import served_verdicts
    from sanctum.bench.decode import _run_once
    from sanctum.engine.model.target import load_target
    from sanctum.serving.requests import GenerateRequest
    from sanctum.settings import engine_settings

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    engine = engine_settings(model=str(target_dir), drafter=str(drafter_dir))
    target = load_target(engine.model)
    prompts = ["def add(a, b):", "for i in range(3):"]
    requests = [GenerateRequest(prompt=p, max_tokens=6, request_id=f"r{i}") for i, p in enumerate(prompts)]  # fmt: skip
    plain = [
        _run_once(target, None, target.tokenizer.encode(p, add_special_tokens=False), 6, engine)[0][:6]
        for p in prompts
    ]  # fmt: skip
    changed = [plain[0][:3] + [(plain[0][3] + 1) % target.vocab_size] + plain[0][4:], plain[1][:4]]
    same, parted = served_verdicts(
        engine, requests, [dict(enumerate(plain)), dict(enumerate(changed))]
    )
    assert [v["verdict"] for v in same] == ["equal", "equal"]
    assert [v["equal_prefix"] for v in same] == [6, 6]
    first, shorter = parted
    assert first["equal_prefix"] == 3
    tie = first["first_near_tie"]
    assert first["verdict"] == (
        "equal-up-to-near-tie" if tie is not None and tie <= 3 else "differs"
    )
    assert shorter == {"equal_prefix": 4, "first_near_tie": None, "verdict": "equal"}  # a prefix
