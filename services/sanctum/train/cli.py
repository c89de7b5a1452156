"""`sanctum train tokenizer | corpus | target | drafter | regen | pack | calibrate | plot`: the training commands."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _corpus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", action="append", default=[], metavar="PATH",
                   help="text files or folders (.txt .md .rst .py .jsonl); default: Python's stdlib")  # fmt: skip
    p.add_argument(
        "--no-chat", action="store_true", help="do not add function chats from .py files"
    )


def _loop_flags(p: argparse.ArgumentParser, steps: int, batch: int, lr: float) -> None:
    p.add_argument("--data", help="a token file from `sanctum train corpus` (instead of --corpus)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int)
    p.add_argument(
        "--time-budget", type=float, help="seconds: fit the schedule into this wall time"
    )
    p.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="storage dtype of the written weights")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="mx.compile the train step (slow to compile on MLX CUDA)")  # fmt: skip
    p.add_argument("--no-compile", action="store_true", help="the default: do not mx.compile")
    p.add_argument("--seed", type=int, default=0)


def _load_corpus(args, tokenizer_dir: Path):
    from .data import Corpus, build_corpus

    if args.data:
        return Corpus.load(args.data)
    return build_corpus(tokenizer_dir, args.corpus or None, chat=not args.no_chat, seed=args.seed)


def cmd_tokenizer(args) -> int:
    from ..tokenizer import build_tokenizer
    from .data import training_texts

    out = build_tokenizer(
        training_texts(args.corpus or None, chat=not args.no_chat), args.vocab_size, args.out
    )
    print(json.dumps({"tokenizer": str(out), "vocab_size": args.vocab_size}))
    return 0


def cmd_corpus(args) -> int:
    from .data import build_corpus

    corpus = build_corpus(
        args.tokenizer, args.corpus or None, chat=not args.no_chat, seed=args.seed
    )
    corpus.save(args.out)
    print(json.dumps({"out": args.out, **corpus.meta}))
    return 0


def cmd_target(args) -> int:
    from .target import TargetShape, TargetTraining, train_target

    tok = Path(args.tokenizer)
    corpus = _load_corpus(args, tok)
    shape = TargetShape(args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads,
                        args.head_dim, args.gdn_key_heads, args.gdn_value_heads, args.gdn_head_dim)  # fmt: skip
    settings = TargetTraining(
        steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
        warmup=args.warmup if args.warmup is not None else max(1, args.steps // 20),
        time_budget_s=args.time_budget, save_every_s=args.save_every, eval_every=args.eval_every,
        log_every=args.log_every, dtype=args.dtype, compile=args.compile and not args.no_compile, seed=args.seed,
    )  # fmt: skip
    summary = train_target(
        corpus, tok, args.out, shape, settings, log=lambda m: print(m, flush=True)
    )
    print(json.dumps({"target": args.out, **{k: v for k, v in summary.items() if k != "corpus"}}))
    return 0


def cmd_drafter(args) -> int:
    from ..engine.model.target import load_target
    from .drafter import DrafterShape, DrafterTraining, target_for_training, train_drafter
    from .gdn import chunked_gdn
    from .regen import load_regen

    with chunked_gdn():
        target = target_for_training(load_target(args.target), args.target_dtype)
    corpus = _load_corpus(args, Path(target.path))
    regen_data = load_regen(args.regen_data) if args.regen_data else None
    short_data = load_regen(args.short_data) if args.short_data else None
    if short_data is not None and args.short_every < 1:
        raise SystemExit(f"--short-every must be 1 or more, got {args.short_every}")
    causal = {"true": True, "false": False}.get(args.is_causal)
    shape = DrafterShape(
        kind=args.kind, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate=args.intermediate,
        tap_ids=_ints(args.taps) if args.taps else None, block_size=args.block_size,
        mask_token_id=args.mask_token_id, sliding_window=args.sliding_window, is_causal=causal,
        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
    )  # fmt: skip
    settings = DrafterTraining(
        steps=args.steps, batch=args.batch, seq_len=args.seq_len, rows_per_seq=args.rows_per_seq,
        block_sizes=_ints(args.block_sizes), lr=args.lr,
        warmup=args.warmup if args.warmup is not None else max(1, args.steps // 25),
        distill=args.distill, regen=args.regen, regen_prompt=args.regen_prompt,
        regen_batch=args.regen_batch, regen_frac=args.regen_frac, hard_labels=args.hard_labels,
        short_every=args.short_every,  # used only with short_data (train_drafter)
        short_batch=args.short_batch, short_rows_per_seq=args.short_rows_per_seq,
        select=args.select, time_budget_s=args.time_budget,
        save_every_s=args.save_every, eval_every=args.eval_every, log_every=args.log_every,
        dtype=args.dtype, compile=args.compile and not args.no_compile, seed=args.seed,
    )  # fmt: skip
    summary = train_drafter(target, corpus, args.out, shape, settings,
                            log=lambda m: print(m, flush=True), init=args.init, regen_data=regen_data,
                            short_data=short_data)  # fmt: skip
    print(json.dumps({"drafter": args.out, **summary}))
    return 0


def cmd_regen(args) -> int:
    from ..engine.model.target import load_target
    from .drafter import target_for_training
    from .gdn import chunked_gdn
    from .regen import build_regen, save_regen

    with chunked_gdn():  # the target as the drafter trainer sees it: float32, dequantized
        target = target_for_training(load_target(args.target), "float32")
    corpus = _load_corpus(args, Path(target.path))
    arrays = build_regen(target, corpus, args.count, args.seq_len, args.spans, args.new_tokens,
                         args.batch, args.holdout, args.seed, args.corpus or None,
                         _floats(args.temperatures), args.prompt_len,
                         log=lambda m: print(m, flush=True), review=args.review)  # fmt: skip
    save_regen(args.out, arrays)
    print(json.dumps({"out": args.out, "train": list(arrays["train"].shape),
                      "holdout": list(arrays["holdout"].shape) if "holdout" in arrays else None,
                      **json.loads(str(arrays["info"]))}))  # fmt: skip
    return 0


def cmd_position_loss(args) -> int:
    from .data import Corpus, heldout_tokens
    from .target import position_loss

    if args.data:
        tokens = Corpus.load(args.data).holdout
    else:
        tokens = heldout_tokens(args.target, args.corpus or None, not args.no_chat, args.seed)
    result = {"target": args.target, "seq_len": args.seq_len, "windows": args.windows,
              "held_out_tokens": int(tokens.size),
              "loss_by_position": position_loss(args.target, tokens, args.seq_len, args.windows)}  # fmt: skip
    print(json.dumps(result))
    return 0


def cmd_plot(args) -> int:
    from .loop import plot_losses

    panels = {}
    for run in args.runs:
        name, _, where = run.rpartition("=")  # "NAME=PATH" names the panel
        path = Path(where)
        log = json.loads((path if path.is_file() else path / "train_log.json").read_text())
        curves = {"train": [(r["step"], r["loss"]) for r in log["train"] if not r.get("short")]}
        if short := [(r["step"], r["loss"]) for r in log["train"] if r.get("short")]:
            curves["train, short steps"] = short  # another data kind: a curve of its own
        for key in sorted({k for e in log["eval"] for k in e if "loss" in k}):
            curves[key] = [(e["step"], e[key]) for e in log["eval"] if key in e]
        panels[name or path.name] = curves
    plot_losses(Path(args.out), panels, args.title)
    print(json.dumps({"png": args.out, "panels": {k: list(v) for k, v in panels.items()}}))
    return 0


def cmd_pack(args) -> int:
    from ..engine.model.target import load_target
    from .pack import pack_drafter, pack_target

    out = Path(args.out)
    if args.drafter_only:  # the target is already packed (or stays as it is): only the drafter
        if not args.drafter:
            raise SystemExit("--drafter-only needs --drafter")
        target, result = Path(args.target), {}
    else:
        target = pack_target(args.target, out / "target", args.target_bits)
        result = {"target": str(target)}
    if args.drafter:
        result["drafter"] = str(
            pack_drafter(args.drafter, out / "drafter", load_target(target), args.drafter_bits)
        )
    print(json.dumps(result))
    return 0


def cmd_calibrate(args) -> int:
    import numpy as np

    from ..engine.model.target import load_target
    from .calibrate import fit_scale, held_out_rows, write_scale
    from .data import sample_windows
    from .drafter import crop, init_trainee, target_for_training
    from .gdn import chunked_gdn
    from .regen import load_regen

    rng = np.random.default_rng(args.seed)
    with chunked_gdn():
        target = target_for_training(load_target(args.target), "float32")
        trainee, _ = init_trainee(args.drafter, target)
        if args.regen_data:  # held-out regenerated rows: blocks where the target wrote itself
            regen = load_regen(args.regen_data)
            if regen.holdout is None:
                raise SystemExit(f"{args.regen_data} has no held-out sequences")
            n = min(args.sequences, regen.holdout.shape[0])
            seq_len = min(args.seq_len, regen.holdout.shape[1])
            tokens, prefer = crop(regen.holdout, regen.holdout_generated, n, seq_len, rng,
                                  pick=np.arange(n))  # fmt: skip
        else:  # held-out corpus windows
            corpus = _load_corpus(args, Path(target.path))
            tokens, prefer = sample_windows(corpus.holdout, args.sequences, args.seq_len, rng), None
        rows = held_out_rows(trainee, target, tokens, prefer, args.block_size,
                             args.rows_per_seq, args.seed)  # fmt: skip
        fit = fit_scale(trainee, rows, _floats(args.temperatures))
    if args.write:
        write_scale(args.drafter, fit["scale"])
    print(json.dumps({"drafter": args.drafter, "written": bool(args.write), **fit}))
    return 0


def register(subparsers) -> None:
    """Adds `train` and its subcommands to the top-level CLI."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    t = subparsers.add_parser("train", help="train a tokenizer, a target, or a DFlash drafter")
    sub = t.add_subparsers(dest="train_command", required=True)

    p = sub.add_parser("tokenizer", help="byte-level BPE with chat specials and <|mask|>")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    _corpus_flags(p)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("corpus", help="tokenize a corpus once (train + held-out files) to an .npz")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    _corpus_flags(p)
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser(
        "target", help="a Qwen3.5 hybrid (Gated DeltaNet + attention 3:1) from scratch"
    )
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--gdn-key-heads", type=int, default=4)
    p.add_argument("--gdn-value-heads", type=int, default=8)
    p.add_argument("--gdn-head-dim", type=int, default=64)
    _corpus_flags(p)
    _loop_flags(p, steps=3000, batch=32, lr=2e-3)
    p.set_defaults(func=cmd_target)

    p = sub.add_parser("drafter", help="a DFlash / DFlash 2 drafter for any mlx-lm target (frozen)")
    p.add_argument("--target", required=True, help="target checkpoint dir (any mlx-lm model)")
    p.add_argument("--out", required=True)
    p.add_argument("--kind", default="dflash", choices=("dflash", "dflash2"),
                   help="dflash2: dynamic convolutions and a candidate selector; with --init of a "
                   "DFlash drafter, its layers go into a new DFlash 2 one")  # fmt: skip
    p.add_argument("--sliding-window", type=int,
                   help="every layer attends to this many rows back (default: full attention)")  # fmt: skip
    p.add_argument("--is-causal", choices=("true", "false"),
                   help="written to the config (default: absent: sliding layers causal)")  # fmt: skip
    p.add_argument("--selector-rank", type=int, default=64, help="DFlash 2 codebook rank")
    p.add_argument("--selector-top-k", type=int, default=16, help="DFlash 2 candidates a row")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--taps", help="target layer ids, e.g. 1,3,5,7 (default: evenly spaced)")
    p.add_argument("--block-size", type=int, default=8, help="block size written to config.json")
    p.add_argument("--block-sizes", default="8,16", help="block sizes trained, alternated")
    p.add_argument(
        "--rows-per-seq", type=int, default=512, help="anchors x block size per sequence"
    )
    p.add_argument("--mask-token-id", type=int)
    p.add_argument("--distill", type=float, default=1.0,
                   help="1: labels are the target's distribution; 0: the data's next token")  # fmt: skip
    p.add_argument(
        "--regen", type=int, default=0, help="sequences the target writes itself (greedy)"
    )
    p.add_argument("--regen-prompt", type=int, default=32)
    p.add_argument("--regen-batch", type=int, default=512)
    p.add_argument("--regen-frac", type=float, default=0.5)
    p.add_argument("--regen-data", metavar="NPZ",
                   help="regenerated sequences from `sanctum train regen` (instead of --regen)")  # fmt: skip
    p.add_argument("--short-data", metavar="NPZ",
                   help="short regenerated sequences (`train regen --seq-len 256 --spans 1 "
                   "--prompt-len 96 ...`) for every --short-every-th step")  # fmt: skip
    p.add_argument("--short-every", type=int, default=4,
                   help="with --short-data: every Nth step trains on short sequences")  # fmt: skip
    p.add_argument("--short-batch", type=int, default=64, help="short sequences a short step")
    p.add_argument("--short-rows-per-seq", type=int, default=256,
                   help="anchors x block size per short sequence")  # fmt: skip
    p.add_argument("--init", metavar="DIR",
                   help="fine-tune this drafter checkpoint (packed or not); its config replaces the shape flags")  # fmt: skip
    p.add_argument("--hard-labels", default="data", choices=("data", "target"),
                   help="hard part of the labels (weight 1 - distill): the data's token or the target's argmax")  # fmt: skip
    p.add_argument("--select", default="loss", choices=("loss", "tau"),
                   help="checkpoint kept: lowest held-out loss or highest held-out teacher-forced tau")  # fmt: skip
    p.add_argument("--target-dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the frozen target (default: as loaded; the CPU loader gives float32)")  # fmt: skip
    _corpus_flags(p)
    _loop_flags(p, steps=2000, batch=32, lr=1e-3)
    p.set_defaults(func=cmd_drafter)

    p = sub.add_parser(
        "regen", help="training windows with spans the target continues itself, to an .npz"
    )
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--data", help="a token file from `sanctum train corpus` (instead of --corpus)")
    p.add_argument("--count", type=int, default=1024, help="training sequences")
    p.add_argument("--holdout", type=int, default=64, help="held-out sequences (evaluation only)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens a sequence")
    p.add_argument("--spans", type=int, default=4, help="generated spans a sequence")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens a span")
    p.add_argument("--prompt-len", type=int, help="where the first span starts (default: random)")
    p.add_argument("--temperatures", default="0",
                   help="continuation temperatures, cycled over the rows (0 = greedy)")  # fmt: skip
    p.add_argument("--batch", type=int, default=64, help="sequences per forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--review", action="store_true",
                   help="every sequence a review chat (bench multiturn's shape): each span the "
                        "reply to a user turn showing a file's code")  # fmt: skip
    _corpus_flags(p)
    p.set_defaults(func=cmd_regen)

    p = sub.add_parser(
        "pack", help="store a trained pair small (quantized; float32 again on the CPU)"
    )
    p.add_argument("--target", required=True)
    p.add_argument("--drafter")
    p.add_argument("--out", required=True, help="writes OUT/target and OUT/drafter")
    p.add_argument("--target-bits", type=int, default=6)
    p.add_argument("--drafter-bits", type=int, default=8)
    p.add_argument("--drafter-only", action="store_true",
                   help="write only OUT/drafter, checked against --target as it is (e.g. a packed one)")  # fmt: skip
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("calibrate",
                       help="fit a drafter's draft_temperature_scale (sampled acceptance) on held-out data")  # fmt: skip
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--regen-data", metavar="NPZ",
                   help="held-out regenerated sequences (default: held-out corpus windows)")  # fmt: skip
    p.add_argument("--data", help="a token file from `sanctum train corpus` (instead of --corpus)")
    p.add_argument("--sequences", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--rows-per-seq", type=int, default=512)
    p.add_argument("--temperatures", default="0.7,1", help="the fit maximizes their mean tau")
    p.add_argument("--write", action="store_true", help="write the scale into config.json")
    p.add_argument("--seed", type=int, default=7)
    _corpus_flags(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("position-loss", help="a target's held-out loss by position, long windows")
    p.add_argument("--target", required=True)
    p.add_argument("--data", help="a token file from `sanctum train corpus` (instead of --corpus)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    _corpus_flags(p)
    p.set_defaults(func=cmd_position_loss)

    p = sub.add_parser("plot", help="loss curves of runs (their train_log.json) as a PNG")
    p.add_argument("runs", nargs="+",
                   help="run folders or train_log.json files, each optionally NAME=PATH")  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="training loss")
    p.set_defaults(func=cmd_plot)
