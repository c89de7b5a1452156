"""The prompt cache: saved target caches keyed by token ids, per model and KV format.

An entry is a token sequence that references shared storage (cache/pages.py): the pages of its
attention KV and drafter taps, and its ladder rungs (the recurrent state at chosen positions),
each stored once however many entries hold the same prefix. Lookup finds the entry with the
longest common prefix through a radix tree and plans a resume from its deepest rung at or
before that prefix.

A conversation's next turn extends the entry it resumed from: once saved, that older entry is
superseded (everything of it a later turn can reach is in the new one) and goes, and the new
entry adopts the old one's rungs that it lacks, as far as the ladder's byte budget allows
(`ladder_bytes`: by default two rungs beyond the entry's own), spread so that an edit of an
earlier turn finds a rung close before it. Eviction is LRU over entries and frees only the pages
and rungs that no remaining entry references.

With a directory, each entry writes one safetensors file holding the pages and rungs it was the
first to store, and then its msgpack metadata naming every page and rung it references and the
files (with their checksums) that hold them; the metadata comes last, so an entry is durable
before it is visible. A file goes when none of its pages and rungs is referenced any more, so a
restart reloads the sharing as it was. Damaged files are skipped with a warning.

Arrays are MLX arrays in this process; the store never runs a model.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import files
from .pages import Page, Record, Rung, cut_page, join_pages, page_bounds, page_keys, rung_key
from .radix import RadixTree, common_prefix

log = logging.getLogger("sanctum.cache")
EXTRA_RUNGS = 2  # default ladder budget: the entry's own rungs and this many of its ancestors'


@dataclass
class CacheEntry:
    """A saved prompt cache, whole. Shapes: KV per attention layer [1, kv_heads, T, head_dim]
    (fp16 mode: (keys, values); q8 mode: mlx-lm's quantized triples, flattened to six arrays);
    rung states per GDN layer (conv [1, K-1, conv_dim], state [1, Hv, Dv, Dk]); taps
    [T, n_taps * H]."""

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
    prompt_len: int = 0  # tokens of the request's prompt (0: unknown, taken as all of them)

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for layer in self.kv for a in layer)
        n += sum(a.nbytes for states in self.rungs.values() for pair in states for a in pair)
        return n + (self.taps.nbytes if self.taps is not None else 0) + self.tokens.nbytes


def _owned(states: list[tuple[mx.array, mx.array]]) -> list[tuple[mx.array, mx.array]]:
    """Copies of a rung's GDN states (exact: a gather) that hold only their own rows. The
    engine's may be views of larger buffers (a conv state of its pass's input rows; on CUDA a
    recurrent state of a verify's rows of states, gdn.ROLLBACK_VIEWS), which a stored view
    would keep alive as long as the entry."""
    return [tuple(mx.take(a, mx.arange(a.shape[0]), axis=0) for a in pair) for pair in states]


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


class PromptStore:
    """Entries over shared pages and rungs (LRU by bytes), optionally persisted in `directory`."""

    def __init__(
        self,
        max_bytes: int = 2 << 30,
        directory: str | Path | None = None,
        ladder_bytes: int = 0,
    ):
        self.max_bytes = int(max_bytes)
        self.ladder_bytes = int(ladder_bytes)  # rung bytes per conversation; 0: EXTRA_RUNGS
        self.directory = Path(directory) if directory else None
        self._records: OrderedDict[str, Record] = OrderedDict()  # LRU order, oldest first
        self._pages: dict[str, Page] = {}
        self._rungs: dict[str, Rung] = {}
        self._trees: dict[str, RadixTree] = {}
        self._bytes = 0
        self._file_refs: dict[str, int] = {}  # file id -> live pages and rungs it holds
        self._digests: dict[str, str] = {}  # file id -> checksum
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.stats = {"lookups": 0, "hits": 0, "evictions": 0, "skipped_files": 0, "superseded": 0}
        if self.directory is not None:
            files.make_private_dir(self.directory)
            self._load_directory()

    # ---- queries -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._records)

    def plan(self, model_key: str, prompt: list[int] | np.ndarray) -> ResumePlan:
        """The best resume point for `prompt`: the deepest rung at or before the common prefix,
        over all entries of this model; never the whole prompt (its last logits are needed)."""
        prompt = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            self.stats["lookups"] += 1
            tree = self._trees.get(model_key)
            best, best_rung, best_lcp = None, 0, 0
            for entry_id, lcp in (tree.match(prompt) if tree else {}).items():
                rec = self._records[entry_id]
                limit = min(lcp, len(prompt) - 1)
                rung = max((p for p in rec.rungs if 0 < p <= limit), default=0)
                best_lcp = max(best_lcp, lcp)
                if rung > best_rung:
                    best, best_rung = rec, rung
            if best is None:
                return ResumePlan(best_lcp, 0)
            self._records.move_to_end(best.entry_id)
            self.stats["hits"] += 1
            n = best_rung
            kv, taps = self._join(best, n)
            rungs = {p: self._rungs[k].states for p, k in best.rungs.items() if p <= n}
            return ResumePlan(best_lcp, n, best.entry_id, kv, rungs, taps)

    def entries(self, model_key: str | None = None) -> list[CacheEntry]:
        """The entries, each assembled whole (its own copy of the shared KV and taps)."""
        with self._lock:
            return [
                self._entry(r) for r in self._records.values() if model_key in (None, r.model_key)
            ]

    def listing(self, model_key: str | None = None) -> list[dict]:
        """Per entry: its figures and bytes by kind, alone and shared with other entries."""
        with self._lock:
            out = []
            for r in self._records.values():
                if model_key not in (None, r.model_key):
                    continue
                pages = [self._pages[k] for k in r.pages]
                rungs = [self._rungs[k] for k in r.rungs.values()]
                kv, taps = sum(p.kv_bytes for p in pages), sum(p.taps_bytes for p in pages)
                rung_bytes = sum(g.nbytes for g in rungs)
                shared = sum(b.nbytes for b in [*pages, *rungs] if b.refs > 1)
                out.append(
                    dict(
                        entry_id=r.entry_id,
                        model_key=r.model_key,
                        kv_mode=r.kv_mode,
                        num_tokens=len(r.tokens),
                        prompt_len=r.prompt_len,
                        rungs=sorted(r.rungs),
                        nbytes=kv + taps + rung_bytes + r.tokens.nbytes,
                        kv_bytes=kv,
                        taps_bytes=taps,
                        rung_bytes=rung_bytes,
                        shared_bytes=shared,
                        created=r.created,
                    )
                )
            return out

    def accounting(self) -> dict:
        """The bytes held, by kind; `shared_bytes`: of pages and rungs more than one entry
        references; `logical_bytes`: what the entries would take each stored alone."""
        with self._lock:
            kv = sum(p.kv_bytes for p in self._pages.values())
            taps = sum(p.taps_bytes for p in self._pages.values())
            rungs = sum(g.nbytes for g in self._rungs.values())
            blobs = [*self._pages.values(), *self._rungs.values()]
            tokens = sum(r.tokens.nbytes for r in self._records.values())
            return dict(
                kv_bytes=kv,
                taps_bytes=taps,
                rung_bytes=rungs,
                token_bytes=tokens,
                shared_bytes=sum(b.nbytes for b in blobs if b.refs > 1),
                logical_bytes=tokens + sum(b.nbytes * b.refs for b in blobs),
            )

    # ---- updates -----------------------------------------------------------------------
    def put(self, entry: CacheEntry) -> str | None:
        """Insert an entry (superseding the older turn it extends, evicting least recently used
        entries to fit); returns its id, or None when it alone is larger than the store."""
        size = entry.nbytes
        if size > self.max_bytes:
            log.warning(
                "prompt cache: entry of %d bytes exceeds the limit %d; not stored",
                size,
                self.max_bytes,
            )
            return None
        rungs = {p: _owned(states) for p, states in entry.rungs.items()}
        mx.eval(
            [a for layer in entry.kv for a in layer],
            [a for s in rungs.values() for pair in s for a in pair],
            entry.taps if entry.taps is not None else [],
        )
        tokens = np.asarray(entry.tokens, dtype=np.int32)
        taps = entry.taps if entry.taps is not None and entry.taps.shape[0] == len(tokens) else None
        with self._lock:
            if not entry.entry_id:
                entry.entry_id = f"{int(time.time() * 1000):x}-{os.getpid():x}-{next(self._ids):x}"
            elif entry.entry_id in self._records:  # stored again: the new one replaces it
                self._remove(entry.entry_id, counted=False)
            rec = Record(
                entry.entry_id,
                entry.model_key,
                entry.kv_mode,
                tokens,
                entry.prompt_len or len(tokens),
                entry.created,
                taps is not None,
                page_keys(entry.model_key, taps is not None, tokens),
                {p: rung_key(entry.model_key, tokens, p) for p in entry.rungs},
            )
            new_pages: dict[str, Page] = {}
            for (start, end), key in zip(page_bounds(len(tokens)), rec.pages, strict=True):
                if key not in self._pages and key not in new_pages:
                    new_pages[key] = cut_page(entry.kv, taps, start, end)
            new_rungs = {k: Rung(p, rungs[p]) for p, k in rec.rungs.items() if k not in self._rungs}
            superseded = self._superseded(rec)
            self._adopt(rec, superseded, new_rungs)
            if self.directory is not None:  # durable before it is visible
                self._write(rec, new_pages, new_rungs)
            self._pages.update(new_pages)
            self._rungs.update(new_rungs)
            self._insert(rec)
            for old in superseded:
                self.stats["superseded"] += 1
                self._remove(old, counted=False)
            while self._bytes > self.max_bytes and len(self._records) > 1:
                oldest = next(iter(self._records))
                self._remove(oldest if oldest != rec.entry_id else list(self._records)[1])
        return entry.entry_id

    def clear(self, model_key: str | None = None) -> int:
        with self._lock:
            ids = [r.entry_id for r in self._records.values() if model_key in (None, r.model_key)]
            for entry_id in ids:
                self._remove(entry_id, counted=False)
            return len(ids)

    # ---- internals ---------------------------------------------------------------------
    def _join(self, rec: Record, n: int):
        count = len(page_bounds(n))
        kv, taps = join_pages([self._pages[k] for k in rec.pages[:count]], n)
        return kv, taps if rec.has_taps else None

    def _entry(self, rec: Record) -> CacheEntry:
        kv, taps = self._join(rec, len(rec.tokens))
        rungs = {p: self._rungs[k].states for p, k in rec.rungs.items()}
        return CacheEntry(
            rec.model_key,
            rec.kv_mode,
            rec.tokens,
            kv,
            rungs,
            taps,
            rec.entry_id,
            rec.created,
            rec.prompt_len,
        )

    def _superseded(self, rec: Record) -> list[str]:
        """Older entries the new one continues: it shares all of their prompt and its own
        prompt goes past the shared part (the next turn of their conversation), or it holds
        all of their tokens. What they add beyond the shared part a later turn cannot reach."""
        tree = self._trees.get(rec.model_key)
        out = []
        for other_id, lcp in (tree.match(rec.tokens) if tree else {}).items():
            other = self._records[other_id]
            if lcp >= other.prompt_len and (lcp == len(other.tokens) or rec.prompt_len > lcp):
                out.append(other_id)
        return out

    def _adopt(self, rec: Record, superseded: list[str], new_rungs: dict[str, Rung]) -> None:
        """Add to `rec` the superseded entries' rungs within the shared prefix that it lacks,
        greedily by how much recomputation each saves an edit at a uniformly random position,
        while the rung bytes stay within the ladder budget."""
        pool = {**self._rungs, **new_rungs}
        own = sum(pool[k].nbytes for k in rec.rungs.values())
        candidates: dict[int, str] = {}
        for other_id in superseded:
            other = self._records[other_id]
            lcp = common_prefix(other.tokens, rec.tokens)
            for p, k in other.rungs.items():
                if p <= lcp and p not in rec.rungs:
                    candidates[p] = k
        if not candidates:
            return
        one = max(pool[k].nbytes for k in candidates.values())
        budget = self.ladder_bytes or own + EXTRA_RUNGS * one
        while candidates and own + one <= budget:
            kept = sorted([0, *rec.rungs, len(rec.tokens)])
            p = max(candidates, key=lambda c, kept=kept: _saving(kept, c))
            rec.rungs[p] = candidates.pop(p)
            own += pool[rec.rungs[p]].nbytes

    def _insert(self, rec: Record) -> None:
        self._records[rec.entry_id] = rec
        self._trees.setdefault(rec.model_key, RadixTree()).insert(rec.entry_id, rec.tokens)
        self._bytes += rec.tokens.nbytes
        for blobs, keys in ((self._pages, rec.pages), (self._rungs, rec.rungs.values())):
            for k in set(keys):
                blob = blobs[k]
                if blob.refs == 0:
                    self._bytes += blob.nbytes
                    if blob.file:
                        self._file_refs[blob.file] = self._file_refs.get(blob.file, 0) + 1
                blob.refs += 1

    def _remove(self, entry_id: str, counted: bool = True) -> None:
        rec = self._records.pop(entry_id)
        self._trees[rec.model_key].remove(entry_id, rec.tokens)
        self._bytes -= rec.tokens.nbytes
        if counted:
            self.stats["evictions"] += 1
        if self.directory is not None:
            (self.directory / f"{entry_id}.msgpack").unlink(missing_ok=True)
        for blobs, keys in ((self._pages, rec.pages), (self._rungs, rec.rungs.values())):
            for k in set(keys):
                blob = blobs[k]
                blob.refs -= 1
                if blob.refs == 0:  # no entry needs it any more
                    del blobs[k]
                    self._bytes -= blob.nbytes
                    if blob.file:
                        self._release_file(blob.file)

    def _release_file(self, file_id: str) -> None:
        self._file_refs[file_id] -= 1
        if self._file_refs[file_id] == 0:
            del self._file_refs[file_id]
            self._digests.pop(file_id, None)
            if self.directory is not None:
                (self.directory / f"{file_id}.safetensors").unlink(missing_ok=True)

    # ---- persistence -------------------------------------------------------------------
    def _write(self, rec: Record, new_pages: dict[str, Page], new_rungs: dict[str, Rung]) -> None:
        if new_pages or new_rungs:
            digest = files.write_blobs(self.directory, rec.entry_id, new_pages, new_rungs)
            self._digests[rec.entry_id] = digest
            for blob in [*new_pages.values(), *new_rungs.values()]:
                blob.file = rec.entry_id
        pool_pages, pool_rungs = {**self._pages, **new_pages}, {**self._rungs, **new_rungs}
        page_files = [pool_pages[k].file for k in rec.pages]
        rung_files = {p: pool_rungs[k].file for p, k in rec.rungs.items()}
        some_page = pool_pages[rec.pages[0]] if rec.pages else None
        some_rung = next(iter(pool_rungs[k] for k in rec.rungs.values()), None)
        files.write_meta(
            self.directory,
            rec,
            page_files,
            rung_files,
            {f: self._digests[f] for f in {*page_files, *rung_files.values()}},
            [len(layer) for layer in some_page.kv] if some_page else [],
            len(some_rung.states) if some_rung else 0,
        )

    def _load_directory(self) -> None:
        metas = files.read_metas(self.directory, self.stats, log)
        tensors = files.TensorFiles(self.directory)
        for meta in sorted(metas, key=lambda m: m["created"]):
            try:
                rec, pages, rungs = files.record_from_meta(meta, tensors, self._pages, self._rungs)
            except Exception as exc:
                self.stats["skipped_files"] += 1
                log.warning("prompt cache: skipping %s: %s", meta["entry_id"], exc)
                continue
            extra = sum(b.nbytes for b in [*pages.values(), *rungs.values()])
            if self._bytes + extra + rec.tokens.nbytes > self.max_bytes:
                continue
            self._pages.update(pages)
            self._rungs.update(rungs)
            for f in {*meta["page_files"], *meta["rung_files"]}:
                self._digests[f] = meta["digests"][f]
            self._insert(rec)
        files.tidy(self.directory, keep=set(self._file_refs))


def _saving(kept: list[int], p: int) -> int:
    """Tokens of recomputation a rung at `p` saves, summed over edits at every position of the
    gap of `kept` (rung positions, with 0 and the end) it falls in."""
    lo = max(q for q in kept if q <= p)
    hi = min((q for q in kept if q > p), default=p)
    return (p - lo) * (hi - p)
