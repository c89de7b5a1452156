"""The prompt cache on disk (cache/store.py says what is written when).

`<id>.safetensors`: the pages and rungs entry `<id>` was the first to store, named
`p.<key>.<layer>.<part>` / `p.<key>.taps` and `r.<key>.<layer>.conv|state`.
`<id>.msgpack`: the entry itself: its tokens, and for each page and rung it references the key
and the file holding it, with every such file's checksum. Files are written to a temporary name
and renamed, private to the serving user (0600 in a 0700 directory).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import mlx.core as mx
import msgpack
import numpy as np

from .pages import Page, Record, Rung

FORMAT_VERSION = 2  # 1: one file per entry holding all its tensors (not shared)
PRIVATE_FILE = 0o600  # entries and their metadata: only the serving user may read them
PARTS = ("conv", "state")


def make_private_dir(directory: Path) -> None:
    """The cache directory, private: the entries hold the conversations in clear."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)


def digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_blobs(
    directory: Path, file_id: str, pages: dict[str, Page], rungs: dict[str, Rung]
) -> str:
    """One safetensors file with these pages and rungs; returns its checksum."""
    tensors = {}
    for key, page in pages.items():
        for i, layer in enumerate(page.kv):
            tensors.update({f"p.{key}.{i}.{j}": a for j, a in enumerate(layer)})
        if page.taps is not None:
            tensors[f"p.{key}.taps"] = page.taps
    for key, rung in rungs.items():
        for i, pair in enumerate(rung.states):
            tensors.update({f"r.{key}.{i}.{part}": a for part, a in zip(PARTS, pair, strict=True)})
    tmp = directory / f"{file_id}.tmp.safetensors"
    mx.save_safetensors(str(tmp), tensors)
    os.chmod(tmp, PRIVATE_FILE)
    checksum = digest(tmp)
    os.replace(tmp, directory / f"{file_id}.safetensors")
    return checksum


def write_meta(
    directory: Path,
    rec,
    page_files: list[str],
    rung_files: dict[int, str],
    digests: dict[str, str],
    kv_layers: list[int],
    gdn_layers: int,
) -> None:
    """The entry's metadata, last: written, it makes the entry visible to a restarted store."""
    positions = sorted(rec.rungs)
    meta = {
        "format": FORMAT_VERSION,
        "model_key": rec.model_key,
        "kv_mode": rec.kv_mode,
        "tokens": rec.tokens.astype(np.int32).tobytes(),
        "prompt_len": rec.prompt_len,
        "created": rec.created,
        "has_taps": rec.has_taps,
        "kv_layers": kv_layers,
        "gdn_layers": gdn_layers,
        "pages": rec.pages,
        "page_files": page_files,
        "rung_positions": positions,
        "rung_keys": [rec.rungs[p] for p in positions],
        "rung_files": [rung_files[p] for p in positions],
        "digests": digests,
    }
    tmp = directory / f"{rec.entry_id}.tmp.msgpack"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as f:
        f.write(msgpack.packb(meta))
    os.replace(tmp, directory / f"{rec.entry_id}.msgpack")


def read_metas(directory: Path, stats: dict, log) -> list[dict]:
    """Every readable entry's metadata (an unreadable one is counted and skipped)."""
    out = []
    for meta_file in sorted(directory.glob("*.msgpack")):
        if ".tmp." in meta_file.name:
            continue
        try:
            meta = msgpack.unpackb(meta_file.read_bytes())
            if isinstance(meta, dict) and meta.get("format") == 1:  # unshared: rebuilt as used
                log.info("prompt cache: dropping %s (an older, unshared format)", meta_file.name)
                meta_file.unlink(missing_ok=True)
                continue
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
                raise ValueError("unknown metadata format")
            meta["entry_id"] = meta_file.stem
            out.append(meta)
        except Exception as exc:
            stats["skipped_files"] += 1
            log.warning("prompt cache: skipping %s: %s", meta_file.name, exc)
    return out


class TensorFiles:
    """Tensor files read once each, after their checksum was checked."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._loaded: dict[str, dict] = {}
        self._sums: dict[str, str] = {}

    def get(self, file_id: str, checksum: str) -> dict:
        path = self.directory / f"{file_id}.safetensors"
        if file_id not in self._sums:
            self._sums[file_id] = digest(path)
        if self._sums[file_id] != checksum:
            raise ValueError("tensor file does not match its checksum (truncated or corrupt)")
        if file_id not in self._loaded:
            self._loaded[file_id] = mx.load(str(path))
        return self._loaded[file_id]


def record_from_meta(meta: dict, tensors: TensorFiles, pages: dict, rungs: dict):
    """(record, the pages and rungs it brings that `pages` / `rungs` lack) from metadata."""
    tokens = np.frombuffer(meta["tokens"], dtype=np.int32).copy()
    digests = meta["digests"]
    new_pages, new_rungs = {}, {}
    covered = 0
    for key, file_id in zip(meta["pages"], meta["page_files"], strict=True):
        start, covered = covered, int(key.rsplit("-", 1)[1])
        if key in pages or key in new_pages:
            continue
        t = tensors.get(file_id, digests[file_id])
        kv = [
            tuple(t[f"p.{key}.{i}.{j}"] for j in range(n)) for i, n in enumerate(meta["kv_layers"])
        ]
        taps = t[f"p.{key}.taps"] if meta["has_taps"] else None
        if any(a.shape[-2] != covered - start for layer in kv for a in layer if a.ndim == 4):
            raise ValueError("KV length does not match the token count")
        new_pages[key] = Page(kv, taps, file=file_id)
    if covered != len(tokens):
        raise ValueError("the pages do not cover the entry's tokens")
    for p, key, file_id in zip(
        meta["rung_positions"], meta["rung_keys"], meta["rung_files"], strict=True
    ):
        if p > len(tokens) or int(key.rsplit("-", 1)[1]) != p:
            raise ValueError("a rung lies beyond the entry's tokens")
        if key in rungs or key in new_rungs:
            continue
        t = tensors.get(file_id, digests[file_id])
        states = [
            tuple(t[f"r.{key}.{i}.{part}"] for part in PARTS) for i in range(meta["gdn_layers"])
        ]
        new_rungs[key] = Rung(p, states, file=file_id)
    rec = Record(
        meta["entry_id"],
        meta["model_key"],
        meta["kv_mode"],
        tokens,
        int(meta["prompt_len"]),
        float(meta["created"]),
        bool(meta["has_taps"]),
        list(meta["pages"]),
        dict(zip(meta["rung_positions"], meta["rung_keys"], strict=True)),
    )
    return rec, new_pages, new_rungs


def tidy(directory: Path, keep: set[str]) -> None:
    """After loading: tensor files that no loaded entry references go, as do temporary files;
    files an older version wrote readable by all are made private."""
    for f in directory.iterdir():
        if not f.is_file():
            continue
        if ".tmp." in f.name or (f.suffix == ".safetensors" and f.stem not in keep):
            f.unlink(missing_ok=True)
        elif f.stat().st_mode & 0o077:
            os.chmod(f, PRIVATE_FILE)
