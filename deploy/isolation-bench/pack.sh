#!/usr/bin/env bash
# Pack what `sanctum bench isolation` needs on a Linux x86-64 host that has Python, numpy,
# safetensors, tokenizers/transformers and grpcio but no Ray, no MLX and no package registry
# (e.g. a GPU host, used for its CPU cores). Run from the repository root, online:
#
#   deploy/isolation-bench/pack.sh [PYTHON_VERSION]      # default 3.12
#
# Writes build/isolation-bench/site.tar.xz (Ray without its Java jars and the libraries sanctum
# does not use, MLX for the CPU, mlx-lm, protobuf, Ray's small pure-Python dependencies) and
# blas.tar.xz (this machine's OpenBLAS and its Fortran runtime, as the Makefile preloads it).
# Both stay small enough to copy to a host without network access; run.sh unpacks them there.
set -euo pipefail
py=${1:-3.12}
out=build/isolation-bench
versions=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in
               ("ray", "mlx", "mlx-cpu", "mlx-lm", "protobuf", "click", "jsonschema",
                "jsonschema-specifications", "referencing", "rpds-py", "attrs")))
PY
)
rm -rf "$out" && mkdir -p "$out/wheels" "$out/site" "$out/blas"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_35_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$out/wheels" $versions
for w in "$out"/wheels/*.whl; do .venv/bin/python -m zipfile -e "$w" "$out/site"; done
# wheels unpacked by zipfile lose their modes; Ray starts these two as programs
chmod +x "$out"/site/ray/core/src/ray/gcs/gcs_server "$out"/site/ray/core/src/ray/raylet/raylet
(cd "$out/site/ray" && rm -rf jars rllib data serve tune train llm air workflow dashboard/client)
tar -cJf "$out/site.tar.xz" -C "$out/site" .
blas=/usr/lib/x86_64-linux-gnu/openblas-pthread
cp -L "$blas/libblas.so.3" "$blas/libopenblas.so.0" /lib/x86_64-linux-gnu/libgfortran.so.5 \
    /lib/x86_64-linux-gnu/libquadmath.so.0 "$out/blas/"
tar -cJf "$out/blas.tar.xz" -C "$out/blas" .
rm -rf "$out/wheels" "$out/site" "$out/blas"
ls -l "$out"
