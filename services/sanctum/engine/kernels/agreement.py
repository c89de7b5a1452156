"""How a kernel's start-up check judges its outputs against the MLX math it replaces: the same
shape and dtype, and a largest error within a share of the reference's own scale."""

from __future__ import annotations

import mlx.core as mx


def compare(where: str, fn, args: tuple, want: mx.array, tolerance: float, compiled=True):
    """`fn(*args)` eagerly (and, with `compiled`, inside mx.compile) against `want`: None when
    both agree, else why not, prefixed by `where` (the case: its shapes). A kernel that does
    not build or run on this GPU is a disagreement too."""
    try:
        results = {"eager": fn(*args)}
        if compiled:
            results["compiled"] = mx.compile(fn)(*args)
        mx.eval(want, results)
    except Exception as exc:
        return f"{where}: {exc.__class__.__name__}: {str(exc)[:300]}"
    if (why := disagreement(results, want, tolerance)) is not None:
        return f"{where} {why}"
    return None


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
