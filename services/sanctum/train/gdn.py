"""Training through the gated delta rule in chunks (Gated DeltaNet's training form).

mlx-lm runs the recurrence one token at a time off Apple GPUs (and always in training mode), and
`mx.fast.gated_delta_update`'s gradient does too: thousands of tiny kernels per step. In chunks
of C tokens the work is a few [C, C] and [C, D]
matmuls per chunk plus a loop over T/C chunks, and autodiff through it is just as cheap.
Same layouts and results as mlx-lm's `gated_delta_ops` (tests/train/test_train.py checks values and
gradients).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
from mlx import nn

from ..engine.model.gdn_math import chunked_gated_delta  # the engine's verify/prefill use it too


@contextmanager
def chunked_gdn(chunk: int = 64):
    """Route mlx-lm's Gated DeltaNet layers (qwen3_5, qwen3_next) through `chunked_gated_delta`."""
    from mlx_lm.models import gated_delta, qwen3_5, qwen3_next

    original = gated_delta.gated_delta_update

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
               lower_bound=None, allow_neg_eigval=False):  # fmt: skip
        # short inputs (decode steps) keep mlx-lm's path: chunks of 1-8 rows only add overhead,
        # and MLX CUDA failed once on a one-row chunk ("cudaGraphAddKernelNode ... invalid argument")
        if mask is not None or lower_bound is not None or allow_neg_eigval or q.shape[1] < 16:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)  # fmt: skip
        log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)  # = log compute_g
        y, state = chunked_gated_delta(q, k, v, log_g, mx.sigmoid(b), state, chunk)
        return y, state

    modules = [m for m in (qwen3_5, qwen3_next) if hasattr(m, "gated_delta_update")]
    saved = [(m, m.gated_delta_update) for m in modules]
    try:
        for m in modules:
            m.gated_delta_update = update
        yield
    finally:
        for m, fn in saved:
            m.gated_delta_update = fn
