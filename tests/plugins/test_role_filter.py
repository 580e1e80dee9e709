"""`decode-filter`, `prefill-filter`, `encode-filter`: llm-d's rules for the
`llm-d.ai/role` label, every role against every filter."""

from __future__ import annotations

import pytest
from epp.plugins.role_filter import ROLE_LABEL, DecodeFilter, EncodeFilter, PrefillFilter

from epp.datastore import Endpoint, EndpointSpec
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_request

ROLES = [None, "decode", "prefill", "encode", "prefill-decode", "both",
         "encode-prefill", "encode-prefill-decode", "", "Decode", "other"]  # fmt: skip

KEEPS = {
    DecodeFilter: {None, "decode", "prefill-decode", "both", "encode-prefill-decode"},
    PrefillFilter: {"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"},
    EncodeFilter: {"encode", "encode-prefill", "encode-prefill-decode"},
}


def endpoint(role: str | None) -> Endpoint:
    labels = {} if role is None else {ROLE_LABEL: role}
    return Endpoint(EndpointSpec(f"pod-{role}", "10.0.0.1:8000", labels=labels))


@pytest.mark.parametrize("kind", list(KEEPS), ids=lambda k: k.__name__)
def test_each_filter_keeps_exactly_its_roles(kind: type) -> None:
    endpoints = [endpoint(role) for role in ROLES]
    kept = kind(None, context("f")).filter(make_request(), CycleState(), endpoints)
    assert [e.labels.get(ROLE_LABEL) for e in kept] == [r for r in ROLES if r in KEEPS[kind]]
