"""The serving core's scheduler (serving/scheduler.py) behind the inline backend, no Ray: requests
interleaved round by round and bounded, cancelled and timed out, prefilled in slices that fit
their time, and no request stalling the others (the hardening limits)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import NO_GATE, wait_for
from helpers import PROMPTS as ALL_PROMPTS

PROMPTS = ALL_PROMPTS[:4]


def inline_backend(pair, max_active: int, round_delay=None, **more):
    """An inline server of the pair with no prompt cache and the speculation gate off (`more`:
    other serve settings; `round_delay`: a pause in every round)."""
    from sanctum.serving.inline import InlineBackend
    from sanctum.settings import serve_settings

    settings = serve_settings(
        pair[0], pair[1], cache_dir="none", max_active=max_active, env=NO_GATE, **more
    )
    return InlineBackend(settings, round_delay)


def record_prefills(decoder) -> list:
    """The request of each prefill forward `decoder` runs from now on, in order."""
    prefilled, real = [], decoder.prefill
    decoder.prefill = lambda seq, *a, **k: prefilled.append(seq.seq_id) or real(seq, *a, **k)
    return prefilled


def test_scheduler_interleaves_bounds_and_cancels(pair, engine):
    from sanctum.serving.errors import InvalidRequest, QueueFull
    from sanctum.serving.inline import RoundDelay
    from sanctum.serving.requests import GenerateRequest

    _, _, reference = engine
    # 20 ms per round: greedy runs of the tiny pair hit EOS after 46-850 tokens, and the
    # "long" requests below must still be running when the queue is checked
    backend = inline_backend(pair, 2, RoundDelay(0.02), max_queue=1)
    try:
        backend.ready(60)
        sched = backend.scheduler
        events = []
        both_active = threading.Event()

        def consume(name, ticket):
            for i, chunk in enumerate(ticket):
                events.append((name, i, tuple(chunk.token_ids)))

        def watch():  # interleaved: at some moment both are open and stepped in turn
            while any(t.is_alive() for t in threads):
                if sched.stats()["active"] == 2:
                    both_active.set()
                time.sleep(0.005)

        tickets = {p: sched.submit(GenerateRequest(prompt=p, max_tokens=20)) for p in PROMPTS[:2]}
        threads = [threading.Thread(target=consume, args=item) for item in tickets.items()]
        for t in threads:
            t.start()
        watcher = threading.Thread(target=watch)
        watcher.start()
        for t in [*threads, watcher]:
            t.join(60)
        for p in PROMPTS[:2]:
            assert [t for name, _, toks in events if name == p for t in toks] == reference(p, 20)
        assert both_active.is_set()

        long = [sched.submit(GenerateRequest(prompt=p, max_tokens=3000)) for p in PROMPTS[:3]]
        with pytest.raises(QueueFull):
            sched.submit(GenerateRequest(prompt=PROMPTS[3], max_tokens=4))
        for t in long:
            sched.cancel(t.request_id)
        for t in long:
            list(t)  # each ends at its next round (or before it opens)
        assert wait_for(sched.idle, 10) and sched.stats()["cancelled"] == 3

        timed = sched.submit(
            GenerateRequest(prompt=PROMPTS[0], max_tokens=3000), deadline=time.time() + 1.0
        )
        assert len(list(timed)) < 3000  # stopped by its deadline
        with pytest.raises(InvalidRequest):
            list(sched.submit(GenerateRequest(prompt="", max_tokens=4)))
    finally:
        backend.close()


def test_queue_full_message_counts_what_stats_count(pair):
    """RESOURCE_EXHAUSTED's message counts requests as stats does, those being opened or
    prefilled included."""
    from sanctum.serving.errors import QueueFull
    from sanctum.serving.inline import RoundDelay
    from sanctum.serving.requests import GenerateRequest

    backend = inline_backend(pair, 2, RoundDelay(0.02), max_queue=1)
    try:
        backend.ready(60)
        sched = backend.scheduler
        sched.prefill_slice = 8  # the long prompt below stays prefilling for a while
        decoding = sched.submit(GenerateRequest(prompt=PROMPTS[3], max_tokens=3000))
        next(iter(decoding))
        long_prompt = "".join(f"value_{i} = compute({i})\n" for i in range(30))
        prefilling = sched.submit(GenerateRequest(prompt=long_prompt, max_tokens=3000))
        waiting = sched.submit(GenerateRequest(prompt=PROMPTS[1], max_tokens=4))
        assert wait_for(lambda: (sched.stats()["active"], sched.stats()["waiting"]) == (2, 1), 10)
        with pytest.raises(QueueFull) as err:
            sched.submit(GenerateRequest(prompt=PROMPTS[2], max_tokens=4))
        assert "2 requests in progress and 1 waiting" in str(err.value), str(err.value)
        for ticket in (decoding, prefilling, waiting):
            sched.cancel(ticket.request_id)
    finally:
        backend.close()


def test_long_prompt_prefills_in_slices_between_rounds(pair, engine):
    """A long prompt arriving while another request decodes is prefilled a slice at a time, with
    the other request's rounds in between (its stream does not stall for the whole prompt), and
    both outputs are still the engine's own."""
    from sanctum.serving.requests import GenerateRequest

    _, _, reference = engine
    backend = inline_backend(pair, max_active=2)
    try:
        backend.ready(60)
        sched, verifier = backend.scheduler, backend.scheduler.verifier
        sched.prefill_slice = 64
        log = []  # what the worker thread did, in order
        prefill_some, step = verifier.prefill_some, verifier.step

        def logged_prefill(act, budget=None, ride=0):
            log.append(("prefill", act.req.request_id))
            return prefill_some(act, budget, ride)

        def logged_step(act):
            log.append(("round", act.req.request_id))
            return step(act)

        verifier.prefill_some, verifier.step = logged_prefill, logged_step
        short = sched.submit(GenerateRequest(prompt=PROMPTS[3], max_tokens=200, request_id="a"))
        stream = iter(short)
        first = [next(stream)]
        long_prompt = "".join(f"value_{i} = compute({i}, {i + 1})\n" for i in range(40))
        assert len(engine[0].tokenizer.encode(long_prompt)) > 4 * 64
        other = sched.submit(GenerateRequest(prompt=long_prompt, max_tokens=8, request_id="b"))
        rest, long_out = list(stream), list(other)
        slices = [i for i, e in enumerate(log) if e == ("prefill", "b")]
        assert len(slices) > 4  # one 64-token slice at a time
        between = log[slices[0] : slices[-1]]
        assert between.count(("round", "a")) >= len(slices) - 1  # a round after every slice
        assert [t for c in first + rest for t in c.token_ids] == reference(PROMPTS[3], 200)
        assert [t for c in long_out for t in c.token_ids] == reference(long_prompt, 8)
    finally:
        backend.close()


