"""Training text: Python's standard library (on every machine, PSF-licensed) or a user's corpus,
turned into one token stream with a held-out split by file.

Part of the stdlib is shaped as chat, rendered with the project's CHAT_TEMPLATE so that multi-turn
chat is in the training distribution:
- function chats: the user gives a function's signature and docstring, the assistant writes the
  function; one to three such turns, and now and then a long conversation of up to twelve;
- review chats, shaped like `sanctum bench multiturn`'s conversations: a reviewer's system prompt,
  then turn after turn the user shows a slice of a file ("Review this code: ...") and the assistant
  answers with the code that follows it. Eight turns make ~3-5K tokens, so the long windows the
  target and drafter train on (4,096 tokens) hold whole conversations.
Windows are cut anywhere in the stream, so a long window also joins files.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..tokenizer import CHAT_TEMPLATE, EOT, python_stdlib_files

HOLDOUT_PERCENT = 5  # files whose path hashes below this are never trained on
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
_SYSTEM = "You are a careful Python programmer. Answer with code."
_ASKS = ("", "Write this function.\n\n", "Implement:\n\n", "Complete the body:\n\n")
REVIEW_SYSTEM = "You are a careful Python reviewer."  # bench multiturn's conversation
REVIEW_CHARS = 900  # the size of bench multiturn's code slices


def review_request(snippet: str) -> str:
    """A user turn of a review chat (bench multiturn asks the same)."""
    return f"Review this code:\n```python\n{snippet}\n```"


def is_holdout(name: str, percent: int = HOLDOUT_PERCENT) -> bool:
    """Stable across machines and Python versions: a hash of the file's relative path."""
    return zlib.crc32(name.encode()) % 100 < percent


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(paths: Iterable[str | Path] | None) -> list[tuple[str, Path]]:
    """(relative name, path) of every text file under `paths`; the stdlib when None."""
    if not paths:
        root = stdlib_root()
        return [(str(p.relative_to(root)), p) for p in python_stdlib_files()]
    out = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            out += [(str(f.relative_to(p)), f) for f in found]
        elif p.is_file():
            out.append((p.name, p))
        else:
            raise FileNotFoundError(f"corpus path {raw}: no such file or directory")
    if not out:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {list(paths)}")
    return out


def render_chat(messages: list[dict]) -> str:
    """The chat template rendered as the tokenizer would (jinja, no generation prompt)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=False)


def function_pairs(source: str, max_lines: int = 60) -> list[tuple[str, str]]:
    """(signature + docstring, whole function) for each documented function in `source`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node) is None or node.end_lineno - node.lineno >= max_lines:
            continue
        doc_end = node.body[0].end_lineno
        stub = textwrap.dedent("\n".join(lines[node.lineno - 1 : doc_end]))
        func = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        pairs.append((stub, func))
    return pairs


def conversations(source: str, rng: random.Random, max_turns: int = 3) -> Iterator[str]:
    """Rendered chats of (stub -> function) turns from one file: up to `max_turns`, one in eight
    up to four times as many (long conversations)."""
    pairs = function_pairs(source)
    rng.shuffle(pairs)
    i = 0
    while i < len(pairs):
        n = rng.randint(1, max_turns * (4 if rng.random() < 0.125 else 1))
        messages = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.5 else []
        for stub, func in pairs[i : i + n]:
            messages.append({"role": "user", "content": rng.choice(_ASKS) + stub})
            messages.append({"role": "assistant", "content": func})
        i += n
        yield render_chat(messages)


