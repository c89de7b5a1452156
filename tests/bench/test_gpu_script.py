"""deploy/gpu/concurrency.sh, the one command a lent GPU runs, smoke-run on this CPU (QUICK=1:
the small seed shape at 2 layers): its steps run in the order STEPS names them, a seed step
after the seed's build, the kernel's registers read without a GPU, and an unknown name is
said, not fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_steps_run_in_the_order_named(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "QUICK": "1",
        "SEED_DIR": str(tmp_path / "seed"),
        "SANCTUM_HOME": str(tmp_path / "home"),
        "STEPS": "seed-steady registers qmm-tiled no-such-step",
    }
    out = tmp_path / "out"
    subprocess.run(
        ["bash", "deploy/gpu/concurrency.sh", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=600,
        capture_output=True,
    )
    done = [line.split()[0] for line in (out / "steps.txt").read_text().splitlines()]
    assert done == ["build", "seed-steady", "registers", "qmm-tiled"]
    lines = [json.loads(line) for line in (out / "concurrency.jsonl").read_text().splitlines()]
    steady = [x["concurrency"] for x in lines if x["step"] == "seed-steady" and "concurrency" in x]
    assert steady == [1, 4, 8]
    assert {"step": "qmm-tiled", "skipped": "not on CUDA"} in lines
    from sanctum.engine.kernels import build

    if build.Compiler.from_wheels("sm_90") is not None:  # off a GPU, the wheel's NVRTC
        variants = [x for x in lines if x["step"] == "registers"]
        assert len(variants) == 20 and all(x["arch"] == "sm_90" for x in variants)
    assert {"step": "no-such-step", "skipped": "no such step"} in lines
