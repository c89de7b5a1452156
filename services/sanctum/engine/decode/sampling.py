"""Sampling: logits processing (temperature, top-k, top-p) and the speculative acceptance rules.

Pure functions over MLX arrays. Both sampled rules keep the target's distribution exactly.
- The token rule (`accept_sampled`): accept a draft d with probability min(1, p(d) / q(d)); on
  the first rejection sample from normalize(max(p - q, 0)); if every draft is accepted, sample
  the bonus token from p.
- Block verification (`accept_block`; Sun et al., "Block Verification Accelerates Speculative
  Decoding", ICLR 2025): the block is judged as a whole, so a draft the token rule would reject
  can still stand when the drafts after it make up for it. It accepts at least as many drafts
  as the token rule in expectation (the most that any lossless rule can, given only the two
  models' conditionals along the block), for the same forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...settings import ACCEPT_RULES  # noqa: F401  (sampling.ACCEPT_RULES: its rules' names)
from ..kernels import cpu


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (top_p / top_k are then irrelevant)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """[R, V] logits -> [R, V] probabilities after temperature, top-k and top-p (float32)."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[:, vocab - params.top_k][:, None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = cpu.softmax(logits)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < params.top_p
        floor = mx.min(mx.where(keep_sorted, sorted_p, mx.inf), axis=-1, keepdims=True)
        probs = mx.where(probs >= floor, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def greedy_tokens(logits: mx.array) -> mx.array:
    """[R, V] logits -> [R] greedy tokens, by mlx-lm's rule: the argmax of the log-probabilities
    in the logits' own dtype. In bf16 the subtraction can tie or reorder nearly equal logits, so a
    plain argmax would not always reproduce mlx-lm's greedy decode."""
    return mx.argmax(logits - cpu.logsumexp(logits), axis=-1)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token per row of [R, V] probabilities."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


def accept_greedy(drafts: mx.array, target_logits: mx.array) -> tuple[int, int]:
    """drafts [L-1], target logits [L, V] -> (accepted count, bonus token)."""
    run, bonus = greedy_acceptance(drafts, target_logits)
    mx.eval(run, bonus)  # one host sync for both
    return int(run.item()), int(bonus.item())


def greedy_acceptance(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """`accept_greedy` unevaluated: (accepted count [], bonus token []) as int32 arrays, which
    a next block can be drafted on before the host reads them."""
    picks = greedy_tokens(target_logits).astype(mx.int32)  # [L]
    match = (drafts == picks[:-1]).astype(mx.int32)
    run = mx.cumprod(match).sum() if drafts.size else mx.array(0, mx.int32)
    return run, mx.take(picks, run)


def accept_sampled(
    drafts: mx.array,  # [L-1]
    draft_probs: mx.array,  # [L-1, V]: q, the distribution each draft was sampled from
    target_probs: mx.array,  # [L, V]: p, processed target distribution per block row
    key: mx.array,
) -> tuple[int, int]:
    """Speculative rejection sampling -> (accepted count, bonus/recovered token)."""
    n = drafts.shape[0]
    k_accept, k_fix = mx.random.split(key)
    rows = mx.arange(n)
    p_d = target_probs[rows, drafts]
    q_d = draft_probs[rows, drafts]
    u = mx.random.uniform(shape=(n,), key=k_accept)
    ok = (u * q_d < p_d).astype(mx.int32)
    accepted = int(mx.cumprod(ok).sum().item()) if n else 0
    residual = None
    if accepted < n:
        residual = mx.maximum(target_probs[accepted] - draft_probs[accepted], 0.0)
    return accepted, _next_token(residual, target_probs[accepted], k_fix)


def token_rule_acceptance(
    drafts: mx.array, draft_probs: mx.array, target_probs: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """`accept_sampled` unevaluated: (accepted count [], next token []), the same draws with
    the same key, so a shared round reads every sequence's acceptance at once. The residual
    is taken at the count before the host reads it: times 0 when every draft is kept, which
    `_draw_next` treats as no residual."""
    n = drafts.shape[0]
    k_accept, k_fix = mx.random.split(key)
    if n == 0:
        return mx.array(0, mx.int32), _draw_next(None, target_probs[0], k_fix)
    rows = mx.arange(n)
    p_d = target_probs[rows, drafts]
    q_d = draft_probs[rows, drafts]
    u = mx.random.uniform(shape=(n,), key=k_accept)
    accepted = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()
    at = mx.minimum(accepted, n - 1)
    rest = mx.maximum(target_probs[at] - draft_probs[at], 0.0) * (accepted < n)
    return accepted, _draw_next(rest, target_probs[accepted], k_fix)


def greedy_acceptance_batch(
    blocks: mx.array,  # [N, L] int32: each an anchor, its drafts, then padding
    logits: list[mx.array],  # each block's target logits [w_n, V]
    widths: list[int],  # each block's real rows w_n
) -> tuple[mx.array, mx.array]:
    """`greedy_acceptance` of N blocks in one graph: (accepted counts [N], bonus tokens [N]),
    int32. Each row's pick is the one its block alone gets (`greedy_tokens` is row-wise)."""
    N, L = blocks.shape
    rows = mx.concatenate(logits) if len(logits) > 1 else logits[0]  # [sum w_n, V]
    picks = greedy_tokens(rows).astype(mx.int32)
    w = np.array(widths)[:, None]
    cols = np.arange(L)[None]
    first = np.cumsum([0] + list(widths[:-1]))[:, None]
    # row n's picks laid out as its block, the last one repeated over the padding
    picks = picks[mx.array(first + np.minimum(cols, w - 1))]  # [N, L]
    is_draft = mx.array(cols[:, :-1] < w - 1)  # [N, L-1]
    match = ((blocks[:, 1:] == picks[:, :-1]) & is_draft).astype(mx.int32)
    run = mx.cumprod(match, axis=1).sum(axis=1)  # [N]
    return run, mx.take_along_axis(picks, run[:, None], axis=1)[:, 0]


def _next_token(residual: mx.array | None, p: mx.array, key: mx.array) -> int:
    """The token after the accepted drafts: from normalize(`residual`) [V] after a rejection,
    else (every draft accepted: the bonus) from `p`, the target's distribution there; also
    from `p` where the residual has no mass (p == q exactly: nothing to correct)."""
    return int(_draw_next(residual, p, key).item())


def _draw_next(residual: mx.array | None, p: mx.array, key: mx.array) -> mx.array:
    """`_next_token`, unevaluated: [] int32."""
    if residual is not None:
        total = residual.sum()
        p = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p)
    return sample(p[None], key)[0]


def block_acceptance(
    drafts: mx.array, draft_probs: mx.array, target_probs: mx.array
) -> tuple[mx.array, mx.array]:
    """Block verification's quantities for drafts [n] with q [n, V] and p [n + 1, V]:
    (h [n + 1], residual [n, V]). Keeping exactly i drafts is decided by independent uniforms:
    the block keeps the largest i with u_i < h[i] (h[0] = 1: none kept is always possible);
    then, for i < n, the next token comes from normalize(residual[i]); for i = n from p[n].

    w_0 = 1 and w_i = min(w_{i-1} p_i(d_i) / q_i(d_i), 1) weigh the prefix of i drafts;
    residual[i] = max(w_i p_{i+1} - q_{i+1}, 0) and, with its mass s_i, h[i] = s_i / (s_i + 1 -
    w_i) for 0 < i < n and h[n] = w_n."""
    n = drafts.shape[0]
    rows = mx.arange(n)
    log_ratio = mx.log(target_probs[rows, drafts]) - mx.log(draft_probs[rows, drafts])
    # log w_i = min(log w_{i-1} + log ratio_i, 0) unrolls to S_i - max_{j <= i} S_j over the
    # prefix sums S (S_0 = 0): a cumsum and a cummax instead of a loop; a p of 0 gives -inf
    sums = mx.concatenate([mx.zeros((1,)), mx.cumsum(log_ratio)])
    w = mx.exp(sums - mx.cummax(sums))  # [n + 1]
    residual = mx.maximum(w[:n, None] * target_probs[:n] - draft_probs, 0.0)  # [n, V]
    mass = residual.sum(axis=-1)
    denom = mass + 1.0 - w[:n]
    # 0 / 0 only when w_i = 1 and p = q there: nothing to correct, keep going
    h = mx.where(denom > 0, mass / mx.maximum(denom, 1e-30), 1.0)
    h = mx.concatenate([mx.ones((1,)), h[1:], w[n:]])
    return h, residual


def accept_block(
    drafts: mx.array,  # [L-1]
    draft_probs: mx.array,  # [L-1, V]: q, the distribution each draft was sampled from
    target_probs: mx.array,  # [L, V]: p, processed target distribution per block row
    key: mx.array,
) -> tuple[int, int]:
    """Block verification -> (accepted count, bonus/recovered token)."""
    accepted, token = block_rule_acceptance(drafts, draft_probs, target_probs, key)
    mx.eval(accepted, token)
    return int(accepted.item()), int(token.item())


def block_rule_acceptance(
    drafts: mx.array, draft_probs: mx.array, target_probs: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """`accept_block` unevaluated: (accepted count [], next token [])."""
    n = drafts.shape[0]
    k_accept, k_fix = mx.random.split(key)
    if n == 0:
        return mx.array(0, mx.int32), _draw_next(None, target_probs[0], k_fix)
    h, residual = block_acceptance(drafts, draft_probs, target_probs)
    u = mx.random.uniform(shape=(n,), key=k_accept)
    accepted = mx.where(u < h[1:], mx.arange(1, n + 1), 0).max()
    # the next token drawn before the host reads `accepted` (one sync a round, not two): from
    # residual[accepted], or, all n kept, from p[n], which `_next_token` takes for a residual
    # of no mass (the row times 0: zeros, the same values as no residual)
    rest = residual[mx.minimum(accepted, n - 1)] * (accepted < n)
    return accepted, _draw_next(rest, target_probs[accepted], k_fix)


def acceptance_length(accepted: int, rounds: int) -> float | None:
    """tau: the mean tokens a speculative round commits, its accepted drafts plus the target's
    bonus token (`accepted` drafts over `rounds` rounds); None without any round."""
    return (accepted + rounds) / rounds if rounds else None
