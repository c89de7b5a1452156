"""`sanctum train pack`: store a trained pair small. The target becomes a standard mlx-lm
quantized checkpoint (any mlx-lm loads it as is) marked `dequantize_on_cpu`, and the drafter body
is saved quantized with a `quantization` entry that `load_drafter` reads. On the CPU both loaders
dequantize to float32 at load, because MLX's quantized CPU matmuls make a verify block much slower.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_model

from .loop import save_sharded

GROUP = 64


def pack_target(src: str | Path, out: str | Path, bits: int = 6) -> Path:
    """Quantize a target checkpoint's linear and embedding weights to `bits` (group 64)."""
    src, out = Path(src), Path(out)
    model, _ = load_model(src)
    raw = json.loads((src / "config.json").read_text())
    model, qconfig = quantize_model(model, raw, GROUP, bits)
    if out.exists():
        for old in out.glob("model*.safetensors*"):
            old.unlink()
    save_model(out, model)
    qconfig["dequantize_on_cpu"] = True  # quantized to stay small, not to run quantized
    (out / "config.json").write_text(json.dumps(qconfig, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "train_log.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def pack_drafter(src: str | Path, out: str | Path, target=None, bits: int = 8) -> Path:
    """Save a DFlash drafter's body with its linear layers quantized to `bits` (group 64); a
    DFlash 2 drafter's candidate selector stays as it is (bfloat16), beside it."""
    from ..engine.model.drafter.load import _quantizable, load_drafter

    src, out = Path(src), Path(out)
    drafter = load_drafter(src, target, parts="both" if target is not None else "body")
    body = drafter.body
    nn.quantize(body, group_size=GROUP, bits=bits, class_predicate=_quantizable(bits))
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(body.parameters()))
    if drafter.cfg.is_v2:
        if drafter.head is None:
            raise ValueError("packing a DFlash 2 drafter needs its target (for the selector)")
        weights.update(tree_flatten(drafter.head.parameters()))
    save_sharded(
        out, {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in weights.items()}
    )
    raw = json.loads((src / "config.json").read_text())
    raw["quantization"] = {"group_size": GROUP, "bits": bits}
    raw["torch_dtype"] = "bfloat16"  # what the unquantized weights are stored as
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    if (src / "train_log.json").is_file() and src != out:
        shutil.copy(src / "train_log.json", out / "train_log.json")
    return out