def test_a_short_prompt_joining_shared_rounds_rides_them_without_a_prefill(
    pair, engine, monkeypatch
):
    """A request arriving while another decodes in shared rounds runs its short prompt inside
    those rounds' target forwards (a block's rows a round), never in a prefill of its own
    between two of the running stream's rounds; its first chunk comes from a round, with its
    time to first token, and both outputs are the engine's own. The
    server built its shared rounds' graphs at load (SANCTUM_WARM_SHARED), and froze what it
    loaded out of the garbage collector's walks (mlx_thread.py)."""
    import gc

    from sanctum.cache import ladder
    from sanctum.serving.inline import InlineBackend, RoundDelay
    from sanctum.serving.requests import GenerateRequest
    from sanctum.serving.scheduler import RIDE_ROUNDS
    from sanctum.settings import serve_settings

    _, _, reference = engine
    # rungs a few tokens apart, so that the short riding prompt holds one (stops split its rows)
    monkeypatch.setattr(ladder, "MIN_SPREAD_GAP", 4)
    env = {**NO_GATE, "SANCTUM_WARM_SHARED": "1"}  # and the shared rounds built at load
    gc.unfreeze()  # (what a server before it in this process froze)
    backend = InlineBackend(
        serve_settings(pair[0], pair[1], cache_dir="none", max_active=2, env=env),
        RoundDelay(0.01),
    )
    try:
        backend.ready(60)
        sched, verifier = backend.scheduler, backend.scheduler.verifier
        assert sched.max_batch == 2 and verifier.ride_width > 1
        assert list(verifier.warmed) == [1, 2]  # (1: its looked-up widths)
        assert gc.get_freeze_count() > 10_000  # the models, their modules and graphs
        prefilled = record_prefills(verifier.decoder)
        first = sched.submit(GenerateRequest(prompt=PROMPTS[3], max_tokens=120, request_id="a"))
        stream = iter(first)
        head = [next(stream), next(stream)]
        prompt = "def area(w, h):\n    return w * h\n\nclass Box:\n"
        n = len(engine[0].tokenizer.encode(prompt))
        assert verifier.ride_width < n <= RIDE_ROUNDS * verifier.ride_width  # over two rounds
        other = sched.submit(GenerateRequest(prompt=prompt, max_tokens=16, request_id="b"))
        joined = list(other)
        rest = list(stream)
        assert prefilled == ["a"]
        assert joined[0].token_ids and joined[-1].usage.ttft_s > 0
        assert [t for c in joined for t in c.token_ids] == reference(prompt, 16)
        assert [t for c in head + rest for t in c.token_ids] == reference(PROMPTS[3], 120)
        # the prompt cache's rungs were taken inside the shared rounds: the same prompt again
        # resumes from one of them, to the same tokens
        again = list(sched.submit(GenerateRequest(prompt=prompt, max_tokens=16, request_id="c")))
        assert 0 < again[-1].usage.resumed_at < n
        assert [t for c in again for t in c.token_ids] == reference(prompt, 16)
    finally:
        backend.close()


