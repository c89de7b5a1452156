"""What a round hands to MLX: evaluations and the op nodes of their graphs, counted while a
`count_ops` block runs (the bench only patches MLX and numpy inside it).

Counted: explicit evaluations (`mx.eval`, `mx.async_eval`), host reads (`.item()`,
`.tolist()`, `np.array` / `np.asarray` of an MLX array) and, among those reads, the implicit
evaluations: reads whose array still had a graph to compute. A read of an array already
evaluated or queued (`mx.async_eval`) only waits for it. Nodes are the op nodes of the graph
an evaluation computes (`mx.export_to_dot`: the unevaluated ancestors of what it is handed),
counted when it is handed over, so no node is counted twice; a compiled function's fused
elementwise kernel is one node, its other ops count one each, as MLX builds them. Each count
is filed under the evaluation's call site in the engine and the phase of the round it serves.
"""

from __future__ import annotations

import io
import re
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

_NODE = re.compile(r'\[label ="([^"]*)", shape=rectangle\]')

# the innermost engine function on an evaluation's stack that names its phase
PHASE_OF = {
    "_queue_rollback": "rollback",
    "rollback": "rollback",
    "rollback_batch": "rollback",
    "accept_greedy": "accept",
    "_accept": "accept",
    "_lazy_accept": "accept",
    "_conclude": "accept",
    "_accept_all": "accept",
    "hand_on": "verify",
    "verify": "verify",
    "verify_batch": "verify",
    "_draft_next": "draft",
    "_draft_piece": "draft",
    "_draft_all": "draft",
    "_draft_batch": "draft",
    "_prefetch": "draft",
    "_prefetch_together": "draft",
    "step_batch": "draft",  # the drafts evaluated before the shared verify is built
    "_speculative_round": "draft",
    "_sample_one": "plain",
    "_plain_step": "plain",
    "_settle_plain": "plain",
    "_plain_steps": "plain",
}


def graph_ops(*arrays) -> Counter:
    """Op nodes (by primitive name; fused kernels as "Compiled") of the unevaluated graph
    behind `arrays`."""
    arrays = [a for a in arrays if isinstance(a, mx.array)]
    if not arrays:
        return Counter()
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return Counter(
        "Compiled" if name.startswith("Compiled") else name
        for name in _NODE.findall(out.getvalue())
    )


def flat_arrays(tree) -> list[mx.array]:
    """The MLX arrays in nested lists, tuples and dicts."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [a for t in tree for a in flat_arrays(t)]
    return []


@dataclass
class Tally:
    """Counts since the block began (`count_ops`)."""

    evals: int = 0  # mx.eval / mx.async_eval calls
    reads: int = 0  # host reads of MLX arrays: .item(), .tolist(), np.array/np.asarray
    implicit_evals: int = 0  # host reads that had a graph to compute
    nodes: int = 0
    ops: Counter = field(default_factory=Counter)  # primitive -> nodes
    nodes_by_phase: Counter = field(default_factory=Counter)
    evals_by_phase: Counter = field(default_factory=Counter)  # explicit and implicit
    nodes_by_site: Counter = field(default_factory=Counter)  # "module.function" -> nodes

    def add(self, arrays: list, explicit: bool) -> None:
        ops = graph_ops(*arrays)
        n = sum(ops.values())
        if not explicit:
            self.reads += 1
            if not n:
                return
            self.implicit_evals += 1
        else:
            self.evals += 1
        site, phase = _call_site()
        self.nodes += n
        self.ops.update(ops)
        self.nodes_by_phase[phase] += n
        self.evals_by_phase[phase] += 1
        self.nodes_by_site[site] += n


def _call_site() -> tuple[str, str]:
    """("module.function" of the innermost engine frame, its phase) of the caller."""
    frame, site, phase = sys._getframe(3), None, None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/sanctum/" in path and "/sanctum/bench/" not in path:
            name = frame.f_code.co_name
            if site is None:
                site = f"{path.rsplit('/', 1)[-1][:-3]}.{name}"
            if name in PHASE_OF:
                phase = PHASE_OF[name]
                break
        frame = frame.f_back
    return site or "bench", phase or "other"


@contextmanager
def count_ops():
    """Count what is handed to MLX inside the block (a Tally); MLX and numpy restored after."""
    tally = Tally()
    real = {
        "eval": mx.eval,
        "async_eval": mx.async_eval,
        "item": mx.array.item,
        "tolist": mx.array.tolist,
        "np.array": np.array,
        "np.asarray": np.asarray,
    }

    def evaluated(fn):
        def wrapped(*args):
            tally.add(flat_arrays(list(args)), explicit=True)
            return fn(*args)

        return wrapped

    def read(fn):
        def wrapped(self, *args, **kwargs):
            tally.add([self], explicit=False)
            return fn(self, *args, **kwargs)

        return wrapped

    def converted(fn):
        def wrapped(obj, *args, **kwargs):
            if isinstance(obj, mx.array):
                tally.add([obj], explicit=False)
            return fn(obj, *args, **kwargs)

        return wrapped

    mx.eval, mx.async_eval = evaluated(real["eval"]), evaluated(real["async_eval"])
    mx.array.item, mx.array.tolist = read(real["item"]), read(real["tolist"])
    np.array, np.asarray = converted(real["np.array"]), converted(real["np.asarray"])
    try:
        yield tally
    finally:
        mx.eval, mx.async_eval = real["eval"], real["async_eval"]
        mx.array.item, mx.array.tolist = real["item"], real["tolist"]
        np.array, np.asarray = real["np.array"], real["np.asarray"]


def per_round(tally: Tally, rounds: int, top: int = 12) -> dict:
    """A Tally's counts divided by `rounds`, for a bench row."""

    def each(counter: Counter, k: int | None = None) -> dict:
        return {name: round(n / rounds, 1) for name, n in counter.most_common(k)}

    return {
        "evals_per_round": round((tally.evals + tally.implicit_evals) / rounds, 2),
        "explicit_evals_per_round": round(tally.evals / rounds, 2),
        "implicit_evals_per_round": round(tally.implicit_evals / rounds, 2),
        "host_reads_per_round": round(tally.reads / rounds, 2),
        "nodes_per_round": round(tally.nodes / rounds, 1),
        "nodes_by_phase": each(tally.nodes_by_phase),
        "evals_by_phase": each(tally.evals_by_phase),
        "nodes_by_site": each(tally.nodes_by_site),
        "top_ops": each(tally.ops, top),
    }
