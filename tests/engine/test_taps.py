"""The sequence's tap log (engine/taps.py): what is pending, what is sent again, what is kept."""

from __future__ import annotations

import mlx.core as mx
from sanctum.engine.decode.taps import TapLog


def rows(start: int, n: int) -> mx.array:
    """[n, 2]: row i holds its position i twice."""
    return mx.repeat(mx.arange(start, start + n)[:, None], 2, axis=1)


def positions(a: mx.array | None) -> list[int]:
    return [] if a is None else a[:, 0].tolist()


def test_unsent_rows_are_the_window_after_what_the_drafter_has():
    log = TapLog(window=5)
    log.add([rows(0, 3), rows(3, 4)])
    assert positions(log.unsent()) == [2, 3, 4, 5, 6]  # a long prompt: only the window
    log.sent = log.end
    assert log.unsent() is None
    log.add(rows(7, 2))
    assert positions(log.unsent()) == [7, 8]
    log.resend()  # a fresh drafter session: the window again
    assert positions(log.unsent()) == [4, 5, 6, 7, 8]
    assert log.all() is None  # not kept for the prompt cache


def test_the_window_bounds_what_is_held_and_keep_all_keeps_every_row():
    log = TapLog(window=4)
    for start in range(0, 40, 2):
        log.add(rows(start, 2))
        assert log.end - log.first <= 2 * 4
    assert positions(log.unsent()) == [36, 37, 38, 39]
    log.add(rows(40, 20))  # one long chunk: cut to the window
    assert log.end - log.first == 4 and positions(log.unsent()) == [56, 57, 58, 59]
    kept = TapLog(window=4, keep_all=True)
    for start in range(0, 12, 3):
        kept.add(rows(start, 3))
    assert positions(kept.all()) == list(range(12))
    resumed = TapLog(window=4, keep_all=True)
    resumed.start_at(10)  # resumed without saved taps: nothing before position 10
    resumed.add(rows(10, 2))
    assert positions(resumed.unsent()) == [10, 11] and resumed.all() is None
