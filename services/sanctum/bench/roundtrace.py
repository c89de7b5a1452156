"""`sanctum bench round-trace`: where a shared round's cost grows with its sequences.

At each concurrency N, N greedy sequences of different prompts are prefilled and run a few
shared rounds (caches and drafter contexts of different lengths), then the pieces of a round
run on them, each awaited alone: the drafter's context rows of N sequences and its body over
N blocks, the head; the verify of N blocks through `verify_batch` (its attention layers over
N caches, GDN layers with their row states and tapes, residual + MLP products at N * L rows,
LM head, the rest); the rollback of N sequences. For each piece: the host time building its
graph (the call; its inputs evaluated before), the evaluation, the op nodes and the most
common ops. A piece called inside another is its own entry (its time out of the outer's).

Each piece's `between_ms`: its own ops evaluated before a piece nested in it (their device
time, taken out of its build). `--gdn-parts` splits the GDN layers too (projections, conv, the
recurrence or block kernel; the rest, the norm and output projection, stays the layer's own),
running them uncompiled to do so.

At one sequence the round is `Decoder.step`, not `verify_batch`: the trace runs the batch
functions with N = 1 so that each piece compares with itself. Timings are synced, so they
split a round rather than add up to an unsynced one (`bench batch --steady` times those).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .opcount import flat_arrays, graph_ops

CONTEXT_ROWS = 6  # new drafter context rows per sequence a round: a steady round's accepted


OUTSIDE = "outside"  # the round's own code, around its top-level pieces


class Spans:
    """Per piece: calls, exclusive build seconds, evaluation seconds, op counts, and the
    seconds spent evaluating, before a piece nested in it, what it computed up to there
    (`between`: device work of the piece's own ops, not the host's)."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.build: Counter = Counter()
        self.eval: Counter = Counter()
        self.between: Counter = Counter()
        self.ops: dict[str, Counter] = {}
        self._inner = [0.0]  # time spent in pieces nested in the current one
        self._names = [OUTSIDE]  # the pieces being called, outermost first

    def wrap(self, name: str, fn):
        """`fn` as a traced piece: inputs (and the caches passed) evaluated first, that time
        the caller's `between`, then the call timed, its outputs and the caches it wrote counted
        and evaluated."""

        def traced(*args, **kwargs):
            t_in = time.perf_counter()
            mx.eval(flat_arrays(list(args)) + _held(args))
            t0 = time.perf_counter()
            self.between[self._names[-1]] += t0 - t_in
            self._inner[-1] += t0 - t_in  # not the caller's build
            self._inner.append(0.0)
            self._names.append(name)
            try:
                result = fn(*args, **kwargs)
            finally:
                inner = self._inner.pop()
                self._names.pop()
            t1 = time.perf_counter()
            outputs = flat_arrays(result) + _held(args)
            ops = graph_ops(*outputs)
            mx.eval(outputs)
            t2 = time.perf_counter()
            self.calls[name] += 1
            self.build[name] += t1 - t0 - inner
            self.eval[name] += t2 - t1
            self.ops.setdefault(name, Counter()).update(ops)
            self._inner[-1] += t2 - t0
            return result

        return traced

    def row(self, passes: int) -> dict:
        return {
            name: {
                "calls": self.calls[name] // passes,
                "build_ms": round(1000 * self.build[name] / passes, 3),
                "eval_ms": round(1000 * self.eval[name] / passes, 3),
                "between_ms": round(1000 * self.between[name] / passes, 3),
                "nodes": round(sum(self.ops[name].values()) / passes, 1),
                "top_ops": {op: round(n / passes, 1) for op, n in self.ops[name].most_common(6)},
            }
            for name in self.calls
        }


def _held(args, depth: int = 2) -> list[mx.array]:
    """The arrays held by the caches (and tapes) in the list arguments of a call."""
    out = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            for item in arg:
                out += _arrays_of(item, depth)
    return out


def _arrays_of(obj, depth: int) -> list[mx.array]:
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for o in obj for a in _arrays_of(o, depth)]
    if depth <= 0 or isinstance(obj, nn.Module) or not hasattr(obj, "__dict__"):
        return []
    return [a for v in vars(obj).values() for a in _arrays_of(v, depth - 1)]


def gdn_parts() -> list[tuple]:
    """The GDN layer's own pieces, (object, attribute, piece) as `trace_level` patches them:
    its input projections, the block's conv, the recurrence (the block kernel where one is
    installed, else the MLX recurrence or the chunked form). Traced only with the GDN layers
    run op by op (`gdn.COMPILE_MAX_ROWS` 0): a compiled graph cannot be evaluated in pieces."""
    from ..engine.model import gdn

    parts = [(gdn, "_project", "gdn_projections"), (gdn, "block_conv", "gdn_conv")]
    parts += [(gdn, "recurrence", "gdn_recurrence"), (gdn, "chunked_gated_delta", "gdn_chunked")]
    if gdn.BLOCK_KERNEL is not None:
        parts.append((gdn, "BLOCK_KERNEL", "gdn_kernel"))
    return parts


