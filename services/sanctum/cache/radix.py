"""A radix tree over token ids: which saved entries share how long a prefix with a prompt."""

from __future__ import annotations

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class _Node:
    __slots__ = ("edges", "entries")

    def __init__(self):
        self.edges: dict[int, tuple[np.ndarray, _Node]] = {}  # first token -> (label, child)
        self.entries: set[str] = set()  # entries whose tokens pass through or end here


class RadixTree:
    """Entries keyed by token sequences; `match` gives each entry's common prefix with a query."""

    def __init__(self):
        self.root = _Node()

    def insert(self, entry_id: str, tokens: np.ndarray) -> None:
        node, i = self.root, 0
        node.entries.add(entry_id)
        while i < len(tokens):
            first = int(tokens[i])
            if first not in node.edges:
                child = _Node()
                child.entries.add(entry_id)
                node.edges[first] = (tokens[i:].copy(), child)
                return
            label, child = node.edges[first]
            n = common_prefix(label, tokens[i:])
            if n < len(label):  # split the edge at the divergence
                mid = _Node()
                mid.entries = set(child.entries)
                mid.edges[int(label[n])] = (label[n:], child)
                node.edges[first] = (label[:n], mid)
                child = mid
            child.entries.add(entry_id)
            node, i = child, i + n

    def remove(self, entry_id: str, tokens: np.ndarray) -> None:
        node, i = self.root, 0
        node.entries.discard(entry_id)
        while i < len(tokens):
            first = int(tokens[i])
            if first not in node.edges:
                return
            label, child = node.edges[first]
            child.entries.discard(entry_id)
            if not child.entries:
                del node.edges[first]
                return
            node, i = child, i + len(label)

    def match(self, tokens: np.ndarray) -> dict[str, int]:
        """entry id -> length of its common prefix with `tokens` (entries sharing >= 1 token)."""
        found: dict[str, int] = {}
        node, i = self.root, 0
        while i < len(tokens):
            edge = node.edges.get(int(tokens[i]))
            if edge is None:
                break
            label, child = edge
            n = common_prefix(label, tokens[i:])
            for e in child.entries:
                found[e] = i + n
            if n < len(label):
                break
            node, i = child, i + n
        return found
