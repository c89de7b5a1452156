"""`sanctum bench cache-size`: the prompt cache's bytes for one conversation at the seed's shapes
(Qwen3.5-27B: 16 attention layers of 4 KV heads x 256, 48 Gated DeltaNet layers of 48 x 128 x 128
float32 state, the DFlash 2 drafter's 5 taps of 5120 bf16), before and after shared storage.

No model runs: the arrays have the seed's shapes and dtypes, the rung positions come from the
ladder policy (cache/ladder.py) turn by turn as the verifier would place them, and the bytes are
the store's own accounting. "Before" is what the old store held: every turn's entry whole
(`CacheEntry.nbytes` summed, as its byte count did); "after" is `PromptStore.nbytes` once the
turns went through the shared store.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GIB = 1 << 30


def seed_shapes() -> dict:
    """The per-layer shapes of the seed's target and drafter (bench/seedbuild.py's configs)."""
    from .seedbuild import SEED_TAPS, SeedShape, target_config

    text = target_config(SeedShape())["text_config"]
    layers, interval = text["num_hidden_layers"], text["full_attention_interval"]
    attention = sum(1 for i in range(layers) if (i + 1) % interval == 0)
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    return {
        "attention_layers": attention,
        "gdn_layers": layers - attention,
        "kv_heads": text["num_key_value_heads"],
        "head_dim": text["head_dim"],
        "conv": (1, text["linear_conv_kernel_dim"] - 1, 2 * hk * dk + hv * dv),
        "state": (1, hv, dv, dk),
        "taps": len(SEED_TAPS) * text["hidden_size"],
    }


def _kv(shapes: dict, kv_mode: str, n: int) -> list[tuple[mx.array, ...]]:
    """Attention KV of `n` tokens per layer: fp16 (keys, values) or mlx-lm's 8-bit triples."""
    h, d = shapes["kv_heads"], shapes["head_dim"]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(shapes["attention_layers"]):
        if kv_mode == "fp16":
            x = mx.array(rng.standard_normal((1, h, n, d), dtype=np.float32)).astype(mx.bfloat16)
            out.append((x, x + 1))
        else:
            w = mx.array(rng.integers(0, 2**32, (1, h, n, d // 4), dtype=np.uint32))
            s = mx.ones((1, h, n, d // 64), mx.bfloat16)
            out.append((w, s, s, w, s, s))
    mx.eval(out)
    return out


def conversation(kv_mode: str, turns: int, tokens: int, depth: int, ladder_bytes: int = 0) -> list:
    """The entries a `turns`-turn chat ending at `tokens` tokens saves, one per turn: each turn
    adds a user message and a 64-token reply, and the next prompt leaves the reply 32 tokens
    before its end (its text re-encoded), where the re-encoding rung sits."""
    from ..cache.ladder import choose_rungs, prefill_stops
    from ..cache.store import CacheEntry

    shapes = seed_shapes()
    kv = _kv(shapes, kv_mode, tokens)
    taps = mx.ones((tokens, shapes["taps"]), mx.bfloat16)
    rung = [
        (mx.ones(shapes["conv"], mx.bfloat16), mx.ones(shapes["state"], mx.float32))
        for _ in range(shapes["gdn_layers"])
    ]  # the same arrays at every position: the accounting counts each rung's own bytes
    ids = np.arange(tokens, dtype=np.int32)
    entries, inherited, resumed_at = [], {}, 0
    for k in range(1, turns + 1):
        end = tokens * k // turns
        prompt_len = end - 64
        starts = [resumed_at + 16] if k > 1 else [8]
        stops = prefill_stops(depth, prompt_len, resumed_at, starts)
        next_turn_end = end - 32
        captured = {p: rung for p in (*stops, end, next_turn_end)}
        rungs = choose_rungs(depth, prompt_len, end, starts, captured, inherited, next_turn_end)
        entries.append(
            CacheEntry(
                f"seed|{kv_mode}",
                kv_mode,
                ids[:end],
                [tuple(a[..., :end, :] for a in layer) for layer in kv],
                rungs,
                taps[:end],
                prompt_len=prompt_len,
            )
        )
        resumed_at = next_turn_end
        inherited = {p: s for p, s in rungs.items() if p <= resumed_at}
    return entries


def run(args) -> list[dict]:
    """Bytes per conversation before and after, and how many fit in 2 GiB and in 16 GiB."""
    from ..cache.store import PromptStore

    rows = []
    for kv_mode in args.kv.split(","):
        entries = conversation(kv_mode, args.turns, args.tokens, args.ladder, args.ladder_bytes)
        before = sum(e.nbytes for e in entries)
        store = PromptStore(1 << 42, ladder_bytes=args.ladder_bytes)
        for e in entries:
            store.put(e)
        after = store.nbytes
        a = store.accounting()
        rows.append(
            {
                "kv": kv_mode,
                "tokens": args.tokens,
                "turns": args.turns,
                "ladder_bytes": args.ladder_bytes,
                "last_entry_GiB": round(entries[-1].nbytes / GIB, 3),
                "before_GiB": round(before / GIB, 3),
                "after_GiB": round(after / GIB, 3),
                "after_kv_taps_GiB": round((a["kv_bytes"] + a["taps_bytes"]) / GIB, 3),
                "after_rungs": [len(e["rungs"]) for e in store.listing()],
                "fit_2GiB_before": (2 * GIB) // before,
                "fit_2GiB_after": (2 * GIB) // after,
                "fit_16GiB_before": (16 * GIB) // before,
                "fit_16GiB_after": (16 * GIB) // after,
            }
        )
    return rows


def add_parser(sub) -> None:
    c = sub.add_parser(
        "cache-size", help="prompt-cache bytes per conversation at the seed's shapes"
    )
    c.add_argument("--kv", default="fp16,q8")
    c.add_argument("--turns", type=int, default=8)
    c.add_argument("--tokens", type=int, default=4096)
    c.add_argument("--ladder", type=int, default=4)
    c.add_argument("--ladder-bytes", type=int, default=0, help="rung bytes per conversation")
    c.add_argument("--json", action="store_true")
