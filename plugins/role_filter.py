"""`decode-filter`, `prefill-filter`, `encode-filter`: keep the endpoints whose role
fits the step being scheduled (llm-d's filters by label, for disaggregated serving).

The role is the endpoint's `llm-d.ai/role` label, matched exactly:

- `decode-filter` keeps decode, prefill-decode, both and encode-prefill-decode,
  and endpoints without the label;
- `prefill-filter` keeps prefill, encode-prefill, prefill-decode, both and
  encode-prefill-decode;
- `encode-filter` keeps encode, encode-prefill and encode-prefill-decode.

An endpoint without a role serves whole requests, so a pool that does not split
its pods keeps working behind `decode-filter`. No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext

ROLE_LABEL: Final = "llm-d.ai/role"


class _RoleFilter:
    roles: ClassVar[frozenset[str]]
    keep_unlabelled: ClassVar[bool]

    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        kept = []
        for endpoint in endpoints:
            role = endpoint.labels.get(ROLE_LABEL)
            if (role is None and self.keep_unlabelled) or role in self.roles:
                kept.append(endpoint)
        return kept


class DecodeFilter(_RoleFilter):
    roles = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})
    keep_unlabelled = True


class PrefillFilter(_RoleFilter):
    roles = frozenset(
        {"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"}
    )
    keep_unlabelled = False


class EncodeFilter(_RoleFilter):
    roles = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})
    keep_unlabelled = False
