"""Helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
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