def test_requests_arriving_during_a_prefill_join_the_first_round(pair, engine):
    """A burst of clients: requests that arrive while the first one's prompt is prefilled are
    opened before the round that follows it, their short prompts riding in that round beside
    the first request's first block (not left to the round after). Outputs are the engine's."""
    import collections

    from sanctum.serving.requests import GenerateRequest

    _, _, reference = engine
    backend = inline_backend(pair, max_active=3)
    try:
        backend.ready(60)
        sched, verifier = backend.scheduler, backend.scheduler.verifier
        assert sched.max_batch == 3
        sched.work_log = collections.deque()
        later = []
        real = verifier.prefill_some

        def prefill_some(act, *a, **k):  # the others arrive during the first one's prefill
            if not later:
                later.extend(
                    sched.submit(
                        GenerateRequest(prompt=PROMPTS[i], max_tokens=12, request_id=f"r{i}")
                    )  # fmt: skip
                    for i in (1, 2)
                )
            return real(act, *a, **k)

        verifier.prefill_some = prefill_some
        first = list(sched.submit(GenerateRequest(prompt=PROMPTS[0], max_tokens=12,
                                                  request_id="r0")))  # fmt: skip
        outs = [first] + [list(t) for t in later]
        rounds = [detail for _, _, kind, detail in list(sched.work_log) if kind == "round"]
        assert rounds[0][0] == 3, rounds  # the first round is all three's
        for i, chunks in enumerate(outs):
            assert [t for c in chunks for t in c.token_ids] == reference(PROMPTS[i], 12), i
    finally:
        backend.close()


def test_a_burst_of_short_prompts_rides_one_round_with_no_prefill(pair, engine, monkeypatch):
    """Requests arriving together, nothing decoding yet: no prompt is prefilled on its own;
    their tails ride the first shared round together (one forward for all), each first
    token from it, and every output is the engine's. The first round waits for the requests
    still being prepared (at most BURST_WAIT_S)."""
    import collections

    from sanctum.serving import scheduler
    from sanctum.serving.requests import GenerateRequest

    _, _, reference = engine
    backend = inline_backend(pair, max_active=3)
    try:
        backend.ready(60)
        sched, verifier = backend.scheduler, backend.scheduler.verifier
        sched.work_log = collections.deque()
        prefilled = record_prefills(verifier.decoder)
        real_prepare = verifier.prepare

        submitted = threading.Event()

        def prepare(req):  # the others take longer to prepare (tokenize) than the first,
            if req.request_id != "r0":  # which is ready only once all three were submitted
                time.sleep(0.2)  # (a busy machine could otherwise run its round before
            else:  # the test thread submits the others)
                submitted.wait(5.0)
            return real_prepare(req)

        verifier.prepare = prepare
        monkeypatch.setattr(scheduler, "BURST_WAIT_S", 5.0)  # (what CI's slowest run needs)
        tickets = [
            sched.submit(GenerateRequest(prompt=PROMPTS[i], max_tokens=12, request_id=f"r{i}"))
            for i in range(3)
        ]
        submitted.set()
        t0 = time.monotonic()
        outs = [list(t) for t in tickets]
        assert time.monotonic() - t0 < 5.0  # (the wait ended when they were ready)
        assert prefilled == []
        log = list(sched.work_log)
        rounds = [detail for _, _, kind, detail in log if kind == "round"]
        assert rounds[0][0] == 3, rounds
        for i, chunks in enumerate(outs):
            assert [t for c in chunks for t in c.token_ids] == reference(PROMPTS[i], 12), i
            assert chunks[-1].usage.ttft_s > 0
    finally:
        backend.close()


