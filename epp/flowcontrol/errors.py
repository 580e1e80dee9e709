"""How flow control answers a request it will not serve: at once, with a status
the client can act on, a `Retry-After` header and llm-d's
`x-llm-d-request-dropped-reason` header.

- 429 (capacity exists but is contended): the band, or the whole queue, is at its
  bound of requests or bytes (`rejected-saturated`), or the request waited its whole
  TTL while the pool had endpoints (`rejected-ttl-expired`).
- 503 (no capacity at all): the TTL ran out while the pool had no ready endpoint
  (`rejected-no-endpoints`).

A request whose client went away gets no answer: there is nobody to read it.
"""

from __future__ import annotations

from typing import ClassVar, Final

from epp.errors import EppError

DROPPED_REASON_HEADER: Final = "x-llm-d-request-dropped-reason"
# Seconds a client is asked to wait before retrying. Short for backpressure (the
# queue drains as requests finish); longer when there is no endpoint at all (a pod
# has to start).
RETRY_AFTER_CONTENDED_S: Final = 1
RETRY_AFTER_NO_ENDPOINTS_S: Final = 5


class FlowControlRejected(EppError):
    """Base of flow control's answers. `response_headers` go on the
    ImmediateResponse beside the JSON body (epp/extproc/messages.py)."""

    reason: ClassVar[str] = "rejected-saturated"
    retry_after_s: ClassVar[int] = RETRY_AFTER_CONTENDED_S

    @property
    def response_headers(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", str(self.retry_after_s)), (DROPPED_REASON_HEADER, self.reason))


class QueueFull(FlowControlRejected):
    """The request's priority band (or the global bound) has no room: shed on
    arrival."""

    status = 429
    error_type = "rate_limit_error"
    outcome = "flow_control_rejected"
    reason = "rejected-saturated"


class QueueTimeout(FlowControlRejected):
    """The request waited its whole TTL and was never dispatched."""

    status = 429
    error_type = "rate_limit_error"
    outcome = "flow_control_ttl_expired"
    reason = "rejected-ttl-expired"


class QueueTimeoutNoEndpoints(FlowControlRejected):
    """The TTL ran out while the pool had no ready endpoint."""

    status = 503
    error_type = "service_unavailable"
    outcome = "flow_control_no_endpoints"
    reason = "rejected-no-endpoints"
    retry_after_s = RETRY_AFTER_NO_ENDPOINTS_S
