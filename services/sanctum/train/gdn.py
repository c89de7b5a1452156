"""The gated delta rule in chunks (Gated DeltaNet's training form), in plain MLX ops.

mlx-lm runs the recurrence one token at a time off Apple GPUs (and always in training mode), and
`mx.fast.gated_delta_update`'s gradient does too: thousands of tiny kernels per step, about 2 s a
step for our 18 M target on an H200. In chunks of C tokens the work is a few [C, C] and [C, D]
matmuls per chunk plus a loop over T/C chunks, and autodiff through it is just as cheap.
Same layouts and results as mlx-lm's `gated_delta_ops` (tests/test_train.py checks values and
gradients).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
from mlx import nn


def chunked_gated_delta(
    q: mx.array,  # [B, T, Hk, Dk] (normalised, readout scale folded in)
    k: mx.array,  # [B, T, Hk, Dk]
    v: mx.array,  # [B, T, Hv, Dv]
    log_g: mx.array,  # [B, T, Hv] log of the per-token decay
    beta: mx.array,  # [B, T, Hv]
    state: mx.array | None = None,  # [B, Hv, Dv, Dk]
    chunk: int = 64,
) -> tuple[mx.array, mx.array]:  # y [B, T, Hv, Dv], state [B, Hv, Dv, Dk]
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if (r := Hv // Hk) > 1:
        q, k = mx.repeat(q, r, -2), mx.repeat(k, r, -2)
    C = min(chunk, 1 << max(0, (T - 1).bit_length()))
    pad = (-T) % C
    if pad:  # zero k/v/beta and zero log-decay leave the state untouched
        q, k, v, log_g, beta = (
            mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, log_g, beta)
        )
    N = (T + pad) // C

    def split(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        return mx.moveaxis(x.astype(mx.float32).reshape(B, N, C, Hv, *x.shape[3:]), 3, 1)

    q, k, v, log_g, beta = map(split, (q, k, v, log_g, beta))
    decay = mx.cumsum(log_g, axis=-1)  # [B, H, N, C] within-chunk cumulative log-decay
    tril = mx.tril(mx.ones((C, C), mx.bool_))
    strict = mx.tril(mx.ones((C, C), mx.bool_), -1)
    diff = decay[..., :, None] - decay[..., None, :]
    L = mx.where(tril, mx.exp(mx.where(tril, diff, 0.0)), 0.0)  # [B, H, N, C, C]
    kb = k * beta[..., None]
    # (I + M)^-1 for the strictly lower M = (beta k k^T) * L: M is nilpotent, so the inverse is
    # the product of (I + (-M)^(2^j)), log2(C) factors
    P = -mx.where(strict, (kb @ k.swapaxes(-1, -2)) * L, 0.0)
    inv, power, n = mx.eye(C) + P, P, 2
    while n < C:
        power = power @ power
        inv = inv + power @ inv
        n *= 2
    u = inv @ (v * beta[..., None])  # [B, H, N, C, Dv]
    w = inv @ (kb * mx.exp(decay)[..., None])  # [B, H, N, C, Dk]
    if state is None:
        S = mx.zeros((B, Hv, Dk, Dv), mx.float32)
    else:
        S = state.astype(mx.float32).swapaxes(-1, -2)  # [B, H, Dk, Dv]
    outs = []
    for i in range(N):
        qi, ki, di = q[:, :, i], k[:, :, i], decay[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append(
            (qi * mx.exp(di)[..., None]) @ S + ((qi @ ki.swapaxes(-1, -2)) * L[:, :, i]) @ v_new
        )
        last = di[..., -1:]
        S = (
            S * mx.exp(last)[..., None]
            + (ki * mx.exp(last - di)[..., None]).swapaxes(-1, -2) @ v_new
        )
    y = mx.moveaxis(mx.stack(outs, axis=2), 1, 3).reshape(B, N * C, Hv, Dv)[:, :T]
    return y.astype(v.dtype), S.swapaxes(-1, -2)


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
