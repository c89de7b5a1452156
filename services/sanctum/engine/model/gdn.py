"""Gated DeltaNet forward that keeps a tape, so a partially accepted block can be rolled back.

mlx-lm's GDN layers (`qwen3_5.GatedDeltaNet`, `qwen3_next.Qwen3NextGatedDeltaNet`) cannot be
trimmed: their cache is the recurrent state after the last row. We run the same computation as
mlx-lm (its projections, conv, `normalize_qk`, decay and gate) and keep, during verification, what
a rollback needs: the conv input rows and the recurrence inputs. Rolling back to `keep` rows then
costs no projection: off Apple GPUs one small matmul per layer from the chunked pass's own
intermediates; on Metal a re-run of the recurrence over the kept rows (docs/design/gdn-rollback.md,
"recompute").

The recurrence itself: one row (a decode step) goes through mlx-lm's own step, exactly as mlx-lm
decodes; several rows (a verify block, a prefill chunk) off Apple GPUs go through the chunked
form below — a few [C, C] and [C, D] matmuls per chunk instead of one tiny kernel chain per row
(the same values to ~1e-7; timings: docs/performance.md). On Apple GPUs mlx-lm's Metal kernel runs every shape. On CUDA a block of
2..BLOCK_KERNEL_MAX_ROWS rows goes through `BLOCK_KERNEL` (gdn_cuda.py) once engine/kernels/cuda.py has
checked it on this GPU; its taped variant writes the state after every row, so a rollback
takes one of them as a view (no kernel, no re-run of the recurrence).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.gated_delta import (
    _gated_delta_step_ops,
    gated_delta_kernel,
    gated_delta_ops,
    normalize_qk,
)
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from ..kernels import fused, platform

# Row counts up to this run through mx.compile (one graph per shape: decode steps and verify
# blocks); longer prefill chunks run op by op rather than compile a graph per prompt length.
COMPILE_MAX_ROWS = 32
CHUNK = 64
_compiled: dict = {}
# A fused kernel (q, k, v, decay, beta, state) -> (y, state) for short blocks, or None (set by
# engine/kernels/cuda.py after its start-up check; tests may set a stand-in)
BLOCK_KERNEL = None
BLOCK_KERNEL_MAX_ROWS = 64
BLOCK_KERNEL_IN_COMPILE = True  # False: passes that use it run op by op (it failed in compile)
# The kernel also takes `keep_rows=True` and then returns the state after every row: a taped
# pass keeps those, and a rollback takes one instead of re-running the recurrence.
BLOCK_KERNEL_KEEPS_ROWS = False
# How a rollback takes a row's state from those: as a view of the rows' buffer (no op reaches
# the GPU; the buffer, a block's rows of states, stays alive until the layer's next pass has
# replaced its state and that pass's tape is dropped; the prompt cache stores copies,
# PromptStore.put), or, False, as a copy (one kernel a layer every rollback). bench seed
# measures both.
ROLLBACK_VIEWS = True
# Prefill (untaped multi-row passes) through mlx-lm's own recurrence, the token loop off Apple
# GPUs: a bf16 prefill is then bit for bit mlx-lm's (the chunked form's float32 sums differ in
# the last bits, which a bf16 model can carry into a different token). Slower; for checks.
MLX_LM_PREFILL = False


@dataclass
class GDNTape:
    """What one GDN layer's verify pass leaves behind for a rollback."""

    cache: object  # the layer's ArraysCache, updated in place on rollback
    conv_input: mx.array  # [B, K-1+S, conv_dim]: old conv state rows, then this pass's rows
    state_in: mx.array  # [B, Hv, Dv, Dk]: recurrent state before the pass
    num_rows: int
    # either the chunked pass's own intermediates (k [B,H,C,Dk], cumulative log-decay [B,H,C],
    # corrected values v_new [B,H,C,Dv]): the state after any row is then one small matmul;
    # or the state after every row ([B, S, Hv, Dv, Dk], from a block kernel that keeps rows);
    # or (Metal kernel path) the recurrence inputs (q, k, v, log_g, beta) to recompute it
    chunk_parts: tuple | None = None
    row_states: mx.array | None = None
    inputs: tuple | None = None

    def state_at(self, keep: int) -> tuple[mx.array, mx.array]:
        """(conv state, recurrent state) after the first `keep` rows of the pass."""
        return self.conv_at(keep), self.recurrent_at(keep)

    def conv_at(self, keep: int) -> mx.array:
        """The conv state after the first `keep` rows of the pass (a view, nothing computed)."""
        n_conv = self.conv_input.shape[1] - self.num_rows
        return self.conv_input[:, keep : keep + n_conv, :]

    def recurrent_at(self, keep: int) -> mx.array:
        """The recurrent state after the first `keep` rows of the pass."""
        if keep == 0:
            return self.state_in
        if self.chunk_parts is not None:
            return _state_after_compiled(keep)(self.state_in, *self.chunk_parts)
        if self.row_states is not None:
            if ROLLBACK_VIEWS:
                return self.row_states[:, keep - 1]
            return mx.take(self.row_states, mx.array(keep - 1), axis=1)
        return recurrence(*(t[:, :keep] for t in self.inputs), self.state_in)[1]

    def rollback(self, keep: int) -> None:
        """Make the layer's cache hold the state after the first `keep` rows of the pass."""
        self.cache[0], self.cache[1] = self.state_at(keep)


