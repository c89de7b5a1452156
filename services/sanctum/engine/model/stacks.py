"""Which shared pass's stacked buffers a cache's arrays are rows of.

A shared verify stacks N sequences' caches on a batch axis (attention KV, GDN states) and hands
each cache its row back as a view. The next shared pass over the same caches in the same order,
none written since, can take the stacked buffers as they are instead of stacking them again (a
copy of every sequence's cache, every layer, every round). Each cache so handed its row is
tagged with the pass's stack and its row in it; a solo forward drops the tags of the caches it
writes (`release`), so that a stack outlives its pass only while its caches still are its rows.
Every write of a tagged cache outside a shared pass must release it first: mlx-lm's KV update
assigns into the cache's arrays in place (the same objects, new contents), which an identity
check cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass

TAG = "_sanctum_stack"  # on a cache object: (its stack, its row in it)


@dataclass
class Stack:
    """A shared pass's stacked arrays ([N, ...] each) and, per cache, the rows of them it was
    handed, in the same order."""

    whole: tuple | None
    rows: list[tuple]


def tag(caches: list, whole: tuple, rows: list[tuple]) -> None:
    """Mark `caches` (in order) as holding `rows[n]`, their rows of `whole`."""
    stack = Stack(tuple(whole), [tuple(r) for r in rows])
    for n, c in enumerate(caches):
        setattr(c, TAG, (stack, n))


def held(caches: list, holds) -> Stack | None:
    """The stack every one of `caches` is tagged with, each at its own place in order and
    still holding (`holds(cache)`, by identity) the rows it was handed; else None."""
    first = getattr(caches[0], TAG, None)
    if first is None:
        return None
    stack = first[0]
    if stack.whole is None or len(stack.rows) != len(caches):
        return None
    for n, c in enumerate(caches):
        tagged = getattr(c, TAG, None)
        if tagged is None or tagged[0] is not stack or tagged[1] != n:
            return None
        if any(a is not b for a, b in zip(holds(c), stack.rows[n], strict=True)):
            return None
    return stack


def release(cache: list) -> None:
    """Drop the tags of one sequence's layer caches (a solo forward is about to write them)."""
    for c in cache:
        vars(c).pop(TAG, None)
