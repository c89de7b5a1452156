"""The few-row 4-bit matmul's routing (engine/qmm_cuda.py) with a pure-MLX stand-in for the
CUDA kernel: which layers it takes, that 2..64 bf16 rows go to it (16 a call) and one row or
many do not, fused sibling products too, and that its check catches a wrong kernel. The
kernel itself is checked on the GPU (test_cuda.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from sanctum.engine.kernels import fused, qmm_checks, qmm_cuda


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """On the CPU the stand-in and MLX's 4-bit matmul give the same bits, so the routing is
    checked exactly; on CUDA they round differently in the last bfloat16 bit."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def _layer(n_in=512, n_out=64, bias=False):
    lin = nn.Linear(n_in, n_out, bias=bias)
    lin.set_dtype(mx.bfloat16)
    return nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)


def test_install_takes_supported_layers_only():
    model = nn.Sequential(_layer(), _layer(n_in=320), _layer(n_out=40))
    model.layers.append(nn.QuantizedLinear.from_linear(nn.Linear(512, 64), bits=8))
    assert qmm_cuda.install(model) == 1  # K % 128, N % 16 and 4 bits bf16 only
    kinds = [type(m) for m in model.layers]
    assert kinds[0] is qmm_cuda.FewRowsQuantizedLinear
    assert all(k is nn.QuantizedLinear for k in kinds[1:])


def test_few_rows_go_to_the_kernel_and_outputs_agree(monkeypatch):
    calls = []

    def standin(x, w, scales, biases):
        calls.append(x.shape)
        return qmm_cuda.reference(x, w, scales, biases)

    monkeypatch.setattr(qmm_cuda, "small_qmm", standin)
    layer = _layer(bias=True)
    sizes = (1, 8, 16, 17, 40, 64, 65)
    xs = {rows: mx.random.normal((1, rows, 512)).astype(mx.bfloat16) for rows in sizes}
    want = {rows: layer(x) for rows, x in xs.items()}
    qmm_cuda.install(layer)
    got = {rows: layer(x) for rows, x in xs.items()}
    # decode (1 row) and passes past SPLIT_ROWS (prefill chunks) keep MLX's kernel; a shared
    # verify's rows go 16 a call, a last call of one row taking one from the call before
    assert [c[0] for c in calls] == [8, 16, 15, 2, 16, 16, 8, 16, 16, 16, 16]
    assert all(c[1] == 512 for c in calls)
    for rows in xs:
        assert got[rows].shape == want[rows].shape == (1, rows, 64)
        np.testing.assert_array_equal(
            np.array(got[rows].astype(mx.float32)), np.array(want[rows].astype(mx.float32))
        )


def _recording(calls: list, kind: str):
    """A stand-in 4-bit kernel: MLX's product, the call noted in `calls` as (kind, rows)."""

    def fn(x, w, scales, biases):
        calls.append((kind, x.shape[0]))
        return qmm_cuda.reference(x, w, scales, biases)

    return fn


def test_with_the_wide_kernel_a_shared_verify_takes_one_call(monkeypatch):
    """Once the wide variant passed its check (`WIDE`), 17..64 rows go to it in one call (the
    weights read once), 2..16 still to the few-row kernel, one row and 65 to MLX's."""
    calls = []
    standin = partial(_recording, calls)
    monkeypatch.setattr(qmm_cuda, "small_qmm", standin("small"))
    monkeypatch.setattr(qmm_cuda, "wide_qmm", standin("wide"))
    monkeypatch.setattr(qmm_cuda, "WIDE", True)
    layer = _layer()
    xs = {rows: mx.random.normal((1, rows, 512)).astype(mx.bfloat16) for rows in (1, 8, 17, 64, 65)}
    want = {rows: layer(x) for rows, x in xs.items()}
    qmm_cuda.install(layer)
    got = {rows: layer(x) for rows, x in xs.items()}
    assert calls == [("small", 8), ("wide", 17), ("wide", 64)]
    for rows in xs:
        np.testing.assert_array_equal(
            np.array(got[rows].astype(mx.float32)), np.array(want[rows].astype(mx.float32))
        )
    calls.clear()  # a wrong wide kernel is caught by the check its verdict runs
    monkeypatch.setattr(qmm_cuda, "wide_qmm", lambda x, *wq: qmm_cuda.reference(x, *wq[:3]) * 1.5)
    assert "max error" in qmm_checks.check(qmm_checks.wide_rows_qmm, rows=(17, 40))


