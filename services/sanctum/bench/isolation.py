"""`sanctum bench isolation`: the cost of splitting the roles into processes.

The same greedy requests run on the inline backend (roles as objects in this process) and on
the actor cluster, alternating, in one run; both without the prompt cache so they do the same
work. Reports tok/s of each, the tax (1 - cluster/inline; also the median over back-to-back
pairs, with a bootstrap interval that says how far one run on a noisy machine can be trusted),
the drafter channel's cost per round (latency, what the verifier still waits with drafts asked
a round ahead, bytes moved both ways) from the verifier's counters, and where each mode's round
time goes. `--round-delay-ms` adds a busy wait to every target forward in BOTH modes to emulate
a slower target: the split's cost stays, the round grows (the wait sits in the forward, where
a real target spends its time, not where drafts overlap; busy, because a sleep would let the
cores go cold as a real forward does not).
"""

from __future__ import annotations

import os
import random
import statistics
import time

from ..settings import add_model_flags

DEFAULT_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
)


def add_parser(bsub) -> None:
    p = bsub.add_parser(
        "isolation", help="actor cluster vs inline: tok/s, tax, transport per round"
    )
    add_model_flags(p)
    p.add_argument(
        "--prompt", action="append", dest="prompts", help="repeatable (default: 4 fixed)"
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--round-delay-ms",
        type=float,
        default=0.0,
        help="busy wait added to every target forward in both modes (emulates a slower target)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="also run this many requests at once in each mode (aggregate tok/s)",
    )
    p.add_argument("--transport", choices=("auto", "shm", "object_store"), default="auto")
    p.add_argument("--json", action="store_true")


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds of these processes so far (Linux /proc; None elsewhere)."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def _per_token(seconds: float | None, tokens: int) -> float | None:
    return None if seconds is None else round(1000.0 * seconds / max(1, tokens), 3)


