"""`sanctum bench speculative` and `sanctum bench tau`: plain against speculative decoding on one
process, the same prompts interleaved, EOS ignored so that every run has the same length."""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.decode.sequence import RoundStats


def _run_once(
    target,
    drafter,
    prompt_ids,
    max_tokens,
    settings,
    sampling=None,
    profile=False,
    rule="block",
    min_tau=0.0,
):
    """One generation; (tokens, round stats, decode seconds, time to first token). Decode time
    runs from the first token to the last, so a long prompt's prefill stays out of tok/s.
    `profile` syncs after each phase of a round, for an exact split (and slower rounds);
    `rule`: how sampled drafts are accepted; `min_tau`: the speculation gate (0: off)."""
    from ..engine.decode.generate import generate
    from ..engine.decode.sampling import SamplingParams

    t0 = time.perf_counter()
    steps, t_first = [], None
    for step in generate(
        target,
        prompt_ids,
        drafter=drafter,
        sampling=sampling or SamplingParams(),
        max_tokens=max_tokens,
        block_size=settings.block_size,
        kv_mode=settings.kv_mode,
        eos_ids=set(),
        profile=profile,
        accept_rule=rule,
        min_tau=min_tau,
    ):
        steps.append(step)
        if t_first is None:
            t_first = time.perf_counter()
    decode_s = time.perf_counter() - t_first
    tokens = [t for s in steps for t in s.tokens]
    return tokens, [s.stats for s in steps if s.stats is not None], decode_s, t_first - t0


def _tau(rounds: list[RoundStats]) -> float:
    """The rounds' mean acceptance length, to 3 places (0 without a speculative round)."""
    from ..engine.decode.sampling import acceptance_length

    spec = [r.accepted for r in rounds if r.bs > 1]
    return round(acceptance_length(sum(spec), len(spec)) or 0.0, 3)


# A divergence counts as a near-tie when the two tokens' logits, from one fresh forward over the
# plain run's tokens, are this close relative to the largest logit, or no further apart than
# one step of the logits' own format at that size (bf16 logits near 6 are multiples of 1/32:
# two a step apart are as close as bf16 can tell). A verify row and a decode step take
# different kernels on a GPU, so the logits differ in their last bits and a near-tie can flip;
# a bug in the rollback or the caches shows as a clear margin.
NEAR_TIE = 2e-3
_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def logit_step(scale: float, dtype) -> float:
    """The spacing of `dtype`'s values at magnitude `scale` (one unit in the last place)."""
    bits = _MANTISSA_BITS.get(str(dtype).rsplit(".", 1)[-1], 23)
    return 2.0 ** (math.floor(math.log2(scale)) - bits) if scale > 0 else 0.0


def first_divergence(target, ids: list[int], plain: list[int], spec: list[int], kv: str) -> dict:
    """Where `spec` first leaves `plain`, and the margin between the two tokens there."""
    import mlx.core as mx

    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if i is None:  # one is a prefix of the other
        return {"at": min(len(plain), len(spec)), "margin": None, "near_tie": False}
    logits, _ = target.forward(mx.array(ids + plain[:i]), target.make_cache(kv))
    row = logits[-1].astype(mx.float32)
    margin = abs((row[plain[i]] - row[spec[i]]).item())
    scale = mx.abs(row).max().item()
    tie = max(NEAR_TIE * scale, logit_step(scale, logits.dtype))
    return {"at": i, "margin": round(margin, 6), "near_tie": margin <= tie}


def speculative(args) -> dict:
    """Plain vs speculative greedy decode of the same prompt; EOS ignored so lengths match."""
    from ..serving.inline import load_models
    from ..settings import engine_settings, model_flags

    settings = engine_settings(**model_flags(args))
    target, drafter = load_models(settings)
    if drafter is None:
        raise ValueError("bench speculative needs a drafter")
    prompt_ids = target.tokenizer.encode(args.prompt, add_special_tokens=False)
    _run_once(target, None, prompt_ids, 8, settings)  # warm up compiled kernels
    _run_once(target, drafter, prompt_ids, 8, settings)
    plain_t, spec_t, spec_rounds, same, divergence = [], [], [], True, None
    for _ in range(args.repeats):
        p_tokens, _, p_elapsed, _ = _run_once(target, None, prompt_ids, args.max_tokens, settings)
        s_tokens, rounds, s_elapsed, _ = _run_once(
            target, drafter, prompt_ids, args.max_tokens, settings
        )
        plain_t.append((len(p_tokens) - 1) / p_elapsed)
        spec_t.append((len(s_tokens) - 1) / s_elapsed)
        if same and p_tokens != s_tokens:  # where, and is it a near-tie?
            divergence = first_divergence(target, prompt_ids, p_tokens, s_tokens, settings.kv_mode)
        same &= p_tokens == s_tokens
    # the split from a run that syncs after each phase (the timed runs sync once a round)
    _, rounds, _, _ = _run_once(
        target, drafter, prompt_ids, args.max_tokens, settings, profile=True
    )
    spec_rounds.extend(r for r in rounds if r.bs > 1)
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
        "tau": _tau(spec_rounds),
        "round_ms": split,
        "greedy_outputs_identical": same,
        "first_divergence": divergence,  # None when identical
    }


