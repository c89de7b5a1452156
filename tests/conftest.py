"""Shared fixtures: tiny checkpoints made once per session through `make_tiny` (real HF layout,
loaded through the real loaders)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
