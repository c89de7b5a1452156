"""What a client asks for and what it gets back, independent of transport (gRPC, Ray, inline).

`validate` is the one place where bad input is recognised; it raises `InvalidRequest` naming the
field, before any model or cache is touched. It looks only at the request as it came off the wire
(sizes, counts, ranges), so it is cheap whatever the request's size: a prompt too long to fit the
context is refused before it is tokenized, by its characters (`Limits.max_prompt_chars`).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from ..engine.decode.sampling import SamplingParams
from ..tokenizer import CHAT_ROLES
from .errors import InvalidRequest


@dataclass(frozen=True)
class GenerateRequest:
    """What a client asks for, made once from the wire (wire/convert.py, api/openai.py) and
    referenced, never copied, by the scheduler's Ticket and the verifier's Prepared. Exactly one
    of prompt / prompt_ids / messages. None means "unset": defaults apply."""

    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int = 64
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    kv_mode: str | None = None
    use_cache: bool = True
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=0.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else int(self.top_k),
            seed=self.seed,
        )


@dataclass
class Usage:
    """Per-request accounting, with the seed's cache fields."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prefix_cached: tokens restored from the prompt cache
    cache_hit_ratio: float = 0.0  # cached_tokens / prompt_tokens
    requested_lcp: int = 0
    resumed_at: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    tau: float = 0.0  # mean acceptance length over speculative rounds
    lookup_rounds: int = 0  # of those, rounds whose drafts were read from the sequence itself
    kv: str = "fp16"
    mode: str = "sync"  # "sync" | "streaming"
    ttft_s: float = 0.0
    elapsed_s: float = 0.0


@dataclass
class Chunk:
    """A piece of the completion as it is committed."""

    text: str
    token_ids: list[int]
    drafted: int = 0  # drafts proposed in the round(s) that produced this chunk
    accepted: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None  # on the last chunk


# Stop sequences are checked against every round's tokens on the model's thread: a bounded set.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """Request limits of the serving model."""

    vocab_size: int
    max_context: int
    max_tokens: int = 4096
    # characters of the longest token: a text longer than max_context * this cannot fit
    max_token_chars: int = 64

    @property
    def max_prompt_chars(self) -> int:
        return self.max_context * self.max_token_chars


def longest_token_chars(tokenizer) -> int:
    """Characters in the tokenizer's longest vocabulary entry (byte-level BPE: its bytes), an
    upper bound on the text one token covers."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):  # no vocabulary to look at: a generous bound
        return 64


def validate(req: GenerateRequest, limits: Limits) -> None:
    """Raise InvalidRequest naming the first bad field; no side effects."""
    given = [n for n in ("prompt", "prompt_ids", "messages") if getattr(req, n) is not None]
    if len(given) != 1:
        raise InvalidRequest("prompt", "give exactly one of prompt, prompt_ids or messages")
    if req.prompt is not None:
        if not req.prompt:
            raise InvalidRequest("prompt", "prompt is empty")
        if len(req.prompt) > limits.max_prompt_chars:
            raise InvalidRequest("prompt", _too_long(len(req.prompt), limits))
    if req.prompt_ids is not None:
        if len(req.prompt_ids) == 0:
            raise InvalidRequest("prompt_ids", "prompt_ids is empty")
        if len(req.prompt_ids) >= limits.max_context:
            raise InvalidRequest(
                "prompt_ids",
                f"prompt of {len(req.prompt_ids)} tokens exceeds the context limit {limits.max_context}",
            )
        for i, t in enumerate(req.prompt_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
                raise InvalidRequest(
                    "prompt_ids",
                    f"prompt_ids[{i}]={t!r} is not a token id in [0, {limits.vocab_size})",
                )
    if req.messages is not None:
        if len(req.messages) == 0:
            raise InvalidRequest("messages", "at least one message is required")
        if len(req.messages) >= limits.max_context:  # every message renders to some tokens
            raise InvalidRequest(
                "messages",
                f"{len(req.messages)} messages cannot fit the context limit {limits.max_context}",
            )
        for i, m in enumerate(req.messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role",
                    f"unknown role {m.get('role')!r}; use one of {', '.join(CHAT_ROLES)}",
                )
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content", "content must be a string")
        chars = sum(len(m["content"]) for m in req.messages)
        if chars > limits.max_prompt_chars:
            raise InvalidRequest("messages", _too_long(chars, limits))
    if not isinstance(req.max_tokens, int) or req.max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be > 0, got {req.max_tokens}")
    if req.max_tokens > limits.max_tokens:
        raise InvalidRequest(
            "max_tokens", f"{req.max_tokens} exceeds the limit {limits.max_tokens}"
        )
    if req.temperature is not None and not (
        math.isfinite(req.temperature) and req.temperature >= 0
    ):
        raise InvalidRequest("temperature", f"must be a finite number >= 0, got {req.temperature}")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {req.top_p}")
    if req.top_k is not None and not 0 <= req.top_k < 2**31:
        raise InvalidRequest("top_k", f"must be in [0, 2^31), got {req.top_k}")
    if req.seed is not None and not 0 <= req.seed < 2**64:  # JSON's integers are unbounded
        raise InvalidRequest("seed", f"must be in [0, 2^64), got {req.seed}")
    if req.kv_mode not in (None, "", *kv_modes()):
        raise InvalidRequest("kv_mode", f"must be fp16 or q8, got {req.kv_mode!r}")
    if len(req.stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            "stop", f"{len(req.stop)} stop sequences; at most {MAX_STOP_SEQUENCES} are allowed"
        )
    for i, s in enumerate(req.stop):
        if not isinstance(s, str):
            raise InvalidRequest(f"stop[{i}]", "stop sequences must be strings")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop[{i}]", f"{len(s)} characters; at most {MAX_STOP_CHARS} are allowed"
            )


def kv_modes() -> tuple[str, ...]:
    """The engine's KV formats (engine/model/target.py; imported here only when validating, so that
    a client importing the request types does not load mlx-lm)."""
    from ..engine.model.target import KV_MODES

    return KV_MODES


def _too_long(chars: int, limits: Limits) -> str:
    return (
        f"{chars} characters cannot fit the context limit of {limits.max_context} tokens "
        f"(at most {limits.max_prompt_chars} characters: {limits.max_token_chars} a token)"
    )


def check_prompt_length(num_prompt_tokens: int, req: GenerateRequest, limits: Limits) -> None:
    """After tokenization: the prompt and the completion must fit the context."""
    field_name = (
        "prompt_ids" if req.prompt_ids is not None else ("messages" if req.messages else "prompt")
    )
    if num_prompt_tokens == 0:
        raise InvalidRequest(field_name, "prompt encodes to no tokens")
    if num_prompt_tokens + req.max_tokens > limits.max_context:
        raise InvalidRequest(
            field_name,
            f"prompt of {num_prompt_tokens} tokens + max_tokens {req.max_tokens} exceeds the "
            f"context limit {limits.max_context}",
        )