def test_with_the_tiled_kernel_a_shared_verify_takes_it(monkeypatch):
    """Once the tiled variant passed its check and gate (`TILED`), 17..64 rows go to it in one
    call; a call naming the wide kernel (its check's, a benchmark's) still gets the wide kernel."""
    calls = []
    standin = partial(_recording, calls)
    for name in ("small", "wide", "tiled"):
        monkeypatch.setattr(qmm_cuda, f"{name}_qmm", standin(name))
    monkeypatch.setattr(qmm_cuda, "WIDE", True)
    monkeypatch.setattr(qmm_cuda, "TILED", True)
    layer = _layer()
    qmm_cuda.install(layer)
    for rows in (8, 17, 64, 65):
        layer(mx.random.normal((rows, 512)).astype(mx.bfloat16))
    assert calls == [("small", 8), ("tiled", 17), ("tiled", 64)]
    qmm_checks.wide_rows_qmm(mx.zeros((24, 512), mx.bfloat16), *_weights(layer))
    assert calls[-1] == ("wide", 24)
    calls.clear()  # where it also beat the few-row kernel: a block of one sequence too
    monkeypatch.setattr(qmm_cuda, "TILED_FEW", True)
    for rows in (1, 2, 8, 16, 17):
        layer(mx.random.normal((rows, 512)).astype(mx.bfloat16))
    assert calls == [("tiled", 2), ("tiled", 8), ("tiled", 16), ("tiled", 17)]


def _weights(layer):
    return layer["weight"], layer["scales"], layer["biases"]


