"""Benchmarks: commands with fixed arguments that print figures (speed is measured here, never
asserted in tests). Ratios are measured within one run, plain and speculative interleaved."""

from __future__ import annotations

import json
import statistics
import time


def _run_once(target, drafter, prompt_ids, max_tokens, settings, sampling=None, profile=False):
    """One generation; (tokens, round stats, decode seconds, time to first token). Decode time
    runs from the first token to the last, so a long prompt's prefill stays out of tok/s.
    `profile` syncs after each phase of a round, for an exact split (and slower rounds)."""
    from ..engine.sampling import SamplingParams
    from ..engine.speculative import generate

    t0 = time.perf_counter()
    steps, t_first = [], None
    for step in generate(target, prompt_ids, drafter=drafter, sampling=sampling or SamplingParams(),
                         max_tokens=max_tokens, block_size=settings.block_size,
                         kv_mode=settings.kv_mode, eos_ids=set(), profile=profile):  # fmt: skip
        steps.append(step)
        if t_first is None:
            t_first = time.perf_counter()
    decode_s = time.perf_counter() - t_first
    tokens = [t for s in steps for t in s.tokens]
    return tokens, [s.stats for s in steps if s.stats is not None], decode_s, t_first - t0


def _tau(rounds) -> float:
    spec = [r for r in rounds if r.bs > 1]
    return round(sum(r.accepted + 1 for r in spec) / max(1, len(spec)), 3)


def speculative(args) -> dict:
    """Plain vs speculative greedy decode of the same prompt; EOS ignored so lengths match."""
    from ..cli import _load_local

    settings, target, drafter = _load_local(args)
    if drafter is None:
        raise ValueError("bench speculative needs a drafter")
    prompt_ids = target.tokenizer.encode(args.prompt, add_special_tokens=False)
    _run_once(target, None, prompt_ids, 8, settings)  # warm up compiled kernels
    _run_once(target, drafter, prompt_ids, 8, settings)
    plain_t, spec_t, spec_rounds, same = [], [], [], True
    for _ in range(args.repeats):
        p_tokens, _, p_elapsed, _ = _run_once(target, None, prompt_ids, args.max_tokens, settings)
        s_tokens, rounds, s_elapsed, _ = _run_once(
            target, drafter, prompt_ids, args.max_tokens, settings
        )
        plain_t.append((len(p_tokens) - 1) / p_elapsed)
        spec_t.append((len(s_tokens) - 1) / s_elapsed)
        same &= p_tokens == s_tokens
    # the split from a run that syncs after each phase (the timed runs sync once a round)
    _, rounds, _, _ = _run_once(target, drafter, prompt_ids, args.max_tokens, settings,
                                profile=True)  # fmt: skip
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
        "tau": round(sum(r.accepted + 1 for r in spec_rounds) / n, 3),
        "round_ms": split,
        "greedy_outputs_identical": same,
    }


def _code_snippets(count: int, chars: int = 900) -> list[str]:
    """Deterministic user material: slices of the standard library's own source."""
    from ..tokenizer import python_stdlib_files

    out = []
    for path in python_stdlib_files():
        text = path.read_text(errors="ignore")
        if len(text) > chars * 2:
            out.append(text[chars : 2 * chars])
        if len(out) == count:
            break
    return out


