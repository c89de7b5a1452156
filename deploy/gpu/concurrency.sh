#!/usr/bin/env bash
# Shared rounds at 1, 4 and 8 sequences in one command. From the repository root, on a machine
# with MLX's CUDA backend and mlx-lm (PYTHONPATH set by this script):
#
#   deploy/gpu/concurrency.sh [OUT_DIR]
#
# Every figure is one JSON line appended to $OUT/concurrency.jsonl as soon as it is measured,
# tagged with its step ("step"), so a run cut short keeps what it measured; each step's stderr
# goes to $OUT/stderr.txt under a "== STEP" line, and $OUT/steps.txt says how each step ended.
# Steps, most important first, each under its own `timeout` (a hang costs that step only):
#   kernel-builds  the CUDA tests of sanctum's kept kernel builds (engine/kernels/build.py)
#                against MLX's own builds of the same sources, and of every kernel against the
#                MLX path; where they fail, the later steps run with SANCTUM_CUDA_BUILDS=mlx
#   registers    the tiled 4-bit kernel's registers, spills and blocks an SM, by the NVRTC MLX
#                loaded (bench registers: compiled, not run)
#   weight-reads  4-bit weights streamed in the tiled kernel's pattern (16 rows, 64 bytes each a
#                tile), four tiles at once, and as if laid out tile-major, against MLX's
#                reduction over the same bytes (bench weight-reads: TB/s)
#   build        the seed-shaped pair (bench seed --build-only; reused under SEED_DIR)
#   qmm-wide     the wide 4-bit kernel's check and a chain of the seed's MLP products at 1..64
#                rows: one wide call, 16 rows a call, MLX's
#   qmm-tiled    the tiled 4-bit kernel's check and speed gate (and its check with the weights 2
#                and 3 tiles ahead, and with 2 thread blocks an SM), and the same chain at 64,
#                24 and 8 rows aiming at 264 or 528 thread blocks, each variant that agreed,
#                against the wide kernel and 16 rows a call
#   qmm-profile  Nsight Compute's view of the tiled kernel at 64 rows (speed of light, memory,
#                warp stalls, occupancy) where the machine has ncu; its report goes to stderr.txt
#   seed-steady  bench batch --steady at 1,4,8 on it: round ms, tok/s vs one, the phases, the
#                op counts (COUNT), every output judged against plain greedy (near-tie verdicts);
#                the tiled kernel's weights as far ahead as ran fastest in qmm-tiled
#   seed-rerun   seed-steady's real levels again with SANCTUM_SHARED_ROLLBACK=rerun (a shared
#                verify keeps no rows' states; its rollback runs the GDN kernel again)
#   seed-gather  seed-steady's real levels again with SANCTUM_SHARED_ROLLBACK=gather (a shared
#                rollback gathers the kept rows' states, against seed-steady's views)
#   seed-long    seed-steady's real levels with each prompt after 4,096 held-out tokens (--context:
#                what the shared rounds' stacked KV costs at long contexts)
#   seed-tau5    seed-steady's levels with acceptance forced to tau 5 (random weights accept
#                none)
#   default-served  bench batch --concurrency 1,4,8 --warm --repeats 3 on the default pair, served
#                inline (a level lasts under a second there: the medians of three passes)
#   cuda-tests   the CUDA tests and the greedy-equality tests judged up to a near tie there
#                (pytest, which the machine must have: prepare-mlx-cuda.sh can carry it)
#   default-gaps  bench gaps --warm on the default pair: a running stream's worst gap as streams
#                2..8 join, and the running streams' worst gap while a ~4K prompt is prefilled
#   seed-wide    seed-steady's real levels again with SANCTUM_QMM_WIDE=wide (the wide kernel,
#                not the tiled one that auto picks where it passed)
#   seed-split   seed-steady's real levels again with SANCTUM_QMM_WIDE=off (16 rows a call)
#   seed-trace   bench round-trace at 1,4,8 on it: each piece of a round timed and op-counted
#   seed-trace-gdn  the same with --gdn-parts: the GDN layers' projections, conv and block kernel
#                each a piece (the layers uncompiled)
#   default-steady  the same as seed-steady on the default pair
# MLX builds its own CUDA kernels at first use, kept under MLX_PTX_CACHE_DIR for later runs;
# sanctum's kernels are kept under $SANCTUM_HOME/cuda-builds (engine/kernels/build.py). After
# each step both are packed into $OUT/cuda-ptx.tar.xz.NN and $OUT/cuda-builds.tar.xz.NN, and
# KERNEL_CACHE=DIR unpacks those from an earlier machine's run before the first step (a fresh
# machine then starts with built kernels). A step starts only while DEADLINE (default 530) seconds
# have not passed. QUICK=1 shrinks everything (the small seed shape at 2 layers, few rounds):
# a smoke run on a CPU. Knobs: SEED_LAYERS (default 64: the seed's depth), SEED_DIR, PYTHON,
# DEADLINE, ROUNDS (timed steady rounds), WARM (untimed rounds), COUNT (rounds with their ops
# counted; 0 on a GPU by default: the counts do not depend on the device), STEPS (the steps to
# run, by name, space-separated, in that order; default all: a second call can run what the
# first did not reach).
set -uo pipefail
out=${1:-${OUT:-/tmp/sanctum-concurrency}}
py=${PYTHON:-python3}
seed_dir=${SEED_DIR:-$HOME/.cache/sanctum/seed}
deadline=${DEADLINE:-530}
mkdir -p "$out"
lines="$out/concurrency.jsonl"
: > "$out/steps.txt"
export PYTHONPATH="$PWD/services${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/.cache/sanctum/cuda-ptx}
if [ "${QUICK:-0}" = 1 ]; then
  seed_args=(--scale small --layers "${SEED_LAYERS:-2}")
  rounds=${ROUNDS:-2} warm=${WARM:-1} phases=1 count=${COUNT:-1} passes=1 tokens=16
  gaps=(--max-tokens 64 --join-tokens 16 --long-tokens 1024)
