"""Random-weight checkpoints in the seed's shapes, for `sanctum bench seed`.

The target is the real Qwen3.5-27B text config (64 layers, hidden 5120, GDN 16 key / 48 value
heads of 128, attention 24 / 4 heads of 256, untied embedding, vocabulary 248,320) quantized to
4 bits in groups of 64, as mlx-community ships it; the drafter is the seed's DFlash 2 (5 sliding
layers at hidden 5120, block 8, taps [5, 19, 33, 47, 61], bf16, the published layout).
Both go to disk in the Hugging Face layout and load through `load_target` / `load_drafter`.

The 4-bit weights are written packed, never as bf16: random nibbles with one scale and bias per
group that centre them and give each matrix a 1/sqrt(fan_in) spread (the output projections
half that), so the residual stream stays finite through 64 layers. Shards are written a few
layers at a time, so the build never holds more than a shard beyond what MLX frees.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from ..engine.model.drafter import DraftBody, DraftHead
from ..engine.model.drafter.config import DrafterConfig
from ..tiny import TINY_TOKENIZER, copy_tokenizer, to_hf_weights

SEED_TAPS = (5, 19, 33, 47, 61)
SEED_LAYERS = 64
QWEN35_MASK_TOKEN = 248070
BITS, GROUP = 4, 64
_NIBBLE_STD = (255 / 12) ** 0.5  # std of a uniform nibble 0..15
_OUTPUT_PROJ = ("o_proj", "out_proj", "down_proj")  # write into the residual stream


@dataclass(frozen=True)
class SeedShape:
    """What `--layers` and the scale-down flags change; the head shapes are always the seed's."""

    layers: int = SEED_LAYERS
    hidden: int = 5120
    intermediate: int = 17408
    vocab: int = 248320
    drafter_layers: int = 5
    drafter_intermediate: int | None = None  # None: the target's

    def key(self) -> str:
        d_int = self.drafter_intermediate or self.intermediate
        return (
            f"L{self.layers}-H{self.hidden}-I{self.intermediate}-V{self.vocab}"
            f"-D{self.drafter_layers}x{d_int}"
        )

    @property
    def tap_ids(self) -> list[int]:
        """The seed's taps, scaled to a shallower target (64 layers: exactly the seed's)."""
        return [min(self.layers - 1, t * self.layers // SEED_LAYERS) for t in SEED_TAPS]

    @property
    def mask_token_id(self) -> int:
        return QWEN35_MASK_TOKEN if self.vocab > QWEN35_MASK_TOKEN else self.vocab - 2


SMALL = SeedShape(hidden=256, intermediate=512, vocab=8192, drafter_layers=2)


def target_config(shape: SeedShape) -> dict:
    """The Qwen3.5-27B config.json (text part), at `shape`'s depth and width."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        # every 4th layer is attention; a shallower target keeps at least its last one
        "full_attention_interval": min(4, shape.layers),
        "attn_output_gate": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "eos_token_id": 0,
        "dtype": "bfloat16",
    }
    q = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    # on a CPU the loader unpacks it to float32: MLX's CPU 4-bit/bf16 kernels are ~100x slower
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
        "quantization": q,
        "quantization_config": q,
        "dequantize_on_cpu": True,
    }


def drafter_config(shape: SeedShape, block_size: int = 8) -> dict:
    """The seed's DFlash 2 drafter in the published layout (is_causal false, all layers
    sliding with window 2048, block_size inside dflash_config)."""
    n = shape.drafter_layers
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "num_hidden_layers": n,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": shape.drafter_intermediate or shape.intermediate,
        "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
        "max_position_embeddings": 262144,
        "num_target_layers": shape.layers,
        "layer_types": ["sliding_attention"] * n,
        "sliding_window": 2048,
        "is_causal": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {
            "block_size": block_size,
            "target_layer_ids": shape.tap_ids,
            "mask_token_id": shape.mask_token_id,
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
            "input_embedding_scale": 1.0,
            "output_multiplier": 1.0,
        },
    }


def _packed(shape: tuple[int, ...], fan_in: int, std: float, key) -> dict[str, mx.array]:
    """A 4-bit affine-quantized matrix [*shape] given as (weight, scales, biases) of random
    nibbles: mean 0, spread `std`."""
    rows, cols = shape
    lo, hi = (
        mx.random.randint(0, 1 << 16, (rows, cols * BITS // 32), dtype=mx.uint32, key=k)
        for k in mx.random.split(key)
    )
    packed = lo | (hi << 16)  # 8 uniform nibbles per word (16-bit draws are exact in float32)
    scale = std / _NIBBLE_STD
    groups = (rows, cols // GROUP)
    return {
        "weight": packed,
        "scales": mx.full(groups, scale, mx.bfloat16),
        "biases": mx.full(groups, -7.5 * scale, mx.bfloat16),
    }


def _target_weights(model: nn.Module, seed: int) -> dict[str, mx.array]:
    """mlx-lm parameter names -> random arrays of the seed checkpoint's dtypes (lazy)."""
    key = mx.random.key(seed)
    out = {}
    for name, v in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue  # written with their weight
        if v.dtype == mx.uint32:  # a quantized matrix: [out, in * bits / 32] packed
            cols = v.shape[-1] * 32 // BITS
            if name.endswith("embed_tokens.weight"):
                std = 1.0
            else:
                std = (0.5 if prefix.rsplit(".", 1)[-1] in _OUTPUT_PROJ else 1.0) / cols**0.5
                std *= 3.0 if name.endswith("lm_head.weight") else 1.0  # peaked logits
            for leaf_name, arr in _packed((v.shape[0], cols), cols, std, sub).items():
                out[f"{prefix}.{leaf_name}"] = arr
        elif leaf == "A_log":
            out[name] = mx.log(mx.random.uniform(1.0, 16.0, v.shape, key=sub))  # float32
        elif leaf == "dt_bias" or v.ndim == 1:
            out[name] = mx.ones(v.shape, mx.bfloat16)  # norms, dt_bias
        else:  # the depthwise conv [C, K, 1]
            out[name] = (0.5 * mx.random.normal(v.shape, key=sub)).astype(mx.bfloat16)
    return out


def _save_shards(out: Path, weights: dict[str, mx.array], max_bytes: int = 2 << 30) -> None:
    """safetensors shards of at most ~`max_bytes` (each computed, written, then dropped), with
    the index mlx-lm and HF expect. Empties `weights`."""
    shards, current, size = [], [], 0
    for name in sorted(weights):
        nbytes = weights[name].nbytes
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    total = sum(a.nbytes for a in weights.values())
    index = {}
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        shard = {name: weights.pop(name) for name in names}
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "pt"})
        index.update(dict.fromkeys(names, fname))
        del shard
        mx.clear_cache()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )


