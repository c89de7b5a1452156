"""Errors across process boundaries: a serving error as a role error (roles.proto) and back, and
as the gRPC status a client gets.
"""

from __future__ import annotations

import logging

import grpc

from ..serving.errors import InternalError, InvalidRequest, QueueFull, Unavailable
from .convert import invalid_message
from .gen import roles_pb2 as roles

log = logging.getLogger("sanctum.api")


def error_event(exc: BaseException) -> roles.VerifierEvent:
    E = roles.RoleError
    if isinstance(exc, InvalidRequest):
        text = str(exc)
        text = text[len(exc.field) + 2 :] if text.startswith(f"{exc.field}: ") else text
        err = E(code=E.INVALID_ARGUMENT, field=exc.field, message=text)
    elif isinstance(exc, QueueFull):
        err = E(code=E.RESOURCE_EXHAUSTED, message=str(exc))
    elif isinstance(exc, Unavailable):
        err = E(code=E.UNAVAILABLE, message=str(exc))
    else:
        err = E(code=E.INTERNAL, message=str(exc) or exc.__class__.__name__)
    return roles.VerifierEvent(error=err)


def error_from_wire(err: roles.RoleError) -> Exception:
    E = roles.RoleError
    if err.code == E.INVALID_ARGUMENT:
        return InvalidRequest(err.field, err.message)
    if err.code == E.RESOURCE_EXHAUSTED:
        return QueueFull(err.message)
    if err.code == E.UNAVAILABLE:
        return Unavailable(err.message)
    return InternalError(err.message)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, invalid_message(exc)
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    log.error("internal error: %r", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc}"
