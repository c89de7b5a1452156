"""sanctum.v1 messages <-> the serving core's plain types (serving/requests.py, serving/stats.py).

Each is converted once each way at each process boundary: the front end converts a client's
request in and its chunks out; between the front end and the verifier actor a request crosses
as a `Submit` and its chunks as `VerifierEvent`s, filled in place (`out=`), not copied. The one
place where wire field names meet the engine's: errors name the wire field (`token_ids`,
`chat.messages[2].role`), so a client can tell what to fix.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict

from ..engine.decode.sampling import acceptance_length
from ..serving.errors import InvalidRequest
from ..serving.requests import Chunk, GenerateRequest, Usage
from ..serving.stats import EntryInfo, Stats
from .gen import inference_pb2 as pb

DEFAULT_MAX_TOKENS = 64
# the KvMode enum <-> the engine's KV formats (engine/model/target.py KV_MODES)
_KV = {pb.KV_MODE_UNSPECIFIED: None, pb.KV_MODE_FP16: "fp16", pb.KV_MODE_Q8: "q8"}
KV_TO_WIRE = {v: k for k, v in _KV.items()}
# request dataclass field -> public proto field
_WIRE_FIELDS = {"prompt": "text", "prompt_ids": "token_ids", "messages": "chat.messages"}


def wire_field(name: str) -> str:
    """`messages[2].role` -> `chat.messages[2].role`, `prompt_ids` -> `token_ids`."""
    head = re.match(r"[a-z_]+", name)
    if head and head.group(0) in _WIRE_FIELDS:
        return _WIRE_FIELDS[head.group(0)] + name[head.end() :]
    return name


def invalid_message(exc: InvalidRequest) -> str:
    """'<wire field>: <what is wrong>' with engine field names translated."""
    text = str(exc)
    if text.startswith(f"{exc.field}: "):
        text = text[len(exc.field) + 2 :]
    for engine in ("prompt_ids", "messages"):  # names in the text; not the word "prompt"
        text = re.sub(rf"\b{engine}\b", _WIRE_FIELDS[engine], text)
    return f"{getattr(exc, 'wire_field', None) or wire_field(exc.field)}: {text}"


def request_from_proto(m: pb.GenerateRequest, request_id: str | None = None) -> GenerateRequest:
    which = m.WhichOneof("prompt")
    if which is None:
        exc = InvalidRequest("prompt", "give one of text, token_ids or chat")
        exc.wire_field = "prompt"  # the oneof itself, not its `text` member
        raise exc
    if m.kv_mode not in _KV:
        raise InvalidRequest("kv_mode", f"unknown KV mode {m.kv_mode}")
    return GenerateRequest(
        prompt=m.text if which == "text" else None,
        prompt_ids=tuple(int(t) for t in m.token_ids.ids) if which == "token_ids" else None,
        messages=tuple({"role": x.role, "content": x.content} for x in m.chat.messages)
        if which == "chat"
        else None,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=m.temperature if m.HasField("temperature") else None,
        top_p=m.top_p if m.HasField("top_p") else None,
        top_k=m.top_k if m.HasField("top_k") else None,
        seed=m.seed if m.HasField("seed") else None,
        stop=tuple(m.stop),
        kv_mode=_KV[m.kv_mode],
        use_cache=m.use_cache if m.HasField("use_cache") else True,
        request_id=request_id or m.request_id or uuid.uuid4().hex,
    )


def request_to_proto(
    req: GenerateRequest, out: pb.GenerateRequest | None = None
) -> pb.GenerateRequest:
    """`req` as the public message; filled into `out` when given (no copy)."""
    m = pb.GenerateRequest() if out is None else out
    m.max_tokens, m.use_cache, m.request_id = req.max_tokens, req.use_cache, req.request_id
    m.kv_mode = KV_TO_WIRE.get(req.kv_mode or None, pb.KV_MODE_UNSPECIFIED)
    m.stop.extend(req.stop)
    if req.prompt is not None:
        m.text = req.prompt
    elif req.prompt_ids is not None:
        m.token_ids.ids.extend(req.prompt_ids)
    elif req.messages is not None:
        m.chat.SetInParent()
        for msg in req.messages:
            m.chat.messages.add(role=msg.get("role", ""), content=msg.get("content", ""))
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            setattr(m, name, getattr(req, name))
    return m


def usage_to_proto(u: Usage) -> pb.Usage:
    return pb.Usage(**{f: getattr(u, f) for f in pb.Usage.DESCRIPTOR.fields_by_name})


def usage_from_proto(m: pb.Usage) -> Usage:
    return Usage(**{f: getattr(m, f) for f in pb.Usage.DESCRIPTOR.fields_by_name})


def chunk_to_proto(
    chunk: Chunk, index: int, out: pb.GenerateResponse | None = None
) -> pb.GenerateResponse:
    """`chunk` as the public message; filled into `out` when given (a field of the message that
    carries it, so nothing is copied)."""
    m = pb.GenerateResponse() if out is None else out
    m.SetInParent()  # present even when every field keeps its default
    m.index, m.text, m.drafted, m.accepted = index, chunk.text, chunk.drafted, chunk.accepted
    m.token_ids.extend(chunk.token_ids)
    m.finish_reason = chunk.finish_reason or ""
    if chunk.usage is not None:
        m.usage.CopyFrom(usage_to_proto(chunk.usage))
    return m


def chunk_from_proto(m: pb.GenerateResponse) -> Chunk:
    return Chunk(
        m.text,
        list(m.token_ids),
        m.drafted,
        m.accepted,
        m.finish_reason or None,
        usage_from_proto(m.usage) if m.HasField("usage") else None,
    )


def rounds_tau(rounds: list[dict]) -> float | None:
    """The mean acceptance length of `rounds` (`round_of`'s), to 4 places; None without a
    speculative round."""
    spec = [r["accepted"] for r in rounds if r["bs"] > 1]
    tau = acceptance_length(sum(spec), len(spec))
    return None if tau is None else round(tau, 4)


def round_of(m: pb.GenerateResponse | Chunk) -> dict:
    """The seed's per-round line for a response or a chunk (index >= 1): bs, accepted,
    committed."""
    return {
        "bs": m.drafted + 1 if m.drafted else 1,
        "accepted": m.accepted,
        "committed": len(m.token_ids),
    }


def stats_to_proto(s: Stats) -> pb.StatsResponse:
    """The public StatsResponse (its fields are the dataclass's, by name)."""
    out = pb.StatsResponse(**{k: v for k, v in asdict(s).items() if k != "cache"})
    out.cache.CopyFrom(pb.CacheStats(**asdict(s.cache)))
    return out


def entries_to_proto(entries: list[EntryInfo]) -> pb.ListCacheResponse:
    return pb.ListCacheResponse(entries=[pb.CacheEntryInfo(**asdict(e)) for e in entries])