def context_prompts(target, contexts: list[int], count: int, seed: int = 0) -> dict:
    """Prompts per context length from held-out files (never trained on): `count` function stubs
    (half raw code, half a chat turn; `heldout_prompts`), each after `context` tokens of other
    held-out text and an end-of-text token, the way a conversation or an open file precedes a
    request."""
    import numpy as np

    from ..tokenizer import EOT
    from ..train.data import heldout_prompts, heldout_tokens

    tokenizer = target.tokenizer
    stubs = [tokenizer.encode(p, add_special_tokens=False) for p in heldout_prompts(count, seed)]
    stream = heldout_tokens(target.path) if any(contexts) else None
    eot = tokenizer.convert_tokens_to_ids(EOT)
    rng = np.random.default_rng(seed)
    out = {}
    for c in contexts:
        rows = []
        for stub in stubs:
            if c:
                s = int(rng.integers(0, stream.size - c))
                rows.append([int(t) for t in stream[s : s + c]] + [eot] + stub)
            else:
                rows.append(stub)
        out[c] = rows
    return out


def tau(args) -> list[dict]:
    """Per context length: tau per block size (greedy) and at each sampling temperature
    (seeded), and plain vs speculative decode tok/s over the same prompts (interleaved prompt by
    prompt, prefill excluded); prompts from held-out files; EOS ignored, so every run is
    max_tokens. Greedy speculative output is checked against plain greedy output."""
    from dataclasses import replace

    from ..engine.decode.sampling import ACCEPT_RULES, SamplingParams
    from ..serving.inline import load_models
    from ..settings import engine_settings, model_flags

    settings = engine_settings(**model_flags(args))
    target, drafter = load_models(settings)
    if drafter is None:
        raise ValueError("bench tau needs a drafter")
    contexts = [int(c) for c in args.contexts.split(",")]
    blocks = [int(b) for b in args.block_sizes.split(",")]
    temps = [float(t) for t in args.temperatures.split(",") if float(t) > 0]
    rules = args.accept_rules.split(",")
    bad = [r for r in rules if r not in ACCEPT_RULES]
    if bad:
        raise ValueError(f"--accept-rules: {bad[0]!r} is not one of {', '.join(ACCEPT_RULES)}")
    prompts = context_prompts(target, contexts, args.num_prompts, args.seed)
    _run_once(target, drafter, prompts[contexts[0]][0], 8, settings)  # warm up
    gate = 0.0
    if args.min_tau != "0":
        from ..engine.decode.decoder import Decoder
        from ..engine.decode.generate import GATE_PROBES, gate_threshold
        from ..engine.decode.peer import LocalDraftPeer

        probe = Decoder(target, drafter, LocalDraftPeer(drafter), blocks[0])
        gate = gate_threshold(args.min_tau, probe, GATE_PROBES[1])  # the sampled rounds' one
    rows = []
    for c in contexts:
        plain_n = plain_s = 0.0
        spec = {b: [0.0, 0.0, []] for b in blocks}  # tokens, seconds, rounds
        sampled = {(t, r): [[], 0, 0.0] for t in temps for r in rules}  # rounds, tokens, s
        plain_sampled = {t: [0, 0.0] for t in temps}  # tokens, s
        same = True
        for i, ids in enumerate(prompts[c]):
            p_tokens, _, p_s, _ = _run_once(target, None, ids, args.max_tokens, settings)
            plain_n, plain_s = plain_n + len(p_tokens) - 1, plain_s + p_s
            for b in blocks:
                tokens, stats, s_s, _ = _run_once(
                    target, drafter, ids, args.max_tokens, replace(settings, block_size=b)
                )
                spec[b][0] += len(tokens) - 1
                spec[b][1] += s_s
                spec[b][2] += stats
                same &= tokens == p_tokens
            for t in temps:
                sp = SamplingParams(temperature=t, seed=args.seed * 1000 + i)
                tokens, _, s_s, _ = _run_once(target, None, ids, args.max_tokens, settings, sp)
                plain_sampled[t][0] += len(tokens) - 1
                plain_sampled[t][1] += s_s
                for r in rules:  # the same seed: the rules see the same first draws
                    tokens, stats, s_s, _ = _run_once(
                        target,
                        drafter,
                        ids,
                        args.max_tokens,
                        replace(settings, block_size=blocks[0]),
                        sp,
                        rule=r,
                        min_tau=gate,
                    )
                    acc = sampled[t, r]
                    acc[0] += stats
                    acc[1] += len(tokens) - 1
                    acc[2] += s_s
        plain = plain_n / plain_s
        row = {
            "context": c,
            "prompt_tokens": round(sum(map(len, prompts[c])) / len(prompts[c])),
            "prompts": len(prompts[c]),
            "plain_tok_s": round(plain, 2),
        }
        for b in blocks:
            n, secs, stats = spec[b]
            row[f"tau_b{b}"] = _tau(stats)
            # of the speculative rounds, those whose drafts were read from the text itself
            # (engine/decode/lookup.py; their blocks may be wider than b)
            drafted = [r for r in stats if r.bs > 1]
            share = sum(r.looked_up for r in drafted) / max(1, len(drafted))
            row[f"lookup_share_b{b}"] = round(share, 3)
            row[f"speculative_tok_s_b{b}"] = round(n / secs, 2)
            row[f"ratio_b{b}"] = round(n / secs / plain, 3)
        for t in temps:
            n, secs = plain_sampled[t]
            row[f"plain_tok_s_t{t:g}"] = round(n / secs, 2)
            for r in rules:  # the first rule's keys carry no suffix
                suffix = "" if r == rules[0] else f"_{r}"
                stats, n, secs = sampled[t, r]
                row[f"tau_t{t:g}_b{blocks[0]}{suffix}"] = _tau(stats)
                row[f"speculative_tok_s_t{t:g}_b{blocks[0]}{suffix}"] = round(n / secs, 2)
        row["sampled_min_tau"] = gate
        row["greedy_outputs_identical"] = same
        rows.append(row)
    return rows