def multiturn(args) -> list[dict]:
    """A chat whose history grows turn by turn; per turn the prompt cache's resume figures and
    time to first token warm (cache as the conversation left it) and cold (same prompt, no
    cache). Assistant replies go back into the history as generated, so the template's own
    rewriting (dropped <think> blocks) decides where the next prefix really ends."""
    from ..cache.store import PromptStore
    from ..cli import _load_local
    from ..engine.speculative import LocalDraftPeer
    from ..serving.requests import GenerateRequest
    from ..serving.verifier import Verifier
    from ..settings import cache_settings

    settings, target, drafter = _load_local(args)
    cache = cache_settings(ladder=args.ladder)
    verifier = Verifier(target, drafter, LocalDraftPeer(drafter) if drafter else None,
                        PromptStore(cache.max_bytes), cache.ladder_depth, settings.kv_mode,
                        settings.block_size)  # fmt: skip
    messages = [{"role": "system", "content": "You are a careful Python reviewer."}]
    rows = []
    for turn, snippet in enumerate(_code_snippets(args.turns), start=1):
        messages.append(
            {"role": "user", "content": f"Review this code:\n```python\n{snippet}\n```"}
        )

        def ask(use_cache, seed=turn):
            req = GenerateRequest(messages=tuple(messages), max_tokens=args.max_tokens,
                                  use_cache=use_cache, seed=seed)  # fmt: skip
            chunks = list(verifier.generate(req))
            return "".join(c.text for c in chunks), chunks[-1].usage

        cold_text, cold = ask(use_cache=False)
        text, warm = ask(use_cache=True)
        assert text == cold_text, "a resumed request must equal the cold one"
        rows.append({
            "turn": turn,
            "prompt_tokens": warm.prompt_tokens,
            "requested_lcp": warm.requested_lcp,
            "resumed_at": warm.resumed_at,
            "prefix_cached": warm.cached_tokens,
            "cache_hit_ratio": warm.cache_hit_ratio,
            "tau": round(warm.tau, 3),
            "ttft_warm_s": warm.ttft_s,
            "ttft_cold_s": cold.ttft_s,
            "kv": warm.kv,
        })  # fmt: skip
        messages.append({"role": "assistant", "content": text})
    return rows


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

    from ..cli import _load_local
    from ..engine.sampling import SamplingParams

    settings, target, drafter = _load_local(args)
    if drafter is None:
        raise ValueError("bench tau needs a drafter")
    contexts = [int(c) for c in args.contexts.split(",")]
    blocks = [int(b) for b in args.block_sizes.split(",")]
    temps = [float(t) for t in args.temperatures.split(",") if float(t) > 0]
    prompts = context_prompts(target, contexts, args.num_prompts, args.seed)
    _run_once(target, drafter, prompts[contexts[0]][0], 8, settings)  # warm up
    rows = []
    for c in contexts:
        plain_n = plain_s = 0.0
        spec = {b: [0.0, 0.0, []] for b in blocks}  # tokens, seconds, rounds
        sampled = {t: [] for t in temps}
        same = True
        for i, ids in enumerate(prompts[c]):
            p_tokens, _, p_s, _ = _run_once(target, None, ids, args.max_tokens, settings)
            plain_n, plain_s = plain_n + len(p_tokens) - 1, plain_s + p_s
            for b in blocks:
                tokens, stats, s_s, _ = _run_once(target, drafter, ids, args.max_tokens,
                                                  replace(settings, block_size=b))  # fmt: skip
                spec[b][0] += len(tokens) - 1
                spec[b][1] += s_s
                spec[b][2] += stats
                same &= tokens == p_tokens
            for t in temps:
                sp = SamplingParams(temperature=t, seed=args.seed * 1000 + i)
                _, stats, _, _ = _run_once(target, drafter, ids, args.max_tokens,
                                           replace(settings, block_size=blocks[0]), sp)  # fmt: skip
                sampled[t] += stats
        plain = plain_n / plain_s
        row = {"context": c, "prompt_tokens": round(sum(map(len, prompts[c])) / len(prompts[c])),
               "prompts": len(prompts[c]), "plain_tok_s": round(plain, 2)}  # fmt: skip
        for b in blocks:
            n, secs, stats = spec[b]
            row[f"tau_b{b}"] = _tau(stats)
            row[f"speculative_tok_s_b{b}"] = round(n / secs, 2)
            row[f"ratio_b{b}"] = round(n / secs / plain, 3)
        for t in temps:
            row[f"tau_t{t:g}_b{blocks[0]}"] = _tau(sampled[t])
        row["greedy_outputs_identical"] = same
        rows.append(row)
    return rows


