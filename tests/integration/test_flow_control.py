"""Flow control through a real Envoy and `epp serve`: a request that arrives while
the pool is full is held (Envoy waits for the EPP's reply with the ext_proc stream
open) and served once a running request ends; one that finds its band full is
answered 429 with Retry-After. Faults while requests wait, and which Envoy timeouts
count the wait: test_flow_control_faults.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.conftest import Stack, running_stack
from tests.integration.test_envoy import metric, post

# The upstreams serve no metrics page, so every pod's metrics are stale: the
# utilization detector's dispatch reading counts this EPP's own requests in flight,
# one per pod at most (staleMaxConcurrency). With three pods, one request in flight
# reads 1/3: the 0.3 ceiling then holds every other request.
CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: header-based-testing-filter
- type: max-score-picker
- type: utilization-detector
  parameters: {staleMaxConcurrency: 1}
- type: static-usage-limit-policy
  parameters: {threshold: 0.3}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: max-score-picker
flowControl:
  defaultRequestTTL: 30s
  defaultPriorityBand: {maxRequests: 1}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("flow-control"), config_text=CONFIG) as running:
        yield running


async def queued(stack: Stack) -> float:
    return await metric(
        stack, "epp_flow_control_queue_size", 'fairness_id="default-flow",priority="0"'
    )


def served(stack: Stack) -> int:
    """Completions that reached an upstream (the metrics scrapes reach them too)."""
    return sum(r.path == "/v1/completions" for u in stack.upstreams for r in u.received)


async def wait_queued(stack: Stack, expected: float, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await queued(stack) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"queue never reached {expected}"
        await asyncio.sleep(0.05)


async def test_a_held_request_is_served_when_the_running_one_ends(stack: Stack) -> None:
    stack.upstreams.clear()
    try:
        await held_then_served(stack)
    finally:
        stack.upstreams.release("fc-1")


async def held_then_served(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        running = await session.post(
            stack.url + "/v1/completions",
            json={"model": "m", "prompt": "first", "stream": True, "max_tokens": 3, "hold": "fc-1"},
        )
        assert running.status == 200
        await running.content.readline()  # the first event: it is in flight upstream
        held = asyncio.ensure_future(
            post(stack, "/v1/completions", {"model": "m", "prompt": "second"})
        )
        await wait_queued(stack, 1)
        assert not held.done()
        assert served(stack) == 1
        # A third finds the band (maxRequests 1) full: answered at once.
        status, headers, body = await post(stack, "/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 429
        headers = {k.lower(): v for k, v in headers.items()}
        assert headers["retry-after"] == "1"
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        assert "holds its maximum of 1 requests" in json.loads(body)["error"]["message"]
        # The running request ends: the held one is routed and served.
        stack.upstreams.release("fc-1")
        await running.read()
        running.release()
        status, _, body = await asyncio.wait_for(held, 10.0)
        assert status == 200
        assert json.loads(body)["choices"][0]["text"] == "ok"
        assert served(stack) == 2
        await wait_queued(stack, 0)


async def test_a_client_that_leaves_while_queued_leaves_the_queue(stack: Stack) -> None:
    stack.upstreams.clear()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": "first", "stream": True, "hold": "fc-2"}
            running = await session.post(stack.url + "/v1/completions", json=body)
            await running.content.readline()
            held = asyncio.ensure_future(
                post(stack, "/v1/completions", {"model": "m", "prompt": "second"})
            )
            await wait_queued(stack, 1)
            # The client hangs up: Envoy half-closes the ext_proc stream (its
            # graceful close), which the EPP reads while the request waits, and the
            # request leaves its queue at once, without ever reaching an upstream.
            held.cancel()
            left = asyncio.get_running_loop().time()
            await wait_queued(stack, 0)
            assert asyncio.get_running_loop().time() - left < 0.2
            cancelled = await metric(
                stack,
                "epp_flow_control_requests_total",
                'fairness_id="default-flow",outcome="cancelled",priority="0"',
            )
            assert cancelled >= 1
            stack.upstreams.release("fc-2")
            await running.read()
            running.release()
        assert served(stack) == 1
    finally:
        stack.upstreams.release("fc-2")
