"""`sanctum bench gaps`: a running stream's worst gap between chunks while others arrive.

Served inline (the backend `bench batch` uses), greedy, two scenarios:
- `joining`: one long stream runs alone for `--before` of its chunks, then streams 2..N start
  one at a time, each after `--join-every` more of its chunks;
- `long_prompt`: `--running` streams run, then a request with a `--long-tokens` prompt (repeated
  code, as token ids) arrives and is prefilled in slices between their rounds.
Every chunk's arrival is taken on the client's monotonic clock. A join's window runs from its
submission to the running stream's first chunk after the newcomer's first chunk (the first
round the newcomer is in); a gap belongs to the window its end falls in. Every output is then
checked against the same request served alone."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from dataclasses import replace

from .batch import PROMPTS, _serve

# repeated into the long prompt: code, as the default pair was trained on
LONG_TEXT = '''def merge(left, right):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    return out + left[i:] + right[j:]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

'''


def add_parser(bsub) -> None:
    from ..settings import add_model_flags

    p = bsub.add_parser(
        "gaps",
        help="a running stream's worst inter-chunk gap as others join or a long prompt lands",
    )
    add_model_flags(p)
    p.add_argument("--streams", type=int, default=8, help="joining: streams in all, the first too")
    p.add_argument("--max-tokens", type=int, default=256, help="the running streams' tokens")
    p.add_argument("--join-tokens", type=int, default=64, help="each joining stream's tokens")
    p.add_argument("--before", type=int, default=8, help="running chunks before the first join")
    p.add_argument("--join-every", type=int, default=2, help="running chunks between joins")
    p.add_argument("--running", type=int, default=4, help="long_prompt: streams already running")
    p.add_argument("--long-tokens", type=int, default=4096, help="long_prompt: its prompt tokens")
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument(
        "--max-batch",
        type=int,
        help="requests a shared round holds (default: the server's; 1: one request's round "
        "at a time)",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="serve each scenario once untimed first (graphs per batch shape built before)",
    )
    p.add_argument("--lines", action="store_true", help="a JSON line per scenario as it ends")
    p.add_argument("--json", action="store_true")


class _Stream(threading.Thread):
    """One streaming client: its chunks' arrival times (monotonic) and tokens."""

    def __init__(self, backend, req):
        super().__init__(daemon=True)
        self.backend, self.req = backend, req
        self.submitted = 0.0
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.usage = None
        self.error: Exception | None = None
        self.done = False
        self._cv = threading.Condition()

    def run(self) -> None:
        self.submitted = time.monotonic()
        try:
            for chunk in self.backend.submit(self.req):
                now = time.monotonic()
                with self._cv:
                    self.times.append(now)
                    self.tokens += chunk.token_ids
                    self.usage = chunk.usage or self.usage
                    self._cv.notify_all()
        except Exception as exc:
            self.error = exc
        with self._cv:
            self.done = True
            self._cv.notify_all()

    def wait_chunks(self, n: int, timeout: float = 600.0) -> int:
        """Wait for its n-th chunk (or its end); the chunks so far."""
        with self._cv:
            self._cv.wait_for(lambda: len(self.times) >= n or self.done, timeout)
            return len(self.times)

    def gaps_after(self, start: float) -> list[tuple[float, float]]:
        """(gap seconds, end time) of each gap that begins at or after `start`."""
        t = self.times
        return [(t[i] - t[i - 1], t[i]) for i in range(1, len(t)) if t[i - 1] >= start]


def _start(backend, req) -> _Stream:
    s = _Stream(backend, req)
    s.start()
    return s


def _window_end(running: _Stream, newcomer: _Stream) -> float:
    """The running stream's first chunk after the newcomer's first: the first round the newcomer
    is in (its first chunk comes from its prefill). Its last chunk if it ended before."""
    first = newcomer.times[0] if newcomer.times else float("inf")
    return next((t for t in running.times if t > first), running.times[-1])


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def _median(gaps: list[tuple[float, float]]) -> float | None:
    return statistics.median(g for g, _ in gaps) if gaps else None


