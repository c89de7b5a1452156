"""The drafter body as the decode loop reaches it: a `DraftPeer`, which is a plain object in
one process (`LocalDraftPeer`) or a proxy to a drafter actor in the cluster (cluster/drafter.py).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from ..model.drafter import Drafter
from .batch import draft_batch

# The most context rows a sequence keeps for its drafter (engine/decode/taps.py), and so the most it
# sends at once: after a long prompt, or to a drafter that lost its context (a restart).
MAX_PENDING_TAP_ROWS = 4096


class DraftUnavailable(RuntimeError):
    """The drafter cannot answer now (its process died or is restarting): decode plainly."""


class DraftPeer(Protocol):
    """What the verifier needs from the drafter body, wherever it runs.

    A peer in another process is `pipelined`: it also has `submit` (same arguments as `draft`,
    returns a handle at once), `collect(handle) -> hidden` and `discard(handle)`, so that the
    decoder can ask for a sequence's next block as soon as a round's tokens are accepted and
    roll back its caches while the drafter computes. `open` says whether the session starts
    empty (then the decoder sends the context it keeps again), and any call may raise
    `DraftUnavailable`, after which the decoder opens the sequence again."""

    pipelined: bool

    def open(self, seq_id: str) -> bool: ...

    def draft(
        self, seq_id: str, new_taps: mx.array | None, block_embeds: mx.array, start: int
    ) -> mx.array:
        """new_taps [C, n_taps*H] of rows start-C..start-1, block_embeds [L, H] -> hidden [L-1, H]."""
        ...

    def close(self, seq_id: str) -> None: ...


class LocalDraftPeer:
    """The drafter body in this process, with one context cache per open sequence. Not
    pipelined: one thread would run the draft and the rollback one after the other anyway."""

    pipelined = False

    def __init__(self, drafter: Drafter):
        self.body = drafter.body
        self.caches: dict[str, list] = {}

    def open(self, seq_id: str) -> bool:
        self.caches[seq_id] = self.body.make_cache()
        return True  # a fresh context

    def draft(self, seq_id, new_taps, block_embeds, start):
        if seq_id not in self.caches:
            raise DraftUnavailable(f"sequence {seq_id} is not open on this drafter")
        if new_taps is not None and (keep := self.body.context_rows_needed()) is not None:
            new_taps = new_taps[-keep:]
        taps = new_taps[None] if new_taps is not None else None
        hidden = self.body(block_embeds[None], start, taps, self.caches[seq_id])
        return hidden[0, 1:]

    def draft_ahead(self, seq_id, new_taps, ctx_start: int, count, block_embeds, start):
        """`draft` of the next block before the host has read this round's acceptance (the
        decoder's draft ahead): `new_taps` [L, n_taps*H] are the verified rows from `ctx_start`,
        of which the first `count` are context, and the anchor sits at `start` (both int32
        arrays not yet evaluated). `settle` follows once the count is read."""
        if seq_id not in self.caches:
            raise DraftUnavailable(f"sequence {seq_id} is not open on this drafter")
        cache = self.caches[seq_id]
        hidden = self.body.ahead(block_embeds[None], start, new_taps[None], ctx_start, count, cache)
        return hidden[0, 1:]

    def settle(self, seq_id: str, count: int) -> None:
        """`count` of the rows the last `draft_ahead` sent are the sequence's context."""
        for c in self.caches.get(seq_id, ()):
            c.settle(count)

    def draft_batch(
        self, seq_ids: list[str], new_taps: list, block_embeds: mx.array, starts: list[int]
    ) -> mx.array:
        """`draft` for N open sequences in one body forward: block_embeds [N, L, H] ->
        hidden [N, L-1, H]."""
        missing = [s for s in seq_ids if s not in self.caches]
        if missing:
            raise DraftUnavailable(f"sequences {missing} are not open on this drafter")
        caches = [self.caches[s] for s in seq_ids]
        return draft_batch(self.body, caches, new_taps, block_embeds, starts)[:, 1:]

    def close(self, seq_id: str) -> None:
        self.caches.pop(seq_id, None)