@dataclass
class GDNBatchTape:
    """One GDN layer's taped pass over N sequences stacked on the batch axis (a shared verify,
    engine/decode/batch.py): each sequence's GDNTape, a row of the stacked tensors, beside those
    tensors, so that rolling all N back costs a few ops per layer however many they are."""

    entries: list[GDNTape]  # per sequence, each of batch 1
    state_in: mx.array  # [N, Hv, Dv, Dk]
    chunk_parts: tuple | None = None  # as GDNTape's, each [N, ...]
    row_states: mx.array | None = None  # [N, S, Hv, Dv, Dk]
    conv_input: mx.array | None = None  # [N, K-1+S, conv_dim]

    def rollback(self, keeps: dict[int, int]) -> None:
        """Roll sequence n's cache back to the first keeps[n] rows, for each n in `keeps`: the
        same arrays, to the bit, as `GDNTape.rollback` of each. Every sequence's row goes
        through the same few ops (those not in `keeps` computed and dropped)."""
        if not keeps:
            return
        N = len(self.entries)
        shared = self.conv_input is not None and (
            self.chunk_parts is not None or (self.row_states is not None and N > 1)
        )
        if not shared:  # recurrence inputs (Metal), or one sequence's row-state views
            for n, keep in keeps.items():
                self.entries[n].rollback(keep)
            return
        kept = np.array([keeps.get(n, 0) for n in range(N)], np.int32)  # [N]
        n_conv = self.conv_input.shape[1] - self.entries[0].num_rows
        at = mx.array((kept[:, None] + np.arange(n_conv, dtype=np.int32))[..., None])
        convs = _split_rows(mx.take_along_axis(self.conv_input, at, axis=1))
        states = _split_rows(self._states_at(kept))
        for n in keeps:
            cache = self.entries[n].cache
            cache[0], cache[1] = convs[n], states[n]

    def _states_at(self, keeps: np.ndarray) -> mx.array:
        """The recurrent state of each sequence after its keeps[n] rows ([N, Hv, Dv, Dk]), by
        a few ops: a gather of the kept rows' states, or `states_after` over the chunk's parts."""
        last = np.maximum(keeps - 1, 0)  # the last kept row (any row where none is kept)
        kept = mx.array((keeps > 0)[:, None, None, None])  # [N, 1, 1, 1]
        if self.chunk_parts is not None:
            k, decay, v_new = self.chunk_parts
            N, H, C = decay.shape
            last = mx.array(np.broadcast_to(last[:, None, None], (N, H, 1)))
            weigh = mx.array(np.arange(C)[None, None] < keeps[:, None, None])  # [N, 1, C]
            return _states_after_compiled(self.state_in, k, decay, v_new, last, weigh, kept)
        N, S = self.row_states.shape[:2]
        flat = self.row_states.reshape(N * S, *self.row_states.shape[2:])
        picked = mx.take(flat, mx.array(np.arange(N) * S + last), axis=0)
        return mx.where(kept, picked, self.state_in)