def reencode(args) -> dict:
    """The re-encoding watch's cost a round (tokenizer.Reencoder, only the unsettled text) against
    re-encoding the whole completion, on held-out stdlib code, `--round-tokens` at a time."""
    from mlx_lm.utils import load_tokenizer

    from ..settings import engine_settings
    from ..tokenizer import Reencoder
    from ..train.data import corpus_files, is_holdout

    settings = engine_settings(args.model, "none", None, None, None)
    tok = load_tokenizer(settings.model)
    held_out = sorted(p for name, p in corpus_files(None) if is_holdout(name) and p.suffix == ".py")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in held_out[:8])
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = tok.encode(text, add_special_tokens=False)[: max(lengths)]
    if len(ids) < max(lengths):
        raise ValueError(f"the held-out text has only {len(ids)} tokens")
    reencoder, widest, windowed = Reencoder(tok), 0, {}
    for end in range(args.round_tokens, len(ids) + 1, args.round_tokens):
        t0 = time.perf_counter()
        reencoder.first_difference(ids[:end], final=False)
        windowed[end] = time.perf_counter() - t0
        widest = max(widest, end - reencoder.settled)
    result = {"model": settings.model, "round_tokens": args.round_tokens,
              "widest_window_tokens": widest, "gave_up": reencoder.exhausted}  # fmt: skip
    for n in lengths:
        near = [windowed[e] for e in windowed if n - 64 < e <= n]  # the rounds just before n
        whole = []
        for _ in range(5):
            t0 = time.perf_counter()
            tok.encode(tok.decode(ids[:n]), add_special_tokens=False)
            whole.append(time.perf_counter() - t0)
        result[f"windowed_ms_at_{n}"] = round(1000.0 * statistics.median(near), 3)
        result[f"whole_ms_at_{n}"] = round(1000.0 * statistics.median(whole), 3)
    return result


def register(sub) -> None:
    """`sanctum bench ...` subcommands."""
    from ..cli import _add_model_flags

    b = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = b.add_subparsers(dest="bench", required=True)
    s = bsub.add_parser("speculative", help="plain vs speculative tok/s, tau, round time split")
    _add_model_flags(s)
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--json", action="store_true")
    m = bsub.add_parser("multiturn", help="prompt-cache hit ratio and warm/cold TTFT per turn")
    _add_model_flags(m)
    m.add_argument("--turns", type=int, default=8)
    m.add_argument("--max-tokens", type=int, default=48)
    m.add_argument("--ladder", type=int, help="ladder depth (default SANCTUM_MLX_SSM_LADDER or 4)")
    m.add_argument("--json", action="store_true")
    from .isolation import add_parser as add_isolation

    add_isolation(bsub, _add_model_flags)
    from .abuse import add_parser as add_abuse

    add_abuse(bsub, _add_model_flags)
    t = bsub.add_parser("tau", help="tau and speculative/plain tok/s per context length")
    _add_model_flags(t)
    t.add_argument("--contexts", default="0,1024,2048,4096",
                   help="tokens of held-out text before each prompt")  # fmt: skip
    t.add_argument("--block-sizes", default="8,16")
    t.add_argument("--temperatures", default="0.7,1.0", help="sampled tau (block: the first)")
    t.add_argument("--num-prompts", type=int, default=8, help="prompts per context length")
    t.add_argument("--max-tokens", type=int, default=96)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", action="store_true")
    r = bsub.add_parser("reencode", help="the re-encoding watch's cost a round vs whole")
    r.add_argument("--model", help="checkpoint whose tokenizer to use (default: the embedded)")
    r.add_argument("--round-tokens", type=int, default=6)
    r.add_argument("--lengths", default="256,1024,4096")
    r.add_argument("--json", action="store_true")
    from .cuda import add_parser as add_cuda
    from .seed import add_parser as add_seed

    add_seed(bsub)
    add_cuda(bsub)
    b.set_defaults(func=main)


def isolation(args) -> dict:
    """Actor cluster vs inline (cluster/isolation.py)."""
    from .isolation import run

    return run(args)


def abuse(args) -> dict:
    """A normal stream's worst gap while abusive clients hammer the server (api/abuse.py)."""
    from .abuse import run

    return run(args)


def seed(args) -> dict:
    """The seed's shapes on random weights (seedbench.py)."""
    from .seed import seed as run

    return run(args)


def cuda(args) -> dict:
    """The CUDA-only paths checked and timed (cudabench.py)."""
    from .cuda import run

    return run(args)


BENCHES = {"speculative": speculative, "multiturn": multiturn, "isolation": isolation, "tau": tau,
           "reencode": reencode, "abuse": abuse, "seed": seed, "cuda": cuda}  # fmt: skip


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
