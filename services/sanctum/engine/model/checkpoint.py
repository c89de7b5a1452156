"""Checkpoints on disk: a directory, or a hub id found in huggingface-hub's local cache (never
downloaded at run time), and its config.json; errors name the problem."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the problem."""


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local directory, or a hub id resolved through huggingface-hub's local cache (offline)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path_or_id}: not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), local_files_only=True))
    except Exception as exc:
        raise CheckpointError(
            f"{path_or_id}: no such directory, and not in the local Hugging Face cache "
            f"(nothing is downloaded at run time): {exc.__class__.__name__}"
        ) from None


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: missing config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
