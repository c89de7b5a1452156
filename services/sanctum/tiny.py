"""Tiny random checkpoints in the real Hugging Face layout (config.json + model.safetensors +
tokenizer files), for tests and benchmarks that must run fast on a CPU.

The target is built with mlx-lm's own model class, then written the way Hugging Face stores it
(the inverse of mlx-lm's `sanitize`), so loading goes through the real loader and its sanitize.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from .engine.model.drafter import DraftBody, DraftHead
from .engine.model.drafter.config import DrafterConfig, default_tap_ids

ASSETS = Path(__file__).resolve().parent / "assets"
TINY_TOKENIZER = ASSETS / "tiny-tokenizer"
TARGET_KINDS = ("hybrid", "moe", "next", "dense")
DRAFTER_KINDS = ("dflash", "dflash2")

_ROPE = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
_GDN = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)


# the tiny DFlash 2 drafters' dynamic convolutions and selector (small shapes, any layout)
TINY_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8,
                    input_embedding_scale=1.0)  # fmt: skip


def target_config(kind: str, vocab: int, eos_id: int, hidden: int = 128, layers: int = 8) -> dict:
    """An HF-style config.json for a tiny target of the given kind."""
    common = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # 8-bit KV quantizes head_dim in groups of 64
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        torch_dtype="float32",
    )
    if kind == "dense":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "rope_theta": 1e6,
        }
    if kind == "next":
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **common,
            **_GDN,
            **_MOE,
            "mlp_only_layers": [],
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
        }
    if kind in ("hybrid", "moe"):
        moe = kind == "moe"
        text = {
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            **common,
            **_GDN,
            **(_MOE if moe else {}),
            "rope_parameters": dict(_ROPE),
        }
        return {
            "architectures": [
                "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
            ],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text,
            "tie_word_embeddings": False,
            "eos_token_id": eos_id,
        }
    raise ValueError(f"unknown target kind {kind!r} (choose from {TARGET_KINDS})")


_ZERO_CENTERED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def to_hf_weights(model_type: str, weights: dict[str, mx.array], num_layers: int) -> dict:
    """mlx-lm parameter names and layouts -> the Hugging Face checkpoint's (inverse sanitize)."""
    if model_type == "qwen3":
        return dict(weights)
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        elif v.ndim == 1 and any(k.endswith(s) for s in _ZERO_CENTERED_NORMS):
            v = v - 1.0  # HF stores these RMSNorm weights zero-centred
        out[k] = v
    if model_type == "qwen3_next":
        for layer in range(num_layers):
            prefix = f"model.layers.{layer}.mlp"
            for name in ("gate_proj", "up_proj", "down_proj"):
                stacked = out.pop(f"{prefix}.switch_mlp.{name}.weight", None)
                if stacked is not None:
                    for e in range(stacked.shape[0]):
                        out[f"{prefix}.experts.{e}.{name}.weight"] = stacked[e]
        return out
    renamed = {}
    for k, v in out.items():  # qwen3_5 / qwen3_5_moe: the text model sits under a VLM wrapper
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        elif k.startswith("language_model."):
            k = k[len("language_model.") :]
        renamed[k] = v
    if model_type == "qwen3_5_moe":
        for layer in range(num_layers):
            prefix = f"model.language_model.layers.{layer}.mlp"
            gate = renamed.pop(f"{prefix}.switch_mlp.gate_proj.weight", None)
            if gate is not None:
                up = renamed.pop(f"{prefix}.switch_mlp.up_proj.weight")
                renamed[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
                renamed[f"{prefix}.experts.down_proj"] = renamed.pop(
                    f"{prefix}.switch_mlp.down_proj.weight"
                )
    return renamed


def _cast(weights: dict, dtype: mx.Dtype) -> dict:
    return {
        k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in weights.items()
    }


def write_target(out: Path, config: dict, model: nn.Module, dtype=mx.float32) -> Path:
    """Write an mlx-lm model as an HF checkpoint directory (with the tiny tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    text = config.get("text_config", config)
    weights = dict(tree_flatten(model.parameters()))
    hf = _cast(to_hf_weights(config["model_type"], weights, text["num_hidden_layers"]), dtype)
    mx.save_safetensors(str(out / "model.safetensors"), hf, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)


def make_tiny_target(
    out: Path,
    kind: str = "hybrid",
    seed: int = 0,
    layers: int = 8,
    hidden: int = 128,
    tokenizer_dir: Path = TINY_TOKENIZER,
    vocab_size: int | None = None,
) -> Path:
    """A random target of `kind` at `out` (HF layout), returned as its directory.
    `vocab_size` below the tokenizer's makes a model that only ever emits the first ids
    (statistical tests want a tiny vocabulary)."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = vocab_size or len(tok["model"]["vocab"])
    eos = tok["model"]["vocab"].get("<|im_end|>")
    if eos is None:
        eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    config = target_config(kind, vocab, eos, hidden=hidden, layers=layers)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    _spread_init(model)
    write_target(out, config, model)
    copy_tokenizer(tokenizer_dir, out)
    return out


def _spread_init(model: nn.Module) -> None:
    """Random weights with some spread, so that greedy decoding is not a single repeated token."""
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith("embed_tokens.weight"):
            params[k] = mx.random.normal(v.shape) * 0.5
    model.update(_unflatten(params))
    mx.eval(model.parameters())


def _unflatten(flat: dict):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


def drafter_config(kind: str, target_dir: Path, block_size: int = 8, layers: int = 2) -> dict:
    tcfg = json.loads((target_dir / "config.json").read_text())
    text = tcfg.get("text_config", tcfg)
    tok = json.loads((target_dir / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|mask|>")
    n_target = text["num_hidden_layers"]
    cfg = {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 2 * text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "block_size": block_size,
        "num_target_layers": n_target,
        # one sliding layer exercises the windowed, causal path
        "layer_types": ["full_attention"] * (layers - 1) + ["sliding_attention"],
        "sliding_window": 16,
        "is_causal": True,
        "dflash_config": {
            "target_layer_ids": list(default_tap_ids(n_target, min(3, n_target))),
            "mask_token_id": mask_id,
        },
    }
    if kind == "dflash2":
        cfg["dflash_config"].update(
            TINY_DFLASH2, output_multiplier=1.0, final_logit_softcapping=30.0
        )
    elif kind != "dflash":
        raise ValueError(f"unknown drafter kind {kind!r} (choose from {DRAFTER_KINDS})")
    return cfg


# Published drafter layouts, applied to a `drafter_config` (tests of the reference rules).
def _dflash2(cfg: dict) -> dict:
    """A published DFlash 2 layout: all sliding, is_causal false, block 16 in dflash_config,
    rope_parameters instead of rope_theta, output multiplier and soft-cap."""
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["sliding_attention"] * 3
    cfg["sliding_window"] = 24
    cfg["is_causal"] = False
    cfg.pop("block_size")
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    cfg["dflash_config"].update(
        TINY_DFLASH2, block_size=16, output_multiplier=0.7, final_logit_softcapping=20.0
    )
    return cfg


def _dflash_mixed(cfg: dict) -> dict:
    """DFlash with sliding and full layers mixed and is_causal true (every layer causal)."""
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    cfg["sliding_window"] = 12
    cfg["is_causal"] = True
    return cfg


def _dflash_plain(cfg: dict) -> dict:
    """DFlash with neither: all full attention, no is_causal (the block sees itself fully)."""
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    cfg.pop("sliding_window")
    cfg.pop("is_causal")
    return cfg


DRAFTER_LAYOUTS = {
    "dflash2": _dflash2,
    "dflash-mixed": _dflash_mixed,
    "dflash-plain": _dflash_plain,
}


def make_tiny_drafter(
    out: Path,
    target_dir: Path,
    kind: str = "dflash",
    seed: int = 1,
    block_size: int = 8,
    layers: int = 2,
) -> Path:
    """A random DFlash / DFlash 2 drafter for the target at `target_dir`."""
    return write_random_drafter(out, drafter_config(kind, target_dir, block_size, layers), seed)


def write_random_drafter(out: Path, raw: dict, seed: int = 1) -> Path:
    """Random weights for the drafter config `raw`, written with it in the published layout."""
    cfg = DrafterConfig.from_dict(raw)
    mx.random.seed(seed)
    body = DraftBody(cfg, len(cfg.target_layer_ids) * cfg.hidden_size)
    weights = dict(tree_flatten(body.parameters()))
    if cfg.is_v2:
        head = DraftHead(cfg, None)
        sel = dict(tree_flatten(head.parameters()))
        for k in sel:
            if "codebook" in k:
                sel[k] = mx.random.normal(sel[k].shape) * 0.1
        weights.update(sel)
        for k in weights:  # conv: identity at offset 0, small elsewhere
            if k.endswith("base_kernel"):
                base = mx.random.normal(weights[k].shape) * 0.05
                weights[k] = base + (mx.arange(cfg.conv_kernel_size) == 0)[None, :, None]
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def make_tiny(
    out: str | Path,
    kind: str = "hybrid",
    drafter: str = "dflash",
    seed: int = 0,
    block_size: int = 8,
) -> tuple[Path, Path]:
    """`sanctum make-tiny`: OUT/target and OUT/drafter."""
    out = Path(out)
    target = make_tiny_target(out / "target", kind, seed)
    draft = make_tiny_drafter(out / "drafter", target, drafter, seed + 1, block_size)
    return target, draft


def ensure_pair(target: str | Path, drafter: str | Path | None) -> None:
    """Make the tiny random pair where settings' `default_pair` points when no trained pair is
    shipped (SANCTUM_HOME/tiny), on first use; any other path is left alone."""
    from .settings import default_pair

    tiny_target, tiny_drafter = default_pair()
    named = {Path(target)} | ({Path(drafter)} if drafter else set())
    if tiny_target.parent != tiny_drafter.parent or not named & {tiny_target, tiny_drafter}:
        return
    if not (tiny_drafter / "config.json").is_file():
        make_tiny(tiny_target.parent)
