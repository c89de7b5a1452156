#!/usr/bin/env bash
# The seed benchmark's GPU run in one command. From the repository root, on a machine where MLX
# (CUDA backend) and mlx-lm import (PYTHONPATH set) and Ray is absent:
#
#   deploy/gpu/run-seed-bench.sh
#
# Steps, most important first; each one's JSON (and stderr) under $OUT (default
# /tmp/sanctum-seed-bench), the summary table last (summary.md); step times: docs/performance.md.
#   seed         sanctum bench seed --json: the first run builds the seed checkpoints under
#                SEED_DIR (default ~/.cache/sanctum/seed), later runs reuse them
#   default-*    sanctum bench speculative, embedded pair, blocks 8 and 16, fp16 and q8
#   cuda         sanctum bench cuda: fused GDN kernel vs mlx-lm's ops, Q8 attention, e2e
#   kernels      deploy/gpu/kernel_trace.py: kernels and GPU busy time per piece of a round
#                (16 target layers; counts where torch's profiler imports)
#   kernels-mlx-draft  the same with the drafter's CUDA kernels off (SANCTUM_DRAFT_KERNELS)
#   pytest-cuda  tests/engine/test_cuda.py, when pytest imports
#   mlx-*        a 16-layer target, plain vs mlx-lm and verify/decode, under MLX's own
#                command-buffer settings (default, bigger buffers, no CUDA graphs)
# A step starts only while DEADLINE (default 540) seconds have not passed, so the whole run
# ends inside a 10-minute limit with what it finished; on a fresh machine (checkpoints to build,
# CUDA kernels to compile) all steps need DEADLINE=1500 or so (run it detached and collect $OUT
# after). MLX compiles its CUDA kernels at first use; the compiled kernels are kept beside the
# checkpoints (MLX_PTX_CACHE_DIR, default ~/.cache/sanctum/cuda-ptx; MLX's own default is under
# /tmp), so a later run skips that.
# Knobs, for a smoke run on a CPU: SEED_ARGS (e.g. "--layers 2 --max-tokens 8"), SPEC_ARGS
# (e.g. "--max-tokens 16 --repeats 1"), VARIANT_ARGS, TRACE_ARGS (e.g. "--small --layers 2"),
# SEED_DIR, PYTHON, DEADLINE.
set -uo pipefail
out=${OUT:-/tmp/sanctum-seed-bench}
py=${PYTHON:-python3}
seed_dir=${SEED_DIR:-$HOME/.cache/sanctum/seed}
deadline=${DEADLINE:-540}
mkdir -p "$out"
: > "$out/steps.txt"
export PYTHONPATH="$PWD/services${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/.cache/sanctum/cuda-ptx}
failed=0

step() {  # step NAME EXT NEEDS COMMAND...: stdout to $out/NAME.EXT, stderr to $out/NAME.err
  local name=$1 ext=$2 needs=$3 t0=$SECONDS rc left
  shift 3
  left=$((deadline - SECONDS))
  if [ "$left" -lt "$needs" ]; then
    echo "$name skipped: ${left}s left of the deadline" | tee -a "$out/steps.txt"
    return
  fi
  timeout "$left" "$@" > "$out/$name.$ext" 2> "$out/$name.err"
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/steps.txt"
  if [ "$rc" -ne 0 ]; then failed=1; tail -n 8 "$out/$name.err"; fi
}

$py -c 'import sys, mlx.core as mx, mlx_lm; print("python", sys.version.split()[0], "mlx", mx.__version__, mx.default_device(), "mlx-lm", mlx_lm.__version__)' | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$out/env.txt"
df -h "$(dirname "$seed_dir")" 2>/dev/null | tail -n 1 | tee -a "$out/env.txt"

bench=($py -m sanctum.cli bench)
# shellcheck disable=SC2086  # the *_ARGS knobs are word lists
step seed json 60 "${bench[@]}" seed --json --dir "$seed_dir" ${SEED_ARGS:-}
for kv in fp16 q8; do
  for block in 8 16; do
    # shellcheck disable=SC2086
    step "default-b$block-$kv" json 30 "${bench[@]}" speculative --block-size "$block" --kv "$kv" \
      --json ${SPEC_ARGS:-}
  done
done
step cuda json 40 "${bench[@]}" cuda --json
# shellcheck disable=SC2086
step kernels json 240 $py deploy/gpu/kernel_trace.py --dir "$seed_dir" ${TRACE_ARGS:---layers 16}
# shellcheck disable=SC2086  # the same trace with the drafter's CUDA kernels off: their before/after
SANCTUM_DRAFT_KERNELS=off \
  step kernels-mlx-draft json 150 $py deploy/gpu/kernel_trace.py --dir "$seed_dir" ${TRACE_ARGS:---layers 16}
if $py -c 'import pytest' 2>/dev/null; then
  step pytest-cuda txt 200 $py -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py
fi
variant=(seed --json --dir "$seed_dir" --plain-only --no-phases --no-ablations --kv fp16)
# shellcheck disable=SC2086
step mlx-default json 60 "${bench[@]}" "${variant[@]}" ${VARIANT_ARGS:---layers 16 --repeats 2 --max-tokens 32}
# shellcheck disable=SC2086
MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=1000 \
  step mlx-big-buffers json 60 "${bench[@]}" "${variant[@]}" ${VARIANT_ARGS:---layers 16 --repeats 2 --max-tokens 32}
# shellcheck disable=SC2086
MLX_USE_CUDA_GRAPHS=0 \
  step mlx-no-cuda-graphs json 60 "${bench[@]}" "${variant[@]}" ${VARIANT_ARGS:---layers 16 --repeats 2 --max-tokens 32}
$py deploy/gpu/summarize.py "$out" | tee "$out/summary.md"
exit "$failed"
