"""Prefill/decode disaggregation on the wire: the decode pod is the destination, and
`x-prefiller-host-port` carries the prefill pod's ip:port only on a disaggregated
pick; a client's own copy of that header never reaches the decode pod's sidecar."""

from __future__ import annotations

import json

import grpc
import pytest

from tests.epp.conftest import Epp, StartEpp
from tests.epp.extproc import envoy_client as ec

HEADER = "x-prefiller-host-port"
DECODE = "10.0.0.1:8000"
PREFILL = "10.0.0.2:8000"

# Disaggregate a request iff the decode pod would prefill at least 100 tokens
# itself (4 characters a token). The approximate producer gives the decider what
# the decode pod caches; each test's long prompts are new to it, so nothing is.
CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    autoTune: false
- type: decode-filter
- type: prefill-filter
- type: max-score-picker
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 100
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
- name: prefill
  plugins:
  - pluginRef: prefill-filter
"""


@pytest.fixture
async def pd_epp(start_epp: StartEpp) -> Epp:
    return await start_epp(
        endpoints={"decode": DECODE, "prefill": PREFILL},
        labels={"decode": {"llm-d.ai/role": "decode"}, "prefill": {"llm-d.ai/role": "prefill"}},
        config_text=CONFIG,
    )


def body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()


async def route(epp: Epp, prompt: str, **header_args: object) -> ec.Reply:
    stream = epp.stream()
    routed = await ec.route(stream, body(prompt), **header_args)
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    return routed.headers_reply


async def test_a_disaggregated_pick_names_the_prefill_pod(pd_epp: Epp) -> None:
    reply = await route(pd_epp, "a long and new document " * 40)  # 240 tokens
    assert reply.destination == DECODE
    assert reply.metadata == {"envoy.lb": {ec.DESTINATION: DECODE}}
    assert reply.set_headers[HEADER] == PREFILL
    assert HEADER not in reply.remove_headers


async def test_a_short_prompt_goes_to_the_decode_pod_alone(pd_epp: Epp) -> None:
    reply = await route(pd_epp, "hello")
    assert reply.destination == DECODE
    assert HEADER not in reply.set_headers


async def test_a_clients_own_prefiller_header_is_removed_or_overwritten(pd_epp: Epp) -> None:
    forged = {HEADER: "203.0.113.9:80"}
    short = await route(pd_epp, "hello", extra=forged)
    assert HEADER in short.remove_headers
    assert HEADER not in short.set_headers
    long = await route(pd_epp, "another long and new document " * 40, extra=forged)
    assert long.set_headers[HEADER] == PREFILL
    assert HEADER not in long.remove_headers  # overwritten instead


async def test_without_disaggregation_a_clients_copy_is_removed_too(epp: Epp) -> None:
    reply = await route(epp, "hello", extra={HEADER: "203.0.113.9:80"})
    assert HEADER in reply.remove_headers
    assert HEADER not in reply.set_headers
