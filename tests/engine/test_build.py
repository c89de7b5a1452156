"""engine/kernels/build.py: each CUDA kernel's build written as mx.fast.cuda_kernel writes it,
compiled once and kept on disk for later processes, MLX's own build where that fails. The
compiler here is a stand-in (no GPU); tests/engine/test_cuda.py runs the real one on CUDA."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from sanctum import settings
from sanctum.engine.kernels import build


class StandInCompiler:
    version = "stand-in sm_90"

    def __init__(self, fail: str | None = None):
        self.compiled: list[str] = []
        self.fail = fail

    def compile(self, text: str, name: str) -> bytes:
        self.compiled.append(name)
        if self.fail and self.fail in text:
            raise RuntimeError(f"{name}: error: {self.fail}")
        return f"cubin of {name}".encode()


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """A stand-in compiler and an empty builds folder; precompiled launches recorded."""
    cc = StandInCompiler()
    monkeypatch.setattr(build, "_compiler", [cc])
    monkeypatch.setattr(build, "builds_dir", lambda: tmp_path / "cuda-builds")
    launched = []

    def precompiled(**kw):
        launched.append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    return cc, launched, tmp_path / "cuda-builds"


def _call(kernel, x, template=(("N", 4), ("FAST", True))):
    return kernel(
        inputs=[x, mx.array([1], dtype=mx.int32)],
        template=template,
        grid=(32, 4, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(4,)],
        output_dtypes=[mx.float32],
    )


def test_source_is_written_as_mlx_writes_a_custom_kernel():
    """The header before the kernel, the inputs as const pointers of their CUDA types then the
    outputs, the template constants as constexprs ahead of the body, and the half-precision
    headers only where a parameter needs them."""
    text = build.kernel_source(
        "k_1_t",
        "// header\n",
        "    y[0] = x[0];",
        [("x", mx.bfloat16), ("steps", mx.int32)],
        [("y", mx.float32)],
        [("N", 1), ("FAST", True)],
    )
    assert text.startswith(build.PRELUDE + "#include <cuda_bf16.h>\n// header\n")
    assert (
        'extern "C" __global__ void k_1_t(\n    const __nv_bfloat16* x,\n    const int32_t* steps,\n'
        "    float* y) {\n  constexpr int N = 1;\n  constexpr bool FAST = true;\n    y[0] = x[0];\n}\n"
    ) in text
    plain = build.kernel_source("k", "", "", [("x", mx.uint16)], [("y", mx.uint16)], [])
    assert "#include" not in plain


def test_a_build_is_compiled_once_and_read_back_by_a_later_process(builds):
    """The first call compiles and keeps the binary; a later process's kernel of the same
    source reads it instead of compiling; another template, other dtypes or a changed source
    are builds of their own, under names that tell them apart."""
    cc, launched, folder = builds
    x = mx.zeros((4,), mx.uint16)
    kernel = build.cuda_kernel("sanctum_k", ["x", "steps"], ["y"], "    y[0] = 1.0f;")
    _call(kernel, x)
    _call(kernel, x)  # the same process: from memory
    assert len(cc.compiled) == 1 and len(list(folder.glob("*.cubin"))) == 1
    assert launched[0]["compiled_source"] == f"cubin of {cc.compiled[0]}".encode()
    assert launched[0]["name"] == cc.compiled[0] and launched[0]["ensure_row_contiguous"]
    assert launched[0]["grid"] == (32, 4, 1) and launched[0]["scalars"] == []

    later = build.cuda_kernel("sanctum_k", ["x", "steps"], ["y"], "    y[0] = 1.0f;")
    _call(later, x)
    assert len(cc.compiled) == 1  # read from disk
    assert launched[-1]["compiled_source"] == launched[0]["compiled_source"]

    _call(later, x, template=(("N", 8), ("FAST", True)))
    _call(later, mx.zeros((4,), mx.float32))
    changed = build.cuda_kernel("sanctum_k", ["x", "steps"], ["y"], "    y[0] = 2.0f;")
    _call(changed, x)
    names = cc.compiled
    assert len(names) == 4 and len(set(names)) == 4
    assert all(n.startswith("sanctum_k_") for n in names)
    assert "_4_t_" in names[0] and "_8_t_" in names[1]


def test_a_kernel_that_does_not_compile_is_built_by_mlx(builds, monkeypatch):
    """A compile error (or no NVRTC) leaves the kernel to mx.fast.cuda_kernel, with the same
    arguments; nothing is kept on disk."""
    cc, launched, folder = builds
    cc.fail = "undefined_thing"
    made = []

    def mlx_kernel(**kw):
        made.append(kw)
        return lambda **call: [call]

    monkeypatch.setattr(mx.fast, "cuda_kernel", mlx_kernel)
    kernel = build.cuda_kernel("sanctum_k", ["x", "steps"], ["y"], "    undefined_thing();")
    (call,) = _call(kernel, mx.zeros((4,), mx.uint16))
    assert not launched and not folder.exists()
    assert made[0]["name"].startswith("sanctum_k_") and made[0]["input_names"] == ["x", "steps"]
    assert call["template"] == [("N", 4), ("FAST", True)] and call["grid"] == (32, 4, 1)


def test_mlx_builds_on_request(monkeypatch):
    """SANCTUM_CUDA_BUILDS=mlx: no compiler is looked for; anything else is refused."""
    monkeypatch.setattr(build, "_compiler", [])
    monkeypatch.setattr(build.Compiler, "find", lambda: pytest.fail("looked for NVRTC"))
    with settings.use_device(cuda_builds="mlx"):
        assert build.compiler() is None
    with pytest.raises(ValueError, match="SANCTUM_CUDA_BUILDS"):
        settings.device_settings({"SANCTUM_CUDA_BUILDS": "nvcc"})


def test_every_kernel_compiles_for_an_h100(tmp_path, monkeypatch):
    """Each of sanctum's CUDA kernels, at shapes and variants the engine builds (the 4-bit
    kernels at 2-64 rows, K split or whole, the tiled one's weights 3 tiles ahead and 2 blocks
    an SM; the GDN kernel in bfloat16 and float32, taped and re-run; the draft attention and
    convolution), compiles for sm_90 through build.py: an edit that breaks a kernel's source
    shows here, not on a lent GPU. Nothing runs (no GPU): the launches are recorded."""
    from sanctum.engine.kernels import draft_cuda, gdn_cuda, qmm_cuda

    cc = build.Compiler.from_wheels("sm_90")
    if cc is None:
        pytest.skip("no NVRTC wheel (nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12)")
    monkeypatch.setattr(build, "_compiler", [cc])
    monkeypatch.setattr(build, "builds_dir", lambda: tmp_path)
    for module in (qmm_cuda, gdn_cuda, draft_cuda):
        monkeypatch.setattr(module, "_kernels", {})
    launched = []

    def precompiled(**kw):
        launched.append(kw["name"])
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: pytest.fail(f"{kw['name']}: no build"))

    def qmm(M, N, K):
        wq, s, b = mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16), 64, 4)
        return mx.random.normal((M, K)).astype(mx.bfloat16), wq, s, b

    mx.eval(qmm_cuda.small_qmm(*qmm(8, 256, 512)), qmm_cuda.wide_qmm(*qmm(40, 256, 512)))
    for M in (2, 24, 64):
        for blocks in (1, 24):
            mx.eval(qmm_cuda.tiled_qmm(*qmm(M, 256, 1024), blocks))
    mx.eval(qmm_cuda.tiled_qmm(*qmm(64, 256, 1024), 24, ahead=3, resident=2))
    B, T, Hk, Hv, Dk, Dv = 2, 8, 2, 4, 64, 32
    for dtype in (mx.bfloat16, mx.float32):
        args = [
            mx.random.normal((B, T, Hk, Dk)).astype(dtype),
            mx.random.normal((B, T, Hk, Dk)).astype(dtype),
            mx.random.normal((B, T, Hv, Dv)).astype(dtype),
            mx.random.uniform(shape=(B, T, Hv)),
            mx.random.uniform(shape=(B, T, Hv)).astype(dtype),
            mx.zeros((B, Hv, Dv, Dk)),
        ]
        mx.eval(gdn_cuda.gated_delta_cuda(*args, keep_rows=True))
        mx.eval(gdn_cuda.gated_delta_cuda(*args, rows=[3, 5]))
    spec = draft_cuda.AttentionSpec(4, 2, 32, 16, True, 1e-6, 0.2, 1e6)
    draft_cuda.verdict([dict(spec.__dict__)], [[64, 2, 16]], [8])  # zeros: disagrees, built
    for kernel in (
        "small_qmm",
        "wide_qmm",
        "tiled_qmm",
        "tiled_qmm_r2",
        "sum_splits",
        "gated_delta",
        "gated_delta_rows",
        "draft_attention",
        "dynamic_conv",
    ):  # each name, then its source's digest (12 hex digits), then its template
        assert any(re.match(f"sanctum_{kernel}_[0-9a-f]{{12}}_", n) for n in launched), kernel
    assert len(list(tmp_path.glob("*.cubin"))) == len(set(launched)) >= 15


def test_bench_registers_reads_ptxas_report(capsys):
    """`sanctum bench registers` compiles the tiled kernel's variants for sm_90 and reads back
    ptxas's registers, spills and shared memory; the blocks an SM follow sm_90's limits (two
    blocks of 256 threads up to 128 registers a thread, one above)."""
    from sanctum.bench.registers import VARIANTS, blocks_per_sm
    from sanctum.cli import main

    assert (blocks_per_sm(128, 32768), blocks_per_sm(129, 32768), blocks_per_sm(64, 32768)) == (
        2, 1, 4)  # fmt: skip
    assert blocks_per_sm(64, 120 * 1024) == 1  # shared memory bound
    if build.Compiler.from_wheels("sm_90") is None:
        pytest.skip("no NVRTC wheel (nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12)")
    args = ["bench", "registers", "--shapes", "256x1024", "--rows", "64", "--arch", "sm_90"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["ahead"], r["resident"]) for r in rows] == VARIANTS
    for r in rows:
        assert 32 <= r["registers"] <= 255 and r["smem_bytes"] == 2 * 64 * 128 * 2  # x, 2 tiles
        assert r["blocks_an_sm"] == blocks_per_sm(r["registers"], r["smem_bytes"])
    assert next(r for r in rows if r["resident"] == 2)["registers"] <= 128  # __launch_bounds__
