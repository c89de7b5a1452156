"""Helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import random
import socket
import time

# prompts the tiny pair answers at some length; the first four are the cluster and serving tests'
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "The quick brown fox",
           "for i in range(10):", "# a comment", "x = [1, 2, 3]", "while True:"]  # fmt: skip

# serving settings' environment for tests of speculation's mechanics: the speculation gate off
# (the tiny random pairs accept too little, so it would turn most of their rounds into plain steps)
NO_GATE = {"SANCTUM_MIN_TAU": "0"}


def wait_for(predicate, timeout=30.0, interval=0.05):
    """Poll `predicate` until it is true or `timeout` passes; an exception while polling counts
    as not yet (a role may be restarting), the last call's is raised."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            if predicate():
                return True
        time.sleep(interval)
    return predicate()


_GIVEN: set[int] = set()  # the ports free_port has handed out in this process


def free_port() -> int:
    """A loopback port free now, above Ray's worker ports (10002-19999) and below the kernel's
    ephemeral range: a port from bind(0) is ephemeral, and in a cluster test one of Ray's
    processes, connecting out after the test chose it, took it before the server listened."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    top = max(low, 20000 + 200)  # 200 tries even where the ephemeral range starts lower
    for port in random.sample(range(20000, top), 200):
        if port in _GIVEN:  # two calls in a row must not name one port
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free loopback port between Ray's and the ephemeral range")


def assert_greedy_equal(target, prompt_ids, plain: list[int], got: list[int], what="") -> None:
    """A greedy run `got` (speculative, looked up or shared) against the plain greedy run `plain`
    of the same prompt and length: token for token on the CPU; on CUDA up to the plain run's
    first near tie (sanctum/bench/neartie.py), since a verify's kernels round the last bits of
    a logit differently from a decode step's there and either pick of a near tie is the model's."""
    from sanctum.engine.kernels.cuda import is_cuda

    if not is_cuda():
        assert got == plain, what
        return
    from sanctum.bench.neartie import near_tie_verdict, top_two_margins

    margins = top_two_margins(target, list(prompt_ids), plain)
    same, tie, verdict = near_tie_verdict(plain, margins, got)
    assert verdict != "differs", f"{what}: parts from plain greedy at {same}, first near tie {tie}"
