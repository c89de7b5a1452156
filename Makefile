# Two commands for a new machine:  `make run` (set up + generate on the embedded model), `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
SANCTUM := $(VENV)/bin/sanctum
# MLX's Linux wheel links the reference BLAS; Debian's OpenBLAS is much faster on the CPU.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
BLAS_ENV = $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),)

.PHONY: setup run test test-fast lint proto serve clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1) || \
		echo "note: could not install OpenBLAS; MLX will use its slow reference BLAS"; fi
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	# the DFlash authors' reference drafter, a test oracle only; its pinned extras are not needed
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	touch $@

run: setup
	$(SANCTUM) generate --prompt "def fibonacci(n):" --max-tokens 64 --verbose

test: setup
	$(BLAS_ENV) $(PY) -m pytest -q

test-fast: setup
	$(BLAS_ENV) $(PY) -m pytest -q -m "not slow"

# Generated modules are committed (a fresh install needs no codegen); rerun after editing proto/.
GEN    := services/sanctum/wire/gen
proto: setup
	rm -rf build/proto && mkdir -p build/proto
	$(PY) -m grpc_tools.protoc -Iproto --python_out=build/proto --pyi_out=build/proto \
		--grpc_python_out=build/proto proto/sanctum/v1/inference.proto
	$(PY) -m grpc_tools.protoc -Iproto --python_out=build/proto --pyi_out=build/proto proto/sanctum/v1/roles.proto
	# protoc writes absolute imports (`from sanctum.v1 import`) that would clash with our package
	for f in build/proto/sanctum/v1/*; do \
		sed -e 's/^from sanctum\.v1 import/from . import/' $$f > $(GEN)/$$(basename $$f); done

# `make serve`: the actor cluster and gRPC on 127.0.0.1:1337 (embedded model unless SANCTUM_MODEL)
serve: setup
	$(BLAS_ENV) $(SANCTUM) serve

lint: setup
	$(VENV)/bin/ruff check services tests && $(VENV)/bin/ruff format --check services tests

clean:
	rm -rf $(VENV) .pytest_cache
