"""`sanctum bench tau-ceiling`: how much sampled tau a block drafter can reach on a target at
all, beside what the loaded drafter reaches, on the same held-out prompts.

A block drafter proposes all of a block's rows in one pass, so its row k cannot see the tokens
drawn for rows 1..k-1: at best its proposal there is the target's own distribution averaged over
them (the row's marginal). DFlash 2's selector lets row k see one of them, the draft before it.
Both ceilings are estimated from the target alone, at positions spread over target-sampled
replies: from the anchor, `samples` continuations are drawn three times over, batched. The first
set estimates each row's marginal m_k, and, per previous token v, the mean of p_k over the
continuations whose token k-1 is v (m_k | v). The other two follow the token rule's accepted
paths with q_k = m_k and q_k = m_k | previous token: at each row a path is accepted with
a_k = sum min(p_k, q_k) and goes on with x_k ~ min(p_k, q_k) / a_k, so P(rows 1..k accepted)
= E[a_1 ... a_k], and tau = 1 + the sum of those. Row 1 sees nothing drawn, so both ceilings
accept it always (q_1 = p_1): a drafter that matched the target exactly there. The
previous-token ceiling is an estimate: with few continuations per previous token its q is
noisy (lower than the exact one), and a token no continuation drew falls back to m_k.

The drafter's own figures are the token rule's too (`--accept-rules token` in `bench tau`), so
the three compare like with like; block verification, the engine's default, accepts ~4-8 %
more (docs/design/round.md)."""

from __future__ import annotations

import time

import numpy as np


