"""`sanctum bench seed`: the engine at the seed's scale, on random weights, in one run.

Builds (once, kept under `--dir`) a Qwen3.5-27B-shaped 4-bit target and the seed's DFlash 2
drafter (seedbuild.py), loads them through `load_target` / `load_drafter`, and prints:
plain tok/s of this engine and of mlx-lm's own greedy `generate_step` on the same model object,
verify(L) / decode(1) for L = 4, 8, 16, the round split (draft, verify, rollback, other), the
break-even tau (round / decode), the projected speed-up at tau 4, 5, 6, 8 (tau * decode /
round) and, to check the projection, the measured speed-up with acceptance forced to each tau
(random weights accept nothing; the forced round runs the real drafter, verify and rollback
and commits tau tokens), with and without drafting ahead where the engine drafts ahead (a GPU:
`Decoder.draft_ahead`; the synced split cannot, each phase waits for the one before). Per-phase timings (seedphases.py) say where a forward's time goes.
`--json` prints one object with the keys plain_tok_s, mlx_lm_tok_s, verify_ratio (L -> ratio),
round_ms, break_even_tau and projected_speedup (tau -> x), build_ms (host time building the
graphs of decode(1), verify(L) and its rollback, before the evaluation), and the rest.

Imports no Ray and no gRPC: it runs where only MLX, mlx-lm and numpy are installed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..engine.decode.decoder import Decoder
from ..engine.decode.generate import make_key
from ..engine.decode.peer import LocalDraftPeer
from ..engine.decode.policy import DecodePolicy, draft_ahead_default
from ..engine.decode.rounds import BatchDecoder
from ..engine.decode.sampling import SamplingParams, acceptance_length, greedy_tokens
from ..engine.kernels import cuda, fused, qmm_checks, qmm_cuda
from ..engine.model import gdn
from ..engine.model.target import load_target
from .seedbuild import SMALL, SeedShape, ensure

TAUS = (4, 5, 6, 8)
VERIFY_ROWS = (4, 8, 16)


class ForcedDecoder(Decoder):
    """The real drafter, verify and rollback, with acceptance forced to `tau - 1` drafts a round
    (or the real rule when tau is None): what a round costs at that acceptance."""

    def __init__(self, target, drafter, block_size: int, tau: int | None, policy=None):
        super().__init__(target, drafter, LocalDraftPeer(drafter), block_size, policy)
        self.tau = tau

    def _accept(self, drafts, q, logits, params, key):
        if self.tau is None:
            return super()._accept(drafts, q, logits, params, key)
        accepted = min(self.tau - 1, drafts.shape[0])
        return accepted, int(greedy_tokens(logits)[accepted].item())

    def _lazy_accept(self, drafts, logits):
        if self.tau is None:
            return super()._lazy_accept(drafts, logits)
        accepted = min(self.tau - 1, drafts.shape[0])
        return mx.array(accepted, mx.int32), greedy_tokens(logits)[accepted].astype(mx.int32)


class ForcedBatchDecoder(ForcedDecoder, BatchDecoder):
    """ForcedDecoder's acceptance in shared rounds too (`bench batch --steady --force-tau`):
    every drafted block of a round keeps `tau - 1` drafts (at most its width's), its bonus token
    the target's greedy token after them, read in one more host read a round."""

    def _accept_all(self, drafted, extra, blocks, outs, widths):
        reads, tokens = super()._accept_all(drafted, extra, blocks, outs, widths)
        counts = [min(self.tau - 1, w - 1) for w in widths[: len(reads)]]
        picked = [greedy_tokens(out[0])[c] for out, c in zip(outs, counts)]
        bonus = mx.stack(picked).tolist() if picked else []
        return [(c, b, ids) for (_, _, ids), c, b in zip(reads, counts, bonus)], tokens


class DraftlessDecoder(ForcedDecoder):
    """ForcedDecoder's rounds without the drafter: the anchor repeated as the drafts, so the
    round is its verify, acceptance and rollback alone (what drafting adds to a round as the
    engine runs it is the difference)."""

    def _draft(self, seq, params, key):
        return mx.full((self.width(seq) - 1,), seq.anchor, mx.int32), None


def _decode(decoder: Decoder, prompt: list[int], max_tokens: int, kv: str):
    """Greedy decode; (tokens, round stats, decode-only seconds: after the first token)."""
    seq = decoder.new_sequence("seed", kv, SamplingParams(), max_tokens)
    key = make_key(0)
    logits = decoder.prefill(seq, prompt)
    tokens = list(decoder.start(seq, logits, key).tokens)
    t0, stats = time.perf_counter(), []
    while seq.finished is None:
        step = decoder.step(seq, key)
        tokens += step.tokens
        stats.append(step.stats)
    elapsed = time.perf_counter() - t0
    decoder.close(seq)
    return tokens, stats, elapsed


def _mlx_lm_decode(model, prompt: list[int], max_tokens: int):
    from mlx_lm.generate import generate_step

    tokens, t0 = [], None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(tok))
        if t0 is None:
            t0 = time.perf_counter()
    return tokens, time.perf_counter() - t0


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def verify_costs(target, prompt: list[int], tap_ids, reps: int, kv: str) -> tuple[dict, list]:
    """decode(1) and verify(L) on the prefilled prompt, each synced and then undone; and that
    prefilled cache. `build_ms`: of each, the host time spent building the lazy graph (the
    Python call, before `mx.eval`), for the rollback too: on a GPU it is not hidden when the
    step waits on its result."""
    cache = target.make_cache(kv)
    target.prefill(prompt, cache)
    offset, rng = len(prompt), np.random.default_rng(1)
    builds: dict = {"decode": [], "verify": {}, "rollback": {}}

    def held():  # what a step leaves in the cache
        return [c.cache if isinstance(c, ArraysCache) else c.state for c in cache]

    def decode():
        states = target.recurrent_state(cache)
        t0 = time.perf_counter()
        logits, _ = target.forward(mx.array([7]), cache)
        builds["decode"].append(time.perf_counter() - t0)
        mx.eval(logits, held())
        target.truncate(cache, offset, states)

    def verify(L):
        block = mx.array(rng.integers(10, target.vocab_size - 10, size=L).tolist())
        t0 = time.perf_counter()
        logits, taps, tape = target.verify(block, cache, tap_ids)
        t1 = time.perf_counter()
        mx.eval(logits, taps, held())
        t2 = time.perf_counter()
        states = target.rollback(cache, tape, 0)
        t3 = time.perf_counter()
        builds["verify"].setdefault(L, []).append(t1 - t0)
        builds["rollback"].setdefault(L, []).append(t3 - t2)
        mx.eval(states)

    def build_ms(times):  # the synced calls' median, not the first (it may compile)
        return round(1000 * statistics.median(times[1:]), 3)

    out = {"decode_ms": round(qmm_checks.median_ms(decode, reps), 3), "verify_ms": {}}
    for L in VERIFY_ROWS:
        out["verify_ms"][L] = round(qmm_checks.median_ms(lambda L=L: verify(L), reps), 3)
    out["verify_ratio"] = {L: round(ms / out["decode_ms"], 3) for L, ms in out["verify_ms"].items()}
    out["build_ms"] = {
        "decode": build_ms(builds["decode"]),
        "verify": {L: build_ms(t) for L, t in builds["verify"].items()},
        "rollback": {L: build_ms(t) for L, t in builds["rollback"].items()},
    }
    return out, cache


