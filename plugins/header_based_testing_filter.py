"""`header-based-testing-filter`: keeps the endpoints a request names in its
`test-epp-endpoint-selection` header (comma-separated `ip:port`).

For conformance and end-to-end tests (GIE ships the same plugin): a test decides
where a request must land and checks that it did. A request without the header
keeps every endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext

SELECTION_HEADER: Final = "test-epp-endpoint-selection"


class HeaderBasedTestingFilter:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        header = request.headers.get(SELECTION_HEADER)
        if header is None:
            return endpoints
        wanted = {part.strip() for part in header.split(",")}
        return [e for e in endpoints if e.address in wanted]
