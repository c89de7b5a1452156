"""Shared storage of the prompt cache: pages and rungs, content-addressed by their token prefix.

An entry's attention KV and drafter taps are cut into pages of `PAGE_TOKENS` tokens (the last
one possibly shorter). A page's key is a digest of every token from the start of the sequence
to the page's end (plus the model and whether taps ride along): KV and taps of a token depend on
the tokens before it only, so two entries with the same first n tokens have the same pages
there, and the store keeps one copy whatever the number of entries extending it. A rung (the
Gated DeltaNet state after p tokens) is keyed the same way by its prefix, so an entry that
inherits a rung references it instead of copying it. Pages and rungs count their referencing
entries; one that no entry references is freed.

`Record` is an entry as the store keeps it: tokens and the keys it references.

Why fixed pages rather than radix-node segments: a page never changes once written (an edge
split would have to cut and rewrite stored arrays and their files), lookups stay in the radix
tree of entries, and the cost of the last, partial page is bounded: at most PAGE_TOKENS - 1
tokens are stored twice when a later turn extends an entry (its full page replaces the partial
one when the older entry goes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

PAGE_TOKENS = 16


@dataclass
class Page:
    """KV of tokens [start, end) per attention layer ([1, kv_heads, end - start, head_dim] or
    the q8 parts), and their taps [end - start, n_taps * H] when the entry kept taps."""

    kv: list[tuple[mx.array, ...]]
    taps: mx.array | None
    refs: int = 0
    file: str = ""  # the persisted file holding it ("" in memory only)

    @property
    def kv_bytes(self) -> int:
        return sum(a.nbytes for layer in self.kv for a in layer)

    @property
    def taps_bytes(self) -> int:
        return self.taps.nbytes if self.taps is not None else 0

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.taps_bytes


@dataclass
class Rung:
    """GDN (conv, state) per layer after `position` tokens."""

    position: int
    states: list[tuple[mx.array, mx.array]]
    refs: int = 0
    file: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pair in self.states for a in pair)


@dataclass
class Record:
    """A stored entry: its tokens and the keys of the pages and rungs it references."""

    entry_id: str
    model_key: str
    kv_mode: str
    tokens: np.ndarray  # [T] int32
    prompt_len: int  # T when unknown
    created: float
    has_taps: bool
    pages: list[str]  # page keys, in token order
    rungs: dict[int, str]  # position -> rung key


def page_bounds(num_tokens: int) -> list[tuple[int, int]]:
    """[(start, end)] of the pages covering `num_tokens` tokens."""
    return [(s, min(s + PAGE_TOKENS, num_tokens)) for s in range(0, num_tokens, PAGE_TOKENS)]


def page_keys(model_key: str, has_taps: bool, tokens: np.ndarray) -> list[str]:
    """The key of each page of `tokens`: a digest of the whole prefix up to the page's end."""
    h = hashlib.blake2b(f"page|{model_key}|{int(has_taps)}|".encode(), digest_size=16)
    keys = []
    for start, end in page_bounds(len(tokens)):
        h.update(np.ascontiguousarray(tokens[start:end], dtype=np.int32).tobytes())
        keys.append(f"{h.hexdigest()}-{end}")
    return keys


def rung_key(model_key: str, tokens: np.ndarray, position: int) -> str:
    """The key of the rung after the first `position` tokens."""
    h = hashlib.blake2b(f"rung|{model_key}|".encode(), digest_size=16)
    h.update(np.ascontiguousarray(tokens[:position], dtype=np.int32).tobytes())
    return f"{h.hexdigest()}-{position}"


def _copy(a: mx.array) -> mx.array:
    # a slice is a view of the whole entry's buffer: a page must own its bytes, or evicting the
    # other pages would free nothing
    return mx.array(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).view(a.dtype)


def cut_page(kv, taps: mx.array | None, start: int, end: int) -> Page:
    """Tokens [start, end) of an entry's KV and taps, as a page owning copies."""
    layers = [tuple(_copy(a[..., start:end, :]) for a in layer) for layer in kv]
    return Page(layers, _copy(taps[start:end]) if taps is not None else None)


def join_pages(pages: list[Page], n: int) -> tuple[list[tuple[mx.array, ...]], mx.array | None]:
    """The first `n` tokens' KV (per layer) and taps from consecutive pages (fresh arrays)."""
    kv = []
    for i in range(len(pages[0].kv) if pages else 0):
        parts = len(pages[0].kv[i])
        kv.append(
            tuple(
                mx.concatenate([p.kv[i][j] for p in pages], axis=-2)[..., :n, :]
                for j in range(parts)
            )
        )
    taps = None
    if pages and all(p.taps is not None for p in pages):
        taps = mx.concatenate([p.taps for p in pages], axis=0)[:n]
    return kv, taps
