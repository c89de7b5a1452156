"""The gated delta rule's chunked form as plain MLX ops: Gated DeltaNet's training form, used by
inference off Apple GPUs for verify blocks and prefill chunks (model/gdn.py), by training for its
gradient (train/gdn.py), and the state after part of a chunk that a rollback takes. Pure
functions over arrays; no module state, no device decisions (the caller passes `lapack`)."""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64  # rows a chunk


# Decay factors below e^-30 (~1e-13) are taken as 0. A head that forgets within a block made
# the chunked form's products of two such factors (e^(d_i - d_j) e^d_j) underflow to subnormal
# floats, which x86 CPUs compute far slower (docs/performance.md). Next
# to the block's own rows, weighted e^0, a term of 1e-13 is below float32 resolution; e^-30
# squared stays a normal float.
DECAY_FLOOR = -30.0


def decay_exp(x: mx.array) -> mx.array:
    """exp(x) of a log-decay x <= 0, exactly 0 below DECAY_FLOOR (never subnormal)."""
    return mx.where(x < DECAY_FLOOR, 0.0, mx.exp(mx.maximum(x, DECAY_FLOOR)))


def state_after(state_in, k, decay, v_new, rows: int) -> mx.array:
    """State after the first `rows` rows of a one-chunk pass, from that pass's intermediates:
    the chunk-end update of `chunked_gated_delta` with the chunk cut at `rows`. The rows past
    it weigh exactly 0 in a product over all the chunk's rows, as in `states_after`: a BLAS
    may sum K=rows and K=chunk terms in different orders (OpenBLAS on some CPUs does), and a
    sequence's rollback must be the same bits alone and in a shared round."""
    last = decay[..., rows - 1 : rows]  # [B, H, 1]
    S = state_in.astype(mx.float32).swapaxes(-1, -2)  # [B, H, Dk, Dv]
    weigh = mx.arange(decay.shape[-1]) < rows  # [C]
    kd = k * mx.where(weigh, decay_exp(last - decay), 0.0)[..., None]
    S = S * decay_exp(last)[..., None] + kd.swapaxes(-1, -2) @ v_new
    return S.swapaxes(-1, -2)


def states_after(state_in, k, decay, v_new, last, weigh, kept) -> mx.array:
    """`state_after` of each sequence n of a one-chunk pass at its own number of kept rows, in
    one pass: `last` [N, H, 1] the index of its last kept row, `weigh` [N, 1, C] its kept
    rows, `kept` [N, 1, 1, 1] whether it keeps any (else: the state before the pass). The rows
    past a keep weigh exactly 0, in the same product over all C rows as `state_after`'s, so
    each sequence's state is the bits `state_after` gives it alone."""
    last = mx.take_along_axis(decay, last, axis=-1)  # [N, H, 1]
    S = state_in.astype(mx.float32).swapaxes(-1, -2)  # [N, H, Dk, Dv]
    kd = k * mx.where(weigh, decay_exp(last - decay), 0.0)[..., None]
    S = S * decay_exp(last)[..., None] + kd.swapaxes(-1, -2) @ v_new
    return mx.where(kept, S.swapaxes(-1, -2), state_in)


def _diagonal_blocks(x: mx.array, size: int) -> mx.array:
    """[..., C, C] -> its C/size diagonal blocks [..., C/size, size, size]."""
    *lead, C, _ = x.shape
    n = C // size
    x = mx.moveaxis(x.reshape(*lead, n, size, n, size), -3, -2)  # [..., n, n, size, size]
    return mx.moveaxis(mx.diagonal(x, axis1=-4, axis2=-3), -1, -3)


def unit_lower_inverse(M: mx.array) -> mx.array:
    """(I + M)^-1 for a strictly lower triangular M [..., C, C], C a power of two, by block
    inversion: the inverse of [[A, 0], [X, D]] is [[A^-1, 0], [-D^-1 X A^-1, D^-1]], block sizes
    1, 2, 4, ... C/2, every block of a level in one batched matmul. Only entries of inverses are
    ever formed, so it is as accurate as the inverse itself; the power series (I - M + M^2 - ...)
    formed M^k terms that overflow float32 once a chunk's keys align (errors of 1e9 at cosine
    0.9, NaN while training at 4K tokens)."""
    C = M.shape[-1]
    inv = mx.ones((*M.shape[:-2], C, 1, 1), M.dtype)  # the C unit diagonal blocks
    b = 1
    while b < C:
        lower = _diagonal_blocks(M, 2 * b)[..., b:, :b]  # X of each 2b-block, [..., n, b, b]
        a, d = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x = -(d @ lower @ a)
        top = mx.concatenate([a, mx.zeros(a.shape, a.dtype)], -1)
        inv = mx.concatenate([top, mx.concatenate([x, d], -1)], -2)
        b *= 2
    return inv[..., 0, :, :]