else
  seed_args=(--scale seed --layers "${SEED_LAYERS:-64}")
  rounds=${ROUNDS:-8} warm=${WARM:-8} phases=4 count=${COUNT:-0} passes=2 tokens=64
  gaps=()
fi
bench=("$py" -m sanctum.cli bench)
# each JSON line of stdin, tagged with its step, appended to $lines
tag=("$py" -c 'import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        print(json.dumps({"step": sys.argv[1], **json.loads(line)}), flush=True)')

step() {  # step NAME SECONDS COMMAND...: at most SECONDS (and the deadline)
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  left=$((deadline - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "{\"step\": \"$name\", \"skipped\": \"${left}s left of the deadline\"}" >> "$lines"
    echo "$name skipped" | tee -a "$out/steps.txt"
    return
  fi
  echo "== $name" >> "$out/stderr.txt"
  timeout "$limit" "$@" 2>> "$out/stderr.txt" | "${tag[@]}" "$name" >> "$lines"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/steps.txt"
  if [ "$rc" -ne 0 ]; then
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$lines"
    tail -n 5 "$out/stderr.txt"
  fi
  pack_kernels
  return "$rc"
}

# The kernel caches into $OUT when they grew: what comes back from a lent machine is at most 8
# files of at most 16 MiB, so a pack is cut into 15 MiB pieces (NAME.tar.xz.00, .01, ...), at
# most 3 (a bigger one is dropped, and said so)
packed=""
builds_dir=${SANCTUM_HOME:-$HOME/.cache/sanctum}/cuda-builds  # sanctum's kernels (kernels/build.py)
pack_kernels() {
  local dir name now pieces
  for dir in "$MLX_PTX_CACHE_DIR" "$builds_dir"; do
    [ -d "$dir" ] || continue
    name=cuda-ptx; [ "$dir" = "$builds_dir" ] && name=cuda-builds
    now="$name:$(find "$dir" -type f | wc -l)"
    case " $packed $name:0 " in *" $now "*) continue ;; esac  # as packed last time, or empty
    rm -f "$out/$name.tar.xz."*
    tar -C "$dir" -cf - . | xz -T0 -1 | split -b 15M -d - "$out/$name.tar.xz."
    pieces=$(ls "$out/$name.tar.xz."* | wc -l)
    if [ "$pieces" -gt 3 ]; then
      rm -f "$out/$name.tar.xz."*
      echo "$name not packed: $pieces pieces of 15 MiB" >> "$out/steps.txt"
    fi
    packed="$packed $now"
  done
}
if [ -n "${KERNEL_CACHE:-}" ]; then
  mkdir -p "$MLX_PTX_CACHE_DIR" "$builds_dir"
  for name in cuda-ptx cuda-builds; do
    dir=$MLX_PTX_CACHE_DIR; [ "$name" = cuda-builds ] && dir=$builds_dir
    ls "$KERNEL_CACHE/$name.tar.xz."* > /dev/null 2>&1 || continue
    cat "$KERNEL_CACHE/$name.tar.xz."* | xz -dc | tar -C "$dir" -xf -
  done
  echo "kernel caches from $KERNEL_CACHE: $(find "$MLX_PTX_CACHE_DIR" -type f | wc -l) PTX files" | tee -a "$out/steps.txt"
fi

"$py" -c 'import json, sys, mlx.core as mx, mlx_lm
print(json.dumps({"python": sys.version.split()[0], "mlx": mx.__version__,
                  "device": str(mx.default_device()), "mlx_lm": mlx_lm.__version__}))' \
  | "${tag[@]}" env >> "$lines"

# Each step is a function s_NAME (dashes as underscores); they run in the order STEPS names them
# (default: the order below), a seed step after the seed's build.
s_build() {
  step build 300 "${bench[@]}" seed --build-only --json --dir "$seed_dir" "${seed_args[@]}"
}
s_qmm_wide() {
  step qmm-wide 200 "$py" -c 'import json
from sanctum.engine.kernels import cuda, qmm_checks as c, qmm_cuda as q
if not cuda.is_cuda():
    raise SystemExit(print(json.dumps({"skipped": "not on CUDA"})))
verdict = c.wide_verdict() or "ok"
print(json.dumps({"wide_verdict": verdict}), flush=True)
split = lambda x, *w: q.rows_qmm(x, *w, wide=False)
for rows in (1, 8, 16, 24, 40, 64):
    row = {"rows": rows, "mlx_ms": round(c.chain_ms(q.reference, rows=rows), 3)}
    if rows > 1:
        row["split_ms"] = round(c.chain_ms(split, rows=rows), 3)
    if rows > q.MAX_ROWS and verdict == "ok":
        row["wide_ms"] = round(c.chain_ms(c.wide_rows_qmm, rows=rows), 3)
    print(json.dumps(row), flush=True)'
}
s_qmm_tiled() {
  step qmm-tiled 200 "$py" -c 'import json
from sanctum.engine.kernels import cuda, qmm_checks as c, qmm_cuda as q
if not cuda.is_cuda():
    raise SystemExit(print(json.dumps({"skipped": "not on CUDA"})))
verdict = c.tiled_verdict() or "ok"  # its check at 3 splittings, then faster than both rivals
print(json.dumps({"tiled_verdict": verdict}), flush=True)
variants = [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)]  # (tiles ahead, blocks an SM)
agreed = [(1, 1)] if verdict == "ok" or verdict.startswith("not faster") else []
for ahead, resident in variants[1:]:
    fn = c.tiled_blocks_qmm(None, ahead, resident)
    result = c.check(fn, c.TILED_SHAPES, rows=(2, 17, 64)) or "ok"
    print(json.dumps({"ahead": ahead, "resident": resident, "verdict": result}), flush=True)
    if result == "ok":
        agreed.append((ahead, resident))
if agreed:
    for rows in (64, 24, 8):
        row = {"rows": rows, "split_ms": round(c.chain_ms(lambda x, *w: q.rows_qmm(x, *w, wide=False), rows=rows), 3)}
        if rows > q.MAX_ROWS:
            row["wide_ms"] = round(c.chain_ms(c.wide_rows_qmm, rows=rows), 3)
        for blocks in (264, 528):  # every variant at 264 blocks and 24 or 64 rows
            for ahead, resident in agreed if blocks == 264 and rows > 8 else agreed[:1]:
                fn = c.tiled_blocks_qmm(blocks, ahead, resident)
                row[f"tiled_b{blocks}_a{ahead}_r{resident}_ms"] = round(c.chain_ms(fn, rows=rows), 3)
        print(json.dumps(row), flush=True)'
  # the seed steps after it take the tiled kernel's weights as far ahead, and as many blocks
  # an SM, as ran fastest at 64 rows here (every variant timed passed its check)
  local pick ahead resident
  pick=$("$py" -c 'import json, re, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if "\"qmm-tiled\"" in l]
row = next((l for l in lines if l.get("rows") == 64), {})
times = {m.groups(): t for k, t in row.items() if (m := re.fullmatch(r"tiled_b264_a(\d)_r(\d)_ms", k))}
print(*min(times, key=times.get) if times else "")' "$lines")
  if [ -n "$pick" ]; then
    read -r ahead resident <<< "$pick"
    export SANCTUM_QMM_TILED_AHEAD=$ahead SANCTUM_QMM_TILED_RESIDENT=$resident
    echo "SANCTUM_QMM_TILED_AHEAD=$ahead SANCTUM_QMM_TILED_RESIDENT=$resident (fastest at 64 rows)" \
      | tee -a "$out/steps.txt"
  fi
}
steady=(--steady "$rounds" --warm-rounds "$warm" --phases "$phases" --concurrency 1,4,8 --lines --json)
[ "$count" -gt 0 ] && steady+=(--count-ops "$count")
seed_pair() {  # target and drafter of the seed step's build; false where it made none
  local pair
  pair=$("$py" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "\"build\"" in l and "target" in l]
print(rows[-1]["target"], rows[-1]["drafter"]) if rows else None' "$lines")
  [ -n "$pair" ] || return 1
  read -r target drafter <<< "$pair"
  seed_steady=("${bench[@]}" batch --model "$target" --drafter "$drafter" "${steady[@]}")
}
s_seed_steady() { seed_pair && step seed-steady 240 "${seed_steady[@]}"; }
s_seed_rerun() { seed_pair && step seed-rerun 200 env SANCTUM_SHARED_ROLLBACK=rerun "${seed_steady[@]}"; }
s_seed_gather() { seed_pair && step seed-gather 200 env SANCTUM_SHARED_ROLLBACK=gather "${seed_steady[@]}"; }
s_seed_long() { seed_pair && step seed-long 240 "${seed_steady[@]}" --context "${SEED_CONTEXT:-4096}"; }
s_seed_tau5() { seed_pair && step seed-tau5 200 "${seed_steady[@]}" --force-tau 5; }
s_default_served() {
  step default-served 240 "${bench[@]}" batch --concurrency 1,4,8 --max-tokens "$tokens" --warm \
    --repeats 3 --json
}
s_cuda_tests() {  # (pytest's report is not JSON: it goes to stderr.txt)
  local cuda_tests=(tests/engine/test_cuda.py tests/engine/test_lookup.py tests/engine/test_batch_rounds.py)
  # each failure reported as it happens: a step cut short by its limit still names them
  step cuda-tests 240 env SANCTUM_TEST_FAILURES_AT_ONCE=1 sh -c 'exec "$@" 1>&2' _ "$py" -m pytest -q -p no:cacheprovider -rf \
    -k "not cluster and not scheduler" "${cuda_tests[@]}"
}
s_qmm_profile() {  # where the tiled kernel's time goes, by Nsight Compute where the machine has it
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null) || {
    echo '{"step": "qmm-profile", "skipped": "no ncu"}' >> "$lines"
    return
  }
  step qmm-profile 150 sh -c 'exec "$@" 1>&2' _ "$ncu" --kernel-name regex:sanctum_tiled \
    --launch-skip 4 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy "$py" -c 'from sanctum.engine.kernels import qmm_checks as c
c.chain_ms(c.tiled_blocks_qmm(None), rows=64, pairs=2, reps=2)'
}
s_kernel_builds() {  # sanctum's kept kernel builds against MLX's, before anything uses them
  step kernel-builds 150 sh -c 'exec "$@" 1>&2' _ "$py" -m pytest -q -p no:cacheprovider -rf \
    tests/engine/test_cuda.py -k "kept_builds or kernel_matches" && return
  # where they fail, the steps after it measure with MLX's builds (slower to start, as before)
  export SANCTUM_CUDA_BUILDS=mlx
  echo "SANCTUM_CUDA_BUILDS=mlx (kernel-builds failed)" | tee -a "$out/steps.txt"
}
s_registers() {  # the tiled kernel's registers and blocks an SM, by the NVRTC MLX loaded
  step registers 60 "${bench[@]}" registers --lines
}
s_default_gaps() { step default-gaps 90 "${bench[@]}" gaps --warm --lines "${gaps[@]}"; }
s_seed_wide() { seed_pair && step seed-wide 200 env SANCTUM_QMM_WIDE=wide "${seed_steady[@]}"; }
s_seed_split() { seed_pair && step seed-split 240 env SANCTUM_QMM_WIDE=off "${seed_steady[@]}"; }
s_seed_trace() {
  seed_pair && step seed-trace 150 "${bench[@]}" round-trace --model "$target" \
    --drafter "$drafter" --passes "$passes" --warm-rounds "$warm" --lines
}
s_weight_reads() { step weight-reads 60 "${bench[@]}" weight-reads --json; }
s_seed_trace_gdn() {
  seed_pair && step seed-trace-gdn 150 "${bench[@]}" round-trace --model "$target" \
    --drafter "$drafter" --passes "$passes" --warm-rounds "$warm" --gdn-parts --lines
}
s_default_steady() { step default-steady 120 "${bench[@]}" batch "${steady[@]}"; }

ALL="kernel-builds registers weight-reads build qmm-wide qmm-tiled qmm-profile seed-steady seed-rerun seed-gather seed-long seed-tau5 default-served cuda-tests
default-gaps seed-wide seed-split seed-trace seed-trace-gdn default-steady"
STEPS=$(echo ${STEPS:-$ALL})
case " $STEPS " in *" seed-"*) case " $STEPS " in *" build "*) ;; *) STEPS="build $STEPS" ;; esac ;; esac
for name in $STEPS; do
  if declare -F "s_${name//-/_}" > /dev/null; then
    "s_${name//-/_}"
  else
    echo "{\"step\": \"$name\", \"skipped\": \"no such step\"}" >> "$lines"
  fi
done
echo "figures: $lines"
