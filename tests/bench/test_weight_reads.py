"""bench weight-reads (bench/weightreads.py): the tiled kernel's weight-read pattern against a
tile-major layout, compiled for an H100 here, run and checked on a GPU."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from sanctum.engine.kernels import build


def test_weight_read_kernels_compile_for_an_h100(capsys):
    """Each pattern's kernel compiles for sm_90 at the seed's shapes, without spills."""
    from sanctum.bench.weightreads import PATTERNS
    from sanctum.cli import main

    if build.Compiler.from_wheels("sm_90") is None:
        pytest.skip("no NVRTC wheel (nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12)")
    assert main(["bench", "weight-reads", "--arch", "sm_90", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k.split()[0] for k in out} == set(PATTERNS)
    assert all(r["spill_stores"] == 0 and 0 < r["registers"] <= 64 for r in out.values())


@pytest.mark.skipif(mx.default_device() != mx.gpu, reason="needs a GPU")
def test_weight_reads_read_every_word_once(capsys):
    """On a GPU: every pattern's XOR of what it read is the matrices' own, and each is timed."""
    from sanctum.cli import main

    assert main(["bench", "weight-reads", "--pairs", "1", "--reps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows_checked"] and out["rows-run4_checked"] and out["tile-major_checked"]
    assert out["rows_tb_s"] > 0 and out["mlx-sum_tb_s"] > 0
