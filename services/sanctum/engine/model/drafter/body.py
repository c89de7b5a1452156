"""The drafter body: its layers over a block and the context of taps."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ...kernels import draft_cuda, fused
from ...kernels.draft_reference import grouped_dynamic_conv
from ...kernels.sdpa import scaled_dot_product_attention
from .config import DrafterConfig
from .context import (
    BufferContext,
    ContextCache,
    FetchedContext,
    buffer_block_mask,
)

# A draft body whose layers all slide runs them as one compiled graph (DraftBody._compilable);
# False: op by op always.
COMPILE_DRAFTS = True
# Before its windows fill, compiled over contexts padded to buckets (ContextCache.bucket), on
# every device; False: op by op until the windows are full. On a GPU op by op the draft is
# host-bound; on the CPU, with the JIT's vectorized kernels (kernels/cpu.py), the compiled
# stack beats op by op too, padding included (docs/performance.md).
PAD_TO_BUCKETS = True


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

    def kernels(self, x: mx.array) -> mx.array:
        """The dynamic part of each row's kernels: [B, L, 2, K, H / group, 1]."""
        B, L, H = x.shape
        dyn = self.kernel_projection(x)
        return dyn.reshape(B, L, 2, self.kernel, H // self.group, 1)

    def apply(self, x: mx.array, dyn: mx.array, which: int) -> mx.array:
        """out[l] = sum over o of (base[o] + dyn[l, o]) * x[l - o], zero before the block."""
        return grouped_dynamic_conv(x, dyn, self.base_kernel, which, self.kernel, self.group)


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
