"""How the ext_proc server reads Envoy's messages while a request waits in flow
control (epp/extproc/server.py's docstring): one read runs ahead then, so Envoy's
half-close (its graceful close, when the client hangs up) takes the request out of
the queue at once; a message read ahead is handed over in order; and a request that
does not wait is read exactly as before, one read at a time from the stream's own
coroutine.

`Process` is driven directly with a fake request iterator (what grpc.aio hands
it), which counts the reads; one test goes through real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from epp.extproc import messages as m
from epp.flowcontrol import FlowController
from tests.epp.conftest import Epp, StartEpp
from tests.epp.extproc.envoy_client import (
    Reply,
    body_messages,
    request_body,
    request_headers,
    response_body,
    response_headers,
)

FLOW_CONTROL = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: utilization-detector
  parameters: {{staleMaxConcurrency: 1}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue-scorer}}]
flowControl:
  defaultRequestTTL: {ttl}
"""
BODY = b'{"model": "m", "prompt": "hello"}'
ONE_POD = {"pod-a": "10.0.0.1:8000"}


class FakeEnvoy:
    """The request iterator of one stream, played by the test: the messages it
    sends, then the end of the stream (Envoy's half-close). Counts every read, how
    many run at once, and which tasks read."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.reads = 0
        self.reading = 0
        self.most_reading = 0
        self.readers: list[asyncio.Task[Any] | None] = []  # every task that read, once
        self.last_reader: asyncio.Task[Any] | None = None

    def __aiter__(self) -> FakeEnvoy:
        return self

    async def __anext__(self) -> Any:
        self.reads += 1
        self.reading += 1
        self.most_reading = max(self.most_reading, self.reading)
        task = self.last_reader = asyncio.current_task()
        if task not in self.readers:
            self.readers.append(task)
        try:
            message = await self._queue.get()
        finally:
            self.reading -= 1
        if message is None:
            raise StopAsyncIteration
        return message

    def send(self, *messages: Any) -> None:
        for message in messages:
            self._queue.put_nowait(message)

    def half_close(self) -> None:
        self._queue.put_nowait(None)


class Served:
    """`Process` for one fake stream, run as grpc.aio runs it: in a task of its own
    that sends each reply (here: records it)."""

    def __init__(self, epp: Epp) -> None:
        self.envoy = FakeEnvoy()
        self.replies: list[Reply] = []
        self.task = asyncio.get_running_loop().create_task(self._run(epp))

    async def _run(self, epp: Epp) -> None:
        async for reply in epp.app.processor.Process(self.envoy, None):
            self.replies.append(Reply.of(reply))

    def read_only_by_its_own_task(self) -> bool:
        return self.envoy.most_reading == 1 and self.envoy.readers == [self.task]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def settle() -> None:
    """Let every task that can run, run (no timer involved)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def flow_control(start_epp: StartEpp, ttl: str = "60s") -> tuple[Epp, FlowController]:
    epp = await start_epp(
        endpoints=ONE_POD,
        config_text=FLOW_CONTROL.format(ttl=ttl),
        refresh_metrics_interval_s=60,
    )
    controller = epp.app.director.config.flow_control
    assert controller is not None
    return epp, controller


async def routed(epp: Epp) -> Served:
    """A request routed to the one pod, its stream left open: the pod is full."""
    first = Served(epp)
    first.envoy.send(request_headers(), *body_messages(BODY))
    await until(lambda: len(first.replies) == 2)
    assert first.replies[0].destination == "10.0.0.1:8000"
    return first


async def finish(served: Served) -> None:
    """The routed request's response, to its end: capacity frees."""
    served.envoy.send(response_headers(), response_body(b"{}", end_of_stream=True))
    await asyncio.wait_for(served.task, 5.0)


async def cancelled(epp: Epp) -> float:
    return await epp.metric(
        "epp_flow_control_requests_total",
        {"outcome": "cancelled", "priority": "0", "fairness_id": "default-flow"},
    )


async def test_a_half_close_while_queued_takes_the_request_out_at_once(
    start_epp: StartEpp,
) -> None:
    epp, controller = await flow_control(start_epp)
    first = await routed(epp)
    second = Served(epp)
    second.envoy.send(request_headers(), *body_messages(BODY))
    await until(lambda: controller.queued == 1)
    await settle()
    # While it waits, one read runs ahead, in a task of its own.
    assert second.envoy.reads == 3
    assert second.envoy.reading == 1
    assert second.envoy.most_reading == 1
    assert len(second.envoy.readers) == 2
    assert second.envoy.readers[0] is second.task
    users = epp.app.director.users(epp.app.director.config)
    assert users == 2
    # Envoy half-closes (the client hung up): out of the queue without any timer
    # running, counted as cancelled; no reply; the RPC ends normally.
    second.envoy.half_close()
    await settle()
    assert controller.queued == 0
    assert second.task.done()
    assert not second.task.cancelled()
    second.task.result()
    assert second.replies == []
    assert await cancelled(epp) == 1
    assert await epp.metric("epp_requests_total", {"outcome": "abandoned"}) == 1
    # The pick was cancelled: it holds nothing, and nothing was routed for it.
    assert epp.app.director.users(epp.app.director.config) == 1
    assert second.envoy.reads == 3
    # The first request ends as usual; nothing is dispatched for the one that left.
    await finish(first)
    assert await epp.wait_in_flight(0) == 0
    assert epp.app.director.users(epp.app.director.config) == 0
    assert controller.picking == 0


