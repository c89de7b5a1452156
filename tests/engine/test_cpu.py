"""The CPU paths: MLX's JIT given the host's ISA (engine/cpu.py) and the grouped attention of
few-row passes (engine/attention.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"

# elementwise graphs whose compiled kernels must give MLX's precompiled ops' bits: the
# transcendental functions the models use, and a multiply-add (no contraction into an fma)
KERNELS = """
import json, shutil, sys
import mlx.core as mx, mlx.nn as nn, numpy as np
from sanctum.engine.kernels import cpu
on = cpu.prepare()
compiler = shutil.which("g++")  # what MLX's JIT will run
x = mx.random.normal((4, 1000), key=mx.random.key(0)) * 4
y = mx.random.normal((4, 1000), key=mx.random.key(1))
graphs = {
    "exp": lambda a, b: mx.exp(a - b),
    "sigmoid_mul": lambda a, b: mx.sigmoid(a) * b,
    "silu_mul": lambda a, b: nn.silu(a) * b,
    "softplus": lambda a, b: nn.softplus(a + b),
    "tanh": lambda a, b: mx.tanh(a) + b,
    "mul_add": lambda a, b: a * b + a,
}
same, outputs = {}, []
for name, f in graphs.items():
    eager = np.array(f(x, y))
    outputs.append(np.array(mx.compile(f)(x, y)))
    same[name] = bool((eager.view(np.uint32) == outputs[-1].view(np.uint32)).all())