def _split_rows(x: mx.array) -> list[mx.array]:
    """x [N, ...] as N arrays [1, ...], by one op."""
    return mx.split(x, x.shape[0], axis=0) if x.shape[0] > 1 else [x]


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
    the chunk-end update of `chunked_gated_delta` with the chunk cut at `rows`."""
    last = decay[..., rows - 1 : rows]  # [B, H, 1]
    S = state_in.astype(mx.float32).swapaxes(-1, -2)  # [B, H, Dk, Dv]
    kd = k[:, :, :rows] * decay_exp(last - decay[..., :rows])[..., None]
    S = S * decay_exp(last)[..., None] + kd.swapaxes(-1, -2) @ v_new[:, :, :rows]
    return S.swapaxes(-1, -2)


def states_after(state_in, k, decay, v_new, last, weigh, kept) -> mx.array:
    """`state_after` of each sequence n of a one-chunk pass at its own number of kept rows, in
    one pass: `last` [N, H, 1] the index of its last kept row, `weigh` [N, 1, C] its kept
    rows, `kept` [N, 1, 1, 1] whether it keeps any (else: the state before the pass). The rows
    past a keep weigh exactly 0, and a product's sum over those trailing zeros is the sum over
    the kept rows alone (the same BLAS kernel, the same order)."""
    last = mx.take_along_axis(decay, last, axis=-1)  # [N, H, 1]
    S = state_in.astype(mx.float32).swapaxes(-1, -2)  # [N, H, Dk, Dv]
    kd = k * mx.where(weigh, decay_exp(last - decay), 0.0)[..., None]
    S = S * decay_exp(last)[..., None] + kd.swapaxes(-1, -2) @ v_new
    return mx.where(kept, S.swapaxes(-1, -2), state_in)


_states_after_compiled = mx.compile(states_after)


def _state_after_compiled(rows: int):
    """`state_after` for `rows` as one compiled graph (its elementwise ops fused): a rollback
    runs it once per GDN layer, every round."""
    key = ("state_after", rows)
    if key not in _compiled:
        _compiled[key] = mx.compile(lambda s, k, d, v: state_after(s, k, d, v, rows))
    return _compiled[key]


def _use_kernel(k: mx.array) -> bool:
    return _kernel_for(k.shape[-1])


def _kernel_for(head_k_dim: int) -> bool:
    # The Metal path's dispatch rule, mlx_lm.models.gated_delta.gated_delta_update's.
    return platform.current().is_metal and head_k_dim >= 32 and head_k_dim % 32 == 0


def use_block_kernel(kernel, keeps_rows: bool, in_compile: bool) -> None:
    """The block kernel multi-row passes take from now on (kernels/cuda.py's `prepare`, once
    its check agreed; None: the MLX path)."""
    global BLOCK_KERNEL, BLOCK_KERNEL_KEEPS_ROWS, BLOCK_KERNEL_IN_COMPILE
    BLOCK_KERNEL, BLOCK_KERNEL_KEEPS_ROWS, BLOCK_KERNEL_IN_COMPILE = kernel, keeps_rows, in_compile


def _block_kernel(rows: int):
    return BLOCK_KERNEL if 1 < rows <= BLOCK_KERNEL_MAX_ROWS else None


def _one_chunk_tape(mod: nn.Module, rows: int) -> bool:
    """A taped pass that fits one chunk keeps the chunk's intermediates (rollback = one matmul)."""
    return not _kernel_for(mod.head_k_dim) and _block_kernel(rows) is None and 1 < rows <= CHUNK


def _row_states_tape(rows: int) -> bool:
    """A taped pass through a block kernel that keeps every row's state (rollback = a copy)."""
    return BLOCK_KERNEL_KEEPS_ROWS and _block_kernel(rows) is not None


def tape_entry(mod: nn.Module, cache, conv_input, state_in, rows: int, extra: tuple) -> GDNTape:
    """The GDNTape of a taped pass over `rows` rows, from what `_gdn_math` returned as extra."""
    entry = GDNTape(cache, conv_input, state_in, rows)
    if _one_chunk_tape(mod, rows):
        entry.chunk_parts = tuple(extra)
    elif _row_states_tape(rows):
        entry.row_states = extra[0]
    else:
        entry.inputs = tuple(extra)
    return entry