PHASES = ("draft", "verify", "rollback", "other")


def _round_split(stats, middle=statistics.fmean) -> dict:
    """Each phase's ms a speculative round (the rounds' mean, or `middle` of them), and their
    total; zeros without a speculative round."""
    spec = [s for s in stats if s.bs > 1]
    split = {p: round(1000 * middle([getattr(s, f"{p}_s") for s in spec]), 3) if spec else 0.0
             for p in PHASES}  # fmt: skip
    split["total"] = round(sum(split.values()), 3)
    return split


def _shape(args) -> SeedShape:
    scale = args.scale
    if scale == "auto":
        scale = "seed" if mx.default_device() == mx.gpu else "small"
    shape = SMALL if scale == "small" else SeedShape()
    shape = replace(shape, layers=args.layers or shape.layers)
    for field in ("hidden", "intermediate", "vocab", "drafter_layers"):
        if getattr(args, field) is not None:
            shape = replace(shape, **{field: getattr(args, field)})
    return shape


def plain_figures(target, prompt: list[int], n: int, repeats: int, kv: str) -> dict:
    """This engine's plain greedy decode against mlx-lm's on the same model object, pairs
    interleaved; the same without queued steps (one sync per token, the old loop); and the
    token agreement, also with the prefill computed as mlx-lm computes it."""
    plain, unqueued = Decoder(target), Decoder(target)
    unqueued._runs_ahead = lambda params: False
    for dec in (plain, unqueued):
        _decode(dec, prompt, 8, kv)
    _mlx_lm_decode(target.model, prompt, 8)
    ours, theirs, old = [], [], []
    for _ in range(repeats):
        tokens, _, s = _decode(plain, prompt, n, kv)
        ours.append((len(tokens) - 1) / s)
        m_tokens, m_s = _mlx_lm_decode(target.model, prompt, n)
        theirs.append((len(m_tokens) - 1) / m_s)
        u_tokens, _, u_s = _decode(unqueued, prompt, n, kv)
        old.append((len(u_tokens) - 1) / u_s)
    out = {
        "plain_tok_s": round(statistics.median(ours), 2),
        "mlx_lm_tok_s": round(statistics.median(theirs), 2),
        "plain_unqueued_tok_s": round(statistics.median(old), 2),
    }
    out["plain_vs_mlx_lm"] = round(out["plain_tok_s"] / out["mlx_lm_tok_s"], 3)
    out["plain_equals_mlx_lm_tokens"] = f"{_same_prefix(tokens, m_tokens)}/{len(m_tokens)}"
    gdn.MLX_LM_PREFILL = True
    try:
        x_tokens = _decode(plain, prompt, n, kv)[0]
    finally:
        gdn.MLX_LM_PREFILL = False
    out["plain_equals_mlx_lm_tokens_same_prefill"] = (
        f"{_same_prefix(x_tokens, m_tokens)}/{len(m_tokens)}"
    )
    if target.fused_groups:  # an experiment: decode steps through the fused products too
        cache = target.make_cache(kv)
        target.prefill(prompt, cache)
        states = target.recurrent_state(cache)
        step = mx.array([tokens[0]])
        unfused = target.forward(step, cache)[0]
        mx.eval(unfused)
        target.truncate(cache, len(prompt), states)
        fused.MIN_ROWS, min_rows = 1, fused.MIN_ROWS
        target.drop_compiled()
        try:
            # one decode step's logits both ways, on the same cache: equal to the bit or not
            diff = mx.abs(target.forward(step, cache)[0] - unfused).max().item()
            out["fused_decode_logits_max_abs_diff"] = diff
            _decode(plain, prompt, 8, kv)
            runs = [_decode(plain, prompt, n, kv) for _ in range(repeats)]
        finally:
            fused.MIN_ROWS = min_rows
            target.drop_compiled()
        rate = statistics.median((len(f) - 1) / f_s for f, _, f_s in runs)
        out["fused_decode_tok_s"] = round(rate, 2)
        out["fused_decode_vs_mlx_lm"] = round(rate / out["mlx_lm_tok_s"], 3)
        out["fused_decode_equals_plain_tokens"] = (
            f"{_same_prefix(runs[0][0], tokens)}/{len(tokens)}"
        )
    return out, tokens


