"""DFlash and DFlash 2 block drafters (DFLASH.md), split into the two halves a cluster places apart.

- `DraftBody`: the drafter's own layers. Input: the block's input embeddings and the target's taps
  of newly committed rows; output: the block's final hidden states. Holds no vocabulary-sized
  weight, so it can run in its own process without a second copy of the target's embedding.
- `DraftHead`: everything vocabulary-sized: the target's LM head (bound, not copied), the
  optional output multiplier and logit soft-cap, and DFlash 2's candidate selector.

Knows nothing about Ray, gRPC or the target's caches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.utils import dequantize_model

from ..kernels import cpu, cuda, draft_cuda
from . import fused
from .attention import scaled_dot_product_attention
from .drafter_config import DrafterConfig
from .target import CheckpointError, read_config, resolve_checkpoint

# ---- the body --------------------------------------------------------------------------


class ContextCache:
    """One drafter layer's context keys/values ([B, n_kv, C, d]), appended a few rows a round.

    A sliding layer keeps only the last `window` rows (sliding_window - 1: all that its anchor
    row can see). mlx-lm's RotatingKVCache would hold them in rotated order after one-row
    updates, while the per-row window mask needs time order, so this keeps its own buffer:
    written in place, `STEP` rows of headroom, compacted when the headroom is used up. A sliding
    layer's buffer also keeps `window` rows in front of its own (zeros, or rows that slid out),
    so a context padded to any bucket is a view of the buffer, not a new array (`padded`)."""

    STEP = 256

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys: mx.array | None = None  # [B, n_kv, capacity, d]
        self.values: mx.array | None = None
        self.begin = self.end = 0  # the rows in use: keys[..., begin:end, :]
        # rows written after `end` whose count the device knows and the host not yet (a block
        # drafted before its round's acceptance is read: `append_unsettled`)
        self.unsettled: mx.array | None = None

    def append(self, keys: mx.array, values: mx.array) -> None:
        self._write(keys, values, keys.shape[2])
        self._advance(keys.shape[2])

    def append_unsettled(self, keys: mx.array, values: mx.array, count: mx.array) -> None:
        """Write n rows after `end` of which only the first `count` (an int32 array, not yet
        evaluated) are context: `bounds` counts them, and `settle` once the host knows the
        count. The rows after them are overwritten by the next append."""
        assert self.unsettled is None, "settle the rows appended before"
        self._write(keys, values, 1)
        self.unsettled = count

    def settle(self, count: int) -> None:
        """The host learns how many rows of the unsettled append are context."""
        self.unsettled = None
        self._advance(count)

    def _write(self, keys: mx.array, values: mx.array, used: int) -> None:
        """Write the n rows after `end`, the buffer regrown first if they do not fit; at least
        `used` of them will be in use (the rows that then slide out are not kept)."""
        n = keys.shape[2]
        if self.keys is None or self.end + n > self.keys.shape[2]:
            held = self.end - self.begin
            if self.window is not None:
                held = min(held, max(0, self.window - used))
            B, H, _, D = keys.shape
            front = self.window or 0
            capacity = front + held + n + self.STEP
            new_k = mx.zeros((B, H, capacity, D), keys.dtype)
            new_v = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
            if held:
                kept = slice(self.end - held, self.end)
                new_k[..., front : front + held, :] = self.keys[..., kept, :]
                new_v[..., front : front + held, :] = self.values[..., kept, :]
            self.keys, self.values, self.begin, self.end = new_k, new_v, front, front + held
        self.keys[..., self.end : self.end + n, :] = keys
        self.values[..., self.end : self.end + n, :] = values

    def _advance(self, n: int) -> None:
        self.end += n
        if self.window is not None:
            self.begin = max(self.begin, self.end - self.window)

    def fetch(self) -> tuple[mx.array, mx.array]:
        assert self.unsettled is None, "rows in use unknown on the host: read by `bounds`"
        return (
            self.keys[..., self.begin : self.end, :],
            self.values[..., self.begin : self.end, :],
        )

    @property
    def num_rows(self) -> int:
        return self.end - self.begin

    def block_mask(self, num_rows: int, causal: bool, window: int | None) -> mx.array | None:
        """The mask of a block of `num_rows` rows over these context rows and its own."""
        return block_attention_mask(self.num_rows, num_rows, causal, window)

    def padded(self, rows: int, block_rows: int, causal: bool, window: int | None, masks: dict):
        """The context as `rows` rows (the real ones last, the pad rows in front masked out) and
        the block's mask over them: one shape for every round while the rows fit `rows`. The pad
        rows are the buffer's own rows in front of `begin` (a sliding layer's buffer keeps
        `window` of them: zeros, or rows that slid out; finite, and never seen), so the padded
        context is a view, no new array. `masks`: a dict that keeps masks by shape and pad, for
        the layers and rounds that share them."""
        pad = rows - self.num_rows
        assert self.window is not None and 0 <= pad and rows <= self.end, (rows, self.end)
        keys = self.keys[..., self.end - rows : self.end, :]
        values = self.values[..., self.end - rows : self.end, :]
        key = (rows, block_rows, pad, causal, window)
        if (mask := masks.get(key)) is None:
            mask = masks[key] = padded_block_mask(*key)
        return FetchedContext(keys, values, mask)

    def bounds(self) -> mx.array:
        """int32 [begin, end, capacity]: what the CUDA attention kernel reads the buffer by
        (unevaluated while rows are unsettled)."""
        capacity = self.keys.shape[2]
        if self.unsettled is None:
            return mx.array([self.begin, self.end, capacity], mx.int32)
        end = self.end + self.unsettled
        begin = mx.array(self.begin, mx.int32)
        if self.window is not None:
            begin = mx.maximum(begin, end - self.window)
        return mx.stack([begin, end, mx.array(capacity, mx.int32)]).astype(mx.int32)

    def buffered(self) -> BufferContext:
        return BufferContext(self.keys, self.values, self.bounds())

    def bucket(self) -> int:
        """Rows `padded` pads a sliding layer's context to: the next multiple of STEP, at most
        the window (so a few shapes in all, and one once the window is full)."""
        return min(self.window, self.STEP * max(1, -(-self.num_rows // self.STEP)))

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class FetchedContext:
    """A context cache's rows as already fetched arrays, padded at the front to a bucket of rows,
    with the block's mask over them (what the compiled layer stack takes)."""

    def __init__(self, keys: mx.array, values: mx.array, mask: mx.array):
        self.keys, self.values, self.mask = keys, values, mask

    def fetch(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def num_rows(self) -> int:
        return self.keys.shape[2]

    def block_mask(self, num_rows: int, causal: bool, window: int | None) -> mx.array:
        return self.mask


class BufferContext:
    """A context cache's whole buffer and the rows in use (`ContextCache.bounds`), as the CUDA
    attention kernel reads them: the same shapes every round until the buffer is regrown, so
    the compiled stack needs no padding and no mask."""

    def __init__(self, keys: mx.array, values: mx.array, bounds: mx.array):
        self.keys, self.values, self.bounds = keys, values, bounds


# A draft body whose layers all slide runs them as one compiled graph (DraftBody._compilable);
# False: op by op always.
COMPILE_DRAFTS = True
# Before its windows fill, compiled over contexts padded to buckets (ContextCache.bucket), on
# every device; False: op by op until the windows are full. On a GPU op by op the draft is
# host-bound. On the CPU, once the JIT's kernels vectorized (engine/cpu.py), the compiled stack
# beat op by op too, padding included: synced draft 7.1-7.4 against 8.4 ms for one sequence,
# 15.2-15.7 against 17.3-18.2 for four (`bench batch --steady 16 --phases 4 --concurrency
# 1,4`'s rounds with this flag on and off in turn, a script; default pair, short prompts, two
# pairs); before, it cost more than compiling saved (0.95x).
PAD_TO_BUCKETS = True


def padded_block_mask(
    rows: int, block_rows: int, pad: int, causal: bool, window: int | None
) -> mx.array:
    """[1, 1, L, rows + L]: `block_attention_mask` over `rows` context rows whose first `pad`
    are padding, never seen. A real key keeps its distance to every block row, so the window
    rule over `rows` rows holds for it as is."""
    mask = block_attention_mask(rows, block_rows, causal, window)
    if mask is None:
        mask = mx.ones((block_rows, rows + block_rows), mx.bool_)
    if pad > 0:
        mask = mask & (mx.arange(rows + block_rows) >= pad)
    return mask[None, None]  # stacks along the batch axis


def buffer_block_mask(
    bounds: mx.array, capacity: int, num_rows: int, causal: bool, window: int | None
) -> mx.array:
    """[1, 1, L, capacity + L]: `block_attention_mask` over a whole context buffer whose rows in
    use are bounds[0]..bounds[1] (int32, maybe not evaluated yet): the same keys visible, the
    buffer's other rows masked out. Buffer row j sits at position start - (end - j)."""
    rows = mx.arange(num_rows)[:, None]
    j = mx.arange(capacity)[None, :]
    end = bounds[1]
    ctx_ok = (j >= bounds[0]) & (j < end)
    if window is not None:
        ctx_ok = ctx_ok & (rows + end - j < window)
    own = mx.arange(num_rows)[None, :] <= rows if causal else mx.ones((num_rows,) * 2, mx.bool_)
    ctx_ok = mx.broadcast_to(ctx_ok, (num_rows, capacity))
    return mx.concatenate([ctx_ok, own], axis=1)[None, None]


def block_attention_mask(
    num_ctx: int, num_rows: int, causal: bool, window: int | None
) -> mx.array | None:
    """[L, C + L] boolean mask of a block over its C context keys (the C rows right before the
    anchor, in time order) and its own L rows, or None when every key is visible.

    The reference rules (DFLASH.md): block rows see each other causally when `causal`; in a
    sliding layer the block row at absolute position p sees a context key at position q only
    when p - q < window, so later rows see fewer context rows than the anchor does."""
    clipped = window is not None and num_ctx + num_rows > window
    if not causal and not clipped:
        return None
    rows = mx.arange(num_rows)[:, None]
    ctx = mx.arange(num_ctx)[None, :]
    # context key j sits at position start - C + j; row i at start + i
    ctx_ok = (rows + num_ctx - ctx < window) if clipped else mx.ones((num_rows, num_ctx), mx.bool_)
    own = mx.arange(num_rows)[None, :] <= rows if causal else mx.ones((num_rows,) * 2, mx.bool_)
    return mx.concatenate([mx.broadcast_to(ctx_ok, (num_rows, num_ctx)), own], axis=1)


class DraftAttention(nn.Module):
    """Qwen3-style attention whose keys/values are [context rows (cached)] + [block rows]."""

    def __init__(self, cfg: DrafterConfig, sliding: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        dim = cfg.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            self.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.window = cfg.sliding_window if sliding else None  # counted per block row
        self.causal = cfg.is_causal if cfg.is_causal is not None else sliding
        self.scale = self.head_dim**-0.5

    def make_cache(self) -> ContextCache:
        return ContextCache(self.window - 1 if self.window is not None else None)

    def _kv(self, x: mx.array, start, projected=None) -> tuple[mx.array, mx.array]:
        B, S, _ = x.shape
        k, v = projected or (self.k_proj(x), self.v_proj(x))
        k = self.k_norm(k.reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=start), v

    def add_context(
        self, ctx: mx.array, start: int, cache: ContextCache, projected=None, count=None
    ) -> None:
        """Project new context rows ([B, C, H] at positions start..) into this layer's cache;
        `projected`: their k and v projections, made already (for several sequences at once);
        `count`: only the first `count` rows are context (`ContextCache.append_unsettled`)."""
        if self.window is not None and (skip := ctx.shape[1] - self.window + 1) > 0:
            assert count is None, "unsettled rows must all fit the window"
            ctx, start = ctx[:, skip:], start + skip  # rows no block row can see again
            projected = projected and tuple(t[:, skip:] for t in projected)
        kv = self._kv(ctx, start, projected)
        if count is None:
            cache.append(*kv)
        else:
            cache.append_unsettled(*kv, count)

    def kernel_spec(self) -> draft_cuda.AttentionSpec | None:
        """This layer as the CUDA kernel takes it, or None where the kernel does not apply (a
        RoPE other than plain rotate-half over the whole head)."""
        rope = self.rope
        if type(rope) is not nn.RoPE or rope.traditional or rope.dims != self.head_dim:
            return None
        return draft_cuda.AttentionSpec(
            heads=self.n_heads,
            kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            window=self.window,
            causal=bool(self.causal),
            eps=float(self.q_norm.eps),
            scale=float(self.scale),
            rope_base=float(rope.base),
            rope_scale=float(rope.scale),
        )

    def _through_kernel(self, x: mx.array, start, cache) -> mx.array | None:
        """The block's attention by the checked CUDA kernel (`cuda.prepare_drafter` sets
        `_kernel`), or None where it does not take this call (then the MLX path runs)."""
        kernel = self.__dict__.get("_kernel")
        if kernel is None or x.dtype != mx.bfloat16:
            return None
        if isinstance(cache, ContextCache):
            if cache.keys is None or cache.keys.dtype != mx.bfloat16:
                return None
            cache = cache.buffered()
        if not isinstance(cache, BufferContext):
            return None
        qkv = fused.joined(self, fused.QKV, x)
        if qkv is None:
            return None
        fn, spec, inv_freq = kernel
        if not draft_cuda.attention_supported(spec, x.shape[1]):
            return None
        start = start if isinstance(start, mx.array) else mx.array(start, mx.int32)
        norms = (self.q_norm.weight, self.k_norm.weight)
        out = fn(qkv, *norms, cache.keys, cache.values, start, cache.bounds, spec, inv_freq)
        return self.o_proj(out)

    def __call__(self, x: mx.array, start: int, cache: ContextCache) -> mx.array:
        if (out := self._through_kernel(x, start, cache)) is not None:
            return out
        if isinstance(cache, BufferContext):
            return self._over_buffer(x, start, cache)
        B, L, _ = x.shape
        q, k, v = fused.project(self, fused.QKV, x)
        q = self.q_norm(q.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k, v = self._kv(x, start, (k, v))
        num_ctx = cache.num_rows
        if num_ctx:
            ck, cv = cache.fetch()
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
        mask = cache.block_mask(L, self.causal, self.window)
        out = scaled_dot_product_attention(q, k, v, None, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _over_buffer(self, x: mx.array, start, ctx: BufferContext) -> mx.array:
        """The MLX path over a whole context buffer read by its bounds (where the kernel does
        not run): every buffer row a key, those outside the rows in use masked out."""
        B, L, _ = x.shape
        q, k, v = fused.project(self, fused.QKV, x)
        q = self.q_norm(q.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k, v = self._kv(x, start, (k, v))
        k = mx.concatenate([ctx.keys, k], axis=2)
        v = mx.concatenate([ctx.values, v], axis=2)
        capacity = ctx.keys.shape[2]
        mask = buffer_block_mask(ctx.bounds, capacity, L, self.causal, self.window)
        out = scaled_dot_product_attention(q, k, v, None, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = fused.project(self, fused.GATED_MLP, x)
        return self.down_proj(nn.silu(gate) * up)


class DynamicConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolution along the block rows."""

    def __init__(self, dim: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, dim))
        self.kernel_projection = nn.Linear(dim, 2 * kernel * (dim // group), bias=False)

    # Every group of `group` channels shares one dynamic weight: x is seen as
    # [B, L, H / group, group] and the weights broadcast over the last axis; a row's
    # predecessors come from a 0/1 shift matrix. Both keep a draft's kernel count down on a GPU,
    # where a drafter layer is bound by kernel launches, not arithmetic: no copy for a repeat,
    # none for a shift. The values are bit for bit those of a repeat and zero-padded shifts.

    def kernels(self, x: mx.array) -> mx.array:
        """The dynamic part of each row's kernels: [B, L, 2, K, H / group, 1]."""
        B, L, H = x.shape
        dyn = self.kernel_projection(x)
        return dyn.reshape(B, L, 2, self.kernel, H // self.group, 1)

    def apply(self, x: mx.array, dyn: mx.array, which: int) -> mx.array:
        """out[l] = sum over o of (base[o] + dyn[l, o]) * x[l - o], zero before the block."""
        B, L, H = x.shape
        grouped = (B, L, H // self.group, self.group)
        base = self.base_kernel.reshape(2, self.kernel, *grouped[2:])
        out = (base[which, 0] + dyn[:, :, which, 0]) * x.reshape(grouped)
        for o in range(1, min(self.kernel, L)):
            shifted = shift_rows(L, o, x.dtype) @ x  # row l holds x[l - o]; the first o zero
            out = out + (base[which, o] + dyn[:, :, which, o]) * shifted.reshape(grouped)
        return out.reshape(B, L, H)


_SHIFTS: dict = {}


def shift_rows(rows: int, by: int, dtype) -> mx.array:
    """[rows, rows] 0/1 matrix S with (S @ x)[l] = x[l - by] (zero for l < by): exact for
    finite x, since each output sums one product by 1 and zeros. Made from numpy and kept, so
    that a compiled graph holds it as a constant and does not build it again every call."""
    key = (rows, by, dtype)
    if (s := _SHIFTS.get(key)) is None:
        s = _SHIFTS[key] = mx.array(np.eye(rows, k=-by, dtype=np.float32), dtype=dtype)
    return s


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__()
        self.self_attn = DraftAttention(cfg, sliding=layer_type == "sliding_attention")
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.is_v2:
            args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv = DynamicConv(*args)
            self.mlp_conv = DynamicConv(*args)

    def __call__(self, x: mx.array, start: int, cache: ContextCache) -> mx.array:
        return self.run(x, lambda y: self.self_attn(y, start, cache))

    def run(self, x: mx.array, attend) -> mx.array:
        """The layer around `attend` (normed rows -> attention output): inference passes the
        cached attention, training a batched, masked one (train/drafter.py)."""
        if "attention_conv" not in self:
            x = x + attend(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        y = self.input_layernorm(x)
        apply = self._conv_apply(y)
        conv = self.attention_conv
        ker = conv.kernels(y)
        x = apply(conv, attend(apply(conv, y, ker, 0)), ker, 1, x)
        y = self.post_attention_layernorm(x)
        conv = self.mlp_conv
        ker = conv.kernels(y)
        return apply(conv, self.mlp(apply(conv, y, ker, 0)), ker, 1, x)

    def _conv_apply(self, y: mx.array):
        """(conv, x, kernels, which, residual=None) -> conv.apply(x, kernels, which) + residual:
        by the checked CUDA kernel (`cuda.prepare_drafter` sets `_conv_kernel`) for bfloat16
        rows, else by MLX's ops."""
        kernel = self.__dict__.get("_conv_kernel")
        if kernel is not None and y.dtype == mx.bfloat16:

            def apply(conv, x, ker, which, residual=None):
                base = conv.base_kernel
                return kernel(x, ker.reshape(*x.shape[:2], -1), base, which, conv.group, residual)

            return apply

        def apply(conv, x, ker, which, residual=None):
            out = conv.apply(x, ker, which)
            return out if residual is None else residual + out

        return apply


class DraftBody(nn.Module):
    """fc + hidden_norm over the taps, the decoder layers, and the final norm."""

    def __init__(self, cfg: DrafterConfig, tap_width: int):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(tap_width, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg, t) for t in cfg.layer_types]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def make_cache(self) -> list[ContextCache]:
        return [layer.self_attn.make_cache() for layer in self.layers]

    def context_rows_needed(self) -> int | None:
        return self.cfg.context_rows_needed()

    def __call__(
        self,
        block_embeds: mx.array,  # [B, L, H]: embeddings of [anchor, MASK, ...]
        start: int,  # absolute position of the anchor
        new_taps: mx.array | None,  # [B, C, n_taps * H_target]: taps of rows start-C .. start-1
        cache: list[ContextCache],
    ) -> mx.array:  # [B, L, H]
        if new_taps is not None and new_taps.shape[1] > 0:
            ctx = self.hidden_norm(self.fc(new_taps))
            ctx_start = start - new_taps.shape[1]
            for layer, c in zip(self.layers, cache):
                layer.self_attn.add_context(ctx, ctx_start, c)
        h = block_embeds
        if self.cfg.input_embedding_scale != 1.0:
            h = h * self.cfg.input_embedding_scale
        if self._buffers_compilable(cache, h):
            context = [t for c in cache for t in (c.keys, c.values, c.bounds())]
            return self._compiled_stack(BufferContext)(h, mx.array(start, mx.int32), *context)
        if self._compilable(cache):
            context = self.padded_context(cache, h.shape[1])
            return self._compiled_stack()(h, mx.array(start), *context)
        for layer, c in zip(self.layers, cache):
            h = layer(h, start, c)
        return self.norm(h)

    def ahead(
        self,
        block_embeds: mx.array,  # [B, L, H]
        start: mx.array,  # int32 []: the anchor's position, not yet evaluated
        new_taps: mx.array,  # [B, C, n_taps * H_target]: taps of rows ctx_start ..
        ctx_start: int,
        count: mx.array,  # int32 []: how many of the C rows are context, not yet evaluated
        cache: list[ContextCache],
    ) -> mx.array:  # [B, L, H]
        """`__call__` for a block drafted before the host has read the previous round's
        acceptance, so before it knows how many of the verified rows are context: they go in
        unsettled (`ContextCache.settle` once known), and every layer reads its buffer by its
        bounds, through the CUDA kernel or the MLX path over the whole buffer, compiled
        either way (one graph while the buffers keep their shapes, as the padded path has)."""
        ctx = self.hidden_norm(self.fc(new_taps))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(ctx, ctx_start, c, count=count)
        h = block_embeds
        if self.cfg.input_embedding_scale != 1.0:
            h = h * self.cfg.input_embedding_scale
        if COMPILE_DRAFTS:
            context = [t for c in cache for t in (c.keys, c.values, c.bounds())]
            return self._compiled_stack(BufferContext)(h, start, *context)
        for layer, c in zip(self.layers, cache):
            h = layer(h, start, c.buffered())
        return self.norm(h)

    def _buffers_compilable(self, cache: list[ContextCache], h: mx.array) -> bool:
        """Whether the layer stack runs compiled over the context buffers themselves: every
        layer's attention goes through the CUDA kernel (`DraftAttention._through_kernel`), which
        reads the rows in use by their bounds, so no padding, no mask and, while the buffers keep
        their shapes, one graph."""
        return (
            COMPILE_DRAFTS
            and h.dtype == mx.bfloat16
            and all(
                "_kernel" in layer.self_attn.__dict__
                and draft_cuda.attention_supported(layer.self_attn._kernel[1], h.shape[1])
                and fused.is_fused(layer.self_attn, fused.QKV)
                and c.keys is not None
                and c.keys.dtype == mx.bfloat16
                for layer, c in zip(self.layers, cache)
            )
        )

    def _compilable(self, cache: list[ContextCache]) -> bool:
        """Whether the layer stack runs as one compiled graph: every layer slides with a plain
        RoPE, and its context is a full window or pads to one of a few bucket shapes
        (PAD_TO_BUCKETS). Full-attention layers' contexts grow without bound, and tracing a
        graph per length would cost more than it saves."""
        return (
            COMPILE_DRAFTS
            and all(
                c.window is not None and (PAD_TO_BUCKETS or c.num_rows == c.window) for c in cache
            )
            and all(type(layer.self_attn.rope) is nn.RoPE for layer in self.layers)
        )

    def padded_context(self, cache: list[ContextCache], block_rows: int) -> list[mx.array]:
        """The compiled stack's context inputs for a block of `block_rows` rows: each layer's
        keys, values and block mask, its rows padded to the layer's bucket."""
        # masks kept across rounds: every layer of a round shares one, and once the windows
        # are full every round has the same
        masks = self.__dict__.setdefault("_masks", {})
        if len(masks) > 64:
            masks.clear()
        out = []
        for layer, c in zip(self.layers, cache):
            attn = layer.self_attn
            fetched = c.padded(c.bucket(), block_rows, attn.causal, attn.window, masks)
            out += [fetched.keys, fetched.values, fetched.mask]
        return out

    def _compiled_stack(self, context=FetchedContext):
        """The layers and the final norm over each layer's context as three arrays (`context`:
        padded rows, their values and the block mask; or, for the CUDA kernel, the buffers and
        their bounds), the anchor's position an array input (one graph per shape). The weights
        are captured at the first trace: an inference body's (training runs `DraftLayer.run`,
        never this)."""
        name = "_stack" if context is FetchedContext else "_stack_buffers"
        fn = self.__dict__.get(name)
        if fn is None:

            def stack(h, start, *ctx):
                for i, layer in enumerate(self.layers):
                    h = layer(h, start, context(*ctx[3 * i : 3 * i + 3]))
                return self.norm(h)

            fn = self.__dict__[name] = mx.compile(stack)
        return fn

    def use_kernels(self, attention: bool, conv: bool) -> None:
        """Route every layer's block attention and DFlash 2 convolutions through the CUDA
        kernels of draft_cuda.py (`cuda.prepare_drafter`, after their check agreed), or back to
        MLX's ops (False; training always: a kernel takes no gradient)."""
        for layer in self.layers:
            attn = layer.self_attn
            spec = attn.kernel_spec() if attention else None
            if spec is not None:
                attn.__dict__["_kernel"] = (draft_cuda.block_attention, spec, spec.inv_freq())
            else:
                attn.__dict__.pop("_kernel", None)
            if conv and "attention_conv" in layer:
                layer.__dict__["_conv_kernel"] = draft_cuda.dynamic_conv
            else:
                layer.__dict__.pop("_conv_kernel", None)
        for name in [k for k in self.__dict__ if k.startswith("_stack")]:
            del self.__dict__[name]  # graphs traced with the other routing


# ---- the head --------------------------------------------------------------------------


# When sampling, DFlash 2's selector re-scores the body's top this many tokens, not its trained
# top-k (16): a token the target samples is often outside the top 16, where q would be zero and
# the draft always rejected (the rejection rule takes whatever q the drafts were drawn from, so
# any pool is lossless). Greedy keeps the trained top-k, the reference's. On the default pair
# (`sanctum bench tau --contexts 0,1024 --num-prompts 8 --block-sizes 8 --temperatures 0.7,1`,
# contexts 0 / 1K): T 0.7 tau 2.36 / 2.23 with 16, 2.59 / 2.53 with 128, 2.46 / 2.59 with 256;
# T 1: 1.70 / 1.65, 2.01 / 2.06, 1.91 / 2.04 (the body's whole distribution, as DFlash drafts:
# 2.11 / 1.99 and 2.19 / 1.98).
SAMPLING_CANDIDATES = 128


# On a GPU, above this vocabulary the top-k runs in two stages (`top_candidates`).
TWO_STAGE_VOCAB = 32768
CHUNK = 1024


def chunk_length(vocab: int) -> int:
    """The two-stage top-k's chunk: the largest divisor of the vocabulary from CHUNK / 2 to
    CHUNK (Qwen3.5's 248,320 = 256 x 970), so that no padding is filled and concatenated every
    draft; CHUNK where there is none."""
    return next((c for c in range(CHUNK, CHUNK // 2 - 1, -1) if vocab % c == 0), CHUNK)


def top_candidates(logits: mx.array, k: int, two_stage: bool | None = None) -> mx.array:
    """The indices of the k largest logits of each row ([..., V] -> [..., k], in no order).

    `two_stage` (default: on a GPU, over a vocabulary above TWO_STAGE_VOCAB): each chunk of
    `chunk_length` logits its own top k, then the top k of those. It is exact (a row's top k
    are each in their chunk's top k); on a GPU, where a partition of a 248K-long row sorts it,
    sorting short rows is far cheaper. By default on the CPU, where MLX's partition costs ~10
    ns an element (0.5 ms for a block's 7 rows of 8,192), the rows are pruned first
    (`_top_by_chunk_max`)."""
    V = logits.shape[-1]
    if two_stage is None:
        on_cpu = mx.default_device() == mx.cpu
        if on_cpu and (size := _pruning_chunk(V, k)):
            return _top_by_chunk_max(logits, k, size)
        two_stage = not on_cpu and V > TWO_STAGE_VOCAB
    if not two_stage or k > CHUNK:
        return mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    size = chunk_length(V)
    chunks = -(-V // size)
    if (pad := chunks * size - V) > 0:
        fill = mx.full((*logits.shape[:-1], pad), -mx.inf, logits.dtype)
        logits = mx.concatenate([logits, fill], axis=-1)
    split = logits.reshape(*logits.shape[:-1], chunks, size)
    local = mx.argpartition(-split, k - 1, axis=-1)[..., :k]  # [..., chunks, k]
    values = mx.take_along_axis(split, local, axis=-1).reshape(*logits.shape[:-1], chunks * k)
    index = (local + mx.arange(chunks)[:, None] * size).reshape(values.shape)
    best = mx.argpartition(-values, k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(index, best, axis=-1)


def _pruning_chunk(vocab: int, k: int) -> int | None:
    """`_top_by_chunk_max`'s chunk for a top k over `vocab`, or None where pruning would not
    pay (too few chunks) or the chunks would not divide the row. 32 for a greedy top 16, 16
    for sampling's 128: on this project's CPU 0.10 against 0.49 ms for 7 rows of 8,192 and a
    top 16, 0.29 against 2.2 ms for 28 rows; 0.19 against 0.40 ms for 7 rows and a top 128
    (a timing script)."""
    size = 32 if k <= 32 else 16
    return size if vocab % size == 0 and vocab // size >= 4 * k else None


def _top_by_chunk_max(logits: mx.array, k: int, size: int) -> mx.array:
    """The top k of each row after pruning it to the k chunks of `size` logits with the
    largest maxima: a row's top k all lie in those chunks (the k-th largest chunk maximum is
    at most the k-th largest logit, since each of those chunks holds a logit at least that
    large; a chunk left out has a smaller maximum, or an equal one, and then a logit it holds
    ties the k-th). So one partition runs over k * size logits, not the whole row: the same
    set, up to which of tied logits it holds."""
    lead, V = logits.shape[:-1], logits.shape[-1]
    split = logits.reshape(*lead, V // size, size)
    chunks = mx.argpartition(-split.max(axis=-1), k - 1, axis=-1)[..., :k]  # [..., k]
    kept = mx.take_along_axis(split, chunks[..., None], axis=-2).reshape(*lead, k * size)
    local = mx.argpartition(-kept, k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(chunks, local // size, axis=-1) * size + local % size


class CandidateSelector(nn.Module):
    """DFlash 2: re-rank each row's top-k candidates by a low-rank (previous, next) bigram score."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    # The score of candidate c after previous token p, at a row with hidden state h:
    #   logit(c) + <successor(c), predecessor(p) * W h>
    # inference (DraftHead) and training (train/blocks.py) both compute it from these three.

    def project(self, hidden: mx.array) -> mx.array:
        """W h, in float32: [..., H] -> [..., rank]."""
        return self.hidden_projection(hidden).astype(mx.float32)

    def context(self, prev: mx.array, projected: mx.array) -> mx.array:
        """predecessor(p) * W h: previous tokens `prev` [...] against `projected` rows
        (broadcast): [..., rank]."""
        return self.predecessor_codebook[prev].astype(mx.float32) * projected

    def scores(self, context: mx.array, cand: mx.array, cand_logits: mx.array) -> mx.array:
        """Candidates `cand` [..., k] (their logits `cand_logits`) scored after each of P
        contexts [..., P, rank]: [..., P, k]."""
        succ = self.successor_codebook[cand].astype(mx.float32)  # [..., k, rank]
        return cand_logits[..., None, :] + context @ succ.swapaxes(-1, -2)


def _walk_rows(first: mx.array, after: mx.array, rows: int, choose) -> mx.array:
    """One block's picks, rows left to right ([rows]): row 0 chooses among `first` [k], row
    r > 0 among `after[r - 1]` [k prev, k] given row r - 1's pick; `choose(scores, r)` picks
    (an argmax, or a draw)."""
    picks, scores = [], first
    for r in range(rows):
        if r > 0:
            scores = after[r - 1][picks[-1]]  # [k]: given the previous row's pick
        picks.append(choose(scores, r))
    return mx.stack(picks)


class DraftHead(nn.Module):
    """Turns the body's hidden states into draft tokens (and their draft distribution q)."""

    def __init__(self, cfg: DrafterConfig, lm_head):
        super().__init__()
        self.cfg = cfg
        object.__setattr__(self, "lm_head", lm_head)  # the target's: bound, not our parameter
        if cfg.is_v2:
            self.candidate_selector = CandidateSelector(cfg)

    def logits(self, hidden: mx.array) -> mx.array:
        """[R, H] -> [R, V] with the config's multiplier and soft-cap."""
        logits = self.lm_head(hidden).astype(mx.float32)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if cap := self.cfg.final_logit_softcapping:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def select(
        self, hidden: mx.array, logits: mx.array, anchor: int, temperature: float, key=None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """DFlash 2 selection, rows left to right.

        Returns (tokens [R], candidate ids [R, k], candidate probabilities q [R, k]); greedy
        (temperature 0) takes the argmax and q is one-hot on it. Sampling draws row r with the
        r-th of `key`'s R splits (`key` required).
        """
        R = hidden.shape[0]
        anchors = mx.array([anchor])
        if temperature > 0:
            # its keys made outside the graph, so that one graph serves every key (mx.random's
            # implicit key would be a constant of the trace)
            if key is None:
                raise ValueError("a sampled selection needs a key")
            keys = mx.random.split(key, R)
            temp = mx.array(temperature, mx.float32)
            if not COMPILE_DRAFTS:
                return self._select_sampled(hidden, logits, anchors, temp, keys)
            # one compiled graph per block height: op by op, a block of 8 was ~300 graph nodes
            # built in Python every round (~180 of them computing ops; `mx.export_to_dot`)
            fn = self.__dict__.get("_compiled_sampled")
            if fn is None:  # the selector's weights are captured at the first trace
                fn = self.__dict__["_compiled_sampled"] = mx.compile(self._select_sampled)
            return fn(hidden, logits, anchors, temp, keys)
        cand, first, after = self._candidate_scores(
            hidden[None], logits[None], anchors, self.cfg.selector_top_k
        )
        cand, first, after = cand[0], first[0], after[0]
        idx = _walk_rows(first, after, R, lambda scores, r: mx.argmax(scores))[:, None]
        tokens = mx.take_along_axis(cand, idx, axis=-1)[:, 0]
        # q one-hot on each pick
        return tokens, cand, (mx.arange(cand.shape[-1])[None] == idx).astype(mx.float32)

    def _select_sampled(self, hidden, logits, anchors, temperature, keys):
        """`select` at `temperature` > 0 ([] float32) with one key a row (`keys` [R, 2])."""
        cand, first, after = self._candidate_scores(
            hidden[None], logits[None], anchors, SAMPLING_CANDIDATES
        )
        cand, first, after = cand[0], first[0], after[0]
        probs = []

        def draw(scores, r):
            probs.append(mx.softmax(scores / temperature))
            return mx.random.categorical(mx.log(probs[-1] + 1e-30), key=keys[r])

        idx = _walk_rows(first, after, hidden.shape[0], draw)[:, None]
        return mx.take_along_axis(cand, idx, axis=-1)[:, 0], cand, mx.stack(probs)

    def select_greedy(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        """`select` at temperature 0 for N blocks at once (a shared round, or one block):
        hidden [N, R, H], logits [N, R, V], anchors [N] -> tokens [N, R], each row's pick given
        its own block's previous pick, as `select` makes it alone. One compiled graph per
        (N, R): op by op its R gathers and argmaxes are that many kernel launches and graph
        nodes built in Python, a round's host time on a GPU."""
        if not COMPILE_DRAFTS:
            return self._select_greedy(hidden, logits, anchors)
        fn = self.__dict__.get("_compiled_select")
        if fn is None:  # the selector's weights are captured at the first trace (inference)
            fn = self.__dict__["_compiled_select"] = mx.compile(self._select_greedy)
        return fn(hidden, logits, anchors)

    def _select_greedy(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        N, R = hidden.shape[:2]
        cand, scores, after = self._candidate_scores(
            hidden, logits, anchors, self.cfg.selector_top_k
        )
        # each row's best candidate after every possible predecessor, in one argmax; the walk
        # is then one gather a row (an argmax and a gather a row took twice the kernels)
        best = mx.argmax(after, axis=-1) if R > 1 else None  # [N, R-1, k prev]
        picks = [mx.argmax(scores, axis=-1)]
        for r in range(1, R):
            picks.append(mx.take_along_axis(best[:, r - 1], picks[-1][:, None], axis=1)[:, 0])
        return mx.take_along_axis(cand, mx.stack(picks, axis=1)[..., None], axis=-1)[..., 0]

    def _candidate_scores(self, hidden, logits, anchors, top_k: int):
        """Blocks [N, R, H] / [N, R, V] after `anchors` [N]: (candidates [N, R, k], row 0's
        scores [N, k], rows 1..R-1's scores for every previous candidate [N, R-1, k, k])."""
        sel = self.candidate_selector
        k = min(max(top_k, self.cfg.selector_top_k), logits.shape[-1])
        cand = top_candidates(logits, k)  # [N, R, k]
        cand_logits = mx.take_along_axis(logits, cand, axis=-1)
        proj = sel.project(hidden)  # [N, R, rank]
        # Every row's scores for every possible predecessor: row 0 follows the anchor, row
        # r > 0 one of row r-1's k candidates ([R-1, k prev, k]). The left-to-right choice is
        # then a gather and an argmax (or a draw) a row.
        first = sel.scores(sel.context(anchors, proj[:, 0])[:, None], cand[:, 0], cand_logits[:, 0])
        after = sel.scores(
            sel.context(cand[:, :-1], proj[:, 1:, None]), cand[:, 1:], cand_logits[:, 1:]
        )
        return cand, first[:, 0], after


@dataclass
class Drafter:
    """A loaded drafter: config, body, head (head only where the target's LM head lives)."""

    cfg: DrafterConfig
    body: DraftBody | None
    head: DraftHead | None
    bits: int = 0
    path: Path | None = None

    @property
    def block_size(self) -> int:
        return self.cfg.block_size


def validate_against_target(
    cfg: DrafterConfig, num_layers: int, hidden: int, vocab: int, where: str
):
    """Fail at load, naming the mismatch, rather than producing garbage drafts."""
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise CheckpointError(
            f"{where}: target_layer_ids {bad} are beyond the target's depth ({num_layers} layers)"
        )
    if cfg.hidden_size != hidden:
        raise CheckpointError(
            f"{where}: drafter hidden_size {cfg.hidden_size} != target hidden size {hidden}"
        )
    if cfg.vocab_size != vocab:
        raise CheckpointError(
            f"{where}: drafter vocab_size {cfg.vocab_size} != target vocab {vocab}"
        )
    if not 0 <= cfg.mask_token_id < vocab:
        raise CheckpointError(f"{where}: mask_token_id {cfg.mask_token_id} outside the vocabulary")


def _quantizable(bits: int):
    def predicate(_path: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and module.weight.shape[-1] % 64 == 0

    return predicate


def load_drafter(
    path_or_id: str | Path,
    target=None,
    *,
    block_size: int | None = None,
    bits: int = 0,
    parts: str = "both",
    target_shape: tuple[int, int, int] | None = None,
    keep_dtype: bool = False,
) -> Drafter:
    """Load a DFlash / DFlash 2 checkpoint, checked against the target.

    `parts`: "both" (inline), "body" (a drafter process: no vocabulary-sized weights) or "head"
    (the verifier's side). `bits` 4 or 8 quantizes the body at load (0 or 16: none).
    `target_shape` = (num_layers, hidden, vocab) stands in for `target` where it is not loaded.
    `keep_dtype`: keep the checkpoint's dtype on the CPU too (by default widened to float32).
    """
    cpu.prepare()  # a drafter process may load no target: engine/cpu.py
    path = resolve_checkpoint(path_or_id)
    raw = read_config(path)
    cfg = DrafterConfig.from_dict(raw, where=str(path))
    if block_size:
        if block_size < 2:
            raise ValueError(f"block size must be at least 2, got {block_size}")
        cfg = replace(cfg, block_size=int(block_size))
    if target is not None:
        target_shape = (target.num_layers, target.hidden_size, target.vocab_size)
    if target_shape is not None:
        validate_against_target(cfg, *target_shape, where=str(path))
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: missing weights (no model*.safetensors)")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    tap_width = len(cfg.target_layer_ids) * cfg.hidden_size
    body = head = None
    if parts in ("both", "body"):
        body = DraftBody(cfg, tap_width)
        if stored := raw.get("quantization"):  # saved quantized to stay small (train/pack.py)
            nn.quantize(body, stored["group_size"], stored["bits"], class_predicate=_quantizable(0))
        _load_weights(
            body,
            {k: v for k, v in weights.items() if not k.startswith("candidate_selector.")},
            path,
        )
        if stored:
            dequantize_model(body)
        if mx.default_device() == mx.cpu and not keep_dtype:
            body.set_dtype(mx.float32)  # half precision is 3-4x slower than fp32 on MLX's CPU
        if bits and bits not in (16, 0):
            if bits not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"drafter bits must be 0/16 (none) or one of 2-8, got {bits}")
            nn.quantize(body, group_size=64, bits=bits, class_predicate=_quantizable(bits))
        mx.eval(body.parameters())
        fused.fuse_drafter(body)  # q/k/v and gate/up each one product
        if bits == 4:  # on CUDA, a block's few-row products through the checked 4-bit kernel
            cuda.prepare_linear(body)
        cuda.prepare_drafter(body)  # on CUDA, the block attention and convolutions fused
    if parts in ("both", "head"):
        if target is None and parts == "both":
            raise ValueError("the head needs the target's LM head")
        head = DraftHead(cfg, target.lm_head if target is not None else None)
        if cfg.is_v2:
            _load_weights(
                head,
                {k: v for k, v in weights.items() if k.startswith("candidate_selector.")},
                path,
            )
        mx.eval(head.parameters())
    return Drafter(cfg, body, head, bits if bits not in (0, 16) else 0, path)


def _load_weights(module: nn.Module, weights: dict, path: Path) -> None:
    expected = {k for k, _ in _flat(module.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing weights {', '.join(missing[:5])}{more}")
    shapes = dict(_flat(module.parameters()))
    for k in expected:
        if tuple(weights[k].shape) != tuple(shapes[k].shape):
            raise CheckpointError(
                f"{path}: weight {k} has shape {tuple(weights[k].shape)}, "
                f"config implies {tuple(shapes[k].shape)}"
            )
    module.load_weights([(k, weights[k]) for k in expected], strict=True)


def _flat(tree, prefix=""):
    from mlx.utils import tree_flatten

    return tree_flatten(tree, prefix=prefix)
