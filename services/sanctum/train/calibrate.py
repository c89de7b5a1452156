"""`sanctum train calibrate`: fit a drafter's `draft_temperature_scale` on held-out data.

When sampling, the engine proposes from the drafter's distribution at the request's temperature
T times this scale (`Decoder._propose`). Any proposal q is lossless under the rejection rule, but
how many drafts it accepts, sum_x min(p(x), q(x)) a row, depends on how well q overlaps the
target's p. A drafter trained partly on hard labels (the target's argmax, for greedy acceptance)
is sharper than the target, so a flatter q (a scale above 1) accepts more.

The fit is teacher-forced, on the same blocks as training's evaluation: each row's q is built as
the engine builds it (DFlash 2: the selector's scores of the body's top `SAMPLING_CANDIDATES`
tokens after the row's true previous token; DFlash: the body's whole softmax), p is the target's
distribution at T, and tau = 1 + sum_k prod_{j<=k} accept_j, averaged over the temperatures.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..engine.model.drafter import SAMPLING_CANDIDATES
from ..engine.model.target import Target
from .blocks import block_rows, sample_anchors, selector_scores, target_pass

SCALES = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.7, 2.0)


def held_out_rows(trainee, target: Target, tokens: np.ndarray, prefer: np.ndarray | None,
                  block: int, rows_per_seq: int, seed: int = 0) -> dict:  # fmt: skip
    """`blocks.block_rows` of held-out `tokens` [B, S] (anchors leaning to `prefer`, the
    target's own tokens), evaluated."""
    cfg = trainee.body.cfg
    ids = mx.array(tokens.astype(np.int32))
    taps, t_logits = target_pass(target, ids, tuple(cfg.target_layer_ids))
    mask_embed = target.embed_tokens(mx.array([cfg.mask_token_id]))
    anchors = sample_anchors(ids.shape[0], ids.shape[1], block, rows_per_seq,
                             np.random.default_rng(seed), prefer)  # fmt: skip
    rows = block_rows(trainee.body, target.lm_head, mask_embed, target.embed_tokens(ids), ids,
                      taps, t_logits, anchors, block)  # fmt: skip
    mx.eval(rows)
    return rows


def proposal(selector, rows: dict, temperature: float, scale: float):
    """Each row's q as the engine proposes it at `temperature` x `scale`: (candidate ids
    [..., k] or None for the whole vocabulary, q [..., k or V])."""
    if selector is not None:
        cand, scores = selector_scores(selector, SAMPLING_CANDIDATES, rows["hidden"],
                                       rows["logits"], rows["prev"])  # fmt: skip
    else:
        cand, scores = None, rows["logits"]
    return cand, mx.softmax(scores / (temperature * scale), axis=-1)


def sampled_tau(trainee, rows: dict, temperature: float, scale: float) -> float:
    """Teacher-forced expected acceptance length at `temperature` with q at T x `scale`."""
    p = mx.softmax(rows["target"] / temperature, axis=-1)
    cand, q = proposal(trainee.selector, rows, temperature, scale)
    if cand is not None:
        p = mx.take_along_axis(p, cand, axis=-1)
    accept = mx.minimum(p, q).sum(-1)  # [B, N, L-1]
    return (1 + mx.cumprod(accept, axis=-1).sum(-1).mean()).item()


def fit_scale(trainee, rows: dict, temperatures=(0.7, 1.0), scales=SCALES) -> dict:
    """The grid's scale with the highest mean sampled tau over `temperatures`, and the table."""
    table = {s: [sampled_tau(trainee, rows, t, s) for t in temperatures] for s in scales}
    best = max(scales, key=lambda s: (sum(table[s]), -abs(s - 1.0)))
    return {"scale": best, "temperatures": list(temperatures),
            "tau": {str(s): [round(v, 4) for v in table[s]] for s in scales}}  # fmt: skip


def write_scale(drafter_dir: str | Path, scale: float) -> Path:
    """Set `draft_temperature_scale` in the checkpoint's config.json (weights untouched)."""
    path = Path(drafter_dir) / "config.json"
    raw = json.loads(path.read_text())
    raw["draft_temperature_scale"] = float(scale)
    path.write_text(json.dumps(raw, indent=2))
    return path