def joining(backend, requests: list, args) -> tuple[dict, dict]:
    """Stream 1 alone for `args.before` chunks, then each other stream after `args.join_every`
    more; (figures, index -> tokens)."""
    first = _start(backend, requests[0])
    joiners, n = [], args.before
    for req in requests[1:]:
        first.wait_chunks(n)
        joiners.append(_start(backend, req))
        n += args.join_every
    for s in [first, *joiners]:
        s.join()
    streams = [first, *joiners]
    _raise(streams)
    gaps = first.gaps_after(first.times[0])
    t_join = joiners[0].submitted if joiners else float("inf")
    windows = [(j.submitted, _window_end(first, j)) for j in joiners]
    before = [(g, e) for g, e in gaps if e <= t_join]
    worst_at, worst_join = None, None
    for k, (lo, hi) in enumerate(windows):
        inside = [(g, e) for g, e in gaps if lo < e <= hi]
        if inside and (worst_join is None or max(inside)[0] > worst_join[0]):
            worst_join, worst_at = max(inside), k + 2  # stream numbers start at 1
    # sharing rounds outside the join windows: after the first join, until the joiners end
    last = max((j.times[-1] for j in joiners), default=float("-inf"))
    shared = [
        (g, e)
        for g, e in gaps
        if t_join < e <= last and not any(lo < e <= hi for lo, hi in windows)
    ]
    median_before, median_shared = _median(before), _median(shared)
    worst = max(gaps) if gaps else None
    worst_work = _work_in(backend, worst_join)
    figures = {
        "scenario": "joining",
        "streams": len(streams),
        "first_stream_chunks": len(first.times),
        "first_stream_tokens": len(first.tokens),
        "joined_while_first_ran": sum(j.submitted < first.times[-1] for j in joiners),
        # streams open, the first among them, as each joined (the round's width is this + 1)
        "open_at_each_join": [
            1 + sum(o.times[-1] > j.submitted for o in joiners[:k]) for k, j in enumerate(joiners)
        ],
        "median_gap_ms_before": _ms(median_before),
        "worst_gap_ms_joining": _ms(worst_join[0]) if worst_join else None,
        "worst_gap_at_stream": worst_at,
        "worst_gap_ms": _ms(worst[0]) if worst else None,
        "median_gap_ms_shared": _ms(median_shared),
        "worst_joining_vs_median_before": _ratio(worst_join, median_before),
        "worst_joining_vs_median_shared": _ratio(worst_join, median_shared),
        "worst_vs_median_before": _ratio(worst, median_before),
        "worst_joining_work": worst_work,
        "rounds_ms_by_size": _rounds_by_size(backend, first.submitted, first.times[-1]),
        "gaps_ms_joining": [
            _ms(max((g for g, e in gaps if lo < e <= hi), default=None)) for lo, hi in windows
        ],
    }
    return figures, {i: s.tokens for i, s in enumerate(streams)}


