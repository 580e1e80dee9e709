"""Flow control through a real in-process EPP, over ext_proc as Envoy speaks it: a
request held while the pool is full, served once a request ends; a shed answered
with 429, Retry-After and a clear body; a client gone while queued."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from tests.epp.conftest import StartEpp
from tests.epp.extproc.envoy_client import (
    EnvoyStream,
    body_messages,
    request_headers,
    respond,
    route,
)

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: utilization-detector
  parameters: {staleMaxConcurrency: 1}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
flowControl:
  defaultPriorityBand: {maxRequests: 1}
"""
BODY = b'{"model": "m", "prompt": "hello"}'
ONE_POD = {"pod-a": "10.0.0.1:8000"}


async def queue(stream: EnvoyStream, **headers: str) -> asyncio.Task[object]:
    """Send a whole request; the task reading its first reply."""
    await stream.send(request_headers(extra=headers), *body_messages(BODY))
    return asyncio.get_running_loop().create_task(stream.expect())


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `condition`: the server handles the stream on its own tasks, and the
    controller has no event to offer a test."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_held_request_is_served_when_capacity_frees(start_epp: StartEpp) -> None:
    epp = await start_epp(endpoints=ONE_POD, config_text=CONFIG, refresh_metrics_interval_s=60)
    controller = epp.app.director.config.flow_control
    assert controller is not None
    first = epp.stream()
    routed = await route(first, BODY)
    assert routed.destination == "10.0.0.1:8000"
    second = epp.stream()
    reply = await queue(second, **{"x-llm-d-inference-fairness-id": "tenant-1"})
    await wait_for(lambda: controller.queued == 1)
    assert not reply.done()
    assert (
        await epp.metric(
            "epp_flow_control_queue_size", {"priority": "0", "fairness_id": "tenant-1"}
        )
        == 1
    )
    # The first response ends: the held request is routed at once.
    await respond(first, [b"{}"])
    decision = await asyncio.wait_for(reply, 5.0)
    assert decision.kind == "request_headers"  # type: ignore[attr-defined]
    assert decision.destination == "10.0.0.1:8000"  # type: ignore[attr-defined]
    # llm-d's control headers do not go upstream.
    assert "x-llm-d-inference-fairness-id" in decision.remove_headers  # type: ignore[attr-defined]
    assert controller.queued == 0
    second.cancel()
    first.cancel()


async def test_a_full_band_is_answered_429_with_retry_after(start_epp: StartEpp) -> None:
    epp = await start_epp(endpoints=ONE_POD, config_text=CONFIG, refresh_metrics_interval_s=60)
    controller = epp.app.director.config.flow_control
    assert controller is not None
    first = epp.stream()
    await route(first, BODY)
    second = epp.stream()
    held = await queue(second)
    await wait_for(lambda: controller.queued == 1)
    third = epp.stream()
    await third.send(request_headers(), *body_messages(BODY))
    reply = await third.expect()
    assert reply.kind == "immediate_response"
    assert reply.status == 429
    assert reply.set_headers["retry-after"] == "1"
    assert reply.set_headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    error = json.loads(reply.body)["error"]
    assert error["type"] == "rate_limit_error"
    assert "priority band 0 holds its maximum of 1 requests" in error["message"]
    assert not held.done()
    held.cancel()
    second.cancel()
    first.cancel()


async def test_a_client_gone_while_queued_leaves_the_queue_at_once(start_epp: StartEpp) -> None:
    epp = await start_epp(endpoints=ONE_POD, config_text=CONFIG, refresh_metrics_interval_s=60)
    controller = epp.app.director.config.flow_control
    assert controller is not None
    first = epp.stream()
    await route(first, BODY)
    second = epp.stream()
    held = await queue(second)
    await wait_for(lambda: controller.queued == 1)
    held.cancel()
    second.cancel()  # Envoy resets the stream when the client goes away
    await wait_for(lambda: controller.queued == 0)
    assert (
        await epp.metric(
            "epp_flow_control_requests_total",
            {"outcome": "cancelled", "priority": "0", "fairness_id": "default-flow"},
        )
        == 1
    )
    # The first request still ends normally, and nothing is dispatched for the
    # request that left.
    await respond(first, [b"{}"])
    assert await epp.wait_in_flight(0) == 0
    first.cancel()
