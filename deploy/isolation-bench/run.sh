#!/usr/bin/env bash
# On the other host, from the repository root (after pack.sh, with build/isolation-bench carried):
#
#   deploy/isolation-bench/run.sh [CPUS ...]     # e.g. 0-1 0-3 all; REPEATS=6 by default
#
# Runs `sanctum bench isolation` once per CPU set, under `taskset -c CPUS` ("all": unpinned), on
# the tiny pair (made here by `sanctum make-tiny`) or, with PAIR=default, on the embedded default
# pair, and writes each run's JSON to
# $OUT/isolation-CPUS.json (or ./isolation-CPUS.json without $OUT).
set -uo pipefail
kit=build/isolation-bench
dest=${OUT:-.}
mkdir -p /tmp/sanctum-site /tmp/sanctum-blas
tar -xJf "$kit/site.tar.xz" -C /tmp/sanctum-site || exit 1
tar -xJf "$kit/blas.tar.xz" -C /tmp/sanctum-blas || exit 1
export PYTHONPATH="/tmp/sanctum-site:$PWD/services" SANCTUM_NO_OPENBLAS=1 RAY_USAGE_STATS_ENABLED=0
export LD_LIBRARY_PATH=/tmp/sanctum-blas LD_PRELOAD=/tmp/sanctum-blas/libblas.so.3
export OPENBLAS_THREAD_TIMEOUT=4  # as the CLI sets it when it preloads OpenBLAS itself
python3 -c "import sys, mlx.core as mx, ray; print(sys.version.split()[0], mx.default_device(), 'ray', ray.__version__)"
echo "$(nproc) CPUs: $(lscpu | sed -n 's/^Model name: *//p')"
pair=(--model /tmp/sanctum-tiny/target --drafter /tmp/sanctum-tiny/drafter)
if [ "${PAIR:-tiny}" = default ]; then pair=(); else
  python3 -m sanctum.cli make-tiny /tmp/sanctum-tiny >/dev/null || exit 1; fi
for cpus in "${@:-all}"; do
  pin=(); [ "$cpus" = all ] || pin=(taskset -c "$cpus")
  "${pin[@]}" python3 -m sanctum.cli bench isolation "${pair[@]}" --repeats "${REPEATS:-6}" --json \
      > "$dest/isolation-$cpus.json" 2> "$dest/isolation-$cpus.err"
  echo "cpus=$cpus exit=$?"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d[k] for k in ('inline_tok_s', 'cluster_tok_s', 'isolation_tax_pct', 'paired_tax_pct_median', 'paired_tax_pct_ci90', 'inline_round_phases_ms', 'cluster_round_phases_ms', 'greedy_outputs_identical')})" "$dest/isolation-$cpus.json"
done