np.save(sys.argv[1], np.stack(outputs))
print(json.dumps({"on": on, "compiler": compiler, "kernels": same}))
"""


def _run_kernels(tmp: Path, **env) -> tuple[dict, np.ndarray]:
    """KERNELS in a fresh process whose temp dir (so MLX's kernel cache) is `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "out.npy"
    run = subprocess.run(
        [sys.executable, "-c", KERNELS, str(out)],
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(SERVICES), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), np.load(out)


@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX's CPU JIT needs g++")
def test_native_jit_kernels_give_the_same_bits(tmp_path):
    """With the wrapper the compiled kernels equal MLX's precompiled ops and the kernels MLX
    compiles with its own command, to the bit; the first prepare drops the kernels cached
    before it (they would stay scalar) and leaves its marker."""
    native_tmp = tmp_path / "native"
    from sanctum.engine.kernels import cpu

    probe = tmp_path / "probe.sh"  # the wrapper lives in the temp dir: it must run from there
    probe.write_text("#!/bin/sh\nexit 0\n")
    probe.chmod(0o700)
    try:
        runs = subprocess.run([str(probe)], capture_output=True).returncode == 0
    except OSError:
        runs = False
    if not runs:
        pytest.skip("the temp dir does not run programs (noexec): prepare keeps MLX's command")

    cache = native_tmp / "mlx" / mx.__version__ / "cpu"
    cache.mkdir(parents=True)
    stale = cache / "libStale_f4_1_contiguous.so"
    stale.write_bytes(b"not a library")
    # an earlier wrapper's marker: its kernels were built with other flags, so they go too
    (cache / cpu._MARKER).write_text("-march=native -ffp-contract=off\n")
    native, native_out = _run_kernels(native_tmp)
    assert native["on"], "the wrapper was not installed"
    assert Path(native["compiler"]).parent.name.startswith("sanctum-jit-")
    assert all(native["kernels"].values()), native["kernels"]
    assert not stale.exists(), "a kernel compiled before these flags was kept"
    assert (cache / cpu._MARKER).read_text().split() == list(cpu.FLAGS)
    assert list(cache.glob("lib*.so")), "no kernel was compiled through the wrapper"
    objdump = shutil.which("objdump")
    if objdump and os.uname().machine == "x86_64":  # the point of the flags: packed arithmetic
        libs = [p for p in cache.glob("lib*Sigmoid*.so") if "contiguous" in p.name]
        assert libs, "no contiguous sigmoid kernel was compiled"
        lib = libs[0]
        code = subprocess.run([objdump, "-d", str(lib)], capture_output=True, text=True).stdout
        assert "mulps" in code, f"{lib.name}: the kernel's loop was not vectorized"

    # a wrapper inherited on PATH (a parent's, as Ray workers inherit it): "off" takes it away
    inherited = Path(native["compiler"]).parent
    path = f"{inherited}{os.pathsep}{os.environ['PATH']}"
    plain, plain_out = _run_kernels(tmp_path / "plain", SANCTUM_CPU_JIT="off", PATH=path)
    assert not plain["on"]
    assert not Path(plain["compiler"]).parent.name.startswith("sanctum-jit-")
    assert native_out.view(np.uint32).tolist() == plain_out.view(np.uint32).tolist()


def _reference(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("rows,keys", [(2, 2), (8, 8), (8, 300), (16, 2304)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "bool4"])
def test_grouped_attention_equals_mlx(heads, kv_heads, rows, keys, mask_kind):
    """The grouped attention is MLX's attention (its CPU fallback) to float32 rounding, for
    grouped and plain heads, every mask form the engine passes, short and 2K-key caches."""
    from sanctum.engine.kernels.sdpa import grouped_attention

    keys_ = mx.random.split(mx.random.key(rows * 1000 + keys), 5)
    q = mx.random.normal((1, heads, rows, 64), key=keys_[0])
    k = mx.random.normal((1, kv_heads, keys, 64), key=keys_[1])
    v = mx.random.normal((1, kv_heads, keys, 64), key=keys_[2])
    visible = mx.random.uniform(shape=(rows, keys), key=keys_[3]) > 0.3
    visible[:, -1] = True  # no row masked out entirely
    mask = {
        "none": None,
        "causal": "causal",
        "bool": visible,
        "additive": mx.where(visible, 0.0, -1e9),
        "bool4": mx.broadcast_to(visible, (1, heads, rows, keys)),
    }[mask_kind]
    want = _reference(q, k, v, 0.125, mask)
    got = grouped_attention(q, k, v, 0.125, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.allclose(got, want, atol=2e-6, rtol=1e-5), float(mx.abs(got - want).max())


def test_grouped_attention_bf16():
    """Half-precision inputs: the softmax in float32, the output in the inputs' dtype, within
    bf16 rounding of MLX's."""
    from sanctum.engine.kernels.sdpa import grouped_attention

    q = mx.random.normal((1, 6, 8, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 96, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 96, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    want = _reference(q, k, v, 0.125, "causal")
    got = grouped_attention(q, k, v, 0.125, "causal")
    assert got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2)


def test_decode_steps_keep_mlx_lm_attention(engine):
    """Only a verify (and a draft) on the CPU takes the grouped attention: after a prefill of
    fewer rows than a verify's limit, a decode step's logits are those of mlx-lm's own module,
    to the bit, and a verify block's equal the ones it gives with MLX's attention to float32
    rounding."""
    from sanctum.engine.kernels import sdpa as attention

    target = engine[0]
    assert not attention.grouped_rows(1) and attention.grouped_rows(8)
    ids = mx.array(
        target.tokenizer.encode("def fibonacci(n):\n    if n < 2:", add_special_tokens=False)
    )

    def run(block: list[int]) -> mx.array:
        cache = target.make_cache()
        target.prefill(ids.tolist(), cache)  # untaped: mlx-lm's attention at any length
        if len(block) == 1:
            return target.forward(mx.array(block), cache)[0]
        return target.verify(mx.array(block), cache, ())[0]

    step = run([5])
    block = run([5, 9, 11, 3, 7, 2, 4, 8])
    attention.ENABLED = False
    try:
        step_mlx = run([5])
        block_mlx = run([5, 9, 11, 3, 7, 2, 4, 8])
    finally:
        attention.ENABLED = True
    assert mx.array_equal(step, step_mlx)
    assert mx.allclose(block, block_mlx, atol=1e-4, rtol=1e-4)