def chunked_gated_delta(
    q: mx.array,  # [B, T, Hk, Dk] (normalised, readout scale folded in)
    k: mx.array,  # [B, T, Hk, Dk]
    v: mx.array,  # [B, T, Hv, Dv]
    log_g: mx.array,  # [B, T, Hv] log of the per-token decay
    beta: mx.array,  # [B, T, Hv]
    state: mx.array | None = None,  # [B, Hv, Dv, Dk]
    chunk: int = CHUNK,
    parts: bool = False,
    lapack: bool = False,
):
    """The gated delta rule in chunks of C rows (Gated DeltaNet's training form), plain MLX ops,
    differentiable: same layouts and results as mlx-lm's `gated_delta_ops`.
    Returns (y [B, T, Hv, Dv], state [B, Hv, Dv, Dk]); with `parts` (one chunk only) also
    (k, cumulative log-decay, v_new) for `state_after`. `lapack`: the chunk's triangular
    inverse by LAPACK (`mx.linalg.tri_inv`: the CPU only, no gradient; one op where the block
    inversion takes many)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = v.dtype  # the activations' (bf16 model: bf16); the math below runs in float32
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
    L = mx.where(tril, decay_exp(mx.where(tril, diff, 0.0)), 0.0)  # [B, H, N, C, C]
    kb = k * beta[..., None]
    M = mx.where(strict, (kb @ k.swapaxes(-1, -2)) * L, 0.0)
    inv = mx.linalg.tri_inv(mx.eye(C) + M, upper=False) if lapack else unit_lower_inverse(M)
    u = inv @ (v * beta[..., None])  # [B, H, N, C, Dv]
    faded = decay_exp(decay)[..., None]  # [B, H, N, C, 1]: each row's decay since the chunk began
    w = inv @ (kb * faded)  # [B, H, N, C, Dk]
    if state is None:
        S = mx.zeros((B, Hv, Dk, Dv), mx.float32)
    else:
        S = state.astype(mx.float32).swapaxes(-1, -2)  # [B, H, Dk, Dv]
    # Per chunk, with v_new = u - w @ S the corrected values: out = (q e^d) @ S + A @ v_new and
    # S' = e^last S + kd^T @ v_new, which is `state_after` over the whole chunk (so a verify
    # block's final state is the one a rollback to all its rows makes). Not folded into
    # S' = (e^last I - kd^T w) S + kd^T u: its products of two decays underflow (DECAY_FLOOR).
    A = (q @ k.swapaxes(-1, -2)) * L  # [B, H, N, C, C]
    states = []  # the state entering each chunk
    for i in range(N):
        states.append(S)
        v_new = u[:, :, i] - w[:, :, i] @ S  # [B, H, C, Dv]
        rows = min(C, T - i * C)  # a padded last chunk's real rows: the same products (BLAS
        # picks its kernel by their length) as a rollback to all of them takes
        S = state_after(S.swapaxes(-1, -2), k[:, :, i], decay[:, :, i], v_new, rows)
        S = S.swapaxes(-1, -2)
    S_in = mx.stack(states, axis=2)  # [B, H, N, Dk, Dv]
    out = (q * faded - A @ w) @ S_in + A @ u  # [B, H, N, C, Dv]
    y = mx.moveaxis(out, 1, 3).reshape(B, N * C, Hv, Dv)[:, :T]
    if parts:
        if N != 1:
            raise ValueError("parts are for one-chunk passes (a verify block)")
        return y.astype(out_dtype), S.swapaxes(-1, -2), (k[:, :, 0], decay[:, :, 0], v_new)
    return y.astype(out_dtype), S.swapaxes(-1, -2)
