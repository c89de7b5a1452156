"""How a prompt-cache entry's tensors lie in one flat list, the one encoding of an entry that
both its files (cache/store.py) and its transfers between role processes (wire/tensors.py) use:
every attention layer's KV arrays (2 in fp16, mlx-lm's 6 quantized ones in q8), then the rungs
in ascending position, each a (conv, state) pair per Gated DeltaNet layer, then the taps.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

KV = list[tuple[mx.array, ...]]  # per attention layer: [1, kv_heads, T, head_dim] (or q8 parts)
Rungs = dict[int, list[tuple[mx.array, mx.array]]]  # position -> GDN (conv, state) per layer
PARTS = ("conv", "state")  # of a rung's pair


@dataclass(frozen=True)
class EntryLayout:
    kv_layers: tuple[int, ...]  # arrays per attention layer
    rungs: tuple[int, ...]  # rung positions, ascending
    gdn_layers: int
    has_taps: bool

    def names(self) -> list[str]:
        """The name of each array, in order (the keys of an entry's safetensors file)."""
        out = [f"kv.{i}.{j}" for i, n in enumerate(self.kv_layers) for j in range(n)]
        for p in self.rungs:
            out += [f"rung.{p}.{i}.{part}" for i in range(self.gdn_layers) for part in PARTS]
        return out + (["taps"] if self.has_taps else [])


def flatten(kv: KV, rungs: Rungs, taps: mx.array | None) -> tuple[EntryLayout, list[mx.array]]:
    """KV layers, rungs and taps -> (layout, flat list)."""
    positions = tuple(sorted(rungs))
    arrays = [a for layer in kv for a in layer]
    arrays += [x for p in positions for pair in rungs[p] for x in pair]
    arrays += [taps] if taps is not None else []
    layout = EntryLayout(
        kv_layers=tuple(len(layer) for layer in kv),
        rungs=positions,
        gdn_layers=len(rungs[positions[0]]) if positions else 0,
        has_taps=taps is not None,
    )
    return layout, arrays


def unflatten(layout: EntryLayout, arrays: list[mx.array]) -> tuple[KV, Rungs, mx.array | None]:
    """The inverse of `flatten`: (kv, rungs, taps)."""
    xs = iter(arrays)
    kv = [tuple(next(xs) for _ in range(n)) for n in layout.kv_layers]
    rungs = {p: [(next(xs), next(xs)) for _ in range(layout.gdn_layers)] for p in layout.rungs}
    taps = next(xs) if layout.has_taps else None
    return kv, rungs, taps
