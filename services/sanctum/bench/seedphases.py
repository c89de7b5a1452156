"""Where a forward's time goes, for `sanctum bench seed`: each piece of a layer timed alone at
1, 4, 8 and 16 rows on the prefilled context (GDN mixer, attention mixer, MLP, LM head; the GDN
mixer's projections, conv, recurrence and output; the drafter's body, head and selector).

A piece is timed as `reps` independent copies built into one graph and evaluated once, so a
few-microsecond kernel is not drowned by the host sync; its graph building is included.
Everything here only reads the caches it is given (attention writes go to copies).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from ..engine.model import gdn
from ..engine.model.target import DequantizedView, Target


def per_call_ms(build: Callable[[], list], reps: int = 8, rounds: int = 3) -> float:
    """Median over `rounds` of (time to build and evaluate `reps` copies of `build()`) / reps."""
    mx.eval(build())  # warm: compiled graphs, kernels
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([build() for _ in range(reps)])
        times.append((time.perf_counter() - t0) / reps)
    return round(1000 * statistics.median(times), 4)


def _copy_gdn_cache(c: ArraysCache) -> ArraysCache:
    out = ArraysCache(size=2)
    out[0], out[1] = c[0], c[1]
    return out


def _copy_kv(c):
    if isinstance(c, QuantizedKVCache):
        out = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    else:
        out = KVCache()
    out.keys, out.values, out.offset = c.keys, c.values, c.offset
    return out


def layer_phases(target: Target, cache: list, rows=(1, 4, 8, 16), reps: int = 8) -> dict:
    """ms per call of one layer's pieces at each row count, on `cache` (prefilled context)."""
    gdn_i = target.is_gdn.index(True) if any(target.is_gdn) else None
    attn_i = target.is_gdn.index(False)
    H = target.hidden_size
    out: dict = {"gdn_mixer": {}, "attention_mixer": {}, "mlp": {}, "lm_head": {}}
    for L in rows:
        x = (mx.random.normal((1, L, H)) * 0.5).astype(target.dtype)
        mx.eval(x)
        if gdn_i is not None:
            layer, c = target.layers[gdn_i], cache[gdn_i]

            def run_gdn(layer=layer, c=c, x=x, L=L):
                c2 = _copy_gdn_cache(c)
                tape = [] if L > 1 else None  # a verify keeps its tape
                y = gdn.gdn_forward(layer.linear_attn, layer.input_layernorm(x), c2, tape)
                extra = [
                    a for t in tape or [] for a in (t.chunk_parts or t.inputs or (t.row_states,))
                ]
                return [y, c2[0], c2[1], *extra]

            out["gdn_mixer"][L] = per_call_ms(run_gdn, reps)
        layer, c = target.layers[attn_i], cache[attn_i]

        def run_attn(layer=layer, c=c, x=x):
            c2 = _copy_kv(c)
            view = DequantizedView(c2) if target.dequantize_q8 and hasattr(c2, "bits") else c2
            mask = create_attention_mask(x, c2)
            return [layer.self_attn(layer.input_layernorm(x), mask, view)]

        out["attention_mixer"][L] = per_call_ms(run_attn, reps)
        layer = target.layers[attn_i]
        out["mlp"][L] = per_call_ms(
            lambda layer=layer, x=x: [target._residual_mlp(layer, x, x)], reps
        )
        out["lm_head"][L] = per_call_ms(lambda x=x: [target.lm_head(target.norm(x[0]))], reps)
    if gdn_i is not None:
        out["gdn_parts"] = {
            L: gdn_parts(target.layers[gdn_i].linear_attn, cache[gdn_i], target.dtype, L, reps)
            for L in (1, 8)
        }
    return out


def gdn_parts(mod: nn.Module, c: ArraysCache, dtype: mx.Dtype, L: int, reps: int) -> dict:
    """The GDN mixer's pieces at L rows, each on precomputed inputs (uncompiled), and the
    recurrence by each available path."""
    x = (mx.random.normal((1, L, mod.hidden_size)) * 0.5).astype(dtype)
    qkv, z, b, a = gdn._project(mod, x)
    conv_in = mx.concatenate([c[0], qkv], axis=1)
    conv_out = nn.silu(mod.conv1d(conv_in))
    q, k, v = [
        t.reshape(1, L, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [mod.key_dim, 2 * mod.key_dim], -1),
            [mod.num_k_heads, mod.num_k_heads, mod.num_v_heads],
            [mod.head_k_dim, mod.head_k_dim, mod.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=mod.head_k_dim**-0.5, eps=1e-6)
    beta = mx.sigmoid(b)
    log_g = -mx.exp(mod.A_log.astype(mx.float32)) * nn.softplus(a + mod.dt_bias)
    state = c[1]
    y, _ = gdn.recurrence(q, k, v, log_g, beta, state)
    mx.eval(x, qkv, z, b, a, conv_in, q, k, v, beta, log_g, state, y)
    w = mod.conv1d.weight  # [C, K, 1]

    def conv_sum():  # the depthwise conv as K shifted multiply-adds (an alternative)
        K = w.shape[1]
        return [nn.silu(sum(conv_in[:, j : j + L] * w[:, j, 0] for j in range(K)))]

    parts = {
        "projections": per_call_ms(lambda: list(gdn._project(mod, x)), reps),
        "conv": per_call_ms(lambda: [nn.silu(mod.conv1d(conv_in))], reps),
        "conv_as_sum": per_call_ms(conv_sum, reps),
        "recurrence": per_call_ms(lambda: list(gdn.recurrence(q, k, v, log_g, beta, state)), reps),
        "recurrence_mlx_lm_ops": per_call_ms(
            lambda: list(gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)), reps
        ),
        "output": per_call_ms(lambda: [mod.out_proj(mod.norm(y, z).reshape(1, L, -1))], reps),
    }
    if L > 1:
        parts["recurrence_chunked"] = per_call_ms(
            lambda: list(gdn.chunked_gated_delta(q, k, v, log_g, beta, state)), reps
        )
    return parts


def drafter_phases(target: Target, drafter, ctx_taps: mx.array, reps: int = 8) -> dict:
    """The drafter's body over a block with `ctx_taps` ([C, n_taps * H]) as context, its head's
    logits over the L-1 draft rows (and padded to a multiple of 8: MLX CUDA's 4-bit matmul costs
    a one-row kernel per row below 8 rows), and DFlash 2's selector."""
    body, head, L = drafter.body, drafter.head, drafter.block_size
    cache = body.make_cache()
    start = ctx_taps.shape[0]
    embeds = target.embed_tokens(mx.array([1] + [drafter.cfg.mask_token_id] * (L - 1)))
    mx.eval(body(embeds[None], start, ctx_taps[None], cache), *(c.keys for c in cache))
    hidden = body(embeds[None], start, None, cache)[0, 1:]
    logits = head.logits(hidden)
    mx.eval(hidden, logits)
    pad = (-hidden.shape[0]) % 8
    padded = mx.concatenate([hidden, mx.zeros((pad, hidden.shape[1]), hidden.dtype)])
    out = {
        "body": per_call_ms(lambda: [body(embeds[None], start, None, cache)], reps),
        "head_logits": per_call_ms(lambda: [head.logits(hidden)], reps),
        "head_logits_padded_to_8": per_call_ms(lambda: [head.logits(padded)], reps),
    }
    if drafter.cfg.is_v2:
        out["select"] = per_call_ms(lambda: list(head.select(hidden, logits, 1, 0.0)), reps)
    return out
