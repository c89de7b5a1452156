"""Errors across process boundaries, in ONE table: each serving error (serving/errors.py) with the
role error code it travels as between processes (roles.proto `RoleError`) and the gRPC status a
client gets. Anything else is internal.
"""

from __future__ import annotations

import logging

import grpc

from ..serving.errors import InternalError, InvalidRequest, QueueFull, Unavailable
from .convert import invalid_message
from .gen import roles_pb2 as roles

log = logging.getLogger("sanctum.api")

# serving error, roles.RoleError.Code, gRPC status
ERRORS: tuple[tuple[type[Exception], int, grpc.StatusCode], ...] = (
    (InvalidRequest, roles.RoleError.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, roles.RoleError.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, roles.RoleError.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (InternalError, roles.RoleError.INTERNAL, grpc.StatusCode.INTERNAL),
)


def _row(exc: BaseException) -> tuple[type[Exception], int, grpc.StatusCode]:
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
