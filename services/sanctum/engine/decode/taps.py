"""A sequence's taps: the outputs of the target layers the drafter is conditioned on, one row per
token the target cache holds. `TapLog` is their one owner: it knows which rows the drafter has
(`sent`), so what is pending, what a prefetched draft carried (sent again if it failed), what a
drafter that lost its context (a restarted process) gets again, and what the prompt cache
saves. Nothing else keeps taps.

Rows are numbered by position in the sequence. The log keeps the last `window` rows (what any
drafter block can see), or every row when the prompt cache will save them (`keep_all`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class TapLog:
    window: int  # rows a drafter can use: the most that is ever sent at once
    keep_all: bool = False  # the prompt cache saves them: keep every row
    chunks: list[mx.array] = field(default_factory=list)  # each [rows, n_taps * H], in order
    first: int = 0  # position of the first row held
    end: int = 0  # one past the last row's position
    sent: int = 0  # rows before this position have reached the drafter

    def add(self, taps: mx.array | list[mx.array]) -> None:
        """Rows for the next positions (their tokens are now in the target cache)."""
        for t in taps if isinstance(taps, list) else [taps]:
            self.chunks.append(t)
            self.end += t.shape[0]
        if self.keep_all:
            return
        # drop whole chunks that the window no longer reaches (no copy); a long prefill's one
        # chunk is cut, so at most twice the window is held
        while (
            len(self.chunks) > 1 and self.end - self.first - self.chunks[0].shape[0] >= self.window
        ):
            self.first += self.chunks.pop(0).shape[0]
        if self.end - self.first > 2 * self.window:
            joined = mx.concatenate(self.chunks)  # [end - first, n_taps * H]
            self.chunks = [joined[joined.shape[0] - self.window :]]
            self.first = self.end - self.window

    def start_at(self, position: int) -> None:
        """No rows before `position` (a resumed prompt whose taps were not saved)."""
        self.first = self.end = self.sent = position

    def unsent(self) -> mx.array | None:
        """[C, n_taps * H]: the rows from `sent` on (at most `window`), or None."""
        start = max(self.sent, self.end - self.window, self.first)
        if start >= self.end:
            return None
        rows, at = [], self.end
        for t in reversed(self.chunks):  # the newest chunks: usually one round's
            rows.append(t)
            at -= t.shape[0]
            if at <= start:
                break
        joined = rows[0] if len(rows) == 1 else mx.concatenate(rows[::-1])
        return joined[start - at :] if start > at else joined

    def resend(self) -> None:
        """The drafter lost its context (a fresh session): the window goes again."""
        self.sent = 0

    def all(self) -> mx.array | None:
        """[end, n_taps * H]: every row from position 0, when the log holds them all."""
        if not self.keep_all or self.first != 0 or not self.chunks:
            return None
        return mx.concatenate(self.chunks)
