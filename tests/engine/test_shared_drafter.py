"""The drafter side of a shared round (`decode.batch.draft_batch`): N sequences' new context
rows and their blocks' attention run as one set of ops per drafter layer, whatever N, and every
block drafts what it drafts alone, at ragged context lengths and positions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from sanctum.bench.opcount import graph_ops
from sanctum.engine.decode.peer import LocalDraftPeer
from sanctum.engine.model.drafter import ContextCache, load_drafter
from sanctum.engine.model.drafter import body as drafter_module
from sanctum.engine.model.target import load_target
from sanctum.tiny import DRAFTER_LAYOUTS, drafter_config, write_random_drafter


def _drafter(make_pair, tmp_path, layout: str):
    target_dir, _ = make_pair("hybrid", "dflash")
    target = load_target(str(target_dir))
    raw = DRAFTER_LAYOUTS[layout](drafter_config("dflash", target_dir))
    drafter = load_drafter(write_random_drafter(tmp_path / layout, raw, seed=2), target)
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    return target, drafter, width


def _taps(count: int, width: int, seed: int) -> mx.array | None:
    if count == 0:
        return None
    return mx.random.normal((count, width), key=mx.random.key(seed))


def _rounds_equal_alone(target, drafter, width, rounds, atol=1e-5):
    """Draft `rounds` ([(new rows, start) per sequence] each) both ways: in one batch and each
    alone; every block's hidden states agree, then one more round drafts alone on the caches
    the batch left (they read as the solo ones)."""
    peer = LocalDraftPeer(drafter)
    N = len(rounds[0])
    L = drafter.cfg.block_size
    for n in range(N):
        peer.open(f"solo{n}")
        peer.open(f"batch{n}")
    for r, plan in enumerate(rounds + [rounds[-1]]):
        taps = [_taps(c, width, 100 * r + n) for n, (c, _) in enumerate(plan)]
        starts = [s for _, s in plan]
        embeds = mx.stack(
            [target.embed_tokens(mx.array([3 + n + r] + [4] * (L - 1))) for n in range(N)]
        )
        alone = [peer.draft(f"solo{n}", taps[n], embeds[n], starts[n]) for n in range(N)]
        if r < len(rounds):
            together = peer.draft_batch([f"batch{n}" for n in range(N)], taps, embeds, starts)
        else:  # after the batch rounds, each on its own again
            together = [peer.draft(f"batch{n}", taps[n], embeds[n], starts[n]) for n in range(N)]
        for n in range(N):
            ok = mx.allclose(together[n], alone[n], atol=atol).item()
            assert ok, f"round {r}, sequence {n}"
            assert (together[n].argmax(-1) == alone[n].argmax(-1)).all().item()


def _plan(first: list[int], grow: list[int], rounds: int) -> list[list[tuple[int, int]]]:
    """Rounds of (new rows, anchor position) per sequence: `first` rows, then `grow`."""
    out, pos = [], list(first)
    out.append([(c, c) for c in first])
    for _ in range(rounds - 1):
        pos = [p + g for p, g in zip(pos, grow)]
        out.append([(g, p) for g, p in zip(grow, pos)])
    return out


def test_padded_sliding_drafts_run_as_one_stack_equal_alone(make_pair, tmp_path, monkeypatch):
    """Contexts padding to different buckets run as one call of the compiled stack (pads
    masked per sequence), each block as alone, over rounds of ragged new rows (one sequence
    with none)."""
    target, drafter, width = _drafter(make_pair, tmp_path, "dflash2")
    body = drafter.body
    window = drafter.cfg.sliding_window
    calls = []
    stack = body._compiled_stack()
    body.__dict__["_stack"] = lambda *a: calls.append(a[0].shape[0]) or stack(*a)
    monkeypatch.setattr(ContextCache, "STEP", 8)
    starts = [13, 5, 11, window + 3]  # buckets 16, 8, 16 and the full window
    _rounds_equal_alone(target, drafter, width, _plan(starts, [3, 0, 7, 1], 3))
    assert [n for n in calls if n > 1] == [4] * 3  # each batch: one call for the four blocks


@pytest.mark.parametrize("layout", ["dflash-mixed", "dflash-plain"])
def test_op_by_op_drafts_equal_alone(make_pair, tmp_path, layout):
    """Drafters with full-attention layers (op by op, contexts of any length): the stacked
    context pads every sequence to the longest, and each drafts as alone."""
    target, drafter, width = _drafter(make_pair, tmp_path, layout)
    _rounds_equal_alone(target, drafter, width, _plan([9, 30, 2, 17], [2, 5, 1, 0], 3))


def test_sliding_drafts_before_the_windows_fill_equal_alone_op_by_op(
    make_pair, tmp_path, monkeypatch
):
    """PAD_TO_BUCKETS off: op by op until every window is full, then compiled."""
    monkeypatch.setattr(drafter_module, "PAD_TO_BUCKETS", False)
    target, drafter, width = _drafter(make_pair, tmp_path, "dflash2")
    _rounds_equal_alone(target, drafter, width, _plan([4, 20, 7], [6, 1, 9], 4))


def _draft_nodes(drafter, width, N: int, rounds: int = 3) -> int:
    """The op nodes of the last of `rounds` shared drafts of N sequences (contexts of
    different lengths), counted as the round hands them to MLX."""
    peer = LocalDraftPeer(drafter)
    L = drafter.cfg.block_size
    ids = [f"s{n}" for n in range(N)]
    for s in ids:
        peer.open(s)
    starts = [5 + 7 * n for n in range(N)]
    nodes = 0
    for r in range(rounds):
        counts = starts if r == 0 else [1 + (n + r) % 3 for n in range(N)]
        starts = starts if r == 0 else [s + c for s, c in zip(starts, counts)]
        taps = [_taps(c, width, 10 * r + n) for n, c in enumerate(counts)]
        embeds = mx.zeros((N, L, drafter.cfg.hidden_size))
        mx.eval(taps, embeds)
        hidden = peer.draft_batch(ids, taps, embeds, starts)
        held = [t for s in ids for c in peer.caches[s] for t in (c.keys, c.values)]
        nodes = sum(graph_ops(hidden, *held).values())
        mx.eval(hidden, held)
    return nodes


@pytest.mark.parametrize("layout", ["dflash2", "dflash-mixed"])
def test_draft_nodes_do_not_grow_with_the_sequences(make_pair, tmp_path, layout):
    """The context rows of N sequences and their blocks' body: the same graph for 2 and 6."""
    _, drafter, width = _drafter(make_pair, tmp_path, layout)
    assert _draft_nodes(drafter, width, 6) == _draft_nodes(drafter, width, 2)
