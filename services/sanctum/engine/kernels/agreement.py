"""How a kernel's start-up check judges its outputs against the MLX math it replaces: the same
shape and dtype, and a largest error within a share of the reference's own scale."""

from __future__ import annotations

import mlx.core as mx


def disagreement(results: dict, want: mx.array, tolerance: float) -> str | None:
    """The first of `results` (name -> output) that differs from `want`, said in words; None
    when all agree."""
    scale = mx.abs(want.astype(mx.float32)).max().item() + 1e-6
    for name, got in results.items():
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{name}: {got.shape} {got.dtype}"
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        if not err <= tolerance * scale:  # also false for NaN
            return f"{name}: max error {err:.3g} (scale {scale:.3g})"
    return None
