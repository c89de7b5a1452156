"""Gated DeltaNet forward that keeps a tape, so a partially accepted block can be rolled back.

mlx-lm's GDN layers (`qwen3_5.GatedDeltaNet`, `qwen3_next.Qwen3NextGatedDeltaNet`) cannot be
trimmed: their cache is the recurrent state after the last row. During block verification we run
the same computation as mlx-lm, through mlx-lm's own helpers, and keep per layer what a rollback
needs: the conv input rows, and either the state after every row (ops path: free, the loop makes
them anyway) or the recurrence inputs to recompute it (Metal kernel path). Rolling back to `keep`
rows then costs no projection at all (HYBRID_CACHE.md, "recompute" and "per-row snapshots").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import (
    _gated_delta_step_ops,
    compute_g,
    gated_delta_kernel,
    normalize_qk,
)
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet


@dataclass
class GDNTape:
    """What one GDN layer's verify pass leaves behind for a rollback."""

    cache: object  # the layer's ArraysCache, updated in place on rollback
    conv_input: mx.array  # [B, K-1+S, conv_dim]: old conv state rows, then this pass's rows
    state_in: mx.array  # [B, Hv, Dv, Dk]: recurrent state before the pass
    row_states: mx.array | None  # [S, B, Hv, Dv, Dk]: state after each row (ops path)
    inputs: tuple | None  # (q, k, v, g, beta) to recompute the recurrence (kernel path)

    def rollback(self, keep: int) -> None:
        """Make the layer's cache hold the state after the first `keep` rows of the pass."""
        num_rows = self.row_states.shape[0] if self.row_states is not None else self.inputs[0].shape[1]
        n_conv = self.conv_input.shape[1] - num_rows
        self.cache[0] = self.conv_input[:, keep : keep + n_conv, :]
        if keep == 0:
            state = self.state_in
        elif self.row_states is not None:
            state = self.row_states[keep - 1]
        else:
            _, state = _recurrence(*(t[:, :keep] for t in self.inputs), self.state_in)
        self.cache[1] = state


def _use_kernel(k: mx.array) -> bool:
    # Same dispatch rule as mlx_lm.models.gated_delta.gated_delta_update.
    return (
        mx.default_device() == mx.gpu
        and mx.metal.is_available()
        and k.shape[-1] >= 32
        and k.shape[-1] % 32 == 0
    )


def _recurrence(q, k, v, g, beta, state, keep_rows: bool = False):
    """Run the gated delta rule over all rows; optionally return the state after each row."""
    if _use_kernel(k):
        y, state = gated_delta_kernel(q, k, v, g, beta, state, None)
        return y, state
    # Mirrors mlx_lm gated_delta_ops step for step (same compiled step), so the numbers match
    # a plain decode through mlx-lm exactly.
    Hk, Hv = q.shape[-2], v.shape[-2]
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    y = mx.stack(ys, axis=1)
    return (y, states) if keep_rows else (y, state)


def _project(mod: nn.Module, x: mx.array):
    """The two mlx-lm GDN classes differ only in how the input projections are laid out."""
    B, S, _ = x.shape
    if isinstance(mod, Qwen3NextGatedDeltaNet):
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x), mod.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], -1)
        return qkv, z, b, a
    qkv = mod.in_proj_qkv(x)
    z = mod.in_proj_z(x).reshape(B, S, mod.num_v_heads, mod.head_v_dim)
    return qkv, z, mod.in_proj_b(x), mod.in_proj_a(x)


# Row counts up to this run through mx.compile (one graph per shape: decode steps and verify
# blocks); longer prefill chunks run op by op rather than compiling a huge unrolled loop.
COMPILE_MAX_ROWS = 32
_compiled: dict = {}


def _gdn_math(mod: nn.Module, x: mx.array, conv_state: mx.array, state_in: mx.array, keep: str):
    """mlx-lm's GDN forward as a pure function of (x, conv state, recurrent state).

    keep: "none" (plain step), "rows" (also the state after every row, stacked [S, B, Hv, Dv, Dk])
    or "inputs" (also the recurrence inputs q, k, v, g, beta, to recompute on rollback).
    """
    B, S, _ = x.shape
    qkv, z, b, a = _project(mod, x)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+S, conv_dim]
    conv_out = nn.silu(mod.conv1d(conv_input))
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
    g = compute_g(mod.A_log, a, mod.dt_bias)
    if keep == "rows" and not _use_kernel(k):
        y, states = _recurrence(q, k, v, g, beta, state_in, keep_rows=True)
        state, extra = states[-1], mx.stack(states)
    else:
        y, state = _recurrence(q, k, v, g, beta, state_in)
        extra = (q, k, v, g, beta) if keep != "none" else ()
    out = mod.out_proj(mod.norm(y, z).reshape(B, S, -1))
    return out, conv_input, state, extra


def _math_for(mod: nn.Module, keep: str, rows: int):
    if rows > COMPILE_MAX_ROWS:
        return lambda *a: _gdn_math(mod, *a, keep)
    key = (id(mod), keep)
    if key not in _compiled:
        _compiled[key] = mx.compile(lambda x, conv, state: _gdn_math(mod, x, conv, state, keep))
    return _compiled[key]


def gdn_forward(mod: nn.Module, x: mx.array, cache, tape: list | None = None,
                row_states: bool = True) -> mx.array:  # fmt: skip
    """mlx-lm's GDN forward (no padding mask) on `cache`; with `tape`, appends a GDNTape.

    `row_states=False` keeps the recurrence inputs instead of per-row states (what the Metal
    kernel path always does); tests use it to pin the recompute path on the CPU.
    """
    B, S, _ = x.shape
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, mod.conv_kernel_size - 1, mod.conv_dim), dtype=x.dtype)
    state_in = cache[1]
    if state_in is None:
        state_in = mx.zeros((B, mod.num_v_heads, mod.head_v_dim, mod.head_k_dim), mx.float32)
    keep = "none" if tape is None else ("rows" if row_states else "inputs")
    out, conv_input, state, extra = _math_for(mod, keep, S)(x, conv_state, state_in)
    cache[0] = conv_input[:, -(mod.conv_kernel_size - 1) :, :]
    cache[1] = state
    cache.advance(S)
    if tape is not None:
        if isinstance(extra, mx.array):
            tape.append(GDNTape(cache, conv_input, state_in, extra, None))
        else:
            tape.append(GDNTape(cache, conv_input, state_in, None, tuple(extra)))
    return out
