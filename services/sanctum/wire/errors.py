"""Errors across process boundaries, in ONE table: each serving error (serving/errors.py) with the
role error code it travels as between processes (roles.proto `RoleError`), the gRPC status a
gRPC client gets, and the HTTP status and OpenAI error type an HTTP client gets (api/http.py).
Anything else is internal.
"""

from __future__ import annotations

import logging
import re

import grpc

from ..serving.errors import InternalError, InvalidRequest, QueueFull, Unavailable
from .convert import invalid_message
from .gen import roles_pb2 as roles

log = logging.getLogger("sanctum.api")

_R = roles.RoleError
_S = grpc.StatusCode
# serving error, roles.RoleError.Code, gRPC status, HTTP status, OpenAI error type
ERRORS: tuple[tuple[type[Exception], int, grpc.StatusCode, int, str], ...] = (
    (InvalidRequest, _R.INVALID_ARGUMENT, _S.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (QueueFull, _R.RESOURCE_EXHAUSTED, _S.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (Unavailable, _R.UNAVAILABLE, _S.UNAVAILABLE, 503, "service_unavailable"),
    (InternalError, _R.INTERNAL, _S.INTERNAL, 500, "server_error"),
)


def _row(exc: BaseException) -> tuple[type[Exception], int, grpc.StatusCode, int, str]:
    return next((row for row in ERRORS if isinstance(exc, row[0])), ERRORS[-1])


def to_role_error(exc: BaseException, out: roles.RoleError) -> None:
    """Fill `out` (a message field, set in place) with `exc`."""
    out.code = _row(exc)[1]
    if isinstance(exc, InvalidRequest):
        text = str(exc)
        out.field = exc.field
        out.message = text[len(exc.field) + 2 :] if text.startswith(f"{exc.field}: ") else text
    else:
        out.message = str(exc) or exc.__class__.__name__


def from_role_error(err: roles.RoleError) -> Exception:
    """The serving error that `err` carries."""
    cls = next((row[0] for row in ERRORS if row[1] == err.code), InternalError)
    if cls is InvalidRequest:
        return InvalidRequest(err.field, err.message)
    return cls(err.message)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and details a client gets for `exc` (an unexpected one is logged)."""
    status = _row(exc)[2]
    if isinstance(exc, InvalidRequest):
        return status, invalid_message(exc)
    if isinstance(exc, (QueueFull, Unavailable)):
        return status, str(exc)
    log.error("internal error: %r", exc, exc_info=exc)
    return status, f"internal error: {exc}"


def http_error(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body (`{"error": {message, type, param, code}}`) an
    HTTP client gets for `exc` (an unexpected one is logged)."""
    row = _row(exc)
    param = None
    if isinstance(exc, InvalidRequest):  # OpenAI's names: token ids are a `prompt` too
        param = re.sub(r"^prompt_ids\b", "prompt", exc.field)
        text = str(exc)
        text = text[len(exc.field) + 2 :] if text.startswith(f"{exc.field}: ") else text
        message = f"{param}: " + re.sub(r"\bprompt_ids\b", "prompt", text)
    elif isinstance(exc, (QueueFull, Unavailable)):
        message = str(exc)
    else:
        log.error("internal error: %r", exc, exc_info=exc)
        message = f"internal error: {exc}"
    code = row[2].name.lower()  # the gRPC status's name: one vocabulary for both front ends
    return row[3], {"error": {"message": message, "type": row[4], "param": param, "code": code}}
