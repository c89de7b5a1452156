"""`sanctum bench batch`: concurrent requests sharing rounds (docs/design/shared-rounds.md).

The same requests are served at each concurrency by that many clients at once (inline, or through
the actor cluster with `--cluster`; SANCTUM_MAX_BATCH = the largest concurrency; at 1 every round
is one request's), then inline at the largest concurrency again with max_batch 1 (the
round-robin), and each output is checked against the concurrency-1 run, where every request was
served alone, and (greedy) against plain greedy decoding of its prompt: equal, or equal up to the
plain run's first near tie (neartie.py; a GPU's batched kernels round differently). `--steady R`
measures the shared rounds themselves instead, without a server, prefill or tails (`steady`)."""

from __future__ import annotations

import json
import os
import queue
import statistics
import threading
import time
from collections import deque
from dataclasses import replace

from .neartie import NEAR_TIE, near_tie_verdict, top_two_margins, worst
from .opcount import count_ops, per_round

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "def add(a, b):",
    "for i in range(10):\n    print(i)\n",
    "def read_file(path):\n    with open(path) as f:",
    "import json\n\n\ndef load(path):",
    "def quicksort(xs):",
]


FORCED = "not checked: acceptance forced"
WARM_ROUNDS = 3  # untimed, before `steady`'s timed rounds: each batch shape's first graphs


