"""Errors that end a request with an HTTP status, shaped like OpenAI's error body.

Anything raised while handling a request that is an `EppError` becomes an Envoy
ImmediateResponse with `status` and the body
`{"error": {"message": ..., "type": ..., "code": status}}`; every other exception is
a bug and becomes a 500 with a generic message (the details go to the log only).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec


class EppError(Exception):
    """Base of the errors a client may see. Subclasses fix the status and type."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    # Bounded label for the `epp_requests_total{outcome}` metric.
    outcome: ClassVar[str] = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> bytes:
        return openai_error_body(self.message, self.error_type, self.status)


class BadRequest(EppError):
    status = 400
    error_type = "invalid_request_error"
    outcome = "bad_request"


class PayloadTooLarge(EppError):
    status = 413
    error_type = "invalid_request_error"
    outcome = "payload_too_large"


class Shed(EppError):
    """The pool is saturated and the request may be dropped (429)."""

    status = 429
    error_type = "rate_limit_error"
    outcome = "shed"


class NoCapacity(EppError):
    """Endpoints exist but every one was filtered out for this request (429, as GIE)."""

    status = 429
    error_type = "rate_limit_error"
    outcome = "no_capacity"


class Unavailable(EppError):
    """No endpoint can take the request at all (503)."""

    status = 503
    error_type = "service_unavailable"
    outcome = "unavailable"


class Overloaded(EppError):
    """The EPP is at its limit of concurrent streams (--max-concurrent-streams): the
    request is refused at once (503), before its body is read."""

    status = 503
    error_type = "service_unavailable"
    outcome = "overloaded"


class InternalError(EppError):
    status = 500
    error_type = "internal_error"
    outcome = "internal_error"


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: int


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_encoder = msgspec.json.Encoder()


def openai_error_body(message: str, error_type: str, code: int) -> bytes:
    return _encoder.encode(_ErrorBody(_ErrorDetail(message=message, type=error_type, code=code)))
