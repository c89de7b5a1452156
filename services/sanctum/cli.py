"""`sanctum generate | make-tiny | bench | serve ...`: the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .settings import add_model_flags


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def cmd_generate(args) -> int:
    from .engine.decode.generate import generate
    from .engine.decode.sampling import SamplingParams
    from .serving.inline import load_models
    from .settings import engine_settings, model_flags
    from .tokenizer import TextStream
    from .wire.convert import rounds_tau

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.server:
        from .api.client import generate_remote

        result = generate_remote(args.server, args, sampling)
    else:
        settings = engine_settings(**model_flags(args))
        target, drafter = load_models(settings)
        prompt_ids = target.tokenizer.encode(args.prompt, add_special_tokens=False)
        stream = TextStream(target.tokenizer, args.stop)
        t0 = time.perf_counter()
        tokens, rounds, text, finish = [], [], "", None
        for step in generate(
            target,
            prompt_ids,
            drafter=drafter,
            sampling=sampling,
            max_tokens=args.max_tokens,
            block_size=settings.block_size,
            kv_mode=settings.kv_mode,
            stop_check=stream.check,
        ):
            tokens.extend(step.tokens)
            delta = stream.push(step.tokens)
            text += delta
            if step.stats is not None:
                rounds.append(
                    {
                        "bs": step.stats.bs,
                        "accepted": step.stats.accepted,
                        "committed": step.stats.committed,
                    }
                )
                if args.verbose:
                    print(step.stats.line(len(tokens)), file=sys.stderr)
            if not args.json and not args.verbose:  # verbose: the text once, after the rounds
                print(delta, end="", flush=True)
            finish = step.finish_reason or finish
        text += stream.finish()
        elapsed = time.perf_counter() - t0
        result = {
            "tokens": tokens,
            "text": text,
            "rounds": rounds,
            "tau": rounds_tau(rounds),
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(tokens),
            "finish_reason": finish,
            "elapsed_s": round(elapsed, 4),
            "tok_per_s": round(len(tokens) / elapsed, 2) if elapsed > 0 else None,
            "kv": settings.kv_mode,
            "drafter": settings.drafter,
        }
    if args.json:
        print(json.dumps(result))
    elif not args.server and not args.verbose:
        print()
    else:
        print(result["text"], flush=True)
    return 0


def cmd_make_tiny(args) -> int:
    from .tiny import make_tiny

    target, drafter = make_tiny(args.out, args.kind, args.drafter, args.seed, args.block_size)
    print(json.dumps({"target": str(target), "drafter": str(drafter)}))
    return 0


_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def _prefer_openblas() -> None:
    """On Linux, MLX's CPU wheel links the reference BLAS, much slower than OpenBLAS; restart once
    with Debian's OpenBLAS preloaded when it is installed. SANCTUM_NO_OPENBLAS=1 opts out.
    Its idle worker threads sleep almost at once (OPENBLAS_THREAD_TIMEOUT=4, 2^4 cycles) instead
    of spinning after every call: a spinning worker holds a core through each wait for another
    process (the drafter, the client); alone, it only burns CPU (docs/performance.md)."""
    import os

    from .settings import OPENBLAS_IDLE_SPIN

    if (
        sys.platform.startswith("linux")
        and os.path.exists(_OPENBLAS)
        and _OPENBLAS not in os.environ.get("LD_PRELOAD", "")
        and not os.environ.get("SANCTUM_NO_OPENBLAS")
    ):
        env = dict(os.environ, LD_PRELOAD=_OPENBLAS, SANCTUM_NO_OPENBLAS="1")
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_IDLE_SPIN)
        os.execve(sys.executable, [sys.executable, "-m", "sanctum.cli", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _prefer_openblas()
    parser = argparse.ArgumentParser(prog="sanctum", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion (locally, or from a server)")
    add_model_flags(g)
    _add_sampling_flags(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--server", help="HOST:PORT of a running `sanctum serve`")
    g.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="--server: the bearer token (default SANCTUM_AUTH_TOKEN, SANCTUM_AUTH_TOKEN_FILE)",
    )
    g.add_argument("--tls", action="store_true", help="--server: TLS, verified by system roots")
    g.add_argument("--tls-ca", metavar="PEM", help="--server: TLS, verified by this CA")
    g.add_argument("--tls-cert", metavar="PEM", help="--server: client certificate (mutual TLS)")
    g.add_argument("--tls-key", metavar="PEM", help="--server: the client certificate's key")
    g.add_argument("-v", "--verbose", action="store_true", help="print per-round stats")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("make-tiny", help="write a tiny random target + drafter (HF layout)")
    t.add_argument("out")
    t.add_argument("--kind", default="hybrid", choices=("hybrid", "moe", "next", "dense"))
    t.add_argument("--drafter", default="dflash", choices=("dflash", "dflash2"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--block-size", type=int, default=8)
    t.set_defaults(func=cmd_make_tiny)

    from .api.commands import register as register_serve

    register_serve(sub)
    from .bench.cli import register as register_bench

    register_bench(sub)
    from .train.cli import register as register_train

    register_train(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # bad flags or files, a port taken
        print(f"sanctum: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
