"""Tensors on the wire: MLX arrays as numpy arrays (bfloat16, which numpy lacks, as its uint16
bit pattern), and a prompt-cache entry's tensors as one flat list (cache/layout.py) described
by a `TensorLayout` (roles.proto), so that MLX arrays never get pickled between role processes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cache import layout as entry_layout
from ..cache.layout import KV, EntryLayout, Rungs
from .gen import roles_pb2 as roles

_NP = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,  # bit pattern; restored with mx.view
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
}


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def to_numpy(a: mx.array) -> np.ndarray:
    """A host copy (or view) of `a` that numpy understands; bfloat16 as uint16 bits."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def from_numpy(x: np.ndarray, dtype: str) -> mx.array:
    a = mx.array(x)  # copies: the source may be a shared slot or a read-only object-store buffer
    return a.view(mx.bfloat16) if dtype == "bfloat16" else a


def flatten(
    kv: KV, rungs: Rungs, taps: mx.array | None
) -> tuple[roles.TensorLayout, list[mx.array]]:
    """An entry's tensors as a flat list (cache/layout.py) and its TensorLayout, with dtypes."""
    layout, arrays = entry_layout.flatten(kv, rungs, taps)
    wire = roles.TensorLayout(
        kv_layers=layout.kv_layers,
        rungs=layout.rungs,
        gdn_layers=layout.gdn_layers,
        has_taps=layout.has_taps,
        dtypes=[dtype_name(a.dtype) for a in arrays],
    )
    return wire, arrays


def unflatten(
    layout: roles.TensorLayout, arrays: list[np.ndarray]
) -> tuple[KV, Rungs, mx.array | None]:
    """The inverse of `flatten` over numpy arrays from another process: (kv, rungs, taps)."""
    plain = EntryLayout(
        tuple(layout.kv_layers),
        tuple(int(p) for p in layout.rungs),
        layout.gdn_layers,
        layout.has_taps,
    )
    return entry_layout.unflatten(plain, [from_numpy(x, d) for x, d in zip(arrays, layout.dtypes)])


def host_copies(arrays: list[mx.array]) -> list[np.ndarray]:
    """Evaluated numpy copies of `arrays` that the Ray object store may own."""
    mx.eval(arrays)
    return [np.array(to_numpy(a)) for a in arrays]  # own copies: the object store takes them