def trace_level(decoder, seqs: list, passes: int, split_gdn: bool = False) -> dict:
    """The pieces of a round of `seqs` (open, steady), each a piece of `Spans`, averaged
    over `passes` traced rounds after one untraced (graphs compiled, kernels built); with
    `split_gdn`, the GDN layers' own pieces too (`gdn_parts`)."""
    from ..engine.decode import batch
    from ..engine.model.target import cache_offset

    target, peer = decoder.target, decoder.peer
    N, L = len(seqs), decoder.block_size
    H = target.hidden_size
    taps_width = len(decoder.tap_ids) * H
    rng = np.random.default_rng(0)
    spans = Spans()
    patched = [  # (object, attribute, piece); modules are unhashable: a list
        (batch, "attention_over", "attention"),
        (batch, "_gdn_batch", "gdn"),
        (batch, "_add_contexts", "drafter_context"),
        (target, "_residual_mlp", "residual_mlp"),
        (target, "lm_head", "lm_head"),
        (peer, "draft_batch", "drafter_body"),
        (decoder.head, "logits", "drafter_head"),
        (target, "rollback_batch", "rollback"),
    ] + (gdn_parts() if split_gdn else [])
    # (object, attribute, what it was, whether the object held it itself)
    real = [(obj, attr, getattr(obj, attr), attr in vars(obj)) for obj, attr, _ in patched]

    def one_round(traced: bool) -> None:
        ids = [seq.seq_id for seq in seqs]
        starts = [cache_offset(seq.cache) for seq in seqs]
        taps = [
            mx.array(rng.standard_normal((CONTEXT_ROWS, taps_width)), target.dtype) for _ in seqs
        ]
        tokens = mx.array(rng.integers(10, target.vocab_size - 10, (N, L)))
        hidden = peer.draft_batch(ids, taps, target.embed_tokens(tokens), starts)
        decoder.head.logits(hidden.reshape(-1, hidden.shape[-1]))
        verify = spans.wrap("verify_rest", batch.verify_batch) if traced else batch.verify_batch
        outs, tape = verify(target, tokens, [seq.cache for seq in seqs], decoder.tap_ids)
        mx.eval([logits for logits, _, _ in outs])
        keeps = [1 + (3 * n) % L for n in range(N)]  # different acceptance per sequence
        mx.eval(target.rollback_batch([seq.cache for seq in seqs], tape, keeps))

    one_round(traced=False)
    for (obj, attr, name), (_, _, fn, _) in zip(patched, real):
        setattr(obj, attr, spans.wrap(name, fn))
    try:
        t0 = time.perf_counter()
        for _ in range(passes):
            one_round(traced=True)
        wall = time.perf_counter() - t0
    finally:
        for obj, attr, fn, own in real:
            if own:
                setattr(obj, attr, fn)
            else:  # a method: the class's again
                delattr(obj, attr)
    row = {"concurrency": N, "traced_round_ms": round(1000 * wall / passes, 2)}
    row["pieces"] = spans.row(passes)
    row["outside_between_ms"] = round(1000 * spans.between[OUTSIDE] / passes, 3)
    return row


def run(args) -> dict:
    """Trace each level (bench/batch.py's steady sequences), a JSON line each as it ends;
    then each piece's nodes and times at the largest level over its own at one sequence."""
    from ..engine.decode.generate import make_key
    from ..engine.decode.peer import LocalDraftPeer
    from ..engine.decode.rounds import BatchDecoder
    from ..engine.model import gdn
    from ..serving.inline import load_models
    from ..settings import engine_settings, model_flags
    from .batch import _round, open_level, steady_budget

    settings = engine_settings(**model_flags(args))
    target, drafter = load_models(settings)
    if drafter is None:
        raise ValueError("bench round-trace needs a drafter")
    decoder = BatchDecoder(target, drafter, LocalDraftPeer(drafter), settings.block_size)
    levels = sorted({int(c) for c in args.concurrency.split(",")} | {1})
    budget = steady_budget(args.warm_rounds + args.passes + 2, decoder.block_size)
    key, rows = make_key(0), []
    compile_rows = gdn.COMPILE_MAX_ROWS
    if args.gdn_parts:  # the GDN layers op by op, so that their pieces can be awaited alone
        gdn.COMPILE_MAX_ROWS = 0
    try:
        for n in levels:
            _, seqs, out = open_level(decoder, settings, n, budget, key)
            for _ in range(args.warm_rounds):
                _round(decoder, seqs, key, out, None)
            rows.append(trace_level(decoder, seqs, args.passes, args.gdn_parts))
            for seq in seqs:
                decoder.close(seq)
            if args.lines:
                print(json.dumps(rows[-1]), flush=True)
    finally:
        gdn.COMPILE_MAX_ROWS = compile_rows
    result = {"block_size": decoder.block_size, "passes": args.passes, "levels": rows}
    result["gdn_parts"] = args.gdn_parts
    result.update(growth(rows))
    if args.lines:
        print(json.dumps({"growth_vs_one": result["growth_vs_one"]}), flush=True)
    return result


def growth(rows: list[dict]) -> dict:
    """Per piece, its nodes, build and eval time at each level over its own at the first."""
    first, out = rows[0]["pieces"], {}
    for name, one in first.items():
        out[name] = {}
        for figure in ("nodes", "build_ms", "eval_ms", "between_ms"):
            base = one[figure]
            out[name][figure] = [
                round(r["pieces"].get(name, {}).get(figure, 0) / base, 2) if base else None
                for r in rows
            ]
    return {"growth_vs_one": out, "concurrency": [r["concurrency"] for r in rows]}


def add_parser(bsub) -> None:
    from ..settings import add_model_flags

    p = bsub.add_parser(
        "round-trace", help="a shared round's pieces timed and op-counted at each concurrency"
    )
    add_model_flags(p)
    p.add_argument("--concurrency", default="1,4,8", help="sequences a round, comma separated")
    p.add_argument("--passes", type=int, default=3, help="traced rounds at each concurrency")
    p.add_argument("--warm-rounds", type=int, default=3, help="shared rounds before tracing")
    p.add_argument(
        "--gdn-parts",
        action="store_true",
        help="also trace the GDN layers' projections, conv and recurrence (those layers then "
        "run uncompiled: their times are not a compiled round's)",
    )
    p.add_argument("--lines", action="store_true", help="a JSON line per level as it ends (stdout)")
    p.add_argument("--json", action="store_true")
