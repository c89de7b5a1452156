"""The target model: an mlx-lm model driven layer by layer, so that we get hidden-state taps,
one-pass block verification with a rollback tape, prefill split at rung positions, and
snapshots of the recurrent state.

Knows nothing about drafters, tokenization policy, prompt caches, Ray or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache
from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

from ...settings import KV_MODES
from ..kernels import cpu, cuda, fused, platform, sdpa
from . import attention, gdn, stacks
from .checkpoint import CheckpointError, read_config, resolve_checkpoint
from .gdn import COMPILE_MAX_ROWS, GDNBatchTape, GDNTape

# mlx-lm model types whose layers are all full attention or Gated DeltaNet.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")
PREFILL_CHUNK = 2048
# On a GPU a forward hands every this many layers to the device as soon as they are built
# (mx.async_eval), so the device runs the first layers while Python builds the rest; on the
# CPU the same thread would do both, so there it does not (platform.Platform.async_layers).
ASYNC_LAYERS = 16


@dataclass
class VerifyTape:
    """What a verify pass leaves behind so that `Target.rollback` can undo its tail rows."""

    start: int  # tokens in the cache before the pass
    num_rows: int
    gdn: list[GDNTape]

    def recurrent_state_at(self, rows: int) -> list[tuple[mx.array, mx.array]]:
        """The GDN layers' state after the first `rows` rows of the pass (position start + rows),
        as `Target.recurrent_state` gives it; the cache is not touched."""
        return [entry.state_at(rows) for entry in self.gdn]


@dataclass
class BatchTape:
    """What a shared verify pass (engine/decode/batch.py) leaves behind: each sequence's VerifyTape,
    and per GDN layer the stacked tape theirs are rows of (`Target.rollback_batch`)."""

    tapes: list[VerifyTape]
    gdn: list[GDNBatchTape]


class Target:
    """A loaded target model with its tokenizer and the few views into it that we need."""

    def __init__(self, model: nn.Module, tokenizer, config: dict, path: Path | None = None):
        cpu.prepare()  # on the CPU, before anything compiles: MLX's JIT with the host's ISA
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.path = path
        text = model.language_model if "language_model" in model else model
        inner = text.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = text.lm_head if "lm_head" in text else inner.embed_tokens.as_linear
        self.num_layers = len(self.layers)
        self.hidden_size = self.embed_tokens.weight.shape[-1]
        if hasattr(self.embed_tokens, "scales"):  # quantized embedding packs its columns
            self.hidden_size = self.embed_tokens.weight.shape[-1] * 32 // self.embed_tokens.bits
        text_config = config.get("text_config", config)
        self.vocab_size = int(text_config["vocab_size"])
        self.model_type = config["model_type"]
        self.is_gdn = [bool(getattr(layer, "is_linear", False)) for layer in self.layers]
        self._first_attn = next((i for i, g in enumerate(self.is_gdn) if not g), None)
        self._first_gdn = next((i for i, g in enumerate(self.is_gdn) if g), None)
        self._compiled_mlp: dict = {}
        self._plans: dict = {}
        self.async_layers = ASYNC_LAYERS if platform.current().is_gpu else 0
        max_pos = text_config.get("max_position_embeddings") or 32768
        self.max_context = int(max_pos)
        self.dtype = self.embed_tokens(mx.array([0])).dtype  # the activations'
        # 8-bit KV read through dequantized copies (MLX CUDA lacks the quantized attention)
        self.dequantize_q8 = cuda.q8_dequantized()
        mixers = [layer.linear_attn for layer, g in zip(self.layers, self.is_gdn) if g]
        shapes = {(m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim) for m in mixers}
        cuda.prepare(
            shapes, self.dtype, gdn.use_block_kernel
        )  # on CUDA: check the fused GDN kernel on these
        # multi-row passes: each layer's sibling input projections as one product
        self.fused_groups = fused.fuse_target(self.layers)
        cuda.prepare_linear(model)  # on CUDA: few-row 4-bit matmuls through a checked kernel

    # ---- caches -------------------------------------------------------------------------
    def make_cache(self, kv_mode: str = "fp16") -> list:
        """One cache per layer: ArraysCache for GDN layers, KV (fp16) or 8-bit KV for attention."""
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv mode must be one of {KV_MODES}, got {kv_mode!r}")
        return [
            ArraysCache(size=2)
            if gdn
            else (QuantizedKVCache(group_size=64, bits=8) if kv_mode == "q8" else KVCache())
            for gdn in self.is_gdn
        ]

    # ---- forward ------------------------------------------------------------------------
    def forward(
        self,
        tokens: mx.array,
        cache: list,
        tap_ids: tuple[int, ...] = (),
        all_logits: bool = True,
        tape: list | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Run `tokens` ([S] int) on top of `cache`.

        Returns logits ([S, V], or [1, V] for the last row when `all_logits` is False) and the
        taps ([S, len(tap_ids) * H], outputs of the listed layers) or None. With `tape`, GDN
        layers record what `rollback` needs.
        """
        stacks.release(cache)  # its caches stop being rows of a shared pass's buffers
        h = self.embed_tokens(tokens[None])  # [1, S, H]
        S = h.shape[1]
        attn_mask = (
            cuda.attention_mask(h, cache[self._first_attn])
            if self._first_attn is not None
            else None
        )
        taped = tape is not None
        wanted = {layer_id: None for layer_id in tap_ids}
        for i, (layer, c, fn) in enumerate(zip(self.layers, cache, self._plan(S, taped))):
            if fn is not None:  # a GDN layer: norm, mixer, residual and MLP in one call
                conv, state_in = gdn.cache_states(layer.linear_attn, c, 1, h.dtype)
                h, c[0], c[1], extra = fn(h, conv, state_in)
                c.advance(S)
                if taped:
                    conv_input, parts = extra
                    tape.append(
                        gdn.tape_entry(layer.linear_attn, c, conv_input, state_in, S, parts)
                    )
            else:
                if self.dequantize_q8 and isinstance(c, QuantizedKVCache):
                    c = DequantizedView(c)
                x = layer.input_layernorm(h)
                if taped and sdpa.grouped_rows(S):  # a verify on the CPU: kernels/sdpa.py
                    r = attention.attention_over(layer.self_attn, x, [attn_mask], [c])
                else:
                    r = layer.self_attn(x, attn_mask, c)
                h = self._residual_mlp(layer, h, r)
            if i in wanted:
                wanted[i] = h
            self.hand_on(i, h)
        taps = mx.concatenate([wanted[i] for i in tap_ids], axis=-1)[0] if tap_ids else None
        out = h[0] if all_logits else h[0, -1:]
        return self.lm_head(self.norm(out)), taps

    def hand_on(self, layer_id: int, h: mx.array) -> None:
        """After layer `layer_id` of a multi-row pass (a verify, a prefill chunk): on a GPU,
        every `async_layers` layers, start the device on what is built so far (ASYNC_LAYERS).
        A decode step does not: plain decoding already builds step n+1 while the device runs
        step n, and a hand-on there did not change a synced step's time."""
        n = self.async_layers
        if n and h.shape[1] > 1 and layer_id % n == n - 1 and layer_id + 1 < self.num_layers:
            mx.async_eval(h)

    def _plan(self, rows: int, taped: bool) -> list:
        """Per layer, what a forward of `rows` rows runs: a GDN layer's whole function, or None
        (attention: mlx-lm's module, then the compiled residual and MLP). Cached for the
        compiled row counts."""
        key = None
        if self._first_gdn is not None:  # what gdn.layer_for's compiled graphs depend on
            key = gdn._compiled_key(self.layers[self._first_gdn].linear_attn, taped, rows)
        if key is not None:
            key = (rows, *key[1:], gdn.BLOCK_KERNEL_MAX_ROWS, mx.default_device().type)
            plan = self._plans.get(key)
            if plan is not None:
                return plan
        plan = [
            gdn.layer_for(layer, taped, rows, _residual_mlp) if g else None
            for layer, g in zip(self.layers, self.is_gdn)
        ]
        if key is not None:
            self._plans[key] = plan
        return plan

    def drop_compiled(self) -> None:
        """Forget the compiled forward graphs: they keep the kernels they were traced with, so
        after swapping how a layer computes (qmm_cuda.disabled, say) they must be traced again."""
        self._plans.clear()
        self._compiled_mlp.clear()
        gdn._compiled.clear()

    def _residual_mlp(self, layer, h: mx.array, r: mx.array) -> mx.array:
        """h + r, then the layer's MLP block: compiled for decode-sized row counts."""
        if h.shape[1] > COMPILE_MAX_ROWS:
            return _residual_mlp(layer, h, r)
        fn = self._compiled_mlp.get(id(layer))
        if fn is None:
            fn = self._compiled_mlp[id(layer)] = mx.compile(lambda h, r: _residual_mlp(layer, h, r))
        return fn(h, r)

    def verify(
        self, block: mx.array, cache: list, tap_ids: tuple[int, ...]
    ) -> tuple[mx.array, mx.array, VerifyTape]:
        """Run a draft block ([L] ints: anchor + drafts) in one forward, keeping a rollback tape."""
        gdn_tape: list[GDNTape] = []
        start = cache_offset(cache)
        width = int(block.shape[0])
        if (rows := cuda.verify_width(width)) > width:  # rows after the block: causal, dropped
            block = mx.pad(block, (0, rows - width))  # by the rollback (keep <= width)
        logits, taps = self.forward(block, cache, tap_ids, all_logits=True, tape=gdn_tape)
        if rows > width:
            logits, taps = logits[:width], taps[:width] if taps is not None else None
        return logits, taps, VerifyTape(start, width, gdn_tape)

    @staticmethod
    def rollback(cache: list, tape: VerifyTape, keep: int) -> list[mx.array]:
        """Keep only the first `keep` rows of the verified block in every layer's cache.
        Positions are absolute, so rolling back again to a smaller `keep` is fine. Returns the
        new (lazy) recurrent states; attention KV is only trimmed, nothing to compute."""
        if not 0 <= keep <= tape.num_rows:
            raise ValueError(f"keep={keep} outside 0..{tape.num_rows}")
        if cache_offset(cache) == tape.start + keep:
            return []
        for entry in tape.gdn:
            entry.rollback(keep)
        _trim_attention(cache, tape.start + keep)
        return _states(tape)

    @staticmethod
    def rollback_batch(caches: list[list], tape: BatchTape, keeps: list[int]) -> list[mx.array]:
        """`rollback` of each sequence of a shared verify pass to its own keep, the GDN layers
        of all of them together (one op per layer where the tape allows: GDNBatchTape); each
        cache ends as its own `rollback` leaves it, to the bit."""
        todo = {}  # sequence -> keep, those whose cache holds rows past it
        for n, (cache, seq_tape, keep) in enumerate(zip(caches, tape.tapes, keeps)):
            if not 0 <= keep <= seq_tape.num_rows:
                raise ValueError(f"keep={keep} outside 0..{seq_tape.num_rows}")
            if cache_offset(cache) != seq_tape.start + keep:
                todo[n] = keep
        for layer in tape.gdn:
            layer.rollback(todo)
        for n, keep in todo.items():
            _trim_attention(caches[n], tape.tapes[n].start + keep)
        return [a for n in todo for a in _states(tape.tapes[n])]

    def prefill(
        self,
        tokens: list[int],
        cache: list,
        tap_ids: tuple[int, ...] = (),
        stops: tuple[int, ...] = (),
        on_stop=None,
        chunk: int = PREFILL_CHUNK,
        split_last: bool = True,
    ) -> tuple[mx.array, list[mx.array]]:
        """Run the prompt in forward calls that end at every position in `stops` (absolute token
        counts, e.g. ladder rungs) and at most `chunk` tokens apart. After a call that ends at a
        stop, `on_stop(position)` runs (to snapshot state there: rungs can only sit at forward-call
        boundaries). Returns the last row's logits ([1, V]) and the taps of each call.
        With `split_last` the last token runs alone, as in mlx-lm's generate_step: the first
        completion token then comes from a one-row step, bit for bit what mlx-lm decodes.
        """
        start = cache_offset(cache)
        end = start + len(tokens)
        last = {end - 1} if split_last and end - 1 > start else set()
        cuts = sorted({p for p in stops if start < p <= end} | {end} | last)
        taps_out, logits, pos = [], None, start
        for cut in cuts:
            while pos < cut:
                step_end = min(cut, pos + chunk)
                piece = mx.array(tokens[pos - start : step_end - start])
                logits, taps = self.forward(piece, cache, tap_ids, all_logits=False)
                if taps is not None:
                    taps_out.append(taps)
                mx.eval(logits, taps if taps is not None else logits)
                pos = step_end
            if on_stop is not None and cut in stops:
                on_stop(cut)
        return logits, taps_out

    def truncate(self, cache: list, offset: int, states: list[tuple[mx.array, mx.array]]) -> None:
        """Undo the last forward calls: attention KV trimmed to `offset` tokens, GDN layers back
        to `states` (what `recurrent_state` returned at that offset)."""
        _trim_attention(cache, offset)
        self.restore_recurrent_state(cache, states)

    # ---- recurrent snapshots ------------------------------------------------------------
    def recurrent_state(self, cache: list) -> list[tuple[mx.array, mx.array]]:
        """(conv state, recurrent state) of every GDN layer: what a ladder rung stores."""
        return [(cache[i][0], cache[i][1]) for i, g in enumerate(self.is_gdn) if g]

    def restore_recurrent_state(self, cache: list, states: list[tuple[mx.array, mx.array]]) -> None:
        stacks.release(cache)
        gdn_ids = [i for i, g in enumerate(self.is_gdn) if g]
        if len(states) != len(gdn_ids):
            raise ValueError(f"snapshot has {len(states)} GDN layers, model has {len(gdn_ids)}")
        for i, (conv, state) in zip(gdn_ids, states):
            cache[i][0], cache[i][1] = conv, state


