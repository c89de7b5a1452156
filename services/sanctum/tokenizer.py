"""Tokenizers the project makes (byte-level BPE with Qwen-style chat tokens) and the text side of
a request: chat rendering, incremental detokenization and stop sequences.

The engine works on token ids only; this module is where text comes in and goes out.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK, END_THINK, MASK = "<think>", "</think>", "<|mask|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END, THINK, END_THINK, MASK)
CHAT_ROLES = ("system", "user", "assistant")

# Qwen-style: earlier assistant turns lose their <think> block, so turn N+1's prompt diverges
# from turn N's cache right after "<|im_start|>assistant\n" (docs/design/prompt-cache.md).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def python_stdlib_files(limit_bytes: int | None = None) -> list[Path]:
    """The standard library's own .py sources (on every machine with Python), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    if limit_bytes is None:
        return files
    out, total = [], 0
    for p in files:
        if total >= limit_bytes:
            break
        out.append(p)
        total += p.stat().st_size
    return out


def build_tokenizer(texts, vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE on `texts` (an iterable of strings) and write it in the Hugging
    Face layout (tokenizer.json + tokenizer_config.json with the chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    return out


def tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": t,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }


class ChatError(ValueError):
    """A chat request that cannot be rendered; the message names the field."""


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Render chat messages with the model's own template."""
    if not messages:
        raise ChatError("messages: at least one message is required")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise ChatError(
                f"messages[{i}].role: unknown role {m.get('role')!r} (use {CHAT_ROLES})"
            )
        if not isinstance(m.get("content"), str):
            raise ChatError(f"messages[{i}].content: must be a string")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def message_starts(
    tokenizer, messages: list[dict], prompt_ids: list[int], add_generation_prompt: bool = True
) -> list[int]:
    """Token positions in `prompt_ids` (the rendered, encoded chat) where each message after the
    first, the generation prompt, and the end start: natural ladder rungs, since later turns
    share exactly these prefixes. That is where `len(encode(render(messages[:i])))` lands for
    every i, found in one pass: a Qwen-style template opens each message with IM_START, a special
    token the encoder never merges across. A template without it gets the starts of the last
    few messages only, each rendered and encoded (so the cost stays linear in the chat)."""
    marker = _token_id(tokenizer, IM_START)
    opens = [i for i, t in enumerate(prompt_ids) if t == marker] if marker is not None else []
    if len(opens) == len(messages) + (1 if add_generation_prompt else 0):
        return [*opens[1:], len(prompt_ids)]
    starts = []
    for i in range(max(1, len(messages) - FALLBACK_STARTS + 1), len(messages) + 1):
        text = render_chat(tokenizer, messages[:i], add_generation_prompt=False)
        starts.append(len(tokenizer.encode(text, add_special_tokens=False)))
    if add_generation_prompt:
        starts.append(len(prompt_ids))
    return starts


FALLBACK_STARTS = 4  # message starts computed by rendering, for templates without IM_START


def _token_id(tokenizer, token: str) -> int | None:
    """The id of a special token, or None when the vocabulary lacks it."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class Reencoder:
    """Where a growing token sequence first stops being the tokenizer's own encoding of its text,
    re-encoding each call only the text after the last settled boundary: O(new text) a round
    instead of O(sequence) (`sanctum bench reencode`).

    A fast tokenizer splits text into pieces (a regex) and encodes each piece on its own, so a
    piece boundary that enough text follows no longer moves, and the text before it need not be
    encoded again. A tokenizer without a fast backend re-encodes everything each call. Past
    MAX_WINDOW unsettled tokens it gives up (`exhausted`) rather than slow every round."""

    SETTLE_TOKENS = 8  # a piece boundary this many matching tokens before the end stays put
    MAX_WINDOW = 512  # bounds one re-encode's cost; Qwen3.5's tokenizer stays far below it

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if getattr(backend, "pre_tokenizer", None) else None
        self.settled = 0  # ids[:settled] are the encoder's own tokens for their text, for good
        self.exhausted = False

    def first_difference(self, ids: list[int], final: bool) -> int | None:
        """The index of the first token in `ids` that the encoder would not produce, among those
        that later tokens can no longer change (all of them once `final`), or None."""
        tail = ids[self.settled :]
        if self.exhausted or len(tail) > self.MAX_WINDOW:
            self.exhausted = True
            return None
        text = self.tokenizer.decode(tail)
        for _ in range(0 if final else 3):  # a character's first bytes decode as U+FFFD,
            if not (tail and text.endswith("\ufffd")):  # which re-encodes differently: wait
                break
            tail = tail[:-1]
            text = self.tokenizer.decode(tail)
        if self._backend is None:
            canonical, offsets = self.tokenizer.encode(text, add_special_tokens=False), None
        else:
            enc = self._backend.encode(text, add_special_tokens=False)
            canonical, offsets = enc.ids, enc.offsets
        # the last tokens may still merge differently as text follows, unless nothing will
        stable = min(len(tail), len(canonical)) - (0 if final else 2)
        first = next((j for j in range(stable) if tail[j] != canonical[j]), None)
        if first is not None:
            return self.settled + first
        if offsets is not None and stable > self.SETTLE_TOKENS:
            self._settle(text, canonical, offsets, stable - self.SETTLE_TOKENS)
        return None

    def _settle(self, text: str, canonical: list[int], offsets: list, limit: int) -> None:
        """Move `settled` to the last piece boundary before token `limit` of the window where
        encoding the rest alone gives the same tokens (special tokens and normalizers split text
        their own way: the check keeps them honest)."""
        starts = {a for _, (a, _) in self._backend.pre_tokenizer.pre_tokenize_str(text)}
        for k in range(limit, 0, -1):
            at = offsets[k][0]
            if at in starts and offsets[k - 1][1] <= at:
                rest = self._backend.encode(text[at:], add_special_tokens=False).ids
                # and the tokens from k decode to that text alone (a decoder may drop a space)
                if rest == canonical[k:] and self.tokenizer.decode(canonical[k:]) == text[at:]:
                    self.settled += k
                return


class TextStream:
    """Incremental detokenization with stop sequences, for one completion.

    `push(new_tokens)` returns how many of them to keep and whether a stop sequence ended the
    completion (the engine's StopCheck), and accumulates the text delta to emit.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.tokens: list[int] = []
        self.text = ""  # text emitted so far
        self._base, self._base_text = 0, ""  # tokens[:_base] decode to _base_text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def check(self, _completion: list[int], new: list[int]) -> tuple[int, bool]:
        """StopCheck for the engine: keep up to the token that completes a stop sequence."""
        if not self.stop:
            return len(new), False
        tail = self.tokens[-32:]  # a stop sequence spans few tokens; decode only the tail
        before = self._decode(tail)
        for n in range(1, len(new) + 1):
            text = self._decode(tail + new[:n])
            if any(s in text and s not in before for s in self.stop):
                return n, True
        return len(new), False

    def _full_text(self) -> str:
        """Decoded text of all tokens, decoding only what came since the last clean boundary
        (byte-level BPE decodes piecewise at UTF-8 boundaries), so a round costs O(new)."""
        tail = self._decode(self.tokens[self._base :])
        if not tail.endswith("\ufffd"):
            self._base_text += tail
            self._base = len(self.tokens)
            return self._base_text
        return self._base_text + tail

    def push(self, new: list[int]) -> str:
        """Add committed tokens; returns the text delta safe to emit now."""
        self.tokens.extend(new)
        full = self._full_text()
        for s in self.stop:
            if (i := full.find(s)) >= 0:
                full = full[:i]
        full = full.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for the next token
        hold = max((_partial_match(full, s) for s in self.stop), default=0)
        ready = full[: len(full) - hold]
        delta = ready[len(self.text) :] if ready.startswith(self.text) else ""
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text once the completion is over (held-back chars are released)."""
        full = self._full_text()
        for s in self.stop:
            if (i := full.find(s)) >= 0:
                full = full[:i]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


def _partial_match(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with (held back: the next
    token may complete it). Scans only the text's last len(stop)-1 characters, by str.find."""
    tail = text[len(text) - min(len(stop) - 1, len(text)) :]
    i = tail.find(stop[0]) if tail else -1
    while i >= 0:
        if stop.startswith(tail[i:]):
            return len(tail) - i
        i = tail.find(stop[0], i + 1)
    return 0
