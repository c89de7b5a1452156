#!/usr/bin/env bash
# Issue 16's GPU run in one command. From the repository root, on a machine where MLX (CUDA
# backend) and mlx-lm import (PYTHONPATH set) and Ray is absent:
#
#   deploy/gpu/run-seed-bench.sh
#
# Steps, each one's JSON (and stderr) under $OUT (default /tmp/sanctum-seed-bench), a summary
# table last (summary.md); rough H200 times:
#   cuda         sanctum bench cuda: fused GDN kernel vs mlx-lm's ops, Q8 attention, end to end  ~0.5 min
#   pytest-cuda  tests/test_cuda.py (when pytest imports)                                        ~0.5 min
#   seed         sanctum bench seed --json: first run builds ~19 GB of checkpoints under
#                SEED_DIR (default ~/.cache/sanctum/seed; later runs reuse them)          ~2-4 min (1-2 reused)
#   default-*    sanctum bench speculative on the embedded pair, blocks 8 and 16, fp16 and q8    ~1.5 min
# Knobs, for a smoke run on a CPU: SEED_ARGS (e.g. "--layers 2 --max-tokens 8"), SPEC_ARGS
# (e.g. "--max-tokens 16 --repeats 1"), SEED_DIR, PYTHON, SEED_TIMEOUT / STEP_TIMEOUT (seconds).
set -uo pipefail
out=${OUT:-/tmp/sanctum-seed-bench}
py=${PYTHON:-python3}
seed_dir=${SEED_DIR:-$HOME/.cache/sanctum/seed}
mkdir -p "$out"
: > "$out/steps.txt"
export PYTHONPATH="$PWD/services${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
failed=0

step() {  # step NAME EXT LIMIT COMMAND...: stdout to $out/NAME.EXT, stderr to $out/NAME.err
  local name=$1 ext=$2 limit=$3 t0=$SECONDS rc
  shift 3
  timeout "$limit" "$@" > "$out/$name.$ext" 2> "$out/$name.err"
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/steps.txt"
  if [ "$rc" -ne 0 ]; then failed=1; tail -n 8 "$out/$name.err"; fi
}

$py -c 'import sys, mlx.core as mx, mlx_lm; print("python", sys.version.split()[0], "mlx", mx.__version__, mx.default_device(), "mlx-lm", mlx_lm.__version__)' | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$out/env.txt"
if $py -c 'import ray' 2>/dev/null; then echo "note: ray imports here; the bench does not use it"; fi

step cuda json "${STEP_TIMEOUT:-240}" $py -m sanctum.cli bench cuda --json
if $py -c 'import pytest' 2>/dev/null; then
  step pytest-cuda txt "${STEP_TIMEOUT:-240}" $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
fi
# shellcheck disable=SC2086  # SEED_ARGS / SPEC_ARGS are word lists
step seed json "${SEED_TIMEOUT:-480}" $py -m sanctum.cli bench seed --json --dir "$seed_dir" ${SEED_ARGS:-}
for kv in fp16 q8; do
  for block in 8 16; do
    # shellcheck disable=SC2086
    step "default-b$block-$kv" json "${STEP_TIMEOUT:-240}" $py -m sanctum.cli bench speculative \
      --block-size "$block" --kv "$kv" --json ${SPEC_ARGS:-}
  done
done
$py deploy/gpu/summarize.py "$out" | tee "$out/summary.md"
exit "$failed"
