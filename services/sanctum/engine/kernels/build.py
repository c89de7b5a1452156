"""Every sanctum CUDA kernel is made here: an mx.fast.cuda_kernel whose name carries a digest
of its source and header. MLX keeps each compiled module on disk (MLX_PTX_CACHE_DIR, by default
under the temp dir per MLX version) keyed by the kernel's name and template arguments alone, so a
kernel whose source changed under its old name would load the old build after an upgrade."""

from __future__ import annotations

import hashlib

import mlx.core as mx


def source_name(name: str, source: str, header: str = "") -> str:
    """`name` with a digest of `source` and `header` (the module name MLX caches under)."""
    digest = hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:12]
    return f"{name}_{digest}"


def cuda_kernel(
    name: str, inputs: list[str], outputs: list[str], source: str, header: str = ""
):
    """mx.fast.cuda_kernel under `source_name`; built by MLX at its first call."""
    return mx.fast.cuda_kernel(
        name=source_name(name, source, header),
        input_names=inputs,
        output_names=outputs,
        source=source,
        header=header,
    )
