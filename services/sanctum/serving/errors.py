"""The errors a request can end with, whatever carries it (inline, Ray, gRPC, HTTP):
wire/errors.py maps each to a role error, a gRPC status and an HTTP status; `outcome` is its
label in the request counter (serving/metrics.py).
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input; `field` names the offending request field (gRPC INVALID_ARGUMENT)."""

    outcome = "invalid_argument"

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class QueueFull(RuntimeError):
    """Too many requests waiting (gRPC RESOURCE_EXHAUSTED)."""

    outcome = "resource_exhausted"


class Unavailable(RuntimeError):
    """The server cannot take or finish the request now: draining, or a role died
    (gRPC UNAVAILABLE; the client may retry)."""

    outcome = "unavailable"


class InternalError(RuntimeError):
    """A request failed inside the engine; other requests are unaffected."""

    outcome = "internal"