def review_chats(source: str, rng: random.Random, max_turns: int = 8) -> Iterator[str]:
    """Rendered review chats of one file: the user shows slice after slice of it, the assistant
    answers each with the code that follows (the next slice, a little longer or shorter)."""
    if len(source) < 4 * REVIEW_CHARS:
        return

    def line_end(i: int) -> int:  # slices end at a line's end
        j = source.find("\n", i)
        return len(source) + 1 if j < 0 else j + 1

    pos = line_end(rng.randrange(0, REVIEW_CHARS))
    while pos + 2 * REVIEW_CHARS < len(source):
        messages = [{"role": "system", "content": REVIEW_SYSTEM}]
        for _ in range(rng.randint(2, max_turns)):
            ask_end = line_end(pos + rng.randint(REVIEW_CHARS // 2, REVIEW_CHARS))
            answer_end = line_end(ask_end + rng.randint(REVIEW_CHARS // 3, REVIEW_CHARS))
            if answer_end > len(source):
                break
            messages.append({"role": "user", "content": review_request(source[pos:ask_end])})
            messages.append({"role": "assistant", "content": source[ask_end:answer_end]})
            pos = answer_end
        if len(messages) > 1:
            yield render_chat(messages)


def _jsonl_documents(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            yield render_chat(row["messages"])
        elif "text" in row:
            yield row["text"]


def documents(files: list[tuple[str, Path]], chat: bool, seed: int = 0) -> Iterator[str]:
    """Each file as a document, plus (for .py files, when `chat`) its function chats."""
    rng = random.Random(seed)
    for _name, path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(text)
            continue
        yield text
        if chat and path.suffix == ".py":
            yield from conversations(text, rng)
            yield from review_chats(text, rng)


@dataclass
class Corpus:
    """Token streams (documents joined by the end-of-text token) and where they came from."""

    train: np.ndarray  # [N] token ids
    holdout: np.ndarray  # [M] token ids
    holdout_files: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = json.dumps({"holdout_files": self.holdout_files, "meta": self.meta})
        with open(path, "wb") as f:
            np.savez_compressed(f, train=self.train, holdout=self.holdout, info=np.array(extra))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Corpus:
        with np.load(path) as z:
            info = json.loads(str(z["info"]))
            return cls(z["train"], z["holdout"], info["holdout_files"], info["meta"])


class TextTokenizer:
    """Fast batch encoding: the `tokenizers` library when tokenizer.json is there, else mlx-lm's."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        if (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(directory / "tokenizer.json"))
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            self.eot_id = self._fast.token_to_id(EOT)
        else:
            from mlx_lm.utils import load_tokenizer

            self._fast = None
            self._slow = load_tokenizer(directory)
            self.vocab_size = len(self._slow.get_vocab())
            self.eot_id = (
                self._slow.convert_tokens_to_ids(EOT) if EOT in self._slow.get_vocab() else None
            )
        if self.eot_id is None:
            eos = self._slow.eos_token_id if self._fast is None else None
            self.eot_id = eos if eos is not None else 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return [self._slow.encode(t, add_special_tokens=False) for t in texts]


def _stream(tok: TextTokenizer, docs: Iterator[str], chunk: int = 256) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    parts, batch = [], []
    for doc in docs:
        batch.append(doc)
        if len(batch) == chunk:
            parts += [np.array(ids + [tok.eot_id], dtype) for ids in tok.encode_batch(batch)]
            batch = []
    if batch:
        parts += [np.array(ids + [tok.eot_id], dtype) for ids in tok.encode_batch(batch)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def build_corpus(
    tokenizer_dir: str | Path,
    paths: Iterable[str | Path] | None = None,
    chat: bool = True,
    seed: int = 0,
    holdout_percent: int = HOLDOUT_PERCENT,
) -> Corpus:
    """Tokenize the stdlib (paths None) or a user's files, holding out whole files."""
    files = corpus_files(paths)
    held = [(n, p) for n, p in files if is_holdout(n, holdout_percent)]
    kept = [(n, p) for n, p in files if not is_holdout(n, holdout_percent)]
    if not kept:  # a one-file corpus: train on it, hold out nothing
        kept, held = files, []
    tok = TextTokenizer(tokenizer_dir)
    train = _stream(tok, documents(kept, chat, seed))
    holdout = _stream(tok, documents(held, chat, seed))
    meta = {"source": "python-stdlib" if not paths else [str(p) for p in paths],
            "files": len(kept), "holdout_files": len(held), "chat": chat,
            "train_tokens": int(train.size), "holdout_tokens": int(holdout.size)}  # fmt: skip
    return Corpus(train, holdout, [n for n, _ in held], meta)


def heldout_tokens(tokenizer_dir: str | Path, paths: Iterable[str | Path] | None = None,
                   chat: bool = True, seed: int = 0) -> np.ndarray:  # fmt: skip
    """The held-out files' token stream alone (what `build_corpus` holds out), without
    tokenizing the training files."""
    held = [(n, p) for n, p in corpus_files(paths) if is_holdout(n)]
    return _stream(TextTokenizer(tokenizer_dir), documents(held, chat, seed))


def training_texts(paths: Iterable[str | Path] | None = None, chat: bool = True) -> Iterator[str]:
    """The texts a tokenizer is trained on: the training files only (never the held-out ones)."""
    files = [(n, p) for n, p in corpus_files(paths) if not is_holdout(n)] or corpus_files(paths)
    return documents(files, chat)


def sample_windows(
    tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator
) -> np.ndarray:
    """[batch, length] random windows of the stream (int32); none for batch 0 (a batch all
    regenerated rows, `--regen-frac 1`)."""
    if batch == 0:
        return np.zeros((0, length), np.int32)
    if tokens.size < length + 1:
        reps = (length + 1) // max(1, tokens.size) + 1
        tokens = np.tile(tokens, reps)
    starts = rng.integers(0, tokens.size - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def heldout_prompts(count: int = 16, seed: int = 0, paths=None) -> list[str]:
    """Prompts from held-out files (never trained on): half raw code (a function's signature and
    docstring, to be continued), half chat (the same stub asked for as a user turn)."""
    rng = random.Random(seed)
    pairs = []
    for name, path in corpus_files(paths):
        if is_holdout(name) and path.suffix == ".py":
            found = function_pairs(path.read_text(encoding="utf-8", errors="replace"))
            rng.shuffle(found)
            pairs += found[:2]  # at most two per file, for variety
    rng.shuffle(pairs)
    prompts = []
    for i, (stub, _) in enumerate(pairs[:count]):
        if i % 2:
            chat = render_chat([{"role": "user", "content": stub}])
            prompts.append(chat + "<|im_start|>assistant\n")
        else:
            prompts.append(stub + "\n")
    return prompts
