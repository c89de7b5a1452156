"""`sanctum bench gaps` end to end on the tiny pair, with small counts: both scenarios' figures,
positive gaps, every output equal to the same request served alone."""

from __future__ import annotations

import json


def test_bench_gaps_reports_both_scenarios(make_pair, capsys):
    from sanctum.cli import main

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    argv = ["bench", "gaps", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--streams", "3", "--max-tokens", "64", "--join-tokens", "12", "--before", "2",
            "--join-every", "2", "--running", "2", "--long-tokens", "300",
            "--long-max-tokens", "4", "--lines", "--json"]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    out = lines[-1]
    assert (
        [r["scenario"] for r in lines[:-1]]
        == ["joining", "long_prompt"]
        == [r["scenario"] for r in out["scenarios"]]
    )
    assert out["outputs_equal_alone"] and out["max_batch"] == 3
    joining, long = out["scenarios"]
    assert joining["outputs_equal_alone"] and long["outputs_equal_alone"]
    assert joining["first_stream_tokens"] == 64 and joining["joined_while_first_ran"] == 2
    assert joining["median_gap_ms_before"] > 0 and joining["worst_gap_ms_joining"] > 0
    assert joining["worst_gap_ms"] >= joining["worst_gap_ms_joining"]
    assert joining["worst_gap_at_stream"] in (2, 3)
    assert len(joining["gaps_ms_joining"]) == 2
    assert long["long_prompt_tokens"] == 300 and long["long_ttft_ms"] > 0
    assert long["median_gap_ms_before"] > 0 and long["worst_gap_ms_during_prefill"] > 0
    # what filled the worst gaps: the worker's pieces, each inside the gap it is listed for
    for work, worst in ((joining["worst_joining_work"], joining["worst_gap_ms_joining"]),
                        (long["worst_gap_work"], long["worst_gap_ms_during_prefill"])):  # fmt: skip
        assert work and {kind for kind, _, _ in work} <= {"open", "prefill", "round"}
        assert sum(ms for _, _, ms in work) <= worst + 0.2
        for kind, detail, _ in work:  # a round: [requests in it, tokens it committed]
            assert kind != "round" or (detail[0] >= 1 and detail[1] >= 0)
    sizes = joining["rounds_ms_by_size"]
    assert {"1", "2"} <= set(sizes)  # (JSON keys)
    assert long["long_prefill_slices_ms"]["slices"] >= 1
    # the long prompt's own share of a gap: one slice between two rounds (the worst gap's
    # pieces), though a gap as its client reads it may also hold the edge of the slice after
    # (the chunk read a little after the round that made it)
    between = [[]]
    for kind, detail, _ in long["worst_gap_work"]:
        between.append([]) if kind == "round" else between[-1].append((kind, detail))
    assert all(sum(kind == "prefill" for kind, _ in piece) <= 1 for piece in between)
    assert 0 <= long["most_prefill_in_a_gap_ms"] <= 2 * long["long_prefill_slices_ms"]["max"] + 0.2
    assert long["median_round_ms_before"] > 0
    assert long["most_prefill_in_a_gap_vs_median_round"] >= 0
    assert out["warmed_s"] == 0  # the suite's servers skip the warm-up (conftest)