def round_split(target, drafter, prompt, n, kv, split_tau) -> dict:
    """Rounds at forced acceptance with each phase synced: the mean and median split, the
    draft's pieces, each phase's share."""
    forced = ForcedDecoder(
        target, drafter, drafter.block_size, split_tau, DecodePolicy(profile=True)
    )
    _decode(forced, prompt, 2 * drafter.block_size, kv)
    forced.draft_pieces.clear()
    rounds = _decode(forced, prompt, n, kv)[1]
    split = _round_split(rounds)
    return {
        "round_ms": split,
        # the same, each phase's median round: a mean well above it means a few slow rounds
        "round_ms_median": _round_split(rounds, statistics.median),
        # the draft phase's pieces, each synced (Decoder._draft_piece): where its time goes
        "draft_pieces_ms": {
            k: round(1000 * statistics.median(v), 3) for k, v in forced.draft_pieces.items()
        },
        "round_share": {p: round(v / split["total"], 3) for p, v in split.items() if p != "total"},
    }


def unsynced_rounds(target, drafter, prompt, n, kv, split_tau, plain_tok_s, ahead) -> dict:
    """Rounds as the engine runs them (no phase synced) at each forced tau, drafting ahead or
    not: the speed-up over plain decoding, and at `split_tau` the mean round's ms and the
    break-even tau it gives (round / decode step), to set beside the synced split's."""
    L = drafter.block_size
    out: dict = {"measured_speedup": {}}
    for tau in TAUS:
        decoder = ForcedDecoder(target, drafter, L, min(tau, L), DecodePolicy(draft_ahead=ahead))
        tokens, stats, s = _decode(decoder, prompt, n, kv)
        out["measured_speedup"][tau] = round((len(tokens) - 1) / s / plain_tok_s, 3)
        if tau == split_tau:
            round_ms = 1000 * s / len(stats)
            out["unsynced_round_ms"] = round(round_ms, 3)
            out["unsynced_break_even_tau"] = round(round_ms * plain_tok_s / 1000, 3)
    return out


