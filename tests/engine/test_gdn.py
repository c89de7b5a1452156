"""The chunked Gated DeltaNet rule on heads that forget within a block, as trained layers have
(strongly negative per-token log-decay): the same values as mlx-lm's per-token rule, no
subnormal decay factors (x86 computes with those far more slowly), and a verify
block's final state exactly the state a rollback to all its rows makes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk
from sanctum.engine.model import gdn

SMALLEST_NORMAL = np.finfo(np.float32).tiny


def _inputs(T: int, seed: int = 0):
    mx.random.seed(seed)
    B, Hk, Dk, Hv, Dv = 2, 2, 16, 4, 16
    q, k = normalize_qk(
        mx.random.normal((B, T, Hk, Dk)),
        mx.random.normal((B, T, Hk, Dk)),
        inv_scale=Dk**-0.5,
        eps=1e-6,
    )
    v = mx.random.normal((B, T, Hv, Dv))
    # heads 0 and 1 forget within a few rows (log-decay -30 and -12 a row), 2 and 3 keep
    rate = mx.array([30.0, 12.0, 0.5, 0.01])
    log_g = -rate * mx.random.uniform(0.5, 1.0, (B, T, Hv))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, log_g, beta, state


def test_decay_exp_is_exp_or_zero_never_subnormal():
    x = mx.linspace(-200.0, 0.0, 20001)
    got = np.array(gdn.decay_exp(x))
    want = np.array(mx.exp(x))
    kept = np.array(x) >= gdn.DECAY_FLOOR
    assert np.array_equal(got[~kept], np.zeros((~kept).sum(), np.float32))
    assert np.array_equal(got[kept], want[kept])  # above the floor: MLX's exp, to the bit
    assert not ((got > 0) & (got < SMALLEST_NORMAL)).any()
    # two factors multiplied (e^(d_i - d_j) e^d_j in the chunked form) stay normal too
    assert float(gdn.decay_exp(mx.array(gdn.DECAY_FLOOR)).item()) ** 2 > SMALLEST_NORMAL


@pytest.mark.parametrize("T", [8, 5, 139])
def test_fast_forgetting_heads_match_mlx_lm(T):
    q, k, v, log_g, beta, state = _inputs(T)
    want_y, want_state = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)
    for lapack in (False, True):
        y, final = gdn.chunked_gated_delta(q, k, v, log_g, beta, state, lapack=lapack)
        assert mx.allclose(y, want_y, atol=1e-5, rtol=1e-4).item()
        assert mx.allclose(final, want_state, atol=1e-5, rtol=1e-4).item()


@pytest.mark.parametrize("T", [8, 5])
def test_block_final_state_is_the_rollback_to_all_rows(T):
    """A fully accepted block keeps the pass's own final state; a partly accepted one gets
    `state_after(keep)` from the tape. Both must be one computation, so that a sequence's
    state does not depend on whether its last block was rolled back."""
    q, k, v, log_g, beta, state = _inputs(T, seed=1)
    _, final, parts = gdn.chunked_gated_delta(q, k, v, log_g, beta, state, parts=True, lapack=True)
    assert np.array_equal(np.array(final), np.array(gdn.state_after(state, *parts, T)))
    # and the rollback to fewer rows is the pass over those rows alone
    for keep in (1, T - 1):
        short = gdn.chunked_gated_delta(*(t[:, :keep] for t in (q, k, v, log_g, beta)), state)
        got = gdn.state_after(state, *parts, keep)
        assert mx.allclose(got, short[1], atol=1e-5, rtol=1e-4).item()