def test_prefill_slices_shrink_to_fit_their_time():
    """A slice is PREFILL_SLICE tokens, or fewer when the request's last slice says they would
    take longer than prefill_slice_s, or, while others decode, than their turn of rounds (the
    median of their last few: one long turn does not double the next slice; attention makes
    tokens dearer as the context grows)."""
    from sanctum.serving.scheduler import MIN_PREFILL_SLICE, Scheduler

    sched = Scheduler(lambda: None, prefill_slice=512)
    sched.prefill_slice_s = 0.25
    assert sched._slice("new") == 512  # nothing measured yet
    for cost, tokens in ((1e-6, 512), (1e-3, 250), (0.1, MIN_PREFILL_SLICE)):
        sched._token_cost["r"] = cost
        assert sched._slice("r") == tokens
    sched._last_token_cost = 1e-3  # a first slice goes by the last one measured
    assert sched._slice("other") == 250
    # while others decode, no longer than their turn of rounds: 100 tokens of 50 ms
    sched._turns.extend([0.05, 0.04, 0.06])
    assert sched._slice("other") == 250  # (nobody decoding)
    sched._active["a"] = None
    sched._token_cost["r"] = 5e-4
    assert sched._slice("r") == 100
    sched._turns.append(0.2)  # one long turn (wide looked-up blocks): the median holds
    assert sched._slice("r") == 110
    sched._turns.extend([0.2] * 5)  # the last few all long: so are the slices
    assert sched._slice("r") == 400
    sched._token_cost["r"] = 1e-2  # at least MIN_PREFILL_SLICE
    assert sched._slice("r") == MIN_PREFILL_SLICE
    sched._active.clear()
    sched.shutdown()


