"""Loading a drafter: its config, body and head, checked against the target."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

from ...kernels import cpu, cuda, fused, platform
from ..checkpoint import CheckpointError, read_config, resolve_checkpoint
from .body import DraftBody
from .config import DrafterConfig
from .head import DraftHead


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
    cpu.prepare()  # a drafter process may load no target: engine/kernels/cpu.py
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
        if platform.current().is_cpu and not keep_dtype:
            body.set_dtype(mx.float32)  # half precision is slower than fp32 on MLX's CPU
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
