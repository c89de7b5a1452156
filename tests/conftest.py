"""Shared fixtures: tiny checkpoints made once per session through `make_tiny` (real HF layout,
loaded through the real loaders)."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import NO_GATE

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# servers skip building their shared rounds' graphs at load (seconds per server, many servers);
# tests/serving/test_serving.py turns it on where it is tested
os.environ.setdefault("SANCTUM_WARM_SHARED", "0")


def pytest_runtest_logreport(report):
    """SANCTUM_TEST_FAILURES_AT_ONCE=1: each failure's report on stderr as it happens, for runs
    that a time limit may stop before pytest's summary (deploy/gpu/concurrency.sh)."""
    if report.failed and os.environ.get("SANCTUM_TEST_FAILURES_AT_ONCE") == "1":
        sys.stderr.write(
            f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n"
        )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def make_pair(tiny_dir):
    """make_pair(kind, drafter) -> (target_dir, drafter_dir), cached per combination."""
    from sanctum.tiny import make_tiny

    made = {}

    def _make(kind="hybrid", drafter="dflash", block_size=8):
        key = (kind, drafter, block_size)
        if key not in made:
            made[key] = make_tiny(
                tiny_dir / f"{kind}-{drafter}-{block_size}", kind, drafter, 0, block_size
            )
        return made[key]

    return _make


@pytest.fixture(scope="module")
def pair(make_pair):
    """The hybrid target and DFlash drafter, as path strings."""
    return tuple(str(p) for p in make_pair("hybrid", "dflash"))


@pytest.fixture(scope="module")
def engine(pair):
    """Target + full drafter in this process, and greedy references from the inline engine."""
    from sanctum.engine.decode.generate import generate
    from sanctum.engine.model.drafter import load_drafter
    from sanctum.engine.model.target import load_target

    target = load_target(pair[0])
    drafter = load_drafter(pair[1], target)

    def reference(prompt, max_tokens=24):
        ids = target.tokenizer.encode(prompt, add_special_tokens=False)
        steps = generate(target, ids, drafter=drafter, max_tokens=max_tokens)
        return [t for s in steps for t in s.tokens]

    return target, drafter, reference


@pytest.fixture(scope="module")
def backend(pair, tmp_path_factory):
    """An inline backend over `pair` (2 active, 2 queued), shared by a module's servers."""
    from sanctum.serving.inline import InlineBackend
    from sanctum.settings import serve_settings

    settings = serve_settings(pair[0], pair[1], max_active=2, max_queue=2,
                              cache_dir=str(tmp_path_factory.mktemp("cache")), env=NO_GATE)  # fmt: skip
    b = InlineBackend(settings)
    b.ready(120)
    yield b
    b.close()


@pytest.fixture
def serve(backend):
    """serve(**Server kwargs) -> a started gRPC Server over the module's backend, stopped after."""
    from sanctum.api.server import Server

    servers = []

    def start(**kw):
        srv = Server(backend, "127.0.0.1", 0, **kw)
        srv.ready(60)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop(0)