def long_prompt(backend, requests: list, args) -> tuple[dict, dict]:
    """`args.running` streams, then the long request once each has `args.before` chunks;
    (figures, index -> tokens; the long request last)."""
    running = [_start(backend, req) for req in requests[:-1]]
    for s in running:
        s.wait_chunks(args.before)
    long = _start(backend, requests[-1])
    for s in [*running, long]:
        s.join()
    _raise([*running, long])
    lo = long.submitted
    started = max(s.times[0] for s in running)
    before, during = [], []
    for s in running:
        gaps = s.gaps_after(started)
        before += [(g, e) for g, e in gaps if e <= lo]
        hi = _window_end(s, long)
        during += [(g, e) for g, e in gaps if lo < e <= hi]
    median_before = _median(before)
    worst = max(during) if during else None
    worst_work = _work_in(backend, worst)
    # what the long prompt itself added to a running stream's gap: its prefill slices inside
    # the gap (the rest of a gap is rounds, which may be long on their own: wide looked-up
    # blocks), against the running streams' median round before it arrived
    added = [_prefill_in(backend, gap, requests[-1].request_id) for gap in during]
    added = [a for a in added if a is not None]
    rounds = _round_times(backend, started, lo, len(running))
    median_round = statistics.median(rounds) if rounds else None
    most_added = max(added) if added else None
    figures = {
        "scenario": "long_prompt",
        "running": len(running),
        "long_prompt_tokens": len(requests[-1].prompt_ids),
        "running_through_prefill": sum(s.times[-1] > long.times[0] for s in running),
        "median_gap_ms_before": _ms(median_before),
        "worst_gap_ms_during_prefill": _ms(worst[0]) if worst else None,
        "worst_vs_median_before": _ratio(worst, median_before),
        "worst_gap_work": worst_work,
        "most_prefill_in_a_gap_ms": _ms(most_added),
        "median_round_ms_before": _ms(median_round),
        "most_prefill_in_a_gap_vs_median_round": round(most_added / median_round, 2)
        if most_added is not None and median_round
        else None,
        "long_prefill_slices_ms": _slices(backend, requests[-1].request_id),
        "long_ttft_ms": _ms(long.times[0] - long.submitted),
        "long_ttft_ms_server": _ms(long.usage.ttft_s) if long.usage else None,
    }
    return figures, {i: s.tokens for i, s in enumerate([*running, long])}


def _work_log(backend) -> list | None:
    """The server's worker's work log so far (`Scheduler.work_log`), or None where not kept."""
    log = getattr(getattr(backend, "scheduler", None), "work_log", None)
    return None if log is None else list(log)


def _work_in(backend, gap: tuple[float, float] | None) -> list | None:
    """What the server's worker did inside `gap` (seconds, end time): each piece that overlaps
    it, in order, as [kind, detail, ms inside the gap] (kind: open, prefill (request, prompt
    tokens left before the slice), round (requests in it, tokens it committed: a round of
    wide looked-up blocks is long but commits many)); the rest of the gap is the time
    between pieces (handing chunks out, the worker's own loop)."""
    log = _work_log(backend)
    if gap is None or log is None:
        return None
    hi = gap[1]
    lo = hi - gap[0]
    out = []
    for t0, t1, kind, detail in log:
        inside = min(t1, hi) - max(t0, lo)
        if inside > 0:
            detail = list(detail) if isinstance(detail, tuple) else detail
            out.append([kind, detail, _ms(inside)])
    return out


def _prefill_in(backend, gap: tuple[float, float], request_id: str) -> float | None:
    """Seconds of `request_id`'s prefill slices inside `gap` (seconds, end time), or None
    without a work log."""
    log = _work_log(backend)
    if log is None:
        return None
    hi = gap[1]
    lo = hi - gap[0]
    return sum(
        max(0.0, min(t1, hi) - max(t0, lo))
        for t0, t1, kind, detail in log
        if kind == "prefill" and detail[0] == request_id
    )


def _round_times(backend, lo: float, hi: float, size: int) -> list[float]:
    """Seconds of each round of `size` requests the worker ran between `lo` and `hi` (a
    round that began before `lo` included: the one a stream's first chunk came from)."""
    log = _work_log(backend) or []
    return [
        t1 - t0
        for t0, t1, kind, detail in log
        if kind == "round" and detail[0] == size and lo <= t1 and t1 <= hi
    ]


def _slices(backend, request_id: str) -> dict | None:
    """The prefill slices the worker ran for `request_id`: how many, their median and longest
    ms (a slice is sized by the request's last slice's cost to SANCTUM_PREFILL_SLICE_MS, or,
    while others decode, to their last turn of rounds)."""
    log = _work_log(backend)
    if log is None:
        return None
    ms = [t1 - t0 for t0, t1, kind, d in log if kind == "prefill" and d[0] == request_id]
    if not ms:
        return None
    return {"slices": len(ms), "median": _ms(statistics.median(ms)), "max": _ms(max(ms))}