def round_figures(target, drafter, prompt, n, kv, split_tau, plain_tok_s, plain_tokens) -> dict:
    """The round split at forced acceptance (phases synced), break-even tau and projections;
    the speed-up measured at each forced tau (no phase syncs); the real rule's output."""
    L = drafter.block_size
    decode_ms = 1000 / plain_tok_s
    out = round_split(target, drafter, prompt, n, kv, split_tau)
    total = out["round_ms"]["total"]
    out["break_even_tau"] = round(total / decode_ms, 3)
    out["projected_speedup"] = {t: round(t * decode_ms / total, 3) for t in TAUS}
    ahead = draft_ahead_default(target, LocalDraftPeer(drafter))  # the engine's, here
    out.update(unsynced_rounds(target, drafter, prompt, n, kv, split_tau, plain_tok_s, ahead))
    if ahead:  # the same rounds drafting after the acceptance is read: its before/after
        out["without_draft_ahead"] = unsynced_rounds(
            target, drafter, prompt, n, kv, split_tau, plain_tok_s, False
        )
    bare = DraftlessDecoder(target, drafter, L, min(split_tau, L), DecodePolicy(draft_ahead=False))
    _, stats, s = _decode(bare, prompt, n, kv)
    bare_ms = 1000 * s / len(stats)
    out["unsynced_round_ms_without_drafting"] = round(bare_ms, 3)
    # drafting's cost in a round as the engine runs it: what it adds to the same rounds that
    # draft after reading the acceptance (drafting ahead reorders a round's work around the
    # host's syncs, so rounds without a draft are compared with rounds that do not draft ahead)
    drafting_ms = out.get("without_draft_ahead", out)["unsynced_round_ms"]
    out["unsynced_draft_share"] = round(max(0.0, 1 - bare_ms / drafting_ms), 3)
    s_tokens, stats, _ = _decode(ForcedDecoder(target, drafter, L, None), prompt, n, kv)
    out["speculative_equals_plain_tokens"] = f"{_same_prefix(s_tokens, plain_tokens)}/{n}"
    spec = [s.accepted for s in stats if s.bs > 1]
    out["random_drafter_tau"] = round(acceptance_length(sum(spec), len(spec)) or 0.0, 3)
    return out


