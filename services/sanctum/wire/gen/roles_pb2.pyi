from . import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Submit(_message.Message):
    __slots__ = ("request", "request_id", "mode", "deadline_unix")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.GenerateRequest
    request_id: str
    mode: str
    deadline_unix: float
    def __init__(self, request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., request_id: _Optional[str] = ..., mode: _Optional[str] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class RoleError(_message.Message):
    __slots__ = ("code", "field", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INTERNAL: _ClassVar[RoleError.Code]
        INVALID_ARGUMENT: _ClassVar[RoleError.Code]
        RESOURCE_EXHAUSTED: _ClassVar[RoleError.Code]
        UNAVAILABLE: _ClassVar[RoleError.Code]
    INTERNAL: RoleError.Code
    INVALID_ARGUMENT: RoleError.Code
    RESOURCE_EXHAUSTED: RoleError.Code
    UNAVAILABLE: RoleError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: RoleError.Code
    field: str
    message: str
    def __init__(self, code: _Optional[_Union[RoleError.Code, str]] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class VerifierEvent(_message.Message):
    __slots__ = ("chunk", "error", "end", "request_id")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    chunk: _inference_pb2.GenerateResponse
    error: RoleError
    end: bool
    request_id: str
    def __init__(self, chunk: _Optional[_Union[_inference_pb2.GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[RoleError, _Mapping]] = ..., end: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class VerifierEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[VerifierEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[VerifierEvent, _Mapping]]] = ...) -> None: ...

class FrontEndMessage(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: Submit
    cancel: str
    def __init__(self, submit: _Optional[_Union[Submit, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("offset", "shape", "dtype")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class DraftAttach(_message.Message):
    __slots__ = ("shm_name", "size")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size: int
    def __init__(self, shm_name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class DraftOpen(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class DraftClose(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class DraftCall(_message.Message):
    __slots__ = ("seq_id", "start", "new_taps", "block_embeds", "reply_offset", "reply_capacity", "batch_seq_ids", "batch_starts", "batch_tap_rows")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TAPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    REPLY_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REPLY_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_STARTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TAP_ROWS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    start: int
    new_taps: TensorRef
    block_embeds: TensorRef
    reply_offset: int
    reply_capacity: int
    batch_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    batch_starts: _containers.RepeatedScalarFieldContainer[int]
    batch_tap_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., start: _Optional[int] = ..., new_taps: _Optional[_Union[TensorRef, _Mapping]] = ..., block_embeds: _Optional[_Union[TensorRef, _Mapping]] = ..., reply_offset: _Optional[int] = ..., reply_capacity: _Optional[int] = ..., batch_seq_ids: _Optional[_Iterable[str]] = ..., batch_starts: _Optional[_Iterable[int]] = ..., batch_tap_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("attach", "open", "draft", "close", "call_id")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    attach: DraftAttach
    open: DraftOpen
    draft: DraftCall
    close: DraftClose
    call_id: int
    def __init__(self, attach: _Optional[_Union[DraftAttach, _Mapping]] = ..., open: _Optional[_Union[DraftOpen, _Mapping]] = ..., draft: _Optional[_Union[DraftCall, _Mapping]] = ..., close: _Optional[_Union[DraftClose, _Mapping]] = ..., call_id: _Optional[int] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("hidden", "error", "not_open", "compute_ms", "call_id")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NOT_OPEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    hidden: TensorRef
    error: str
    not_open: bool
    compute_ms: float
    call_id: int
    def __init__(self, hidden: _Optional[_Union[TensorRef, _Mapping]] = ..., error: _Optional[str] = ..., not_open: _Optional[bool] = ..., compute_ms: _Optional[float] = ..., call_id: _Optional[int] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("node_id", "address", "authkey", "pid", "drafter", "bits", "started")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AUTHKEY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    authkey: bytes
    pid: int
    drafter: str
    bits: int
    started: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., authkey: _Optional[bytes] = ..., pid: _Optional[int] = ..., drafter: _Optional[str] = ..., bits: _Optional[int] = ..., started: _Optional[float] = ...) -> None: ...

class PlanQuery(_message.Message):
    __slots__ = ("model_key", "prompt_ids")
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    model_key: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_key: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorLayout(_message.Message):
    __slots__ = ("kv_layers", "rungs", "gdn_layers", "has_taps", "dtypes")
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RUNGS_FIELD_NUMBER: _ClassVar[int]
    GDN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HAS_TAPS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    kv_layers: _containers.RepeatedScalarFieldContainer[int]
    rungs: _containers.RepeatedScalarFieldContainer[int]
    gdn_layers: int
    has_taps: bool
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kv_layers: _Optional[_Iterable[int]] = ..., rungs: _Optional[_Iterable[int]] = ..., gdn_layers: _Optional[int] = ..., has_taps: _Optional[bool] = ..., dtypes: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumePlanHeader(_message.Message):
    __slots__ = ("requested_lcp", "resumed_at", "entry_id", "layout")
    REQUESTED_LCP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    requested_lcp: int
    resumed_at: int
    entry_id: str
    layout: TensorLayout
    def __init__(self, requested_lcp: _Optional[int] = ..., resumed_at: _Optional[int] = ..., entry_id: _Optional[str] = ..., layout: _Optional[_Union[TensorLayout, _Mapping]] = ...) -> None: ...

class EntryHeader(_message.Message):
    __slots__ = ("model_key", "kv_mode", "tokens", "layout", "created", "prompt_len")
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    model_key: str
    kv_mode: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    layout: TensorLayout
    created: float
    prompt_len: int
    def __init__(self, model_key: _Optional[str] = ..., kv_mode: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[TensorLayout, _Mapping]] = ..., created: _Optional[float] = ..., prompt_len: _Optional[int] = ...) -> None: ...