def batch_tape_entry(
    mod: nn.Module, caches: list, conv_input, state_in, rows: int, extra: tuple
) -> GDNBatchTape:
    """The GDNBatchTape of a taped pass over N sequences' states stacked on the batch axis
    (`caches`: theirs, each of batch 1), from what `_gdn_math` returned."""
    rows_of = [_split_rows(t) for t in (conv_input, state_in, *extra)]  # one op a tensor
    entries = [
        tape_entry(mod, c, conv, state, rows, tuple(parts))
        for c, (conv, state, *parts) in zip(caches, zip(*rows_of))
    ]
    batch = GDNBatchTape(entries, state_in, conv_input=conv_input)
    if _one_chunk_tape(mod, rows):
        batch.chunk_parts = tuple(extra)
    elif _row_states_tape(rows):
        batch.row_states = extra[0]
    return batch


def recurrence(q, k, v, log_g, beta, state):
    """The gated delta rule over all rows: (y [B, S, Hv, Dv], final state [B, Hv, Dv, Dk])."""
    if _use_kernel(k):  # the Metal path; its ops form where Metal kernels cannot run
        metal = gated_delta_kernel if platform.current().metal_kernels else gated_delta_ops
        return metal(q, k, v, mx.exp(log_g), beta, state, None)
    if q.shape[1] == 1:  # a decode step: mlx-lm's own step, so plain decoding matches mlx-lm
        Hk, Hv = q.shape[-2], v.shape[-2]
        if (repeat := Hv // Hk) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        y, state = _gated_delta_step_ops(
            q[:, 0], k[:, 0], v[:, 0], mx.exp(log_g[:, 0]), beta[:, 0], state
        )
        return y[:, None], state
    if (kernel := _block_kernel(q.shape[1])) is not None:
        return kernel(q, k, v, mx.exp(log_g), beta, state)
    return chunked_gated_delta(q, k, v, log_g, beta, state, CHUNK, lapack=_lapack())


def _lapack() -> bool:
    """Inference on the CPU: the chunked form's triangular inverse by LAPACK."""
    return platform.current().is_cpu


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


def _project(mod: nn.Module, x: mx.array):
    """The two mlx-lm GDN classes differ only in how the input projections are laid out."""
    B, S, _ = x.shape
    if isinstance(mod, Qwen3NextGatedDeltaNet):
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(
            *fused.project(mod, fused.GDN_GROUPS[1], x)
        )
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], -1)
        return qkv, z, b, a
    qkv, z, b, a = fused.project(mod, fused.GDN_GROUPS[0], x)
    return qkv, z.reshape(B, S, mod.num_v_heads, mod.head_v_dim), b, a


def _gdn_math(mod: nn.Module, x: mx.array, conv_state: mx.array, state_in: mx.array, taped: bool):
    """mlx-lm's GDN forward as a pure function of (x, conv state, recurrent state); with `taped`
    it also returns the recurrence inputs (q, k, v, log_g, beta) for a rollback."""
    B, S, _ = x.shape
    qkv, z, b, a = _project(mod, x)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+S, conv_dim]
    conv_out = nn.silu(block_conv(mod, conv_input) if S > 1 else mod.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [mod.key_dim, 2 * mod.key_dim], -1),
            [mod.num_k_heads, mod.num_k_heads, mod.num_v_heads],
            [mod.head_k_dim, mod.head_k_dim, mod.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=mod.head_k_dim**-0.5, eps=1e-6)
    beta = mx.sigmoid(b)
    log_g = -mx.exp(mod.A_log.astype(mx.float32)) * nn.softplus(a + mod.dt_bias)  # log compute_g
    if taped and _one_chunk_tape(mod, S):
        y, state, extra = chunked_gated_delta(
            q, k, v, log_g, beta, state_in, CHUNK, parts=True, lapack=_lapack()
        )
    elif MLX_LM_PREFILL and not taped and S > 1 and not _kernel_for(mod.head_k_dim):
        y, state = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state_in)
        extra = ()
    else:
        if taped and _row_states_tape(S):
            y, state, rows = BLOCK_KERNEL(q, k, v, mx.exp(log_g), beta, state_in, keep_rows=True)
            extra = (rows,)
        else:
            y, state = recurrence(q, k, v, log_g, beta, state_in)
            extra = (q, k, v, log_g, beta) if taped else ()
        y = y.astype(x.dtype)  # a no-op but after the kernel
    out = mod.out_proj(mod.norm(y, z).reshape(B, S, -1))
    return out, conv_input, state, extra


