"""Greedy equality up to the first near tie: how a bench judges a batched or speculative run
against the plain greedy run of the same prompt.

On the CPU the rows of a batched or multi-row forward compute exactly what one row computes,
so the outputs must be equal. On a GPU a [N, L] verify and a one-row decode run different
kernels (another reduction order, bf16 rounding at other points), so their logits differ in
the last bits; where the plain run's top two logits are that close, either token is the
model's answer and the runs may part there. The verdict says which of the two happened.
"""

from __future__ import annotations

import mlx.core as mx

# Top-two logit margin (plain run) at or under which a greedy pick is a near tie: four bf16
# steps of a logit in [16, 32) (one step 0.125), more than kernels of another shape move it.
NEAR_TIE = 0.5

VERDICTS = ("equal", "equal-up-to-near-tie", "differs")  # best to worst


def top_two_margins(target, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Per completion position, the top-two logit margin of the target's prediction of it,
    from one forward over prompt + completion (a fresh fp16 cache): [len(completion_ids)]."""
    if not completion_ids:
        return []
    tokens = mx.array(list(prompt_ids) + list(completion_ids)[:-1])
    logits, _ = target.forward(tokens, target.make_cache("fp16"), all_logits=True)
    rows = logits[len(prompt_ids) - 1 :].astype(mx.float32)  # [len(completion), V]
    top = mx.topk(rows, 2, axis=-1)  # unordered: the margin is their absolute difference
    return mx.abs(top[:, 0] - top[:, 1]).tolist()


def near_tie_verdict(
    plain_ids: list[int],
    margins: list[float],  # [len(plain_ids)]: `top_two_margins` of the plain run
    other_ids: list[int],
    tolerance: float = NEAR_TIE,
) -> tuple[int, int | None, str]:
    """(equal prefix length, first near-tie position of the plain run or None, verdict):
    "equal"; "equal-up-to-near-tie" when the runs part at or after the plain run's first
    near tie; else "differs"."""
    same = next(
        (i for i, (a, b) in enumerate(zip(plain_ids, other_ids)) if a != b),
        min(len(plain_ids), len(other_ids)),
    )
    tie = next((i for i, m in enumerate(margins) if m <= tolerance), None)
    if same == len(plain_ids) == len(other_ids):
        return same, tie, "equal"
    if tie is not None and same >= tie:
        return same, tie, "equal-up-to-near-tie"
    return same, tie, "differs"


def worst(verdicts: list[str]) -> str:
    """The worst of several verdicts ("equal" for none)."""
    return max(verdicts, key=VERDICTS.index, default="equal")
