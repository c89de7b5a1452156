"""`sanctum bench isolation` (bench/isolation.py): its bootstrap interval, and the bench end to
end in its own process and local Ray cluster."""

from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def pair(make_pair):
    return tuple(str(p) for p in make_pair("hybrid", "dflash"))


def test_median_interval_brackets_the_median_and_narrows_with_data():
    from sanctum.bench.isolation import median_interval

    assert median_interval([0.97] * 9) == (0.97, 0.97)
    rng = np.random.default_rng(0)
    few, many = list(rng.normal(0.95, 0.05, 12)), list(rng.normal(0.95, 0.05, 400))
    for xs in (few, many):
        lo, hi = median_interval(xs)
        assert lo <= float(np.median(xs)) <= hi
    assert median_interval(few) == median_interval(few)  # fixed seed: reproducible figures
    width = [hi - lo for lo, hi in (median_interval(few), median_interval(many))]
    assert width[1] < width[0] / 2


@pytest.mark.slow
def test_isolation_bench_runs_both_modes_and_they_agree(pair):
    """`sanctum bench isolation` end to end (its own local Ray cluster): same greedy tokens in
    both modes, and every figure the note quotes is there."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, SANCTUM_NO_OPENBLAS="1")
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-m", "sanctum.cli", "bench", "isolation", "--model", pair[0],
         "--drafter", pair[1], "--repeats", "1", "--max-tokens", "12", "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout)
    assert figures["greedy_outputs_identical"] is True
    assert figures["inline_tok_s"] > 0 and figures["cluster_tok_s"] > 0
    assert figures["draft_calls"] > 0 and figures["transport_bytes_per_round"] > 0
    lo, hi = figures["paired_tax_pct_ci90"]
    assert lo <= figures["paired_tax_pct_median"] <= hi
    assert set(figures["cluster_round_phases_ms"]) == {"draft", "verify", "rollback", "other"}
    cpus = len(os.sched_getaffinity(0))  # the figures say what the split ran on
    assert figures["usable_cpus"] == cpus
    assert figures["cluster_blas_threads"]["drafter"] == (
        os.environ.get("SANCTUM_DRAFTER_THREADS") or str(1 if cpus <= 2 else cpus)
    )