def test_tiled_splits_fill_the_gpu_without_empty_splits():
    """K splits only where N / 128 thread blocks are fewer than asked for, each split at least
    one 128-wide tile and none empty."""
    assert qmm_cuda.tiled_splits(5120, 34816) == 1  # the fused gate+up: 272 blocks already
    assert qmm_cuda.tiled_splits(5120, 17408) == 2  # 136 blocks
    assert qmm_cuda.tiled_splits(17408, 5120) == 7  # 40 blocks; 136 tiles, 20 a split
    assert qmm_cuda.tiled_splits(640, 272, blocks=24) == 5  # 3 blocks: a tile a split
    assert qmm_cuda.tiled_splits(1536, 1024, blocks=1) == 1
    for K, N, blocks in ((17408, 5120, 264), (1152, 64, 100), (640, 272, 7)):
        splits = qmm_cuda.tiled_splits(K, N, blocks)
        per = -(-(K // 128) // splits)
        assert (splits - 1) * per < K // 128 <= splits * per  # the last split has tiles


def test_tiled_wrapper_adds_the_splits_sums(monkeypatch):
    """`tiled_qmm` launches one thread block per 128 features and split, and adds the splits'
    float32 sums by `sum_splits` (or takes the bfloat16 output as is, unsplit): stand-in
    kernels that compute each split's share of K and add them as the kernels' contracts say
    give MLX's product back."""
    launches = []

    def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        x, w, scales, biases, dims = inputs
        t = dict(template)
        assert dims.tolist() == [x.shape[0]] and t["NT"] == -(-x.shape[0] // 8)
        assert t["AHEAD"] == qmm_cuda.TILED_AHEAD
        launches.append((t["S"], grid, threadgroup, output_shapes[0], output_dtypes[0]))
        wf = mx.dequantize(
            w, mx.view(scales, mx.bfloat16), mx.view(biases, mx.bfloat16), group_size=64, bits=4
        ).astype(mx.float32)
        xf = mx.view(x, mx.bfloat16).astype(mx.float32)
        per = -(-(t["K"] // 128) // t["S"]) * 128
        sums = [xf[:, a : a + per] @ wf[:, a : a + per].T for a in range(0, t["K"], per)]
        if t["S"] == 1:
            return [mx.view(sums[0].astype(mx.bfloat16), mx.uint16)]
        return [mx.stack(sums)]

    def sum_kernel(inputs, grid, threadgroup, output_shapes, output_dtypes):
        p, sizes = inputs
        splits, count = sizes.tolist()
        launches.append(("sum", splits, count, grid, output_shapes[0], output_dtypes[0]))
        y = p[0]
        for s in range(1, splits):  # in order, as the kernel adds them
            y = y + p[s]
        return [mx.view(y.astype(mx.bfloat16), mx.uint16)]

    monkeypatch.setitem(qmm_cuda._kernels, "sanctum_tiled_qmm", kernel)
    monkeypatch.setitem(qmm_cuda._kernels, "sanctum_sum_splits", sum_kernel)
    layer = _layer(n_in=640, n_out=272)
    x = mx.random.normal((40, 640)).astype(mx.bfloat16)
    # the float32 product of the dequantized weights (MLX's CPU quantized matmul is further
    # from it than bfloat16 rounding), rounded as the wrapper rounds
    wf = mx.dequantize(*_weights(layer), group_size=64, bits=4).astype(mx.float32)
    want = np.array((x.astype(mx.float32) @ wf.T).astype(mx.bfloat16).astype(mx.float32))
    for blocks in (1, 6, None):
        got = qmm_cuda.tiled_qmm(x, *_weights(layer), blocks)
        assert got.dtype == mx.bfloat16 and got.shape == (40, 272)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=1e-2, atol=1e-2)
    sums = ("sum", 40 * 272, (-(-40 * 272 // 256) * 256, 1, 1), (40, 272), mx.uint16)
    assert (
        launches
        == [
            (1, (32, 24, 1), (32, 8, 1), (40, 272), mx.uint16),  # 3 blocks of 8 warps
            (2, (32, 24, 2), (32, 8, 1), (2, 40, 272), mx.float32),  # 5 tiles: 3 + 2
            (sums[0], 2, *sums[1:]),
            (5, (32, 24, 5), (32, 8, 1), (5, 40, 272), mx.float32),
            (sums[0], 5, *sums[1:]),
        ]
    )


def test_check_accepts_the_reference_and_catches_a_bad_kernel():
    assert qmm_checks.check(qmm_cuda.reference) is None

    def one_row_wrong(x, w, scales, biases):
        y = qmm_cuda.reference(x, w, scales, biases)
        return mx.concatenate([y[:1] * 1.5, y[1:]])

    assert "max error" in qmm_checks.check(one_row_wrong)


class _Pair(nn.Module):  # an owner of two sibling projections, as an MLP's gate and up
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = _layer(), _layer()


def test_fused_products_take_the_kernel_too(monkeypatch):
    """A fused gate+up (engine/fused.py) goes through the kernel over its concatenated weight
    (N = 128) and gives what its layers give on their own; one row keeps MLX's matmul;
    `disabled` gives MLX's back for every call and restores the kernel after."""
    calls = []

    def standin(x, w, scales, biases):
        calls.append((x.shape, w.shape[0]))
        return qmm_cuda.reference(x, w, scales, biases)

    monkeypatch.setattr(qmm_cuda, "small_qmm", standin)
    owner = _Pair()
    assert fused.fuse(owner, fused.GATED_MLP)
    x = mx.random.normal((1, 8, 512)).astype(mx.bfloat16)
    want = [owner.gate_proj(x), owner.up_proj(x)]
    assert qmm_cuda.install(owner) == 2
    got = fused.project(owner, fused.GATED_MLP, x)
    assert calls == [((8, 512), 128)]
    for g, w in zip(got, want):
        assert g.shape == w.shape == (1, 8, 64)
        np.testing.assert_array_equal(
            np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        )
    calls.clear()
    fused.project(owner, fused.GATED_MLP, x[:, :1])
    with qmm_cuda.disabled(owner):
        fused.project(owner, fused.GATED_MLP, x)
    assert calls == []
    fused.project(owner, fused.GATED_MLP, x)
    assert calls == [((8, 512), 128)]


@pytest.mark.parametrize(
    ("mode", "tiled", "few", "wide", "want", "asked"),
    [
        ("auto", None, None, None, "tiled+few", ["tiled", "tiled-few"]),  # wide is not asked
        ("auto", None, "not faster", None, "tiled", ["tiled", "tiled-few"]),
        ("auto", "not faster", None, None, "wide", ["tiled", "wide"]),
        ("auto", "not faster", None, "max error", "split", ["tiled", "wide"]),
        ("wide", None, None, None, "wide", ["wide"]),  # the tiled kernel is not asked
        ("off", None, None, None, "split", []),
    ],
)
def test_load_picks_the_tiled_kernel_then_the_wide_one(
    monkeypatch, mode, tiled, few, wide, want, asked
):
    """At load (`cuda._prepare_wide`): with SANCTUM_QMM_WIDE=auto, the tiled kernel where its
    check and speed gate passed (and for 2..16 rows too where it beat the few-row kernel),
    else the wide kernel where its did, else 16 rows a call; `wide` never asks the tiled
    kernel, `off` neither."""
    from sanctum import settings
    from sanctum.engine.kernels import cuda

    seen = []

    def child_verdict(key, args):
        seen.append(args[1])
        # the child's argv as qmm_checks' __main__ reads it: KIND, then the tiled kernel's A R
        assert args[2:] == (["1", "1"] if args[1].startswith("tiled") else [])
        return {"tiled": tiled, "tiled-few": few, "wide": wide}[args[1]]

    monkeypatch.setattr(cuda, "_child_verdict", child_verdict)
    flags = ("WIDE", False), ("TILED", False), ("TILED_FEW", False), ("TILED_AHEAD", 1)
    for name, value in (*flags, ("TILED_RESIDENT", 1)):
        monkeypatch.setattr(qmm_cuda, name, value)
    with settings.use_device(settings.device_settings({"SANCTUM_QMM_WIDE": mode})):
        cuda._prepare_wide()
    kernel = "tiled" if qmm_cuda.TILED else "wide" if qmm_cuda.WIDE else "split"
    assert kernel + ("+few" if qmm_cuda.TILED_FEW else "") == want
    assert seen == asked


def test_two_resident_blocks_build_a_kernel_of_their_own(monkeypatch):
    """`resident=2` launches a kernel built under its own name from a header that bounds its
    registers (`__launch_bounds__` through the `__global__` that MLX writes), with the same
    template and grid as the default one."""
    built, launched = [], []

    def fake_cuda_kernel(name, inputs, outputs, source, header=""):
        built.append((name, header))

        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launched.append((name, dict(template), grid))
            return [mx.zeros(output_shapes[0], output_dtypes[0])]

        return kernel

    monkeypatch.setattr(qmm_cuda.build, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(qmm_cuda, "_kernels", {})
    layer = _layer(n_in=640, n_out=256)
    x = mx.random.normal((24, 640)).astype(mx.bfloat16)
    qmm_cuda.tiled_qmm(x, *_weights(layer), 1)
    qmm_cuda.tiled_qmm(x, *_weights(layer), 1, resident=2)
    assert [b[0] for b in built] == ["sanctum_tiled_qmm", "sanctum_tiled_qmm_r2"]
    assert "__launch_bounds__" not in built[0][1]
    assert built[1][1].startswith(qmm_cuda.TILED_HEADER)
    assert built[1][1].endswith(
        "#undef __global__\n#define __global__ __location__(global) __launch_bounds__(256, 2)\n"
    )
    assert launched[0][1:] == launched[1][1:]


def test_kernel_names_carry_their_sources_digest():
    """MLX keeps a process's built modules by the kernel's name alone: every sanctum kernel's
    name carries a digest of its source and header, so two sources never share a build, and no
    engine module builds a kernel but through build.py."""
    from sanctum.engine.kernels import build

    a = build.source_name("sanctum_k", "y[0] = x[0];", "// h")
    assert a == build.source_name("sanctum_k", "y[0] = x[0];", "// h")
    assert a.startswith("sanctum_k_")
    assert a != build.source_name("sanctum_k", "y[0] = 2 * x[0];", "// h")
    assert a != build.source_name("sanctum_k", "y[0] = x[0];", "// h2")
    kernels = Path(build.__file__).parent
    direct = [p.name for p in kernels.glob("*.py") if "fast.cuda_kernel(" in p.read_text()]
    assert direct == ["build.py"]