def _rounds_by_size(backend, lo: float, hi: float) -> dict | None:
    """Rounds the worker ran between `lo` and `hi`, by the requests in them: {size: [the first
    round's ms, the median of the later ones' (None: no later one), how many]}: a size's first
    round builds its graphs unless they were built before (SANCTUM_WARM_SHARED)."""
    log = _work_log(backend)
    if log is None:
        return None
    sizes: dict[int, list[float]] = {}
    for t0, t1, kind, detail in log:
        if kind == "round" and lo <= t0 and t1 <= hi:
            sizes.setdefault(detail[0], []).append(t1 - t0)
    return {
        n: [_ms(ms[0]), _ms(statistics.median(ms[1:])) if len(ms) > 1 else None, len(ms)]
        for n, ms in sorted(sizes.items())
    }


def _ratio(worst: tuple[float, float] | None, median: float | None) -> float | None:
    return round(worst[0] / median, 2) if worst and median else None


def _raise(streams: list[_Stream]) -> None:
    for s in streams:
        if s.error is not None:
            raise s.error


def long_prompt_ids(tokenizer, n: int) -> tuple[int, ...]:
    """`n` token ids of repeated code."""
    once = tokenizer.encode(LONG_TEXT)
    return tuple((once * (n // len(once) + 1))[:n])


def run(args) -> dict:
    from ..serving.inline import InlineBackend
    from ..serving.requests import GenerateRequest
    from ..settings import model_flags, serve_settings

    if min(args.streams, args.running, args.before, args.join_every) < 1:
        raise ValueError("--streams, --running, --before and --join-every must be >= 1")
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError("--max-batch must be >= 1 (1: one request's round at a time)")
    width = max(args.streams, args.running + 1)
    settings = serve_settings(
        **model_flags(args), cache_dir="none", max_active=width, max_batch=args.max_batch
    )
    backend = InlineBackend(settings)

    def request(i: int, max_tokens: int, **prompt) -> GenerateRequest:
        prompt = prompt or {"prompt": PROMPTS[i % len(PROMPTS)]}
        return GenerateRequest(
            **prompt, max_tokens=max_tokens, temperature=0.0, use_cache=False, request_id=f"g{i}"
        )

    try:
        backend.ready(300)
        backend.scheduler.work_log = deque(maxlen=1 << 16)
        target = backend.verifier.target
        fits = args.long_tokens + args.long_max_tokens
        if fits > target.max_context:
            raise ValueError(f"--long-tokens + --long-max-tokens ({fits}) > the context")
        ids = long_prompt_ids(target.tokenizer, args.long_tokens)
        plans = [
            (
                joining,
                [request(0, args.max_tokens)]
                + [request(i, args.join_tokens) for i in range(1, args.streams)],
            ),
            (
                long_prompt,
                [request(i, args.max_tokens) for i in range(args.running)]
                + [request(args.running, args.long_max_tokens, prompt_ids=ids)],
            ),
        ]
        _serve(backend, plans[0][1][:1], 1)  # warm-up: compiled graphs, BLAS threads
        rows = []
        for scenario, requests in plans:
            if args.warm:
                scenario(backend, _renamed(requests, "warm"), args)
            figures, tokens = scenario(backend, _renamed(requests, "timed"), args)
            alone = _serve(backend, requests, 1)[1]  # one client: every request on its own
            figures["outputs_equal_alone"] = all(
                tokens[i] == alone[i][0] for i in range(len(requests))
            )
            figures["max_batch"] = backend.scheduler.max_batch
            rows.append(figures)
            if args.lines:
                print(json.dumps(figures), flush=True)
        return {
            "serving": "inline",
            "max_batch": backend.scheduler.max_batch,
            "block_size": settings.engine.block_size or "the drafter's",
            "warm": args.warm,
            # seconds the server spent at load on shared rounds of each size (SANCTUM_WARM_SHARED)
            "warmed_s": round(sum(backend.verifier.warmed.values()), 2),
            "scenarios": rows,
            "outputs_equal_alone": all(r["outputs_equal_alone"] for r in rows),
        }
    finally:
        backend.close()


def _renamed(requests: list, tag: str) -> list:
    return [replace(r, request_id=f"{r.request_id}-{tag}") for r in requests]