def median_interval(xs: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap interval for the median of `xs` (fixed seed: the same data, the same
    interval). On a noisy machine it says whether a run can tell 4% from 6% at all."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    tail = int(draws * (1.0 - level) / 2.0)
    return medians[tail], medians[draws - 1 - tail]


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def _round_phases(before, after) -> dict:
    """Mean ms per round of each phase between two StatsResponses."""
    rounds = max(1, after.rounds - before.rounds)
    out = {}
    for phase in ("draft", "verify", "rollback", "other"):
        field = f"round_{phase}_ms"
        total = getattr(after, field) * after.rounds - getattr(before, field) * before.rounds
        out[phase] = round(total / rounds, 3)
    return out


def _run(backend, prompt: str, max_tokens: int):
    from ..serving.requests import GenerateRequest

    t0 = time.perf_counter()
    chunks = list(
        backend.submit(GenerateRequest(prompt=prompt, max_tokens=max_tokens, use_cache=False))
    )
    elapsed = time.perf_counter() - t0
    u = chunks[-1].usage
    return [t for c in chunks for t in c.token_ids], u.rounds, elapsed, u.elapsed_s


def _run_concurrent(backend, prompts: list[str], clients: int, max_tokens: int):
    """`clients` requests at once (prompts in turn): their tokens, and the seconds until the
    last one ended."""
    import threading

    outs: list = [None] * clients

    def one(i: int) -> None:
        outs[i] = _run(backend, prompts[i % len(prompts)], max_tokens)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs, time.perf_counter() - t0


def _concurrent(backends: dict, prompts: list[str], clients: int, max_tokens: int, repeats: int):
    """Aggregate tok/s of each mode with `clients` requests in flight: the verifier interleaves
    them round by round, so in the cluster the drafter computes one request's next block while
    the verifier verifies another's."""
    tokens = {name: 0 for name in backends}
    seconds = {name: 0.0 for name in backends}
    identical, outs = True, {}
    for rep in range(repeats):
        names = list(backends) if rep % 2 == 0 else list(backends)[::-1]
        for name in names:
            outs[name], elapsed = _run_concurrent(backends[name], prompts, clients, max_tokens)
            tokens[name] += sum(len(o) for o in outs[name])
            seconds[name] += elapsed
        identical &= outs["inline"] == outs["cluster"]
    tok_s = {name: tokens[name] / seconds[name] for name in backends}
    return {
        "clients": clients,
        "inline_tok_s": round(tok_s["inline"], 2),
        "cluster_tok_s": round(tok_s["cluster"], 2),
        "isolation_tax_pct": round(100.0 * (1.0 - tok_s["cluster"] / tok_s["inline"]), 2),
        "greedy_outputs_identical": identical,
    }


def run(args) -> dict:
    import ray

    from ..cluster.backend import role_blas_threads, start_cluster, usable_cpus
    from ..cluster.localray import init_local_ray
    from ..serving.inline import InlineBackend, RoundDelay
    from ..settings import model_flags, serve_settings

    settings = serve_settings(**model_flags(args), cache_dir="none", transport=args.transport)
    delay = RoundDelay(args.round_delay_ms / 1000.0, busy=True) if args.round_delay_ms else None
    prompts = args.prompts or list(DEFAULT_PROMPTS)
    inline = InlineBackend(settings, delay)
    inline.ready()
    init_local_ray(namespace=f"sanctum-bench-{os.getpid()}", log_to_driver=False)
    try:
        cluster = start_cluster(settings, delay)
        cluster.ready(600)
        for backend in (inline, cluster):  # warm-up: compiled kernels, first-call costs
            for prompt in prompts:
                _run(backend, prompt, 16)
        pids = {"inline": [os.getpid()], "cluster": [os.getpid(), *cluster.pids().values()]}
        cpu = {"inline": 0.0, "cluster": 0.0}
        before = {"inline": inline.stats(), "cluster": cluster.stats()}
        # tokens, rounds, seconds seen by the caller, seconds inside the verifier (open..last chunk)
        totals = {"inline": [0, 0, 0.0, 0.0], "cluster": [0, 0, 0.0, 0.0]}
        ratios = []  # cluster tok/s / inline tok/s of the same prompt, run back to back
        identical = True
        for rep in range(args.repeats):
            for prompt in prompts:
                order = (("inline", inline), ("cluster", cluster))
                outs, speed = {}, {}
                for name, backend in order if rep % 2 == 0 else order[::-1]:
                    c0 = _cpu_seconds(pids[name])
                    tokens, rounds, elapsed, inside = _run(backend, prompt, args.max_tokens)
                    c1 = _cpu_seconds(pids[name])
                    cpu[name] = (
                        None
                        if c0 is None or c1 is None or cpu[name] is None
                        else cpu[name] + c1 - c0
                    )
                    outs[name], speed[name] = tokens, len(tokens) / elapsed
                    for k, v in enumerate((len(tokens), rounds, elapsed, inside)):
                        totals[name][k] += v
                identical &= outs["inline"] == outs["cluster"]
                ratios.append(speed["cluster"] / speed["inline"])
        after = {"inline": inline.stats(), "cluster": cluster.stats()}
        concurrent = None
        if args.concurrency > 1:
            concurrent = _concurrent(
                {"inline": inline, "cluster": cluster},
                prompts,
                args.concurrency,
                args.max_tokens,
                args.repeats,
            )
        cluster.close()
    finally:
        ray.shutdown()
        inline.close()
    phases = {name: _round_phases(before[name], after[name]) for name in before}
    before, after = before["cluster"], after["cluster"]
    calls = after.draft_calls - before.draft_calls

    def per_call(field: str) -> float:  # the mean of a per-call figure over the timed runs
        total = (
            getattr(after, field) * after.draft_calls - getattr(before, field) * before.draft_calls
        )
        return total / max(1, calls)

    tok_s = {k: v[0] / v[2] for k, v in totals.items()}
    return {
        "model": settings.engine.model,
        "drafter": settings.engine.drafter,
        "transport": after.transport,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "round_delay_ms": args.round_delay_ms,
        "usable_cpus": usable_cpus(),  # the split needs cores: see deploy/README
        "cluster_blas_threads": role_blas_threads(settings.processes),
        "inline_tok_s": round(tok_s["inline"], 2),
        "cluster_tok_s": round(tok_s["cluster"], 2),
        "isolation_tax_pct": round(100.0 * (1.0 - tok_s["cluster"] / tok_s["inline"]), 2),
        # the same from back-to-back pairs (robust to a noisy machine): median and quartiles
        "paired_tax_pct_median": round(100.0 * (1.0 - statistics.median(ratios)), 2),
        "paired_tax_pct_q1_q3": [round(100.0 * (1.0 - q), 2) for q in _quartiles(ratios)[::-1]],
        # where the median could lie given this run's spread (90%, bootstrap over the pairs)
        "paired_tax_pct_ci90": [round(100.0 * (1.0 - q), 2) for q in median_interval(ratios)[::-1]],
        "inline_round_ms": round(1000.0 * totals["inline"][2] / max(1, totals["inline"][1]), 3),
        "cluster_round_ms": round(1000.0 * totals["cluster"][2] / max(1, totals["cluster"][1]), 3),
        # the same, timed inside the verifier: the difference is the stream back to the caller
        "inline_verifier_round_ms": round(
            1000.0 * totals["inline"][3] / max(1, totals["inline"][1]), 3
        ),
        "cluster_verifier_round_ms": round(
            1000.0 * totals["cluster"][3] / max(1, totals["cluster"][1]), 3
        ),
        # CPU time of the role processes per token: what the split costs in work, unlike
        # tok/s undisturbed by other load on the machine (Linux only)
        "inline_cpu_ms_per_token": _per_token(cpu["inline"], totals["inline"][0]),
        "cluster_cpu_ms_per_token": _per_token(cpu["cluster"], totals["cluster"][0]),
        # where a round's time goes on the verifier, in each mode (ms per round)
        "inline_round_phases_ms": phases["inline"],
        "cluster_round_phases_ms": phases["cluster"],
        "draft_calls": calls,
        # drafts overlap the verifier's rollback and streaming (asked for a round ahead):
        "overlapped_draft_calls": after.overlapped_draft_calls - before.overlapped_draft_calls,
        "drafter_wait_ms_per_round": round(per_call("drafter_wait_ms_per_round"), 4),
        "drafter_compute_ms_per_round": round(per_call("drafter_compute_ms_per_round"), 4),
        # the channel's own latency (round trip minus compute; since start, warm-up included)
        "transport_ms_per_round": round(after.transport_ms_per_round, 4),
        "transport_bytes_per_round": round(per_call("transport_bytes_per_round")),
        "greedy_outputs_identical": identical,
        # --concurrency N: N requests at once in each mode (aggregate tok/s), after the above
        "concurrent": concurrent,
    }