class DequantizedView:
    """An 8-bit KV cache as mlx-lm's attention sees it when MLX lacks the quantized attention
    kernel (CUDA): the new K/V are stored 8-bit as usual, and the attention gets dequantized
    copies ([B, kv_heads, T, head_dim], the scales' dtype). Having no `bits` attribute, it sends
    mlx-lm's SDPA down the plain path."""

    def __init__(self, cache: QuantizedKVCache):
        self.cache = cache

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        c = self.cache
        qk, qv = c.update_and_fetch(keys, values)
        return (
            mx.dequantize(*qk, group_size=c.group_size, bits=c.bits),
            mx.dequantize(*qv, group_size=c.group_size, bits=c.bits),
        )


def _residual_mlp(layer, h: mx.array, r: mx.array) -> mx.array:
    # the second half of mlx-lm's DecoderLayer.__call__ (same for every supported model type)
    h = h + r
    return h + fused.gated_mlp(layer.mlp, layer.post_attention_layernorm(h))


def _trim_attention(cache: list, offset: int) -> None:
    """Attention KV back to `offset` tokens (trimming is all it takes: positions are absolute)."""
    for c in cache:
        if c.is_trimmable() and c.offset > offset:  # attention KV; GDN state is not trimmable
            c.trim(c.offset - offset)


