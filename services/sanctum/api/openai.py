"""OpenAI's chat and completions requests -> the serving core's `GenerateRequest`, and its chunks
and usage -> OpenAI's response objects (plain dicts, JSON-ready). No HTTP here (api/http.py).

Only what is OpenAI's own is checked here: the body's shape and JSON types, `n` (1 only), the
fields sanctum does not serve; each refusal is an `InvalidRequest` naming the field. Everything
else (sizes, counts, ranges, roles) is the serving core's one validation
(serving/requests.py `validate`), as for gRPC.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..serving.errors import InvalidRequest
from ..serving.requests import GenerateRequest, Usage

CHAT, TEXT = "chat", "text"


@dataclass(frozen=True)
class Call:
    """What the front end needs beyond the request: how to answer, under which names."""

    kind: str  # CHAT | TEXT
    model: str
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    max_tokens_field: str = "max_tokens"  # the name the client used (max_completion_tokens)
    created: int = field(default_factory=lambda: int(time.time()))


def _get(body: dict, name: str, types: tuple, what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise InvalidRequest(name, f"must be {what}, got {type(value).__name__}")
    return value


def _common(body: dict, kind: str, model: str) -> tuple[dict, Call]:
    """The fields both endpoints take, as GenerateRequest keywords, and the call."""
    if _get(body, "n", (int,), "an integer") not in (None, 1):
        raise InvalidRequest("n", f"only n=1 is served, got {body['n']}")
    for name in ("logprobs", "echo"):
        if body.get(name) not in (None, False, 0):
            raise InvalidRequest(name, "is not supported")
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("best_of", "only best_of=1 is served")
    _get(body, "model", (str,), "a string")
    stream = bool(_get(body, "stream", (bool,), "a boolean"))
    options = _get(body, "stream_options", (dict,), "an object") or {}
    include_usage = _get(options, "include_usage", (bool,), "a boolean")
    if options and not stream:
        raise InvalidRequest("stream_options", "is only allowed with stream: true")
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    max_field = max_field or "max_tokens"
    max_tokens = _get(body, max_field, (int,), "an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("stop", "must be a string or a list of strings")
    kw = dict(
        temperature=_get(body, "temperature", (int, float), "a number"),
        top_p=_get(body, "top_p", (int, float), "a number"),
        top_k=_get(body, "top_k", (int,), "an integer"),
        seed=_get(body, "seed", (int,), "an integer"),
        stop=tuple(stop or ()),
    )
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    call = Call(kind, model, stream, bool(include_usage), max_field)
    return kw, call


def chat_request(body: dict, model: str) -> tuple[GenerateRequest, Call]:
    """POST /v1/chat/completions."""
    kw, call = _common(body, CHAT, model)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("messages", "must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}]", "must be an object with role and content")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidRequest(f"messages[{i}].content", "only text parts are served")
            content = "".join(str(p.get("text", "")) for p in content)
        out.append({"role": m.get("role"), "content": "" if content is None else content})
    return GenerateRequest(messages=tuple(out), **kw), call


def completion_request(body: dict, model: str) -> tuple[GenerateRequest, Call]:
    """POST /v1/completions: `prompt` is a string or a list of token ids (or a list of one)."""
    kw, call = _common(body, TEXT, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return GenerateRequest(prompt=prompt, **kw), call
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return GenerateRequest(prompt_ids=tuple(prompt), **kw), call
    raise InvalidRequest("prompt", "must be a string or a list of token ids (one prompt only)")


def usage_object(u: Usage) -> dict:
    """OpenAI's usage, with the prompt cache's tokens and sanctum's own figures."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "sanctum": {
            "tau": u.tau,
            "drafted_tokens": u.drafted_tokens,
            "accepted_tokens": u.accepted_tokens,
            "rounds": u.rounds,
            "lookup_rounds": u.lookup_rounds,
            "requested_lcp": u.requested_lcp,
            "resumed_at": u.resumed_at,
            "cache_hit_ratio": u.cache_hit_ratio,
            "kv": u.kv,
            "ttft_s": u.ttft_s,
            "elapsed_s": u.elapsed_s,
        },
    }


def _head(call: Call, request_id: str, chunk: bool) -> dict:
    if call.kind == CHAT:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": f"chatcmpl-{request_id}", "object": obj}
    return {"id": f"cmpl-{request_id}", "object": "text_completion"}


def completion_object(
    call: Call, request_id: str, text: str, finish: str | None, usage: Usage | None
) -> dict:
    """The whole answer (stream: false)."""
    choice = {"index": 0, "logprobs": None, "finish_reason": finish or "stop"}
    if call.kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        **_head(call, request_id, False),
        "created": call.created,
        "model": call.model,
        "choices": [choice],
        "usage": usage_object(usage) if usage is not None else None,
    }


def chunk_object(
    call: Call, request_id: str, text: str | None, finish: str | None = None, role: bool = False
) -> dict:
    """One server-sent event of a stream (role: the chat stream's opening delta)."""
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish}
    if call.kind == CHAT:
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    out = {
        **_head(call, request_id, True),
        "created": call.created,
        "model": call.model,
        "choices": [choice],
    }
    if call.include_usage:
        out["usage"] = None
    return out


def usage_chunk(call: Call, request_id: str, usage: Usage) -> dict:
    """The stream's last event with stream_options.include_usage: no choices, the usage."""
    return {
        **_head(call, request_id, True),
        "created": call.created,
        "model": call.model,
        "choices": [],
        "usage": usage_object(usage),
    }