def test_no_request_stalls_the_others(pair, engine):
    """Head-of-line stalls: while a stream decodes, a 15 MB prompt, an 800-message
    chat and 100 stop strings of 10 KB arrive. The big prompt and the stop strings are refused
    at once (by size, before any tokenization), the chat is prepared off the model's thread and
    prefilled in slices, and the stream's worst gap between chunks stays well under a second (a
    prompt tokenized on the model's thread would stall every stream)."""
    from sanctum.serving.errors import InvalidRequest
    from sanctum.serving.inline import RoundDelay
    from sanctum.serving.requests import GenerateRequest

    backend = inline_backend(pair, 4, RoundDelay(0.005))
    try:
        backend.ready(60)
        sched = backend.scheduler
        normal = sched.submit(GenerateRequest(prompt=PROMPTS[3], max_tokens=3000, request_id="n"))
        arrivals, stream = [], iter(normal)
        for _ in range(3):
            next(stream)
        done = threading.Event()

        def read_normal():
            for _ in stream:
                arrivals.append(time.perf_counter())
                if done.is_set():
                    sched.cancel("n")

        reader = threading.Thread(target=read_normal)
        reader.start()
        t0 = time.perf_counter()
        huge = sched.submit(GenerateRequest(prompt="x = 1\n" * ((15 << 20) // 6), max_tokens=4))
        with pytest.raises(InvalidRequest) as err:
            list(huge)
        assert err.value.field == "prompt" and "characters" in str(err.value)
        assert time.perf_counter() - t0 < 1.0  # refused by size, not after tokenizing
        stops = sched.submit(GenerateRequest(prompt="hi", stop=("s" * 10_000,) * 100))
        with pytest.raises(InvalidRequest) as err:
            list(stops)
        assert err.value.field == "stop"
        chat = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"}
                for i in range(800)]  # fmt: skip
        long_chat = sched.submit(
            GenerateRequest(messages=tuple(chat), max_tokens=4, request_id="c")
        )
        assert wait_for(lambda: sched.stats()["active"] == 2, timeout=10)  # prepared: prefilling
        time.sleep(1.5)  # a few of its prefill slices, between the stream's rounds
        sched.cancel("c")
        assert list(long_chat) == []  # ended by the cancel, no error
        done.set()
        reader.join(60)
        gaps = np.diff([t0, *arrivals])
        assert len(arrivals) > 5 and gaps.max() < 1.0, gaps.max()
    finally:
        backend.close()


def test_served_requests_count_their_looked_up_rounds(pair, engine):
    """`SANCTUM_LOOKUP_MIN` reaches the serving decoder (1 here, so that the random pair finds
    repeats; 0 would turn it off), and the rounds whose drafts were read from the request's own
    tokens show in its usage (also over the wire), in Stats and in /metrics."""
    from sanctum.serving.inline import InlineBackend
    from sanctum.serving.requests import GenerateRequest
    from sanctum.settings import serve_settings
    from sanctum.wire.convert import usage_from_proto, usage_to_proto

    _, _, reference = engine
    env = {**NO_GATE, "SANCTUM_LOOKUP_MIN": "1"}
    backend = InlineBackend(serve_settings(pair[0], pair[1], cache_dir="none", env=env))
    try:
        backend.ready(120)
        assert backend.verifier.decoder.lookup_min == 1
        req = GenerateRequest(prompt=ALL_PROMPTS[2], max_tokens=64, use_cache=False)
        chunks = list(backend.submit(req))
        assert [t for c in chunks for t in c.token_ids] == reference(ALL_PROMPTS[2], 64)
        usage = chunks[-1].usage
        assert 0 < usage.lookup_rounds < usage.rounds
        assert usage_from_proto(usage_to_proto(usage)).lookup_rounds == usage.lookup_rounds
        assert backend.stats().lookup_rounds == usage.lookup_rounds
        text = backend.metrics.render().decode()
        assert f"sanctum_lookup_rounds_total {float(usage.lookup_rounds)}" in text
    finally:
        backend.close()


def test_served_requests_are_gated_by_a_threshold_measured_at_load(pair, engine):
    """By default (`SANCTUM_MIN_TAU=auto`) the serving decoder measures what a round costs in
    plain steps, greedy and sampled, and gates on it: a greedy request of the tiny pair (which
    accepts little) then takes plain steps too, and its output is still the engine's."""
    from sanctum.serving.inline import InlineBackend
    from sanctum.serving.requests import GenerateRequest
    from sanctum.settings import serve_settings

    _, _, reference = engine
    backend = InlineBackend(serve_settings(pair[0], pair[1], cache_dir="none", env={}))
    try:
        backend.ready(120)
        d = backend.verifier.decoder
        assert d.min_tau >= 1.0 and d.min_tau_sampled >= 1.0
        backend.verifier.decoder = d = d.with_policy(
            min_tau=99.0
        )  # no round reaches it: the gate must trip
        req = GenerateRequest(prompt=ALL_PROMPTS[0], max_tokens=60, use_cache=False)
        chunks = list(backend.submit(req))
        assert [t for c in chunks for t in c.token_ids] == reference(ALL_PROMPTS[0], 60)
        assert any(c.drafted == 0 for c in chunks[1:]) and any(c.drafted for c in chunks[1:])
        stats = backend.stats()  # and the gate shows: its thresholds, the steps it took
        assert stats.min_tau == 99.0 and stats.min_tau_sampled == d.min_tau_sampled
        gated = sum(1 for c in chunks[1:] if c.drafted == 0)
        assert stats.gated_steps == gated
        text = backend.metrics.render().decode()
        assert f"sanctum_gated_steps_total {float(gated)}" in text
        assert 'sanctum_gate_min_tau{kind="greedy"} 99.0' in text
    finally:
        backend.close()
