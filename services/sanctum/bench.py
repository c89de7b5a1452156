"""Benchmarks: commands with fixed arguments that print figures (speed is measured here, never
asserted in tests). Ratios are measured within one run, plain and speculative interleaved."""

from __future__ import annotations

import json
import statistics
import time


def _run_once(target, drafter, prompt_ids, max_tokens, settings):
    from .engine.sampling import SamplingParams
    from .engine.speculative import generate

    t0 = time.perf_counter()
    steps = list(
        generate(target, prompt_ids, drafter=drafter, sampling=SamplingParams(),
                 max_tokens=max_tokens, block_size=settings.block_size, kv_mode=settings.kv_mode,
                 eos_ids=set())  # fmt: skip
    )
    elapsed = time.perf_counter() - t0
    tokens = [t for s in steps for t in s.tokens]
    return tokens, [s.stats for s in steps if s.stats is not None], elapsed


def speculative(args) -> dict:
    """Plain vs speculative greedy decode of the same prompt; EOS ignored so lengths match."""
    from .cli import _load_local

    settings, target, drafter = _load_local(args)
    if drafter is None:
        raise ValueError("bench speculative needs a drafter")
    prompt_ids = target.tokenizer.encode(args.prompt, add_special_tokens=False)
    _run_once(target, None, prompt_ids, 8, settings)  # warm up compiled kernels
    _run_once(target, drafter, prompt_ids, 8, settings)
    plain_t, spec_t, spec_rounds, same = [], [], [], True
    for _ in range(args.repeats):
        p_tokens, _, p_elapsed = _run_once(target, None, prompt_ids, args.max_tokens, settings)
        s_tokens, rounds, s_elapsed = _run_once(target, drafter, prompt_ids, args.max_tokens, settings)
        plain_t.append(len(p_tokens) / p_elapsed)
        spec_t.append(len(s_tokens) / s_elapsed)
        spec_rounds.extend(r for r in rounds if r.bs > 1)
        same &= p_tokens == s_tokens
    n = max(1, len(spec_rounds))
    split = {
        name: round(1000 * sum(getattr(r, f"{name}_s") for r in spec_rounds) / n, 3)
        for name in ("draft", "verify", "rollback", "other")
    }
    plain, spec = statistics.median(plain_t), statistics.median(spec_t)
    return {
        "model": settings.model,
        "drafter": settings.drafter,
        "block_size": drafter.block_size,
        "kv": settings.kv_mode,
        "max_tokens": args.max_tokens,
        "plain_tok_s": round(plain, 2),
        "speculative_tok_s": round(spec, 2),
        "ratio": round(spec / plain, 3),
        "tau": round(sum(r.accepted + 1 for r in spec_rounds) / n, 3),
        "round_ms": split,
        "greedy_outputs_identical": same,
    }


def main(args) -> int:
    result = {"speculative": speculative}[args.bench](args)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>26}: {v}")
    return 0