def write_target(out: Path, shape: SeedShape, seed: int = 0) -> Path:
    config = target_config(shape)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))  # lazy random init: only names and shapes
    nn.quantize(model, GROUP, BITS)  # every Linear and the embedding, as mlx-community's 4-bit
    weights = to_hf_weights(config["model_type"], _target_weights(model, seed), shape.layers)
    out.mkdir(parents=True, exist_ok=True)
    _save_shards(out, weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(TINY_TOKENIZER, out)  # ids are fed directly; any tokenizer loads
    return out


def write_drafter(out: Path, shape: SeedShape, seed: int = 1) -> Path:
    raw = drafter_config(shape)
    cfg = DrafterConfig.from_dict(raw)
    key = mx.random.key(seed)
    params = dict(
        tree_flatten(DraftBody(cfg, len(cfg.target_layer_ids) * cfg.hidden_size).parameters())
    )
    params.update(tree_flatten(DraftHead(cfg, None).parameters()))
    weights = {}
    for name, v in params.items():
        key, sub = mx.random.split(key)
        if name.endswith("base_kernel"):  # identity at offset 0, small elsewhere
            w = 0.05 * mx.random.normal(v.shape, key=sub)
            w = w + (mx.arange(cfg.conv_kernel_size) == 0)[None, :, None]
        elif "codebook" in name:
            w = 0.1 * mx.random.normal(v.shape, key=sub)
        elif v.ndim == 1:
            w = mx.ones(v.shape)
        else:
            w = mx.random.normal(v.shape, key=sub) / v.shape[-1] ** 0.5
        weights[name] = w.astype(mx.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    _save_shards(out, weights)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def ensure(
    root: Path, shape: SeedShape, log=print, with_drafter: bool = True
) -> tuple[Path, Path, float]:
    """(target dir, drafter dir, seconds spent building): built once under `root`, reused
    after. A directory counts only once its `complete` marker is written (after the weights)."""
    t0 = time.perf_counter()
    target, drafter = root / shape.key() / "target", root / shape.key() / "drafter"
    todo = [(target, write_target)] + ([(drafter, write_drafter)] if with_drafter else [])
    for path, write in todo:
        marker = path / "complete"
        if marker.is_file() and json.loads(marker.read_text()) == asdict(shape):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log(f"building {path} ...")
        write(path, shape)
        marker.write_text(json.dumps(asdict(shape)))
    return target, drafter, time.perf_counter() - t0