def verify_ablations(target, prompt, tap_ids, reps: int, kv: str, say) -> dict:
    """verify(L) / decode(1) again with each load-time speed path turned off in turn (the fused
    GDN kernel, the few-row 4-bit kernel, the fused projections): their before/after."""
    out: dict = {}
    if gdn.BLOCK_KERNEL is not None:  # the same without the fused kernel: its before/after
        kernel, gdn.BLOCK_KERNEL = gdn.BLOCK_KERNEL, None
        try:
            out["without_gdn_kernel"] = verify_costs(target, prompt, tap_ids, reps, kv)[0]
            say(f"verify without the GDN kernel: {json.dumps(out['without_gdn_kernel'])}")
        finally:
            gdn.BLOCK_KERNEL = kernel
    with qmm_cuda.disabled(target.model) as swapped:
        if swapped:  # the same with MLX's own few-row 4-bit matmul: the kernel's before/after
            target.drop_compiled()  # (compiled graphs would keep the kernel)
            out["without_qmm_kernel"] = verify_costs(target, prompt, tap_ids, reps, kv)[0]
            say(f"verify without the few-row 4-bit kernel: {out['without_qmm_kernel']}")
    if swapped:
        target.drop_compiled()
    if target.fused_groups:  # each layer's projections on their own: fused.py's before/after
        with fused.disabled():
            target.drop_compiled()
            out["without_fused_projections"] = verify_costs(target, prompt, tap_ids, reps, kv)[0]
        target.drop_compiled()
        say(f"verify without fused projections: {out['without_fused_projections']}")
    return out


def seed(args) -> dict:
    from ..engine.model.drafter import load_drafter
    from ..settings import sanctum_home

    shape = _shape(args)
    root = Path(args.dir).expanduser() if args.dir else sanctum_home() / "seed"
    began = time.perf_counter()  # each line says when: where a run's time went

    def say(msg: str) -> None:
        print(f"[seed {time.perf_counter() - began:.0f}s] {msg}", file=sys.stderr, flush=True)

    target_dir, drafter_dir, build_s = ensure(root, shape, say, with_drafter=not args.plain_only)
    if args.build_only:  # the checkpoints for other benches (`--model`, `--drafter`)
        return {"target": str(target_dir), "drafter": str(drafter_dir), "build_s": build_s}
    t0 = time.perf_counter()
    target = load_target(target_dir)
    drafter = None
    if not args.plain_only:
        drafter = load_drafter(drafter_dir, target, block_size=args.block_size)
    load_s = time.perf_counter() - t0
    say(f"loaded in {load_s:.1f} s: {cuda.report()}")
    n, kv, *other_kv = args.max_tokens, *args.kv.split(",")
    prompt = np.random.default_rng(0).integers(10, shape.vocab - 10, args.prompt_tokens).tolist()
    result = {
        "shape": shape.key(),
        "block_size": drafter.block_size if drafter else None,
        "kv": kv,
        "prompt_tokens": len(prompt),
        "max_tokens": n,
        "build_s": round(build_s, 1),
        "load_s": round(load_s, 1),
        "policy": cuda.report(),
    }
    say("plain decode: this engine vs mlx-lm")
    figures, plain_tokens = plain_figures(target, prompt, n, args.repeats, kv)
    result.update(figures)
    say(f"plain: {json.dumps(figures)}")  # each section's figures as they come: a run cut
    say("verify(L) vs decode(1)")  # short by its time limit still reports what it measured
    tap_ids = tuple(shape.tap_ids)
    costs, cache = verify_costs(target, prompt, tap_ids, args.reps, kv)
    result.update(costs)
    say(f"verify: {json.dumps(costs)}")
    if drafter is not None:
        say(f"rounds at block {drafter.block_size}, acceptance forced")
        rounds = round_figures(
            target, drafter, prompt, n, kv, args.split_tau, result["plain_tok_s"], plain_tokens
        )
        result.update(rounds)
        say(f"rounds: {json.dumps(rounds)}")
        kernels = cuda.report()["draft_kernels"]
        if kernels["attention_layers"] or kernels["conv_layers"]:  # their before/after
            body = drafter.body
            body.use_kernels(attention=False, conv=False)
            try:
                off = round_split(target, drafter, prompt, n, kv, args.split_tau)
            finally:
                body.use_kernels(
                    attention=bool(kernels["attention_layers"]), conv=bool(kernels["conv_layers"])
                )
            result["without_draft_kernels"] = off
            say(f"rounds without the draft kernels: {json.dumps(off)}")
        if gdn.BLOCK_KERNEL_KEEPS_ROWS and gdn.ROLLBACK_VIEWS:  # rollback copying its rows:
            gdn.ROLLBACK_VIEWS = False  # the views' before/after
            try:
                copies = round_split(target, drafter, prompt, n, kv, args.split_tau)
            finally:
                gdn.ROLLBACK_VIEWS = True
            result["with_rollback_copies"] = copies
            say(f"rounds with the rollback copying: {json.dumps(copies)}")
    if not args.no_ablations:  # after the headline figures: each recompiles every graph
        result.update(verify_ablations(target, prompt, tap_ids, args.reps, kv, say))
    if drafter is None:  # --plain-only
        return result
    if not args.no_phases:
        from .seedphases import drafter_phases, layer_phases

        say("per-phase timings")
        taps = target.prefill(prompt, target.make_cache(kv), tap_ids)[1]
        result["phases"] = layer_phases(target, cache, reps=args.reps)
        result["phases"]["drafter"] = drafter_phases(
            target, drafter, mx.concatenate(taps), args.reps
        )
    for mode in other_kv:
        say(f"kv {mode}: plain and speculative at forced tau 5")
        p_tok, _, p_s = _decode(Decoder(target), prompt, n, mode)
        s_tok, _, s_s = _decode(
            ForcedDecoder(target, drafter, drafter.block_size, 5), prompt, n, mode
        )
        result[f"kv_{mode}"] = {
            "plain_tok_s": round((len(p_tok) - 1) / p_s, 2),
            "speculative_tau5_tok_s": round((len(s_tok) - 1) / s_s, 2),
            "plain_equals_fp16_tokens": f"{_same_prefix(p_tok, plain_tokens)}/{n}",
        }
    return result


