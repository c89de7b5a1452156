"""A DFlash / DFlash 2 drafter's config.json (docs/design/drafter.md): what `DrafterConfig.from_dict` accepts
and checks (unknown keys ignored, missing or inconsistent ones a CheckpointError), and the
default choice of target layers to tap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import CheckpointError

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True)
class DrafterConfig:
    """The fields of a DFlash / DFlash 2 config.json that the drafter uses."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # block rows see the block causally: when given, in every layer; when None, in sliding layers
    is_causal: bool | None = None
    # DFlash 2 only
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # sanctum's own key (`sanctum train calibrate`): when sampling, the drafter proposes from its
    # scores at temperature T x this scale, fitted on held-out data (any proposal distribution is
    # lossless under the rejection rule; a trained drafter is sharper than the target, and a
    # flatter q overlaps p more)
    draft_temperature_scale: float = 1.0

    @property
    def is_v2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def context_rows_needed(self) -> int | None:
        """How many trailing context rows any block can see (None: all): sliding_window - 1
        when every layer slides."""
        if all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window - 1
        return None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "drafter") -> DrafterConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{where}: unknown architecture {archs!r} (expected one of {ARCHITECTURES})"
            )
        missing = [k for k in _REQUIRED if k not in raw]
        dcfg = raw.get("dflash_config") or {}
        for key in ("target_layer_ids", "mask_token_id"):
            if key not in dcfg and key not in raw:
                missing.append(f"dflash_config.{key}")
        block = dcfg.get("block_size", raw.get("block_size"))  # DFlash 2 keeps it in dflash_config
        if block is None:
            missing.append("block_size")
        if missing:
            raise CheckpointError(f"{where}: config.json is missing {', '.join(missing)}")
        n_layers = int(raw["num_hidden_layers"])
        layer_types = tuple(raw.get("layer_types") or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers:
            raise CheckpointError(
                f"{where}: layer_types has {len(layer_types)} entries, {n_layers} layers"
            )
        if "sliding_attention" in layer_types and not raw.get("sliding_window"):
            raise CheckpointError(f"{where}: sliding_attention layers need sliding_window")
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        if rope_params := raw.get("rope_parameters"):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        opt = {
            k: dcfg[k]
            for k in (
                "conv_kernel_size",
                "conv_group_size",
                "selector_rank",
                "selector_top_k",
                "input_embedding_scale",
                "output_multiplier",
                "final_logit_softcapping",
            )
            if dcfg.get(k) is not None
        }
        if "final_logit_softcapping" not in opt and raw.get("final_logit_softcapping"):
            opt["final_logit_softcapping"] = raw["final_logit_softcapping"]
        return cls(
            architecture=arch,
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw["num_key_value_heads"]),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            block_size=int(block),
            target_layer_ids=tuple(
                int(i) for i in dcfg.get("target_layer_ids", raw.get("target_layer_ids"))
            ),
            mask_token_id=int(dcfg.get("mask_token_id", raw.get("mask_token_id"))),
            num_target_layers=raw.get("num_target_layers"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            layer_types=layer_types,
            sliding_window=raw.get("sliding_window"),
            is_causal=None if raw.get("is_causal") is None else bool(raw["is_causal"]),
            draft_temperature_scale=_positive(raw, "draft_temperature_scale", where),
            **opt,
        )


def _positive(raw: dict, key: str, where: str) -> float:
    value = raw.get(key, 1.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise CheckpointError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def default_tap_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Evenly spaced from 1 to n - 3 (36 layers, 5 taps -> 1, 9, 17, 25, 33)."""
    if num_taps == 1:
        return (1,)
    last = max(1, num_target_layers - 3)
    return tuple(round(1 + i * (last - 1) / (num_taps - 1)) for i in range(num_taps))
