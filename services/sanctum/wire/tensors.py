"""Tensors on the wire: MLX arrays as numpy arrays (bfloat16, which numpy lacks, as its uint16
bit pattern) and a prompt-cache entry's tensors as one flat list described by a `TensorLayout`
(roles.proto), so that MLX arrays never get pickled between role processes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

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


def flatten(kv: list[tuple], rungs: dict, taps) -> tuple[roles.TensorLayout, list[mx.array]]:
    """KV layers, rungs (ascending position, (conv, state) per GDN layer), taps -> flat list."""
    arrays = [a for layer in kv for a in layer]
    positions = sorted(rungs)
    for p in positions:
        arrays.extend(x for pair in rungs[p] for x in pair)
    if taps is not None:
        arrays.append(taps)
    layout = roles.TensorLayout(
        kv_layers=[len(layer) for layer in kv],
        rungs=positions,
        gdn_layers=len(rungs[positions[0]]) if positions else 0,
        has_taps=taps is not None,
        dtypes=[dtype_name(a.dtype) for a in arrays],
    )
    return layout, arrays


def unflatten(layout: roles.TensorLayout, arrays: list[np.ndarray]):
    """The inverse of `flatten`, as MLX arrays: (kv, rungs, taps)."""
    xs = iter(from_numpy(x, d) for x, d in zip(arrays, layout.dtypes))
    kv = [tuple(next(xs) for _ in range(n)) for n in layout.kv_layers]
    rungs = {int(p): [(next(xs), next(xs)) for _ in range(layout.gdn_layers)] for p in layout.rungs}
    taps = next(xs) if layout.has_taps else None
    return kv, rungs, taps


def _host(arrays: list[mx.array]) -> list[np.ndarray]:
    mx.eval(arrays)
    return [np.array(to_numpy(a)) for a in arrays]  # own copies: the object store takes them