def add_parser(bsub) -> None:
    s = bsub.add_parser(
        "seed",
        help="the seed's shapes on random weights: plain vs mlx-lm, "
        "verify/decode, round split, break-even tau",
    )
    s.add_argument("--dir", help="checkpoint cache (default ~/.cache/sanctum/seed)")
    s.add_argument("--layers", type=int, help="target depth (default 64)")
    s.add_argument(
        "--scale",
        choices=("auto", "seed", "small"),
        default="auto",
        help="small: hidden 256, intermediate 512, vocab 8192, 2 drafter layers "
        "(the head shapes stay the seed's); auto: seed on a GPU, small on a CPU, "
        "which cannot run the seed's width in minutes",
    )
    s.add_argument("--hidden", type=int)
    s.add_argument("--intermediate", type=int)
    s.add_argument("--vocab", type=int)
    s.add_argument("--drafter-layers", type=int)
    s.add_argument("--block-size", type=int, help="draft block (default the drafter's, 8)")
    s.add_argument("--prompt-tokens", type=int, default=128)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3, help="plain vs mlx-lm pairs")
    s.add_argument("--reps", type=int, default=8, help="timed calls per verify/phase figure")
    s.add_argument("--split-tau", type=int, default=5, help="forced tau of the round split")
    s.add_argument("--kv", default="fp16,q8", help="KV formats: the first is measured in full")
    s.add_argument("--no-phases", action="store_true")
    s.add_argument(
        "--no-ablations",
        action="store_true",
        help="skip verify(L) without each GPU speed path (each recompiles the forward)",
    )
    s.add_argument(
        "--plain-only",
        action="store_true",
        help="no drafter: plain vs mlx-lm and verify/decode only (an A/B of MLX settings)",
    )
    s.add_argument(
        "--build-only",
        action="store_true",
        help="build (or find) the checkpoints, print their dirs",
    )
    s.add_argument("--json", action="store_true")
