from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_MODE_UNSPECIFIED: _ClassVar[KvMode]
    KV_MODE_FP16: _ClassVar[KvMode]
    KV_MODE_Q8: _ClassVar[KvMode]
KV_MODE_UNSPECIFIED: KvMode
KV_MODE_FP16: KvMode
KV_MODE_Q8: KvMode

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "kv_mode", "use_cache", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    USE_CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    kv_mode: KvMode
    use_cache: bool
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., kv_mode: _Optional[_Union[KvMode, str]] = ..., use_cache: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "cache_hit_ratio", "requested_lcp", "resumed_at", "completion_tokens", "drafted_tokens", "accepted_tokens", "rounds", "tau", "kv", "mode", "ttft_s", "elapsed_s", "lookup_rounds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_LCP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    cache_hit_ratio: float
    requested_lcp: int
    resumed_at: int
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    rounds: int
    tau: float
    kv: str
    mode: str
    ttft_s: float
    elapsed_s: float
    lookup_rounds: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cache_hit_ratio: _Optional[float] = ..., requested_lcp: _Optional[int] = ..., resumed_at: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., tau: _Optional[float] = ..., kv: _Optional[str] = ..., mode: _Optional[str] = ..., ttft_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., lookup_rounds: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("index", "text", "token_ids", "drafted", "accepted", "finish_reason", "usage")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    accepted: int
    finish_reason: str
    usage: Usage
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("bs", "accepted", "committed")
    BS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    bs: int
    accepted: int
    committed: int
    def __init__(self, bs: _Optional[int] = ..., accepted: _Optional[int] = ..., committed: _Optional[int] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("text", "token_ids", "rounds", "finish_reason", "usage")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rounds: _containers.RepeatedCompositeFieldContainer[Round]
    finish_reason: str
    usage: Usage
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., rounds: _Optional[_Iterable[_Union[Round, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("entries", "bytes", "max_bytes", "lookups", "hits", "evictions", "available", "directory", "kv_bytes", "taps_bytes", "rung_bytes", "shared_bytes", "logical_bytes", "superseded")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAPS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNG_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    max_bytes: int
    lookups: int
    hits: int
    evictions: int
    available: bool
    directory: str
    kv_bytes: int
    taps_bytes: int
    rung_bytes: int
    shared_bytes: int
    logical_bytes: int
    superseded: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., available: _Optional[bool] = ..., directory: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., taps_bytes: _Optional[int] = ..., rung_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., superseded: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("model", "drafter", "block_size", "kv", "mode", "active", "waiting", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "rounds", "drafted_tokens", "accepted_tokens", "cancelled", "rejected", "drafter_available", "transport", "cache", "draft_calls", "transport_ms_per_round", "transport_bytes_per_round", "drafter_compute_ms_per_round", "round_draft_ms", "round_verify_ms", "round_rollback_ms", "round_other_ms", "drafter_wait_ms_per_round", "overlapped_draft_calls", "min_tau", "min_tau_sampled", "gated_steps", "lookup_rounds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_MS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_COMPUTE_MS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ROLLBACK_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_OTHER_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_WAIT_MS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    MIN_TAU_FIELD_NUMBER: _ClassVar[int]
    MIN_TAU_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    GATED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    drafter: str
    block_size: int
    kv: str
    mode: str
    active: int
    waiting: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    cancelled: int
    rejected: int
    drafter_available: bool
    transport: str
    cache: CacheStats
    draft_calls: int
    transport_ms_per_round: float
    transport_bytes_per_round: float
    drafter_compute_ms_per_round: float
    round_draft_ms: float
    round_verify_ms: float
    round_rollback_ms: float
    round_other_ms: float
    drafter_wait_ms_per_round: float
    overlapped_draft_calls: int
    min_tau: float
    min_tau_sampled: float
    gated_steps: int
    lookup_rounds: int
    def __init__(self, model: _Optional[str] = ..., drafter: _Optional[str] = ..., block_size: _Optional[int] = ..., kv: _Optional[str] = ..., mode: _Optional[str] = ..., active: _Optional[int] = ..., waiting: _Optional[int] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., cancelled: _Optional[int] = ..., rejected: _Optional[int] = ..., drafter_available: _Optional[bool] = ..., transport: _Optional[str] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ..., draft_calls: _Optional[int] = ..., transport_ms_per_round: _Optional[float] = ..., transport_bytes_per_round: _Optional[float] = ..., drafter_compute_ms_per_round: _Optional[float] = ..., round_draft_ms: _Optional[float] = ..., round_verify_ms: _Optional[float] = ..., round_rollback_ms: _Optional[float] = ..., round_other_ms: _Optional[float] = ..., drafter_wait_ms_per_round: _Optional[float] = ..., overlapped_draft_calls: _Optional[int] = ..., min_tau: _Optional[float] = ..., min_tau_sampled: _Optional[float] = ..., gated_steps: _Optional[int] = ..., lookup_rounds: _Optional[int] = ...) -> None: ...

class ListCacheRequest(_message.Message):
    __slots__ = ("model_key",)
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    model_key: str
    def __init__(self, model_key: _Optional[str] = ...) -> None: ...

class CacheEntryInfo(_message.Message):
    __slots__ = ("entry_id", "model_key", "kv_mode", "num_tokens", "rungs", "nbytes", "created", "prompt_len", "kv_bytes", "taps_bytes", "rung_bytes", "shared_bytes")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNGS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAPS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNG_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    model_key: str
    kv_mode: str
    num_tokens: int
    rungs: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    created: float
    prompt_len: int
    kv_bytes: int
    taps_bytes: int
    rung_bytes: int
    shared_bytes: int
    def __init__(self, entry_id: _Optional[str] = ..., model_key: _Optional[str] = ..., kv_mode: _Optional[str] = ..., num_tokens: _Optional[int] = ..., rungs: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., created: _Optional[float] = ..., prompt_len: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., taps_bytes: _Optional[int] = ..., rung_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ...) -> None: ...

class ListCacheResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CacheEntryInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[CacheEntryInfo, _Mapping]]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("model_key",)
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    model_key: str
    def __init__(self, model_key: _Optional[str] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...
