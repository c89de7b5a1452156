"""What a client asks for and what it gets back, independent of transport (gRPC, Ray, inline).

`validate` is the one place where bad input is recognised; it raises `InvalidRequest` naming the
field, before any model or cache is touched.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .engine.sampling import SamplingParams
from .tokenizer import CHAT_ROLES


class InvalidRequest(ValueError):
    """Bad input; `field` names the offending request field (gRPC INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of prompt / prompt_ids / messages. None means "unset": defaults apply."""

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


@dataclass(frozen=True)
class Limits:
    """Request limits of the serving model."""

    vocab_size: int
    max_context: int
    max_tokens: int = 4096


def validate(req: GenerateRequest, limits: Limits) -> None:
    """Raise InvalidRequest naming the first bad field; no side effects."""
    given = [n for n in ("prompt", "prompt_ids", "messages") if getattr(req, n) is not None]
    if len(given) != 1:
        raise InvalidRequest("prompt", "give exactly one of prompt, prompt_ids or messages")
    if req.prompt is not None and not req.prompt:
        raise InvalidRequest("prompt", "prompt is empty")
    if req.prompt_ids is not None:
        if len(req.prompt_ids) == 0:
            raise InvalidRequest("prompt_ids", "prompt_ids is empty")
        for i, t in enumerate(req.prompt_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
                raise InvalidRequest(
                    "prompt_ids",
                    f"prompt_ids[{i}]={t!r} is not a token id in [0, {limits.vocab_size})",
                )
        if len(req.prompt_ids) >= limits.max_context:
            raise InvalidRequest(
                "prompt_ids",
                f"prompt of {len(req.prompt_ids)} tokens exceeds the context limit {limits.max_context}",
            )
    if req.messages is not None:
        if len(req.messages) == 0:
            raise InvalidRequest("messages", "at least one message is required")
        for i, m in enumerate(req.messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role",
                    f"unknown role {m.get('role')!r}; use one of {', '.join(CHAT_ROLES)}",
                )
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content", "content must be a string")
    if not isinstance(req.max_tokens, int) or req.max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be > 0, got {req.max_tokens}")
    if req.max_tokens > limits.max_tokens:
        raise InvalidRequest(
            "max_tokens", f"{req.max_tokens} exceeds the limit {limits.max_tokens}"
        )
    if req.temperature is not None and not req.temperature >= 0:
        raise InvalidRequest("temperature", f"must be >= 0, got {req.temperature}")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {req.top_p}")
    if req.top_k is not None and req.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0, got {req.top_k}")
    if req.kv_mode not in (None, "", "fp16", "q8"):
        raise InvalidRequest("kv_mode", f"must be fp16 or q8, got {req.kv_mode!r}")
    if any(not isinstance(s, str) for s in req.stop):
        raise InvalidRequest("stop", "stop sequences must be strings")


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
