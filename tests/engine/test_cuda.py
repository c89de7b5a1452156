"""GPU-only: the fused GDN kernel and the Q8 attention fallback on an NVIDIA GPU (MLX's CUDA
backend), against the pure MLX paths. Skipped elsewhere; the CPU runs the same checks with a
pure-MLX stand-in (test_decode.py, test_seedbench.py)."""

from __future__ import annotations

from argparse import Namespace

import mlx.core as mx
import pytest
from sanctum.engine.kernels import cuda, draft_cuda, gdn_cuda, qmm_checks, qmm_cuda

pytestmark = pytest.mark.skipif(not cuda.is_cuda(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("shape", [(16, 48, 128, 128), (4, 8, 64, 64), (2, 4, 32, 32)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_gdn_kernel_matches_mlx_lm_ops(shape, dtype):
    assert (
        gdn_cuda.check(gdn_cuda.gated_delta_cuda, *shape, dtype, rows=(1, 2, 5, 8, 16, 33)) is None
    )


def test_gdn_rerun_gives_the_taped_rows_states_bit_for_bit():
    """A shared rollback's re-run (SANCTUM_SHARED_ROLLBACK=rerun: each sequence's first
    rows[b] rows again, in one launch) gives the very state the taped pass kept after those
    rows, and a sequence with none kept its state as it was."""
    Hk, Hv, Dk, Dv = 16, 48, 128, 128  # the seed's heads
    ks = mx.random.split(mx.random.key(5), 7)
    q = mx.random.normal((3, 8, Hk, Dk), key=ks[0]).astype(mx.bfloat16) * 0.1
    k = mx.random.normal((3, 8, Hk, Dk), key=ks[1]).astype(mx.bfloat16) * 0.1
    v = mx.random.normal((3, 8, Hv, Dv), key=ks[2]).astype(mx.bfloat16)
    g = mx.exp(-mx.random.uniform(0.01, 2.0, (3, 8, Hv), key=ks[3]))
    beta = mx.sigmoid(mx.random.normal((3, 8, Hv), key=ks[4])).astype(mx.bfloat16)
    state = 0.3 * mx.random.normal((3, Hv, Dv, Dk), key=ks[5])
    _, _, rows = gdn_cuda.gated_delta_cuda(q, k, v, g, beta, state, keep_rows=True)
    _, rerun = gdn_cuda.gated_delta_cuda(q, k, v, g, beta, state, rows=[0, 3, 8])
    assert mx.array_equal(rerun[0], state[0])
    assert mx.array_equal(rerun[1], rows[1, 2])
    assert mx.array_equal(rerun[2], rows[2, 7])


def test_few_row_qmm_kernel_matches_mlx():
    """The few-row 4-bit kernel against MLX's quantized matmul: its own check, and the seed
    target's MLP shapes (5120 -> 17408 -> 5120) at the verify's row counts."""
    assert qmm_checks.check() is None
    assert qmm_checks.check(shapes=((17408, 5120), (5120, 17408)), rows=(2, 8, 16)) is None


def test_wide_qmm_kernel_matches_mlx():
    """The wide variant (17..64 rows in one call) against MLX's quantized matmul, at a shared
    verify's row counts, its check's shapes and the seed target's MLP shapes."""
    fn = qmm_checks.wide_rows_qmm
    assert qmm_checks.check(fn, rows=(17, 24, 33, 40, 57, 64)) is None
    shapes = ((17408, 5120), (5120, 17408))
    assert qmm_checks.check(fn, shapes=shapes, rows=(24, 64)) is None


@pytest.mark.parametrize(("blocks", "ahead"), [(1, None), (24, None), (None, None), (24, 3)])
def test_tiled_qmm_kernel_matches_mlx(blocks, ahead):
    """The tiled variant (x staged in shared memory, 128 features a thread block) against MLX's
    quantized matmul, K whole (blocks=1) and split, the weights 1 or 3 tiles ahead, at its
    check's shapes (one of N not a multiple of 128) and the seed target's MLP shapes."""
    fn = qmm_checks.tiled_blocks_qmm(blocks, ahead)
    assert qmm_checks.check(fn, qmm_checks.TILED_SHAPES, rows=(2, 17, 24, 33, 40, 57, 64)) is None
    shapes = ((17408, 5120), (5120, 17408))
    assert qmm_checks.check(fn, shapes=shapes, rows=(24, 64)) is None


def test_tiled_qmm_rows_do_not_depend_on_the_rows_beside_them():
    """A row's product through the tiled kernel is the same bits in a call of 8 rows and of 64
    (K is split by N and K only, the splits added in order): a block verified alone and in a
    shared verify get the same products."""
    for N, K in ((17408, 5120), (5120, 17408)):  # K whole, and split 7 ways
        w = (mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16)
        wq = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((64, K)).astype(mx.bfloat16)
        alone, shared = qmm_cuda.tiled_qmm(x[:8], *wq), qmm_cuda.tiled_qmm(x, *wq)
        assert mx.array_equal(alone, shared[:8]), (N, K)


def test_kept_builds_equal_mlx_builds(tmp_path, monkeypatch):
    """The kernels built by engine/kernels/build.py (NVRTC, kept on disk) give the very bits of
    mx.fast.cuda_kernel's builds of the same source, and a later process's kernel reads the
    kept build instead of compiling."""
    from sanctum.engine.kernels import build

    monkeypatch.setattr(build, "builds_dir", lambda: tmp_path)
    # kernels an earlier test built are kept in the module's table: start without them
    monkeypatch.setattr(qmm_cuda, "_kernels", {})
    assert build.compiler() is not None, "NVRTC not found: every kernel falls back to MLX's builds"
    ks = mx.random.split(mx.random.key(9), 2)
    w = mx.random.normal((512, 1024), key=ks[0]).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((40, 1024), key=ks[1]).astype(mx.bfloat16)
    kept = qmm_cuda.tiled_qmm(x, wq, scales, biases, 24)  # split: the tiled and sum kernels
    monkeypatch.setattr(qmm_cuda, "_kernels", {})
    with monkeypatch.context() as m:
        m.setattr(build, "_compiler", [None])  # MLX builds them
        mlx_built = qmm_cuda.tiled_qmm(x, wq, scales, biases, 24)
    assert mx.array_equal(kept, mlx_built)
    files = sorted(tmp_path.glob("*.cubin"))
    assert len(files) == 2
    monkeypatch.setattr(qmm_cuda, "_kernels", {})
    compiled = []
    monkeypatch.setattr(build.Compiler, "compile", lambda self, t, n: compiled.append(n))
    again = qmm_cuda.tiled_qmm(x, wq, scales, biases, 24)
    assert mx.array_equal(again, kept) and not compiled


def test_cuda_paths_end_to_end():
    """bench cuda: kernel checks, the Q8 fallback, rollback and lossless greedy with the kernel."""
    from sanctum.bench.cuda import run

    result = run(Namespace(standin=False))
    assert result["ok"], (result["failed"], result.get("end_to_end"))
    assert result["policy_after_load"]["gdn_block_kernel"]
    assert result["policy"]["q8_attention"] == "dequantized"


_DRAFT_SPECS = [  # the seed's drafter (DFlash 2, window 2048) and the default pair's (window 256)
    draft_cuda.AttentionSpec(32, 8, 128, 2048, False, 1e-6, 128**-0.5, 1e7),
    draft_cuda.AttentionSpec(6, 2, 64, 256, False, 1e-6, 64**-0.5, 1e6),
    draft_cuda.AttentionSpec(6, 2, 64, None, True, 1e-6, 64**-0.5, 1e6),  # full, causal
]


@pytest.mark.parametrize("spec", _DRAFT_SPECS)
def test_draft_attention_kernel_matches_the_mlx_path(spec):
    assert draft_cuda.check_attention(draft_cuda.block_attention, spec, rows=(1, 7, 8, 16)) is None


@pytest.mark.parametrize("shape", [(5120, 2, 16), (384, 2, 16), (256, 3, 8)])
def test_draft_conv_kernel_matches_the_mlx_path(shape):
    assert draft_cuda.check_conv(draft_cuda.dynamic_conv, *shape) is None
