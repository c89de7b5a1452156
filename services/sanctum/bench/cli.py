"""`sanctum bench ...`: benchmarks are commands with fixed arguments that print figures (speed
is measured here, never asserted in tests); ratios are measured within one run, the compared
modes interleaved. The top of the house: a bench may use any layer below."""

from __future__ import annotations

import json

from .decode import speculative, tau
from .multiturn import multiturn, reencode


def register(sub) -> None:
    """`sanctum bench ...` subcommands."""
    from ..settings import add_model_flags

    b = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = b.add_subparsers(dest="bench", required=True)
    s = bsub.add_parser("speculative", help="plain vs speculative tok/s, tau, round time split")
    add_model_flags(s)
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--json", action="store_true")
    m = bsub.add_parser("multiturn", help="prompt-cache hit ratio and warm/cold TTFT per turn")
    add_model_flags(m)
    m.add_argument("--turns", type=int, default=8)
    m.add_argument("--max-tokens", type=int, default=48)
    m.add_argument("--ladder", type=int, help="ladder depth (default SANCTUM_MLX_SSM_LADDER or 4)")
    m.add_argument(
        "--branch", action="store_true", help="then edit the middle turn and resume from the cache"
    )
    m.add_argument("--json", action="store_true")
    from .isolation import add_parser as add_isolation

    add_isolation(bsub)
    from .abuse import add_parser as add_abuse

    add_abuse(bsub)
    from .http import add_parser as add_http

    add_http(bsub)
    from .batch import add_parser as add_batch

    add_batch(bsub)
    from .gaps import add_parser as add_gaps

    add_gaps(bsub)
    from .roundtrace import add_parser as add_round_trace

    add_round_trace(bsub)
    t = bsub.add_parser("tau", help="tau and speculative/plain tok/s per context length")
    add_model_flags(t)
    t.add_argument(
        "--contexts", default="0,1024,2048,4096", help="tokens of held-out text before each prompt"
    )
    t.add_argument("--block-sizes", default="8,16")
    t.add_argument("--temperatures", default="0.7,1.0", help="sampled tau (block: the first)")
    t.add_argument(
        "--accept-rules",
        default="block",
        help="sampled drafts' acceptance, comma separated: block (verification), token (rule); "
        "each rule after the first adds keys ending in _<rule>",
    )
    t.add_argument(
        "--min-tau",
        default="0",
        help="the speculation gate for the sampled runs: a threshold, auto (measured, as "
        "serving does) or 0 (off: pure speculation figures)",
    )
    t.add_argument("--num-prompts", type=int, default=8, help="prompts per context length")
    t.add_argument("--max-tokens", type=int, default=96)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", action="store_true")
    r = bsub.add_parser("reencode", help="the re-encoding watch's cost a round vs whole")
    r.add_argument("--model", help="checkpoint whose tokenizer to use (default: the embedded)")
    r.add_argument("--round-tokens", type=int, default=6)
    r.add_argument("--lengths", default="256,1024,4096")
    r.add_argument("--json", action="store_true")
    from .cachesize import add_parser as add_cache_size
    from .ceiling import add_parser as add_tau_ceiling
    from .cuda import add_parser as add_cuda
    from .registers import add_parser as add_registers
    from .seed import add_parser as add_seed
    from .weightreads import add_parser as add_weight_reads

    add_seed(bsub)
    add_cuda(bsub)
    add_registers(bsub)
    add_weight_reads(bsub)
    add_cache_size(bsub)
    add_tau_ceiling(bsub)
    b.set_defaults(func=main)


def isolation(args) -> dict:
    """Actor cluster vs inline (bench/isolation.py)."""
    from .isolation import run

    return run(args)


def abuse(args) -> dict:
    """A normal stream's worst gap while abusive clients hammer the server (bench/abuse.py)."""
    from .abuse import run

    return run(args)


def http(args) -> dict:
    """HTTP vs gRPC per-request latency on one server (bench/http.py)."""
    from .http import run

    return run(args)


def batch(args) -> dict:
    """Concurrent requests sharing rounds: tok/s, TTFT, tau by concurrency (bench/batch.py)."""
    from .batch import run

    return run(args)


def gaps(args) -> dict:
    """A running stream's worst gap as others join or a long prompt lands (bench/gaps.py)."""
    from .gaps import run

    return run(args)


def round_trace(args) -> dict:
    """A shared round's pieces timed and op-counted by concurrency (bench/roundtrace.py)."""
    from .roundtrace import run

    return run(args)


def seed(args) -> dict:
    """The seed's shapes on random weights (bench/seed.py)."""
    from .seed import seed as run

    return run(args)


def cache_size(args) -> list[dict]:
    """Prompt-cache bytes per conversation at the seed's shapes (bench/cachesize.py)."""
    from .cachesize import run

    return run(args)


def tau_ceiling(args) -> list[dict]:
    """Sampled tau a block drafter could reach on the target, beside the drafter's (bench/ceiling.py)."""
    from .ceiling import run

    return run(args)


def cuda(args) -> dict:
    """The CUDA-only paths checked and timed (bench/cuda.py)."""
    from .cuda import run

    return run(args)


def registers(args) -> list[dict]:
    """The tiled 4-bit kernel's registers and blocks an SM, compiled only (bench/registers.py)."""
    from .registers import run

    return run(args)


def weight_reads(args) -> dict:
    """4-bit weights read in the tiled kernel's pattern and others (bench/weightreads.py)."""
    from .weightreads import run

    return run(args)


BENCHES = {
    "speculative": speculative,
    "multiturn": multiturn,
    "isolation": isolation,
    "tau": tau,
    "reencode": reencode,
    "abuse": abuse,
    "http": http,
    "batch": batch,
    "gaps": gaps,
    "round-trace": round_trace,
    "seed": seed,
    "cuda": cuda,
    "registers": registers,
    "weight-reads": weight_reads,
    "cache-size": cache_size,
    "tau-ceiling": tau_ceiling,
}


def main(args) -> int:
    result = BENCHES[args.bench](args)
    if args.json:
        print(json.dumps(result))
    elif isinstance(result, list):
        keys = list(result[0]) if result else []
        print("  ".join(f"{k:>15}" for k in keys))
        for row in result:
            print("  ".join(f"{str(row[k]):>15}" for k in keys))
    else:
        for k, v in result.items():
            print(f"{k:>26}: {v}")
    return 0