def _states(tape: VerifyTape) -> list[mx.array]:
    """The (lazy) GDN states a rollback along `tape` left in the cache."""
    return [a for entry in tape.gdn for a in entry.cache.state if a is not None]


def cache_offset(cache: list) -> int:
    """Number of tokens the cache holds (attention offset, or GDN-only models: tracked lengths)."""
    for c in cache:
        if c.is_trimmable():  # attention KV (mlx-lm's cache protocol); GDN state is not
            return c.offset
    raise ValueError("GDN-only targets are not supported: no attention layer to count positions")


def load_target(path_or_id: str | Path, keep_dtype: bool = False) -> Target:
    """Load any supported mlx-lm target (quantized or not) with its tokenizer, offline.

    On the CPU the weights are widened to float32 (MLX's CPU matmuls are faster there)
    unless `keep_dtype`: then the model computes in the checkpoint's own dtype, as on a GPU."""
    path = resolve_checkpoint(path_or_id)
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: unknown or unsupported architecture model_type={model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if not list(path.glob("model*.safetensors")):
        raise CheckpointError(f"{path}: missing weights (no model*.safetensors)")
    try:
        model, config = load_model(path)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: config.json is missing a field the model needs: {exc}"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: weights do not match the config: {exc}") from None
    if platform.current().is_cpu and not keep_dtype:
        # MLX's CPU matmuls: float32 is faster than half/quantized
        unpack = bool(config.get("dequantize_on_cpu"))  # quantized only to stay small (pack.py)
        if unpack:
            dequantize_model(model)
        if unpack or not ({"quantization", "quantization_config"} & set(config)):
            model.set_dtype(mx.float32)
    mx.eval(model.parameters())  # materialise now, not inside every (compiled) forward
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return Target(model, tokenizer, config, path)
