"""Sibling projections of one input fused into one matmul for multi-row passes.

Why: a Gated DeltaNet layer projects its input four times (qkv, z, and the two 48-feature gate
projections b and a) and an MLP twice (gate, up). At one row each is a short memory-bound
kernel; at a verify block's 8 rows MLX CUDA runs its 4-bit matrix kernel per projection, and the
narrow gate projections go to its naive kernel. One product over the concatenated weight reads
the same bytes in one launch: one call fewer per group on every device (docs/performance.md).

At load the sibling weights are concatenated along their output axis and each original layer is
given a view (a row slice, no copy) of the fused weight, so memory does not grow and one-row
calls (decode steps) still run mlx-lm's own layers on the same values: plain decoding stays
mlx-lm's. Only calls of `MIN_ROWS` rows or more take the fused product. Each output feature is
the same dot product either way; only the kernel's choice of tiling may differ, as it already
does between a verify's rows and a decode step's.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextMLP

from ... import settings

MIN_ROWS = 2
ENABLED = True  # False: every layer on its own (`disabled`)

# the attribute under which an owner keeps its FusedProjection (not a child module: the model's
# parameters, what is saved or counted, do not change)
_KEY = "_fused_projections"

GDN_GROUPS = (  # Qwen3.5's GDN input projections; Qwen3-Next's
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("in_proj_qkvz", "in_proj_ba"),
)
GATED_MLP = ("gate_proj", "up_proj")
QKV = ("q_proj", "k_proj", "v_proj")  # the drafter's attention (mlx-lm's calls its own)


class FusedProjection:
    """One product standing for several linear layers of the same input (no biases), their
    outputs in order; computed as nn.Linear / nn.QuantizedLinear compute theirs."""

    def __init__(self, layers: list[nn.Module]):
        first = layers[0]
        self.quant = None
        names = ("weight",)
        if isinstance(first, nn.QuantizedLinear):
            self.quant = dict(
                group_size=first.group_size, bits=first.bits, mode=getattr(first, "mode", "affine")
            )
            names = ("weight", "scales", "biases") if "biases" in first else ("weight", "scales")
        sizes = [int(layer["weight"].shape[0]) for layer in layers]
        self.arrays = {n: mx.concatenate([layer[n] for layer in layers], axis=0) for n in names}
        mx.eval(self.arrays)
        start = 0
        for layer, size in zip(layers, sizes):  # views of the fused rows: no second copy
            layer.update({n: a[start : start + size] for n, a in self.arrays.items()})
            start += size
        mx.eval([layer.parameters() for layer in layers])  # the views, materialized (no copy)
        self.layers = layers
        self.given = [layer["weight"] for layer in layers]
        self.splits = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        # set on CUDA by qmm_cuda.install: (x, *weights) -> y through a few-row kernel, or None
        # where it does not take x (then MLX's matmul, as below)
        self.kernel = None

    def still_current(self, owner: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether `owner`'s layers still hold the views given at load: a layer replaced or
        re-weighted since (dequantized, cast, trained) makes the fused copy stale."""
        return all(
            owner[n] is layer and layer["weight"] is w
            for n, layer, w in zip(names, self.layers, self.given)
        )

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.joined(x), self.splits, axis=-1)

    def joined(self, x: mx.array) -> mx.array:
        """The product over the concatenated weight, its outputs side by side (unsplit)."""
        a = self.arrays
        y = self.kernel(x, *a.values()) if self.kernel is not None else None
        if y is None:  # no kernel, or one that does not take x: MLX's matmul
            if self.quant is None:
                y = x @ a["weight"].T
            else:
                w, scales, biases = a["weight"], a["scales"], a.get("biases")
                y = mx.quantized_matmul(x, w, scales, biases, transpose=True, **self.quant)
        return y


def _fusable(layers: list) -> bool:
    if any("bias" in layer for layer in layers):
        return False
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, nn.QuantizedLinear):
        return False  # a kernel-routed subclass (qmm_cuda) keeps its own calls
    shapes = {int(layer["weight"].shape[1]) for layer in layers}
    if len(shapes) != 1:
        return False
    first = layers[0]
    if isinstance(first, nn.QuantizedLinear):
        same = {
            (layer.group_size, layer.bits, getattr(layer, "mode", "affine")) for layer in layers
        }
        dtypes = {(layer["scales"].dtype, layer["weight"].dtype) for layer in layers}
        with_biases = {"biases" in layer for layer in layers}
        return len(same) == 1 and len(dtypes) == 1 and len(with_biases) == 1
    return len({layer["weight"].dtype for layer in layers}) == 1