def add_parser(bsub) -> None:
    from ..settings import add_model_flags

    p = bsub.add_parser(
        "tau-ceiling",
        help="sampled tau a block drafter could reach on this target, beside the drafter's own",
    )
    add_model_flags(p)
    p.add_argument("--contexts", default="0,1024", help="tokens of held-out text before prompts")
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per context length")
    p.add_argument("--samples", type=int, default=64, help="continuations per set and position")
    p.add_argument(
        "--positions",
        default="0,16,32,48,64,80",
        help="where along each sampled reply the ceilings are estimated (its tokens)",
    )
    p.add_argument("--max-tokens", type=int, default=96, help="the drafter's runs, as bench tau")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _repeat_cache(cache: list, n: int) -> list:
    """A batch-1 target cache as `n` identical rows (mlx-lm's caches have no repeat; its batch
    caches are built for left-padded prompts)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    out = []
    for c in cache:
        if isinstance(c, KVCache):
            r = KVCache()
            r.keys = mx.repeat(c.keys[..., : c.offset, :], n, axis=0)
            r.values = mx.repeat(c.values[..., : c.offset, :], n, axis=0)
            r.offset = c.offset
        elif isinstance(c, ArraysCache):
            r = ArraysCache(size=len(c.cache))
            r.cache = [mx.repeat(s, n, axis=0) for s in c.cache]
        else:
            raise ValueError(f"tau-ceiling: {type(c).__name__} caches are not supported")
        out.append(r)
    return out


def _walks(target, cache, anchor: int, temperature: float, rows: int, n: int, key):
    """P(rows 1..k accepted), k = 1..rows, with q = each row's marginal and with q = its
    marginal given the previous token (the module's docstring), from `anchor` on `cache`."""
    import mlx.core as mx

    from ..engine.decode.sampling import SamplingParams, probabilities

    sampling = SamplingParams(temperature)
    caches = _repeat_cache(cache, 3 * n)
    tokens = mx.full((3 * n, 1), anchor, mx.int32)
    weight = [mx.ones((n,)), mx.ones((n,))]
    accepted: list[list[float]] = [[], []]
    prev = None  # the previous row's tokens of each set
    for _ in range(rows):
        p = probabilities(target.model(tokens, cache=caches)[:, -1], sampling)  # [3n, V]: as served
        marginal = p[:n].mean(axis=0, keepdims=True)
        if prev is None:
            given_prev = marginal
        else:  # the mean p of the first set's continuations that drew this path's previous token
            same = (prev[2][:, None] == prev[0][None, :]).astype(mx.float32)  # [n, n]
            count = same.sum(axis=1, keepdims=True)
            given_prev = mx.where(count > 0, (same @ p[:n]) / mx.maximum(count, 1), marginal)
        key, *keys = mx.random.split(key, 4)
        drawn = [mx.random.categorical(mx.log(p[:n] + 1e-30), key=keys[0])]
        for j, q in enumerate((marginal, given_prev)):
            overlap = mx.minimum(p[(j + 1) * n : (j + 2) * n], q)
            weight[j] = weight[j] * overlap.sum(axis=-1)
            accepted[j].append(weight[j].mean())
            drawn.append(mx.random.categorical(mx.log(overlap + 1e-30), key=keys[j + 1]))
        prev = drawn
        tokens = mx.concatenate(drawn)[:, None].astype(mx.int32)
        mx.eval(tokens, weight)
    return [[float(a) for a in row] for row in accepted], key


def _drafter_rows(target, drafter, prompts, samplings, args, settings, rows: int) -> list[float]:
    """The loaded drafter's P(rows 1..k accepted) under the token rule, each prompt with its
    sampling (seeded as bench tau)."""
    from .decode import _run_once

    accepted = []
    for ids, sampling in zip(prompts, samplings):
        _, stats, _, _ = _run_once(
            target, drafter, ids, args.max_tokens, settings, sampling, rule="token"
        )
        accepted += [s.accepted for s in stats if s.bs > 1]
    acc = np.array(accepted)
    return [float((acc >= k).mean()) if acc.size else 0.0 for k in range(1, rows + 1)]


def run(args) -> list[dict]:
    import mlx.core as mx

    from ..engine.decode.sampling import SamplingParams
    from ..serving.inline import load_models
    from ..settings import engine_settings, model_flags
    from .decode import _run_once, context_prompts

    settings = engine_settings(**model_flags(args))
    target, drafter = load_models(settings)
    if drafter is None:
        raise ValueError("bench tau-ceiling compares with a drafter: give one (not 'none')")
    block = settings.block_size or drafter.block_size
    contexts = [int(c) for c in args.contexts.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    if any(t <= 0 for t in temps):
        raise ValueError("--temperatures: sampled ones only (> 0); greedy's ceiling is the block")
    positions = sorted({int(p) for p in args.positions.split(",")})
    if positions[0] < 0 or args.samples < 1:
        raise ValueError("--positions must be >= 0 and --samples >= 1")
    prompts = context_prompts(target, contexts, args.num_prompts, args.seed)
    key = mx.random.key(args.seed)
    rows = []
    for c in contexts:
        for temperature in temps:
            t0 = time.perf_counter()
            walks: list[list[list[float]]] = [[], []]
            samplings = [  # seeded as bench tau's
                SamplingParams(temperature=temperature, seed=args.seed * 1000 + i)
                for i in range(len(prompts[c]))
            ]
            for ids, sampling in zip(prompts[c], samplings):
                # the target's own seeded reply, as plain sampled decoding gives it; the
                # ceilings are taken at its positions, reply[pos] the anchor
                reply, *_ = _run_once(target, None, ids, positions[-1] + 1, settings, sampling)
                cache = target.make_cache("fp16")
                target.prefill(list(ids), cache)
                done = 0  # reply tokens the cache holds
                for pos in positions:
                    if pos > done:
                        target.forward(mx.array(reply[done:pos]), cache, all_logits=False)
                        done = pos
                    pair, key = _walks(
                        target, cache, reply[pos], temperature, block - 1, args.samples, key
                    )
                    walks[0].append(pair[0])
                    walks[1].append(pair[1])
            ceiling, given_prev = (np.array(w).mean(axis=0) for w in walks)
            drafter_rows = _drafter_rows(
                target, drafter, prompts[c], samplings, args, settings, block - 1
            )
            rows.append(
                {
                    "context": c,
                    "temperature": temperature,
                    "block_size": block,
                    "positions": len(walks[0]),
                    "tau_ceiling_rows_independent": round(1 + float(ceiling.sum()), 3),
                    "tau_ceiling_previous_token": round(1 + float(given_prev.sum()), 3),
                    "tau_drafter_token_rule": round(1 + sum(drafter_rows), 3),
                    "accepted_rows_independent": [round(float(a), 3) for a in ceiling],
                    "accepted_previous_token": [round(float(a), 3) for a in given_prev],
                    "accepted_drafter": [round(a, 3) for a in drafter_rows],
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
    return rows