def block_conv(mod: nn.Module, conv_input: mx.array) -> mx.array:
    """mlx-lm's causal depthwise conv (`mod.conv1d`) as K multiply-adds of shifted
    rows, summed in float32 and rounded once, as a conv kernel sums: in a compiled pass one
    fused kernel with the SiLU after it. MLX's grouped conv1d is slower on the CPU and on
    CUDA runs cuDNN's kernel with copies around it. Its values differ from the conv's in the last bits (summation
    order), like the chunked recurrence's; a decode step keeps mlx-lm's conv, so that plain
    decoding stays mlx-lm's."""
    w = mod.conv1d.weight  # [C, K, 1]
    K = w.shape[1]
    S = conv_input.shape[1] - K + 1

    def term(j):  # cast after slicing: the casts fuse with the sums (a cast slice is a copy)
        return conv_input[:, j : j + S].astype(mx.float32) * w[:, j, 0].astype(mx.float32)

    out = term(0)
    for j in range(1, K):
        out = out + term(j)
    if "bias" in mod.conv1d:
        out = out + mod.conv1d.bias.astype(mx.float32)
    return out.astype(conv_input.dtype)


def cache_states(mod: nn.Module, cache, batch: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(conv state, recurrent state) a GDN layer's cache holds, zeros before its first token."""
    conv, state = cache[0], cache[1]
    if conv is None:
        conv = mx.zeros((batch, mod.conv_kernel_size - 1, mod.conv_dim), dtype=dtype)
    if state is None:
        state = mx.zeros((batch, mod.num_v_heads, mod.head_v_dim, mod.head_k_dim), mx.float32)
    return conv, state


def _compiled_key(mod: nn.Module, taped: bool, rows: int) -> tuple | None:
    """What a compiled GDN graph of `rows` rows depends on beyond shapes, or None when such a
    pass runs op by op (long prefill chunks; a block kernel that failed inside compile)."""
    if rows > COMPILE_MAX_ROWS or (not BLOCK_KERNEL_IN_COMPILE and _block_kernel(rows)):
        return None
    tape_kind = (_one_chunk_tape(mod, rows), _row_states_tape(rows)) if taped else ()
    return (id(mod), taped, *tape_kind, id(BLOCK_KERNEL), MLX_LM_PREFILL)


def _math_for(mod: nn.Module, taped: bool, rows: int):
    key = _compiled_key(mod, taped, rows)
    if key is None:
        return lambda *a: _gdn_math(mod, *a, taped)
    if key not in _compiled:
        _compiled[key] = mx.compile(lambda x, conv, state: _gdn_math(mod, x, conv, state, taped))
    return _compiled[key]


def layer_for(layer: nn.Module, taped: bool, rows: int, post):
    """A whole GDN decoder layer as one function of (h, conv state, recurrent state): the input
    norm, `_gdn_math` and `post(layer, h, r)` (the residual and MLP), compiled as one graph for
    `rows` up to COMPILE_MAX_ROWS (as `_math_for`), so that a forward pays one call per layer.
    Returns (h, new conv state, new recurrent state, (conv input, extra) or ()): with `taped`,
    what `tape_entry` takes."""
    mod = layer.linear_attn
    n_conv = mod.conv_kernel_size - 1

    def fn(h, conv_state, state_in):
        r, conv_input, state, extra = _gdn_math(
            mod, layer.input_layernorm(h), conv_state, state_in, taped
        )
        out = post(layer, h, r)
        return out, conv_input[:, -n_conv:, :], state, ((conv_input, extra) if taped else ())

    key = _compiled_key(mod, taped, rows)
    if key is None:
        return fn
    key = ("layer", id(layer), id(post), *key)
    if key not in _compiled:
        _compiled[key] = mx.compile(fn)
    return _compiled[key]


def gdn_forward(mod: nn.Module, x: mx.array, cache, tape: list | None = None) -> mx.array:
    """mlx-lm's GDN forward (no padding mask) on `cache`; with `tape`, appends a GDNTape."""
    B, S, _ = x.shape
    conv_state, state_in = cache_states(mod, cache, B, x.dtype)
    out, conv_input, state, extra = _math_for(mod, tape is not None, S)(x, conv_state, state_in)
    cache[0] = conv_input[:, -(mod.conv_kernel_size - 1) :, :]
    cache[1] = state
    cache.advance(S)
    if tape is not None:
        tape.append(tape_entry(mod, cache, conv_input, state_in, S, extra))
    return out