def fuse(owner: nn.Module, names: tuple[str, ...]) -> bool:
    """Fuse `owner`'s layers `names` (when all are there and alike) for `project`."""
    if not all(name in owner for name in names):
        return False
    if is_fused(owner, names):
        return True
    layers = [owner[name] for name in names]
    if not _fusable(layers):
        return False
    owner.__dict__.setdefault(_KEY, {})[names] = FusedProjection(layers)
    return True


def products(model: nn.Module) -> list[FusedProjection]:
    """Every fused product under `model`."""
    return [p for _, m in model.named_modules() for p in m.__dict__.get(_KEY, {}).values()]


def is_fused(owner: nn.Module, names: tuple[str, ...]) -> bool:
    return names in owner.__dict__.get(_KEY, {})


def _for(owner: nn.Module, names: tuple[str, ...], x: mx.array) -> FusedProjection | None:
    """The group's fused product if `x` should take it: fused, current, MIN_ROWS rows or more."""
    if not ENABLED or x.size // x.shape[-1] < MIN_ROWS:
        return None
    groups = owner.__dict__.get(_KEY)
    fused = groups.get(names) if groups else None
    if fused is not None and not fused.still_current(owner, names):
        del groups[names]  # stale: the layers compute on their own from now on
        return None
    return fused


def joined(owner: nn.Module, names: tuple[str, ...], x: mx.array) -> mx.array | None:
    """The group's outputs side by side in one array (what a kernel reading them all takes),
    or None where `x` does not take the fused product (`_for`)."""
    fused = _for(owner, names, x)
    return fused.joined(x) if fused is not None else None


def project(owner: nn.Module, names: tuple[str, ...], x: mx.array) -> list[mx.array]:
    """`[owner.<name>(x) for name in names]`, as one product when fused (`_for`)."""
    fused = _for(owner, names, x)
    if fused is not None:
        return fused(x)
    return [owner[name](x) for name in names]


@contextmanager
def disabled():
    """Every layer on its own inside the block (a benchmark's before/after; compiled graphs
    traced before keep what they were traced with: Target.drop_compiled)."""
    global ENABLED
    ENABLED, before = False, ENABLED
    try:
        yield
    finally:
        ENABLED = before


# mlx-lm's MLPs whose call is down_proj(swiglu(gate_proj(x), up_proj(x)))
_GATED_MLPS = (qwen3.MLP, Qwen3NextMLP)


def gated_mlp(mlp: nn.Module, x: mx.array) -> mx.array:
    """`mlp(x)`, with gate and up as one product for a multi-row `x` when fused at load."""
    fused = _for(mlp, GATED_MLP, x)
    if fused is not None:
        gate, up = fused(x)
        return mlp.down_proj(swiglu(gate, up))
    return mlp(x)


def fuse_target(layers: list[nn.Module]) -> int:
    """Fuse what `gdn._project` and `gated_mlp` can use in each target layer; returns how many
    groups. SANCTUM_FUSED_PROJECTIONS=off leaves every layer as loaded (a before/after)."""
    if settings.device().fused_projections == "off":
        return 0
    count = 0
    for layer in layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            count += sum(fuse(mixer, names) for names in GDN_GROUPS)
        if type(layer.mlp) in _GATED_MLPS:
            count += fuse(layer.mlp, GATED_MLP)
    return count


def fuse_drafter(body: nn.Module) -> int:
    """Fuse each draft layer's q/k/v and gated MLP (engine/model/drafter/ calls `project`)."""
    if settings.device().fused_projections == "off":
        return 0
    return sum(fuse(layer.self_attn, QKV) + fuse(layer.mlp, GATED_MLP) for layer in body.layers)


def unfuse(model: nn.Module) -> None:
    """Forget every fused product under `model`: a model about to be trained must compute
    from its parameters (a fused product would take no gradient)."""
    for _, module in model.named_modules():
        module.__dict__.pop(_KEY, None)
