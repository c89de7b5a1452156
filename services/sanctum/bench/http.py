"""`sanctum bench http`: the per-request overhead of the HTTP front end against gRPC, on the same
prompts against one server (the inline roles, gRPC and HTTP on one loop over one backend).

Each prompt runs greedily through every front end in turn, the order rotating each repeat, so
the modes see the same machine state and (after a warm-up pass) the same prompt cache: gRPC
Complete (unary) and Generate (streamed), HTTP POST /v1/completions whole and as server-sent
events (httpx, one keep-alive connection, as the gRPC client keeps one channel), and the openai
SDK (when installed). Reports each mode's median latency, and the median over prompts and
repeats of each HTTP mode's paired difference from its gRPC counterpart, with a 90% bootstrap
interval: the HTTP tax per request. The texts must agree (`same_text`).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from ..settings import add_model_flags
from .isolation import DEFAULT_PROMPTS, median_interval


def add_parser(bsub) -> None:
    p = bsub.add_parser("http", help="HTTP vs gRPC per-request latency on one server")
    add_model_flags(p)
    p.add_argument(
        "--prompt", action="append", dest="prompts", help="repeatable (default: 4 fixed)"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", action="store_true")


def _modes(grpc_client, http, sdk, max_tokens: int) -> dict:
    """mode -> fn(prompt) -> (seconds, seconds to the first text, text)."""

    def grpc_unary(prompt):
        t0 = time.perf_counter()
        text = grpc_client.complete(prompt, max_tokens=max_tokens).text
        dt = time.perf_counter() - t0
        return dt, dt, text

    def grpc_stream(prompt):
        t0, first, text = time.perf_counter(), None, ""
        for m in grpc_client.generate(prompt, max_tokens=max_tokens):
            if m.text and first is None:
                first = time.perf_counter() - t0
            text += m.text
        return time.perf_counter() - t0, first, text

    body = {"model": "m", "max_tokens": max_tokens}

    def http_unary(prompt):
        t0 = time.perf_counter()
        r = http.post("/v1/completions", json={**body, "prompt": prompt})
        r.raise_for_status()
        dt = time.perf_counter() - t0
        return dt, dt, r.json()["choices"][0]["text"]

    def http_stream(prompt):
        t0, first, text = time.perf_counter(), None, ""
        with http.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
        return time.perf_counter() - t0, first, text

    modes = {
        "grpc_unary": grpc_unary,
        "http_unary": http_unary,
        "grpc_stream": grpc_stream,
        "http_stream": http_stream,
    }
    if sdk is not None:

        def openai_sdk(prompt):
            t0 = time.perf_counter()
            out = sdk.completions.create(model="m", prompt=prompt, max_tokens=max_tokens)
            dt = time.perf_counter() - t0
            return dt, dt, out.choices[0].text

        modes["openai_sdk"] = openai_sdk
    return modes


# each HTTP mode against its gRPC counterpart
PAIRS = {"http_unary": "grpc_unary", "http_stream": "grpc_stream", "openai_sdk": "grpc_unary"}


def run(args) -> dict:
    import httpx

    from ..api.client import Client
    from ..api.server import Server
    from ..serving.inline import InlineBackend
    from ..settings import model_flags, serve_settings

    try:
        import openai
    except ImportError:  # a test dependency: without it, the SDK's column is left out
        openai = None
    prompts = list(args.prompts or DEFAULT_PROMPTS)
    settings = serve_settings(**model_flags(args), cache_dir="none", env=os.environ)
    backend = InlineBackend(settings)
    server = None
    try:
        backend.ready(600)
        server = Server(backend, "127.0.0.1", 0)
        server.ready(60)
        port = server.start_http(0)
        base = f"http://127.0.0.1:{port}"
        with (
            Client(server.address) as grpc_client,
            httpx.Client(base_url=base, timeout=120) as http,
        ):
            sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="none") if openai else None
            modes = _modes(grpc_client, http, sdk, args.max_tokens)
            names = list(modes)
            texts: dict[tuple[str, str], set] = {}
            for prompt in prompts:  # warm-up: connections, the prompt cache, lazy imports
                for name in names:
                    modes[name](prompt)
            times = {n: [] for n in names}
            firsts = {n: [] for n in names}
            for r in range(args.repeats):
                for prompt in prompts:
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for name in order:
                        dt, first, text = modes[name](prompt)
                        times[name].append(dt)
                        firsts[name].append(first if first is not None else dt)
                        texts.setdefault((prompt, name), set()).add(text)
    finally:
        if server is not None:
            server.stop(0)
        backend.close()
    same = all(
        len({t for n in names for t in texts[(p, n)]}) == 1 for p in prompts
    )  # every mode, every repeat: one text per prompt
    out = {
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "same_text": same,
    }
    for name in names:
        out[f"{name}_ms"] = round(1000 * statistics.median(times[name]), 3)
    for name in ("grpc_stream", "http_stream"):
        out[f"{name}_first_text_ms"] = round(1000 * statistics.median(firsts[name]), 3)
    for http_mode, grpc_mode in PAIRS.items():
        if http_mode not in times:
            continue
        diffs = [1000 * (h - g) for h, g in zip(times[http_mode], times[grpc_mode])]
        lo, hi = median_interval(diffs)
        out[f"{http_mode}_overhead_ms"] = round(statistics.median(diffs), 3)
        out[f"{http_mode}_overhead_90ci_ms"] = [round(lo, 3), round(hi, 3)]
    diffs = [1000 * (h - g) for h, g in zip(firsts["http_stream"], firsts["grpc_stream"])]
    out["http_stream_first_text_overhead_ms"] = round(statistics.median(diffs), 3)
    return out
