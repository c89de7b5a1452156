"""The prompt cache: saved target caches keyed by token ids, per model and KV format.

An entry holds the attention KV of all its tokens ONCE (trimmable to any prefix), the recurrent
(GDN) state only at its ladder rungs, and the drafter's context taps. Lookup finds the entry with
the longest common prefix through a radix tree and plans a resume from its deepest rung at or
before that prefix. Eviction is LRU by bytes. With a directory, entries persist as safetensors
(tensors) + msgpack (metadata); damaged files are skipped with a warning.

Arrays are MLX arrays in this process; the store never runs a model.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import msgpack
import numpy as np

from .layout import EntryLayout, flatten, unflatten
from .radix import RadixTree

log = logging.getLogger("sanctum.cache")
FORMAT_VERSION = 1
PRIVATE_FILE = 0o600  # entries and their metadata: only the serving user may read them


@dataclass
class CacheEntry:
    """A saved prompt cache. Shapes: KV per attention layer [1, kv_heads, T, head_dim] (fp16 mode:
    (keys, values); q8 mode: mlx-lm's quantized triples, flattened to six arrays); rung states per
    GDN layer (conv [1, K-1, conv_dim], state [1, Hv, Dv, Dk]); taps [T, n_taps * H]."""

    model_key: str  # which model (and KV format) these tensors belong to
    kv_mode: str  # "fp16" | "q8"
    tokens: np.ndarray  # [T] int32: exactly the tokens the KV holds
    kv: list[tuple[mx.array, ...]]
    rungs: dict[
        int, list[tuple[mx.array, mx.array]]
    ]  # position -> GDN states after that many tokens
    taps: mx.array | None = None
    entry_id: str = ""
    created: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for layer in self.kv for a in layer)
        n += sum(a.nbytes for states in self.rungs.values() for pair in states for a in pair)
        return n + (self.taps.nbytes if self.taps is not None else 0) + self.tokens.nbytes


@dataclass(frozen=True)
class ResumePlan:
    """Where a prompt resumes, with exactly the data needed to do it (no whole entry):
    the KV of the first `resumed_at` tokens, the rungs at or below it (the state to restore is
    `rungs[resumed_at]`; the others seed the new entry's ladder) and the drafter's context taps.
    When nothing usable is cached, resumed_at is 0 and the data fields are empty."""

    requested_lcp: int  # longest common prefix of the prompt with any saved entry
    resumed_at: int  # deepest rung <= min(lcp, prompt_len - 1): at least one token is recomputed
    entry_id: str | None = None
    kv: list[tuple] = field(default_factory=list)  # per attention layer, sliced to resumed_at
    rungs: dict[int, list[tuple]] = field(default_factory=dict)  # positions <= resumed_at
    taps: mx.array | None = None  # [resumed_at, n_taps * H]

    @classmethod
    def from_entry(cls, entry: CacheEntry, requested_lcp: int, resumed_at: int) -> ResumePlan:
        n = resumed_at
        # slices are fresh array objects: a live cache writing into them never writes the entry
        kv = [tuple(a[..., :n, :] for a in layer) for layer in entry.kv]
        taps = entry.taps[:n] if entry.taps is not None and entry.taps.shape[0] >= n else None
        rungs = {p: s for p, s in entry.rungs.items() if p <= n}
        return cls(requested_lcp, n, entry.entry_id, kv, rungs, taps)


class PromptStore:
    """Entries in memory (LRU by bytes), optionally persisted in `directory`."""

    def __init__(self, max_bytes: int = 2 << 30, directory: str | Path | None = None):
        self.max_bytes = int(max_bytes)
        self.directory = Path(directory) if directory else None
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # LRU order, oldest first
        self._trees: dict[str, RadixTree] = {}
        self._bytes = 0
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.stats = {"lookups": 0, "hits": 0, "evictions": 0, "skipped_files": 0}
        if self.directory is not None:
            # private: the entries hold the conversations in clear
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)
            self._load_directory()

    # ---- queries -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def plan(self, model_key: str, prompt: list[int] | np.ndarray) -> ResumePlan:
        """The best resume point for `prompt`: the deepest rung at or before the common prefix,
        over all entries of this model; never the whole prompt (its last logits are needed)."""
        prompt = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            self.stats["lookups"] += 1
            tree = self._trees.get(model_key)
            best, best_rung, best_lcp = None, 0, 0
            for entry_id, lcp in (tree.match(prompt) if tree else {}).items():
                entry = self._entries[entry_id]
                limit = min(lcp, len(prompt) - 1)
                rung = max((p for p in entry.rungs if 0 < p <= limit), default=0)
                best_lcp = max(best_lcp, lcp)
                if rung > best_rung:
                    best, best_rung = entry, rung
            if best is None:
                return ResumePlan(best_lcp, 0)
            self._entries.move_to_end(best.entry_id)
            self.stats["hits"] += 1
            return ResumePlan.from_entry(best, best_lcp, best_rung)

    def entries(self, model_key: str | None = None) -> list[CacheEntry]:
        with self._lock:
            return [e for e in self._entries.values() if model_key in (None, e.model_key)]

    # ---- updates -----------------------------------------------------------------------
    def put(self, entry: CacheEntry) -> str | None:
        """Insert an entry (evicting least recently used ones to fit); returns its id, or None
        when it alone is larger than the store."""
        size = entry.nbytes
        if size > self.max_bytes:
            log.warning(
                "prompt cache: entry of %d bytes exceeds the limit %d; not stored",
                size,
                self.max_bytes,
            )
            return None
        mx.eval(
            [a for layer in entry.kv for a in layer],
            [a for s in entry.rungs.values() for pair in s for a in pair],
            entry.taps if entry.taps is not None else [],
        )
        if not entry.entry_id:
            with self._lock:
                entry.entry_id = f"{int(time.time() * 1000):x}-{os.getpid():x}-{next(self._ids):x}"
        if self.directory is not None:
            self._write(entry)  # durable before it is visible: a crash never loses a listed entry
        with self._lock:
            self._drop_duplicates(entry)
            while self._bytes + size > self.max_bytes and self._entries:
                self._evict(next(iter(self._entries)))
            self._insert(entry)
        return entry.entry_id

    def clear(self, model_key: str | None = None) -> int:
        with self._lock:
            ids = [e.entry_id for e in self.entries(model_key)]
            for entry_id in ids:
                self._evict(entry_id, counted=False)
            return len(ids)

    def _insert(self, entry: CacheEntry) -> None:
        self._entries[entry.entry_id] = entry
        self._trees.setdefault(entry.model_key, RadixTree()).insert(entry.entry_id, entry.tokens)
        self._bytes += entry.nbytes

    def _drop_duplicates(self, entry: CacheEntry) -> None:
        """An older entry with the very same tokens is superseded (its rungs were inherited)."""
        tree = self._trees.get(entry.model_key)
        if tree is None:
            return
        for other_id, lcp in tree.match(entry.tokens).items():
            other = self._entries[other_id]
            if lcp == len(other.tokens) == len(entry.tokens):
                self._evict(other_id, counted=False)

    def _evict(self, entry_id: str, counted: bool = True) -> None:
        entry = self._entries.pop(entry_id)
        self._trees[entry.model_key].remove(entry_id, entry.tokens)
        self._bytes -= entry.nbytes
        if counted:
            self.stats["evictions"] += 1
        if self.directory is not None:
            for suffix in (".msgpack", ".safetensors"):
                (self.directory / f"{entry_id}{suffix}").unlink(missing_ok=True)

    # ---- persistence -------------------------------------------------------------------
    def _write(self, entry: CacheEntry) -> None:
        """safetensors for tensors, msgpack for metadata; each written to a temp name, then
        renamed, the metadata last (an entry without metadata is ignored at load)."""
        layout, arrays = flatten(entry.kv, entry.rungs, entry.taps)
        tensors = dict(zip(layout.names(), arrays, strict=True))
        base = self.directory / entry.entry_id
        tmp = base.with_suffix(".tmp.safetensors")
        mx.save_safetensors(str(tmp), tensors)
        os.chmod(tmp, PRIVATE_FILE)
        digest = _file_digest(tmp)
        os.replace(tmp, base.with_suffix(".safetensors"))
        meta = {
            "format": FORMAT_VERSION,
            "model_key": entry.model_key,
            "kv_mode": entry.kv_mode,
            "tokens": entry.tokens.astype(np.int32).tobytes(),
            "kv_layers": list(layout.kv_layers),
            "rungs": list(layout.rungs),
            "gdn_layers": layout.gdn_layers,
            "has_taps": layout.has_taps,
            "created": entry.created,
            "digest": digest,
        }
        tmp_meta = base.with_suffix(".tmp.msgpack")
        fd = os.open(tmp_meta, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(meta))
        os.replace(tmp_meta, base.with_suffix(".msgpack"))

    def _load_directory(self) -> None:
        loaded = []
        for meta_file in sorted(self.directory.glob("*.msgpack")):
            if ".tmp." in meta_file.name:
                continue
            try:
                loaded.append(self._read(meta_file))
            except Exception as exc:
                self.stats["skipped_files"] += 1
                log.warning("prompt cache: skipping %s: %s", meta_file.name, exc)
        for entry in sorted(loaded, key=lambda e: e.created):
            if self._bytes + entry.nbytes <= self.max_bytes:
                self._insert(entry)
        for kept in self.directory.iterdir():  # files an older version wrote readable by all
            if kept.is_file() and kept.stat().st_mode & 0o077:
                os.chmod(kept, PRIVATE_FILE)
        for stray in self.directory.glob("*.tmp.*"):
            stray.unlink(missing_ok=True)

    def _read(self, meta_file: Path) -> CacheEntry:
        meta = msgpack.unpackb(meta_file.read_bytes())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise ValueError("unknown metadata format")
        tensor_file = meta_file.with_suffix(".safetensors")
        if _file_digest(tensor_file) != meta["digest"]:
            raise ValueError("tensor file does not match its checksum (truncated or corrupt)")
        tensors = mx.load(str(tensor_file))
        tokens = np.frombuffer(meta["tokens"], dtype=np.int32).copy()
        layout = EntryLayout(
            tuple(meta["kv_layers"]),
            tuple(int(p) for p in meta["rungs"]),
            meta["gdn_layers"],
            meta["has_taps"],
        )
        kv, rungs, taps = unflatten(layout, [tensors[name] for name in layout.names()])
        for layer in kv:
            if any(a.shape[-2] != len(tokens) for a in layer if a.ndim == 4):
                raise ValueError("KV length does not match the token count")
        if any(p > len(tokens) for p in rungs):
            raise ValueError("a rung lies beyond the entry's tokens")
        return CacheEntry(
            meta["model_key"],
            meta["kv_mode"],
            tokens,
            kv,
            rungs,
            taps,
            entry_id=meta_file.stem,
            created=float(meta["created"]),
        )


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
