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
form (gdn_math.py) — a few [C, C] and [C, D] matmuls per chunk instead of one tiny kernel chain per row
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
from . import stacks
from .gdn_math import (  # noqa: F401  (gdn.<name>: the rule's math, reached through this module)
    CHUNK,
    DECAY_FLOOR,
    chunked_gated_delta,
    decay_exp,
    state_after,
    states_after,
    unit_lower_inverse,
)

# Row counts up to this run through mx.compile (one graph per shape: decode steps and verify
# blocks); longer prefill chunks run op by op rather than compile a graph per prompt length.
COMPILE_MAX_ROWS = 32
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
# How a shared verify (N > 1 sequences through the block kernel) is rolled back
# (SANCTUM_SHARED_ROLLBACK, set by cuda.prepare):
# - "views" (the default: half the gather's time on an H100, docs/performance.md): the pass
#   keeps every row's state, and each sequence is rolled back by its own tape, whose rows are
#   a slice of the pass's (with ROLLBACK_VIEWS no kernel; every sequence's rows stay alive
#   until the next pass's rollback);
# - "gather": the pass keeps every row's state, and the kept ones are gathered for all
#   sequences at once (a few kernels a layer, the rows' buffer freed at once);
# - "rerun": the pass keeps no rows' states (at the seed's shape they are 3 MB a row and
#   layer: 8 sequences' blocks write 0.2 GB a layer), only the kernel's inputs, and the rollback
#   runs the kernel again over each sequence's kept rows, all sequences in one launch a layer:
#   the same rows' arithmetic in the same order, so the state the taped pass would have kept.
SHARED_ROLLBACK = "views"
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
    # or the block kernel's own inputs (q, k, v, decay g, beta) to run it again over the kept
    # rows (SHARED_ROLLBACK "rerun"); or (Metal kernel path) the recurrence inputs (q, k, v,
    # log_g, beta) to recompute it
    chunk_parts: tuple | None = None
    row_states: mx.array | None = None
    kernel_inputs: tuple | None = None
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
        if self.kernel_inputs is not None:
            return BLOCK_KERNEL(*self.kernel_inputs, self.state_in, rows=[keep])[1]
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
    kernel_inputs: tuple | None = None  # as GDNTape's, each [N, ...]
    conv_input: mx.array | None = None  # [N, K-1+S, conv_dim]

    def rollback(self, keeps: dict[int, int]) -> None:
        """Roll sequence n's cache back to the first keeps[n] rows, for each n in `keeps`: the
        same arrays, to the bit, as `GDNTape.rollback` of each. Every sequence's row goes
        through the same few ops (those not in `keeps` computed and dropped)."""
        if not keeps:
            return
        N = len(self.entries)
        gather = self.row_states is not None and N > 1 and SHARED_ROLLBACK != "views"
        shared = self.conv_input is not None and (
            self.chunk_parts is not None or gather or self.kernel_inputs is not None
        )
        if not shared:  # recurrence inputs (Metal), or row-state views: each sequence's own
            for n, keep in keeps.items():  # (its entry's rows are a slice of the pass's)
                self.entries[n].rollback(keep)
            return
        caches = [e.cache for e in self.entries]
        rows = self.entries[0].num_rows
        # the sequences not rolled back hold the pass's own rows, which (row states, a re-run,
        # the chunk's parts alike) are their state after all its rows: taken with the others,
        # every cache gets its row of one stack, for the next shared pass to take whole
        whole = len(keeps) < N and restacked(caches) is not None
        kept = np.array([keeps.get(n, rows if whole else 0) for n in range(N)], np.int32)
        n_conv = self.conv_input.shape[1] - rows
        at = mx.array((kept[:, None] + np.arange(n_conv, dtype=np.int32))[..., None])
        conv_all = mx.take_along_axis(self.conv_input, at, axis=1)
        state_all = self._states_at(kept, any(k == 0 for k in keeps.values()))
        convs, states = _split_rows(conv_all), _split_rows(state_all)
        for n in range(N) if whole else keeps:
            cache = self.entries[n].cache
            cache[0], cache[1] = convs[n], states[n]
        if whole or len(keeps) == N:  # every cache a row of these
            tag_stacked(caches, conv_all, convs, state_all, states)

    def _states_at(self, keeps: np.ndarray, none_kept: bool = True) -> mx.array:
        """The recurrent state of each sequence after its keeps[n] rows ([N, Hv, Dv, Dk]), by
        a few ops: the block kernel run again over the kept rows, a gather of the kept rows'
        states, or `states_after` over the chunk's parts. Without `none_kept` (no sequence
        rolled back keeps 0 rows: a round keeps at least its committed token) the gather's
        rows of keeps 0 are left as any row (their sequences' states are dropped), which saves
        a pass over all N states."""
        if self.kernel_inputs is not None:
            return BLOCK_KERNEL(*self.kernel_inputs, self.state_in, rows=keeps.tolist())[1]
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
        return mx.where(kept, picked, self.state_in) if none_kept else picked


def tag_stacked(caches: list, conv, convs, state, states) -> None:
    """Mark each of `caches` (one GDN layer's, in order) as holding its row of `conv` and
    `state` (`convs[n]`, `states[n]`: model/stacks.py)."""
    stacks.tag(caches, (conv, state), list(zip(convs, states)))


