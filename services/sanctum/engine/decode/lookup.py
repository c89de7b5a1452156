"""Drafts read from the sequence itself (prompt lookup).

Text repeats: code quoted back from the prompt, a function rewritten with one change, a reply
that restates an earlier turn's. When the tokens just committed repeat an earlier stretch of
the sequence for `min_match` tokens or more, the tokens that followed that stretch are a better
guess than a block drafter's, which conditions on a few layers' taps and not on the exact
tokens it would have to copy; they also cost nothing to propose. Below that length a match says
little (short n-grams recur in code with any continuation), so the drafter's block stands.

The target verifies a looked-up block like any other, so the output is the same either way;
only acceptance changes. Decided by the sequence's own tokens alone, so a sequence proposes the
same blocks alone, inline or in the cluster (a shared round may shorten them: rounds.py).
"""

from __future__ import annotations

import numpy as np

# Decoder.lookup_min's default (SANCTUM_LOOKUP_MIN): the shortest repeat whose continuation is
# proposed: 4 lost tau in the chat bench, and 5 or 12 gained less (README, "Repeated text").
MIN_MATCH = 8
MAX_MATCH = 32  # a longer match says no more; the most recent of the longest wins


class TokenIndex:
    """A sequence's tokens as one int32 buffer, grown from the list the decoder keeps (which
    only grows once rounds start), for a vectorised search each round."""

    def __init__(self) -> None:
        self._buf = np.empty(1024, np.int32)
        self._n = 0
        self._source: list[int] | None = None
        self._last: tuple | None = None  # (query, answer): a prefetch and its round ask alike

    def _sync(self, tokens: list[int]) -> None:
        """The buffer holds `tokens`, and room for one more (the anchor)."""
        if tokens is not self._source or len(tokens) < self._n:  # a new list: start over
            self._source, self._n = tokens, 0
        need = len(tokens) + 1
        if need > self._buf.shape[0]:
            grown = np.empty(max(need, 2 * self._buf.shape[0]), np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        if len(tokens) > self._n:
            self._buf[self._n : len(tokens)] = tokens[self._n :]
            self._n = len(tokens)

    def continuation(
        self, tokens: list[int], anchor: int, count: int, min_match: int
    ) -> np.ndarray | None:
        """The `count` tokens that followed the latest longest earlier occurrence of the
        sequence's last `min_match`+ tokens (`tokens`, then `anchor`), or None when there is no
        such occurrence with `count` tokens after it."""
        query = (id(tokens), len(tokens), anchor, count, min_match)
        if self._last is not None and self._last[0] == query:
            return self._last[1]
        self._sync(tokens)
        n = self._n + 1
        h = self._buf[:n]
        h[-1] = anchor  # past the synced tokens: the next sync overwrites it
        # j: where an earlier copy of the anchor sits, with `count` tokens after it in h
        cand = np.flatnonzero(h[: n - count] == anchor) if n > count else np.empty(0, np.int64)
        length = 1
        while cand.size and length < MAX_MATCH:
            longer = cand[cand >= length]
            longer = longer[h[longer - length] == h[n - 1 - length]]
            if not longer.size:
                break
            cand, length = longer, length + 1
        found = None
        if cand.size and length >= min_match:
            j = int(cand[-1])
            found = h[j + 1 : j + 1 + count].copy()
        self._last = (query, found)
        return found