def add_parser(bsub) -> None:
    from ..settings import add_model_flags

    p = bsub.add_parser(
        "batch", help="aggregate and per-request tok/s, TTFT and tau by concurrency"
    )
    add_model_flags(p)
    p.add_argument("--concurrency", default="1,2,4", help="clients at once, comma separated")
    p.add_argument("--requests", type=int, help="requests at each concurrency (default: the most)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded samples")
    p.add_argument("--adaptive-width", action="store_true", help="SANCTUM_ADAPTIVE_WIDTH=1")
    p.add_argument(
        "--warm",
        action="store_true",
        help="serve each level once before timing it (compiled graphs per batch shape: slow "
        "to build on a GPU, built once by a running server)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="serve through the actor cluster (verifier, drafter and store actors) instead of "
        "inline; its max_batch is fixed at start, so no round-robin row",
    )
    p.add_argument(
        "--steady",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="time ROUNDS shared rounds of the engine itself at each concurrency (sequences "
        "prefilled first, a few rounds untimed): the round's cost without a server's prefill "
        "or tails; 0 serves requests as above",
    )
    p.add_argument(
        "--phases",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="with --steady: ROUNDS more rounds at each concurrency with every phase awaited "
        "(draft, verify, rollback, the rest), for the round's split; slower rounds",
    )
    p.add_argument(
        "--count-ops",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="with --steady: ROUNDS more rounds at each concurrency with the evaluations and "
        "graph nodes they hand to MLX counted (bench/opcount.py)",
    )
    p.add_argument(
        "--warm-rounds",
        type=int,
        default=WARM_ROUNDS,
        metavar="ROUNDS",
        help="with --steady: untimed rounds at each concurrency before the timed ones (on the "
        "H200 a process's first run had not settled after 3 + 8 rounds; a second run had)",
    )
    p.add_argument(
        "--force-tau",
        default="0",
        metavar="TAU[,TAU...]",
        help="with --steady: every round keeps TAU - 1 drafts whatever the target says (a "
        "random-weight pair's rounds at a trained pair's acceptance; lookup off, outputs "
        "not checked); 0: the real acceptance; several: every level at each, in one process",
    )
    p.add_argument(
        "--lines", action="store_true", help="with --steady: a JSON line per level as it ends"
    )
    p.add_argument(
        "--context",
        type=int,
        default=0,
        help="with --steady: tokens of held-out text before each prompt (long contexts)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="serve every level this many times, in reverse every other time (medians "
        "reported, each pass's figures and its ratios to its own one stream beside them)",
    )
    p.add_argument("--json", action="store_true")


def _serve(backend, requests: list, clients: int) -> tuple[float, dict]:
    """Serve `requests` with `clients` of them in flight at once; (wall seconds, id -> result)."""
    from ..serving.requests import GenerateRequest

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i, req in enumerate(requests):
        todo.put((i, req))
    out: dict = {}

    def client():
        while True:
            try:
                i, req = todo.get_nowait()
            except queue.Empty:
                return
            fresh = GenerateRequest(**{**req.__dict__, "request_id": f"{req.request_id}-{clients}"})
            chunks = list(backend.submit(fresh))
            out[i] = ([t for c in chunks for t in c.token_ids], chunks[-1].usage)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def steady(args, levels: list[int], taus: list[int] = (0,)) -> dict:
    """Shared rounds in steady state (`BatchDecoder.step_batch`; one sequence: `step`), greedy,
    the block of the model flags: at each concurrency N the first N prompts prefilled,
    `args.warm_rounds` rounds untimed, then `args.steady` rounds timed. Per level: ms a round
    (mean; and min, median, max), tokens a round (all the sequences'), tok/s and its ratio to
    one sequence's, tau, MLX's peak memory, and with `--phases` the split of a round
    (`_phases`), with `--count-ops` what a round hands to MLX (`count_rounds`); every
    sequence's tokens checked against plain greedy decoding of its prompt, equal or equal up
    to the plain run's first near tie (neartie.py). Every level again at each forced tau of
    `taus` (0: the real acceptance; forced rounds' outputs are not checked)."""
    import mlx.core as mx

    from ..engine.decode.generate import make_key
    from ..engine.decode.peer import LocalDraftPeer
    from ..engine.decode.policy import DecodePolicy
    from ..engine.decode.rounds import BatchDecoder
    from ..engine.kernels import cuda
    from ..serving.inline import load_models
    from ..settings import engine_settings, model_flags

    settings = engine_settings(**model_flags(args))
    target, drafter = load_models(settings)
    if drafter is None:
        raise ValueError("bench batch --steady needs a drafter")

    def decoder_at(tau: int) -> BatchDecoder:
        if not tau:
            return BatchDecoder(target, drafter, LocalDraftPeer(drafter), settings.block_size)
        from .seed import ForcedBatchDecoder  # what a round costs at that acceptance

        policy = DecodePolicy(lookup_min=0)
        return ForcedBatchDecoder(target, drafter, settings.block_size, tau, policy)

    rounds = args.warm_rounds + args.steady + args.phases + args.count_ops
    decoders = {tau: decoder_at(tau) for tau in taus}
    budget = steady_budget(rounds, decoders[taus[0]].block_size)
    key, rows = make_key(0), []
    for tau, n in [(tau, n) for tau in taus for n in levels]:
        decoder = decoders[tau]
        prompts, seqs, out = open_level(decoder, settings, n, budget, key, args.context)
        accepted: list[int] = []
        for _ in range(args.warm_rounds):
            _round(decoder, seqs, key, out, None)
        before = sum(map(len, out))
        mx.reset_peak_memory()
        each = []  # each round's wall time: a round ends on its acceptance, read on the host
        t0 = time.perf_counter()
        for _ in range(args.steady):
            t1 = time.perf_counter()
            _round(decoder, seqs, key, out, accepted)
            each.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
        peak = mx.get_peak_memory()
        made = sum(map(len, out)) - before
        phases = _phases(decoder, seqs, key, out, args.phases) if args.phases else None
        ops = count_rounds(decoder, seqs, key, out, args.count_ops) if args.count_ops else None
        finished = sum(seq.finished is not None for seq in seqs)
        for seq in seqs:
            decoder.close(seq)
        # forced acceptance commits drafts the target did not choose: nothing to check
        verdicts = [] if tau else plain_verdicts(target, settings, prompts, out)
        rows.append(
            {
                "concurrency": n,
                "round_ms": round(1000 * wall / args.steady, 2),
                "round_ms_min_median_max": [
                    round(1000 * x, 2) for x in (min(each), statistics.median(each), max(each))
                ],
                "tokens_per_round": round(made / args.steady, 2),
                "tok_s": round(made / wall, 1),
                "tau": round(sum(accepted) / max(1, len(accepted)), 3),
                "peak_memory_gb": round(peak / 2**30, 2),  # MLX's, over the timed rounds
                # sequences that ended before the last measured round (their budget or the
                # context): the rounds after were narrower than `concurrency`
                "sequences_finished": finished,
                "force_tau": tau or None,
                "outputs_equal_plain": None
                if tau
                else all(v["verdict"] == "equal" for v in verdicts),
                "equality": FORCED if tau else worst([v["verdict"] for v in verdicts]),
                "equality_per_sequence": verdicts,
            }
        )
        if phases is not None:
            rows[-1]["phases_ms"] = phases
        if ops is not None:
            rows[-1]["ops"] = ops
        row = rows[-1]  # levels ascend from one sequence, at each forced tau
        base = next(r for r in rows if r["force_tau"] == row["force_tau"])
        row["tok_s_vs_one"] = round(row["tok_s"] / base["tok_s"], 2) if base["tok_s"] else None
        if ops is not None and base["ops"]["nodes_per_round"]:
            ops["nodes_vs_one"] = round(ops["nodes_per_round"] / base["ops"]["nodes_per_round"], 2)
        if args.lines:  # each level as it ends: a run cut short keeps the levels it measured
            print(json.dumps(row), flush=True)
    checked = [r for r in rows if r["force_tau"] is None]
    return {
        "mode": "steady rounds",
        "policy": cuda.report(),  # the kernels and settings the rounds ran with
        "rounds": args.steady,
        "warm_rounds": args.warm_rounds,
        "block_size": decoder.block_size,
        "near_tie_logits": NEAR_TIE,
        "levels": rows,
        "force_tau": [t or None for t in taus],
        # over the levels at the real acceptance (forced ones commit drafts unchecked)
        "all_outputs_equal_plain": all(r["outputs_equal_plain"] for r in checked)
        if checked
        else None,
        "equality": worst([r["equality"] for r in checked]) if checked else FORCED,
    }


def steady_budget(rounds: int, block_size: int) -> int:
    """max_tokens of a steady sequence: no sequence ends within `rounds` rounds. A round
    commits up to its block, and a looked-up block can be wider than the drafter's."""
    from ..engine.decode.policy import LOOKUP_MAX_WIDTH

    return 1 + rounds * max(block_size, LOOKUP_MAX_WIDTH)


def open_level(
    decoder, settings, n: int, budget: int, key, context: int = 0
) -> tuple[list, list, list]:
    """N greedy sequences of the first N prompts, prefilled and started: (prompt ids,
    sequences, each sequence's tokens so far). With `context`, each prompt comes after that
    many tokens of held-out text (a different stretch each) and an end-of-text token."""
    from ..engine.decode.sampling import SamplingParams

    target = decoder.target
    prompts = [target.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    if context:
        from ..tokenizer import EOT
        from ..train.data import heldout_tokens

        stream = heldout_tokens(target.path)
        if stream.size < n * context:
            raise ValueError(f"--context {context}: the held-out text has {stream.size} tokens")
        eot = target.tokenizer.convert_tokens_to_ids(EOT)
        prompts = [
            [int(t) for t in stream[i * context : (i + 1) * context]] + [eot] + p
            for i, p in enumerate(prompts)
        ]
    seqs = [
        decoder.new_sequence(f"steady-{n}-{i}", settings.kv_mode, SamplingParams(), budget)
        for i in range(n)
    ]
    out = []
    for seq, prompt in zip(seqs, prompts):
        out.append(list(decoder.start(seq, decoder.prefill(seq, prompt), key).tokens))
    return prompts, seqs, out


def plain_verdicts(target, settings, prompts: list, outs: list) -> list[dict]:
    """Each output against plain greedy decoding of its prompt, to as many tokens
    (neartie.py): the equal prefix, the plain run's first near tie, the verdict."""
    return judged_against_plain(target, settings, prompts, [dict(enumerate(outs))])[0]


def judged_against_plain(target, engine, prompts: list, levels: list[dict]) -> list[list[dict]]:
    """`plain_verdicts` of several levels' outputs of the same prompts (each level: prompt
    index -> tokens), one plain run a prompt (as long as its longest output): per level, per
    prompt, the equal prefix, the plain run's first near tie, the verdict."""
    from .decode import _run_once

    judged: list[list[dict]] = [[] for _ in levels]
    for i, prompt in enumerate(prompts):
        longest = max(len(level[i]) for level in levels)
        plain = _run_once(target, None, prompt, longest, engine)[0][:longest]
        margins = None  # computed once, where some output parts from the plain run
        for verdicts, level in zip(judged, levels):
            tokens = level[i]
            if margins is None and tokens != plain[: len(tokens)]:
                margins = top_two_margins(target, prompt, plain)
            n = len(tokens)
            same, tie, verdict = near_tie_verdict(plain[:n], (margins or [])[:n], tokens)
            verdicts.append({"equal_prefix": same, "first_near_tie": tie, "verdict": verdict})
    return judged


def count_rounds(decoder, seqs: list, key, out: list[list[int]], rounds: int) -> dict:
    """`rounds` more rounds with what they hand to MLX counted (opcount.py), per round."""
    with count_ops() as tally:
        for _ in range(rounds):
            _round(decoder, seqs, key, out, None)
    return per_round(tally, rounds)


def _phases(decoder, seqs: list, key, out: list[list[int]], rounds: int) -> dict:
    """`rounds` rounds with every phase awaited (`DecodePolicy.profile`): ms a round of each phase,
    summed over the round's sequences (each step's stats hold its share of the shared phases)."""
    total = {"draft": 0.0, "verify": 0.0, "rollback": 0.0, "other": 0.0, "round": 0.0}
    decoder = decoder.with_policy(profile=True)
    for _ in range(rounds):
        t0 = time.perf_counter()
        steps = _round(decoder, seqs, key, out, None)
        total["round"] += time.perf_counter() - t0
        for step in steps:
            for name in ("draft", "verify", "rollback", "other"):
                total[name] += getattr(step.stats, f"{name}_s")
    return {name: round(1000 * s / rounds, 2) for name, s in total.items()}


def _round(decoder, seqs: list, key, out: list[list[int]], accepted: list[int] | None) -> list:
    """One round of every sequence (shared, or one's own `step`), its tokens appended to
    `out`; with `accepted`, each speculative round's committed tokens too. A finished
    sequence sits out. Returns the steps."""
    live = [n for n, seq in enumerate(seqs) if seq.finished is None]
    if len(live) > 1:
        steps = decoder.step_batch([seqs[n] for n in live], [key] * len(live))
    else:
        steps = [decoder.step(seqs[n], key) for n in live]
    for n, step in zip(live, steps):
        out[n] += step.tokens
        if accepted is not None and step.stats is not None and step.stats.bs > 1:
            accepted.append(step.stats.accepted + 1)
    return steps


def _level(clients: int, width: int, runs: list[dict]) -> dict:
    """A level's row from its passes: each figure the median over them (the first pass's
    cold wall), outputs equal to alone in every pass, and with several passes each one's
    aggregate tok/s."""
    row = {"concurrency": clients, "max_batch": width}
    for name in ("aggregate_tok_s", "per_request_tok_s", "ttft_ms", "tau", "wall_s"):
        row[name] = round(statistics.median(r[name] for r in runs), 3)
    row["completion_tokens"] = runs[0]["completion_tokens"]
    row["outputs_equal_alone"] = all(r["outputs_equal_alone"] for r in runs)
    row["cold_wall_s"] = runs[0]["cold_wall_s"]
    row["each_request_s_tau"] = runs[0]["each_request"]  # the first pass's
    timed = [r for r in runs if "round_ms_median" in r]
    if timed:  # the server's rounds: the passes' median round, and the longest of any pass
        row["round_ms_median"] = round(statistics.median(r["round_ms_median"] for r in timed), 1)
        worst = max(timed, key=lambda r: r["round_ms_max"])
        row["round_ms_max"], row["longest_round"] = worst["round_ms_max"], worst["longest_round"]
    if len(runs) > 1:
        row["aggregate_tok_s_runs"] = [r["aggregate_tok_s"] for r in runs]
    return row


def _keep_work_log(backend):
    """A fresh work log on an inline server's worker (`Scheduler.work_log`): the pass's
    rounds are timed there. None through the cluster."""
    scheduler = getattr(backend, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "work_log"):
        return None
    scheduler.work_log = deque()
    return scheduler.work_log


def _rounds_of(log) -> dict:
    """A pass's rounds from its work log: the median and longest round's ms, and the longest
    one's [requests, tokens committed] (a round of wide looked-up blocks is long but commits
    many; a stall commits few)."""
    # (a copy: the worker may still be logging the last round as its client reads its chunk)
    rounds = [(t1 - t0, d) for t0, t1, kind, d in list(log or ()) if kind == "round"]
    if not rounds:
        return {}
    longest = max(rounds, key=lambda r: r[0])
    return {
        "round_ms_median": round(1000 * statistics.median(ms for ms, _ in rounds), 1),
        "round_ms_max": round(1000 * longest[0], 1),
        "longest_round": list(longest[1]),
    }


def run(args) -> dict:
    try:
        taus = [int(t) for t in str(args.force_tau).split(",")]
    except ValueError:
        raise ValueError(f"--force-tau takes integers, got {args.force_tau!r}") from None
    if min(taus) < 0:
        raise ValueError(f"--force-tau must be >= 1 (0: the real acceptance), got {args.force_tau}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if (args.phases or args.count_ops or any(taus)) and not args.steady:
        raise ValueError(
            "--phases, --count-ops and --force-tau are for --steady's rounds: give --steady"
        )
    if args.steady:
        if args.cluster or args.temperature:
            raise ValueError(
                "--steady times the engine's greedy rounds: no --cluster, no --temperature"
            )
        if min(args.phases, args.count_ops, args.warm_rounds) < 0 or args.steady < 0:
            raise ValueError("--steady, --phases, --count-ops and --warm-rounds must be >= 0")
        return steady(args, sorted({int(c) for c in args.concurrency.split(",")} | {1}), taus)
    from ..serving.inline import InlineBackend
    from ..serving.requests import GenerateRequest
    from ..settings import model_flags, serve_settings

    levels = sorted({int(c) for c in args.concurrency.split(",")} | {1})
    count = args.requests or max(levels)
    settings = serve_settings(
        **model_flags(args), cache_dir="none", max_batch=max(levels), max_active=max(levels)
    )
    settings = replace(settings, adaptive_width=int(args.adaptive_width))
    requests = [
        GenerateRequest(
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=i,
            use_cache=False,
            request_id=f"bench-{i}",
        )
        for i in range(count)
    ]
    if args.cluster:
        from ..cluster.backend import start_cluster
        from ..cluster.localray import init_local_ray

        init_local_ray(namespace=f"sanctum-bench-{os.getpid()}", log_to_driver=False)
        backend = start_cluster(settings)
    else:
        backend = InlineBackend(settings)
    try:
        backend.ready(300)
        _serve(backend, requests[:1], 1)  # warm-up: compiled graphs, BLAS threads
        alone = None
        # each level batched, then (inline) the largest one again without shared rounds (the
        # round-robin of one request's round at a time), in the same run; with --repeats, the
        # whole plan again, in reverse every other time (a machine's drift falls on both ends)
        plan = [(c, max(levels)) for c in levels] + ([] if args.cluster else [(max(levels), 1)])
        runs: dict[tuple[int, int], list[dict]] = {step: [] for step in plan}
        outputs: dict[tuple[int, int], dict] = {}  # each level's first pass: id -> tokens
        for rep in range(args.repeats):
            for clients, width in plan if rep % 2 == 0 else plan[::-1]:
                if not args.cluster:
                    backend.scheduler.max_batch = width  # read between rounds; idle here
                cold_s = None
                if args.warm and rep == 0:  # a first pass traces and compiles each new shape
                    cold_s = round(_serve(backend, requests, clients)[0], 3)
                log = _keep_work_log(backend)
                wall, out = _serve(backend, requests, clients)
                tokens = {i: toks for i, (toks, _) in out.items()}
                outputs.setdefault((clients, width), tokens)
                if alone is None:
                    alone = tokens
                usages = [u for _, u in out.values()]
                total = sum(u.completion_tokens for u in usages)
                runs[(clients, width)].append(
                    {
                        "aggregate_tok_s": round(total / wall, 1),
                        "per_request_tok_s": round(
                            sum(u.completion_tokens / u.elapsed_s for u in usages) / len(usages),
                            1,
                        ),
                        "ttft_ms": round(1000 * sum(u.ttft_s for u in usages) / len(usages), 1),
                        "tau": round(sum(u.tau for u in usages) / len(usages), 3),
                        "completion_tokens": total,
                        "wall_s": round(wall, 3),
                        "outputs_equal_alone": tokens == alone,
                        "cold_wall_s": cold_s,  # the same requests once before, untimed (--warm)
                        # each request's seconds from submission to its last token, and its tau
                        # (which one sets the level's wall)
                        "each_request": [
                            [round(out[i][1].elapsed_s, 3), round(out[i][1].tau, 2)]
                            for i in sorted(out)
                        ],
                        **_rounds_of(log),
                    }
                )
        rows = [_level(clients, width, runs[(clients, width)]) for clients, width in plan]
        base = runs[plan[0]]
        for row, step in zip(rows, plan):
            row["aggregate_vs_one"] = round(row["aggregate_tok_s"] / rows[0]["aggregate_tok_s"], 2)
            if args.repeats > 1:  # each pass's level against the same pass's one stream
                row["aggregate_vs_one_runs"] = [
                    round(r["aggregate_tok_s"] / b["aggregate_tok_s"], 2)
                    for r, b in zip(runs[step], base)
                ]
        top = rows[len(levels) - 1]["aggregate_tok_s"]
        result = {
            "requests": count,
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "block_size": settings.engine.block_size or "the drafter's",
            "temperature": args.temperature,
            "adaptive_width": bool(args.adaptive_width),
            "serving": "cluster" if args.cluster else "inline",
            "levels": rows,
            "all_outputs_equal_alone": all(r["outputs_equal_alone"] for r in rows),
            "batched_vs_unbatched_at_most": None
            if args.cluster
            else round(top / rows[-1]["aggregate_tok_s"], 2),
        }
    finally:
        backend.close()
        if args.cluster:
            import ray

            ray.shutdown()
    # the server is closed: the plain runs' model is the only one loaded now
    if args.temperature:
        result["equality"] = "not checked: sampled"
        return result
    judged = served_verdicts(settings.engine, requests, [outputs[step] for step in plan])
    for row, verdicts in zip(rows, judged):
        row["outputs_equal_plain"] = all(v["verdict"] == "equal" for v in verdicts)
        row["equality"] = worst([v["verdict"] for v in verdicts])
        if row["equality"] != "equal":  # where each request parted from plain decoding
            row["equality_per_request"] = verdicts
    result["near_tie_logits"] = NEAR_TIE
    result["equality"] = worst([r["equality"] for r in rows])
    return result


def served_verdicts(engine, requests: list, levels: list[dict]) -> list[list[dict]]:
    """`judged_against_plain` of each level's served outputs (request index -> tokens), the
    prompts encoded as served. The target is loaded again here, once the server has gone: a
    cluster's lives in another process."""
    from ..engine.model.target import load_target

    target = load_target(engine.model)
    prompts = [target.tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    return judged_against_plain(target, engine, prompts, levels)