def restacked(caches: list) -> tuple[mx.array, mx.array] | None:
    """(conv state, recurrent state) stacked for `caches` without a copy, where every cache
    still holds the row a shared pass or rollback handed it, in this order; else None."""
    stack = stacks.held(caches, lambda c: (c[0], c[1]))
    return stack.whole if stack is not None else None


def _split_rows(x: mx.array) -> list[mx.array]:
    """x [N, ...] as N arrays [1, ...], by one op."""
    return mx.split(x, x.shape[0], axis=0) if x.shape[0] > 1 else [x]


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


def use_block_kernel(
    kernel, keeps_rows: bool, in_compile: bool, shared_rollback: str = "views"
) -> None:
    """The block kernel multi-row passes take from now on (kernels/cuda.py's `prepare`, once
    its check agreed; None: the MLX path), and how a shared verify is rolled back
    (SHARED_ROLLBACK)."""
    global BLOCK_KERNEL, BLOCK_KERNEL_KEEPS_ROWS, BLOCK_KERNEL_IN_COMPILE, SHARED_ROLLBACK
    BLOCK_KERNEL, BLOCK_KERNEL_KEEPS_ROWS, BLOCK_KERNEL_IN_COMPILE = kernel, keeps_rows, in_compile
    SHARED_ROLLBACK = shared_rollback


def _block_kernel(rows: int):
    return BLOCK_KERNEL if 1 < rows <= BLOCK_KERNEL_MAX_ROWS else None


def _one_chunk_tape(mod: nn.Module, rows: int) -> bool:
    """A taped pass that fits one chunk keeps the chunk's intermediates (rollback = one matmul)."""
    return not _kernel_for(mod.head_k_dim) and _block_kernel(rows) is None and 1 < rows <= CHUNK


def _row_states_tape(rows: int, shared: bool) -> bool:
    """A taped pass through a block kernel that keeps every row's state (rollback = a copy)."""
    return BLOCK_KERNEL_KEEPS_ROWS and _block_kernel(rows) is not None and not _rerun(shared)


def _rerun_tape(rows: int, shared: bool) -> bool:
    """A taped pass through the block kernel that keeps its inputs (rollback = a re-run)."""
    return _rerun(shared) and _block_kernel(rows) is not None


def _rerun(shared: bool) -> bool:
    return shared and BLOCK_KERNEL_KEEPS_ROWS and SHARED_ROLLBACK == "rerun"


def tape_entry(
    mod: nn.Module, cache, conv_input, state_in, rows: int, extra: tuple, shared: bool = False
) -> GDNTape:
    """The GDNTape of a taped pass over `rows` rows, from what `_gdn_math` returned as extra
    (`shared`: the pass was several sequences', and this is one's share)."""
    entry = GDNTape(cache, conv_input, state_in, rows)
    if _one_chunk_tape(mod, rows):
        entry.chunk_parts = tuple(extra)
    elif _row_states_tape(rows, shared):
        entry.row_states = extra[0]
    elif _rerun_tape(rows, shared):
        entry.kernel_inputs = tuple(extra)
    else:
        entry.inputs = tuple(extra)
    return entry


def batch_tape_entry(
    mod: nn.Module, caches: list, conv_input, state_in, rows: int, extra: tuple
) -> GDNBatchTape:
    """The GDNBatchTape of a taped pass over N sequences' states stacked on the batch axis
    (`caches`: theirs, each of batch 1), from what `_gdn_math` returned."""
    shared = len(caches) > 1  # as `_gdn_math` decided, from the pass's batch
    rows_of = [_split_rows(t) for t in (conv_input, state_in, *extra)]  # one op a tensor
    entries = [
        tape_entry(mod, c, conv, state, rows, tuple(parts), shared)
        for c, (conv, state, *parts) in zip(caches, zip(*rows_of))
    ]
    batch = GDNBatchTape(entries, state_in, conv_input=conv_input)
    if _one_chunk_tape(mod, rows):
        batch.chunk_parts = tuple(extra)
    elif _row_states_tape(rows, shared):
        batch.row_states = extra[0]
    elif _rerun_tape(rows, shared):
        batch.kernel_inputs = tuple(extra)
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
        if taped and _row_states_tape(S, B > 1):
            y, state, rows = BLOCK_KERNEL(q, k, v, mx.exp(log_g), beta, state_in, keep_rows=True)
            extra = (rows,)
        elif taped and _rerun_tape(S, B > 1):
            g = mx.exp(log_g)  # kept as the kernel took it: a re-run gets the same bits
            y, state = BLOCK_KERNEL(q, k, v, g, beta, state_in)
            extra = (q, k, v, g, beta)
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
    # (whether a taped pass keeps rows' states or the kernel's inputs also depends on its batch:
    # a new batch size is a new trace of the same compiled function)
    keeps_rows = BLOCK_KERNEL_KEEPS_ROWS and _block_kernel(rows) is not None
    tape_kind = (_one_chunk_tape(mod, rows), keeps_rows, SHARED_ROLLBACK) if taped else ()
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