async def test_a_message_read_while_queued_is_handled_after_the_decision(
    start_epp: StartEpp,
) -> None:
    """A STREAMED request body is routed on its headers; a body chunk read while
    the request waits is handed to the stream after the decision, in order."""
    epp, controller = await flow_control(start_epp)
    first = await routed(epp)
    second = Served(epp)
    second.envoy.send(request_headers(request_body_mode=m.STREAMED))
    await until(lambda: controller.queued == 1)
    await settle()
    assert second.envoy.reading == 1  # the read ahead
    second.envoy.send(request_body(b"the rest", end_of_stream=True))
    await settle()
    # The read ahead returned the chunk; no other read starts while the request
    # waits, and the chunk is not handled yet.
    assert second.envoy.reads == 2
    assert second.envoy.reading == 0
    assert second.replies == []
    assert controller.queued == 1
    await finish(first)
    await until(lambda: len(second.replies) == 2)
    decision, body = second.replies
    assert decision.kind == "request_headers"
    assert decision.destination == "10.0.0.1:8000"
    assert body.kind == "request_body"  # the chunk, let through after the decision
    # Then reads go on one at a time, from the stream's own task.
    await settle()
    assert second.envoy.reads == 3
    assert second.envoy.reading == 1
    assert second.envoy.last_reader is second.task
    second.envoy.send(response_headers(), response_body(b"{}", end_of_stream=True))
    second.envoy.half_close()
    await asyncio.wait_for(second.task, 5.0)
    assert [r.kind for r in second.replies[2:]] == ["response_headers", "response_body"]
    assert await epp.wait_in_flight(0) == 0
    assert await cancelled(epp) == 0


async def test_a_request_shed_while_a_read_runs_ahead_ends_after_the_half_close(
    start_epp: StartEpp,
) -> None:
    """The TTL's 429 ends the stream; the read started while the request waited
    is let end (Envoy half-closes after an ImmediateResponse) before the RPC ends,
    so no read is pending when the status goes."""
    epp, controller = await flow_control(start_epp, ttl="0.2s")
    first = await routed(epp)
    second = Served(epp)
    second.envoy.send(request_headers(), *body_messages(BODY))
    await until(lambda: len(second.replies) == 1)
    (shed,) = second.replies
    assert shed.kind == "immediate_response"
    assert shed.status == 429
    await settle()
    assert not second.task.done()
    assert second.envoy.reading == 1
    second.envoy.half_close()
    await asyncio.wait_for(second.task, 1.0)
    assert second.envoy.reads == 3
    assert controller.queued == 0
    assert epp.app.director.users(epp.app.director.config) == 1
    await finish(first)
    assert await epp.wait_in_flight(0) == 0


async def test_requests_that_do_not_wait_are_read_as_before(start_epp: StartEpp) -> None:
    """Flow control off, and on with room: every read from the stream's own task,
    one at a time, and none while a message is handled."""
    epp_off = await start_epp(endpoints=ONE_POD, refresh_metrics_interval_s=60)
    epp_on, controller = await flow_control(start_epp)
    for epp in (epp_off, epp_on):
        served = Served(epp)
        served.envoy.send(request_headers())
        await settle()
        assert served.envoy.reads == 2  # the headers, and the read for the next
        served.envoy.send(*body_messages(BODY))
        await until(lambda s=served: len(s.replies) == 2)  # type: ignore[misc]
        await settle()
        assert served.envoy.reads == 3
        served.envoy.send(response_headers(), response_body(b"{}", end_of_stream=True))
        await asyncio.wait_for(served.task, 5.0)
        # The response ended the stream: no read after the last message.
        assert served.envoy.reads == 4
        assert served.envoy.reading == 0
        assert served.read_only_by_its_own_task()
        assert [r.kind for r in served.replies] == [
            "request_headers",
            "request_body",
            "response_headers",
            "response_body",
        ]
        # A client that leaves before its request is routed: the end of the
        # stream read as before.
        gone = Served(epp)
        gone.envoy.send(request_headers())
        gone.envoy.half_close()
        await asyncio.wait_for(gone.task, 5.0)
        assert gone.envoy.reads == 2
        assert gone.read_only_by_its_own_task()
        assert gone.replies == []
    assert controller.passes > 0
    assert await cancelled(epp_on) == 0


async def test_a_half_close_while_queued_through_grpc(start_epp: StartEpp) -> None:
    """The same over real gRPC: the client's half-close (Envoy's graceful close)
    while the request waits ends the stream with status OK and no reply, and the
    request leaves the queue."""
    epp, controller = await flow_control(start_epp)
    first = epp.stream()
    await first.send(request_headers(), *body_messages(BODY))
    assert (await first.expect()).kind == "request_headers"
    await first.recv_body("request_body")
    second = epp.stream()
    await second.send(request_headers(), *body_messages(BODY))
    await until(lambda: controller.queued == 1)
    started = asyncio.get_running_loop().time()
    await second.call.done_writing()
    await until(lambda: controller.queued == 0, timeout_s=1.0)
    assert asyncio.get_running_loop().time() - started < 0.5
    assert await second.ended() == grpc.StatusCode.OK
    assert await cancelled(epp) == 1
    assert epp.app.processor.active == 1
    await first.send(response_headers(), response_body(b"{}", end_of_stream=True))
    await first.expect()
    await first.expect()
    assert await first.ended() == grpc.StatusCode.OK
    assert await epp.wait_in_flight(0) == 0
    assert epp.app.processor.active == 0
