"""The flow controller on a fake clock: bands, fairness, ordering, bounds, TTLs,
cancellation, and dispatch driven by events only."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from epp.plugins.edf_ordering_policy import EdfOrderingPolicy
from epp.plugins.fcfs_ordering_policy import FcfsOrderingPolicy
from epp.plugins.soft_reflective_ceiling_policy import SoftReflectiveCeilingPolicy

from epp.extproc import messages as m
from epp.flowcontrol import FlowQueue, QueueFull, QueueItem, QueueTimeout, QueueTimeoutNoEndpoints
from epp.scheduling import NoParameters
from tests.epp.flowcontrol.helpers import Rig, make_rig, settle, template
from tests.plugins.helpers import context


def hold(rig: Rig) -> None:
    """Make the pool saturated with a request of ours in flight (so the idle floor
    does not apply)."""
    rig.detector.value = 1.0
    rig.datastore.acquire(rig.endpoints[0])


def release(rig: Rig) -> None:
    rig.detector.value = 0.0
    rig.datastore.release(rig.endpoints[0])
    rig.controller.notify()


def sample(rig: Rig, name: str, **labels: str) -> float:
    value = rig.registry.get_sample_value(name, labels)
    return value if value is not None else 0.0


async def test_a_request_passes_at_once_while_the_pool_has_room() -> None:
    rig = make_rig()
    task = rig.submit("a")
    await settle()
    assert task.done()
    assert rig.dispatched == ["a"]
    assert rig.controller.queued == 0
    assert sample(rig, "epp_flow_control_requests_total", outcome="dispatched", priority="0",
                  fairness_id="default-flow") == 1  # fmt: skip


async def test_strict_priority_between_bands() -> None:
    rig = make_rig(endpoints=1)
    hold(rig)
    tasks = [
        rig.submit("low-1", priority=-1),
        rig.submit("mid-1", priority=0),
        rig.submit("high-1", priority=5),
        rig.submit("low-2", priority=-1),
        rig.submit("high-2", priority=5),
    ]
    await settle()
    assert rig.dispatched == []
    assert rig.controller.queued == 5
    release(rig)
    await asyncio.gather(*tasks)
    assert rig.dispatched == ["high-1", "high-2", "mid-1", "low-1", "low-2"]


@pytest.mark.parametrize(
    ("ceiling", "saturation", "dispatched"),
    [
        (1.5, 1.2, ["high"]),  # the top band passes a saturated pool, up to its ceiling
        (1.5, 1.6, []),  # past its own ceiling it waits too
        (1.0, 1.2, []),  # llm-d's behaviour: at saturation no band is dispatched
    ],
)
async def test_the_top_band_has_a_ceiling_of_its_own(
    ceiling: float, saturation: float, dispatched: list[str]
) -> None:
    params = msgspec.convert(
        {"highestBandCeiling": ceiling}, SoftReflectiveCeilingPolicy.Parameters
    )
    rig = make_rig(endpoints=1, usage_limit=SoftReflectiveCeilingPolicy(params, context("soft")))
    hold(rig)
    rig.detector.value = saturation
    # The high band first, so that "mid" is not the top band when it arrives.
    tasks = [rig.submit("high", priority=5), rig.submit("mid", priority=0)]
    await settle()
    assert rig.dispatched == dispatched
    assert rig.controller.queued == 2 - len(dispatched)
    release(rig)
    await asyncio.gather(*tasks)
    assert sorted(rig.dispatched) == ["high", "mid"]


async def test_round_robin_gives_a_quiet_flow_its_turns_against_a_burst() -> None:
    rig = make_rig(endpoints=1, band=template("round-robin"))
    hold(rig)
    tasks = [rig.submit(f"burst-{i}", flow="tenant-a") for i in range(6)]
    tasks += [rig.submit(f"quiet-{i}", flow="tenant-b") for i in range(2)]
    await settle()
    release(rig)
    await asyncio.gather(*tasks)
    assert rig.dispatched == [
        "burst-0", "quiet-0", "burst-1", "quiet-1", "burst-2", "burst-3", "burst-4", "burst-5",
    ]  # fmt: skip


async def test_global_strict_serves_the_band_first_come_first_served() -> None:
    rig = make_rig(endpoints=1)
    hold(rig)
    tasks = [rig.submit(f"burst-{i}", flow="tenant-a") for i in range(3)]
    tasks.append(rig.submit("quiet-0", flow="tenant-b"))
    await settle()
    release(rig)
    await asyncio.gather(*tasks)
    assert rig.dispatched == ["burst-0", "burst-1", "burst-2", "quiet-0"]


async def test_fcfs_within_a_flow() -> None:
    rig = make_rig(endpoints=1, band=template("round-robin"))
    hold(rig)
    tasks = []
    for i in range(5):
        tasks.append(rig.submit(f"r{i}", flow="tenant"))
        rig.clock.advance(0.1)
    await settle()
    release(rig)
    await asyncio.gather(*tasks)
    assert rig.dispatched == [f"r{i}" for i in range(5)]


def test_edf_orders_by_deadline_then_arrival() -> None:
    def item(seq: int, at: float, ttl: float) -> QueueItem:
        return QueueItem(f"r{seq}", "f", 0, 1, enqueued_at=at, seq=seq, ttl_s=ttl)

    items = [item(1, 0.0, 60.0), item(2, 1.0, 10.0), item(3, 2.0, 0.0), item(4, 3.0, 8.0)]
    edf = FlowQueue("f", EdfOrderingPolicy(NoParameters(), context("edf")))
    fcfs = FlowQueue("f", FcfsOrderingPolicy(NoParameters(), context("fcfs")))
    for queued in items:
        edf.push(queued)
        fcfs.push(queued)
    # Deadlines 60, 11, none, 11: the two at 11 by arrival, the one without last.
    assert [edf.pop().request_id for _ in range(4)] == ["r2", "r4", "r1", "r3"]
    assert [fcfs.pop().request_id for _ in range(4)] == ["r1", "r2", "r3", "r4"]


async def test_a_full_band_sheds_at_once_with_429_retry_after_and_a_clear_body() -> None:
    rig = make_rig(band=template(max_requests=2))
    hold(rig)
    waiting = [rig.submit("a"), rig.submit("b")]
    await settle()
    with pytest.raises(QueueFull) as info:
        await rig.controller.admit("c", 0, "default-flow", 10)
    error = info.value
    assert error.status == 429
    assert "priority band 0 holds its maximum of 2 requests" in error.message
    reply = m.immediate_response(error).immediate_response
    assert reply.status.code == 429
    headers = {o.header.key: o.header.raw_value.decode() for o in reply.headers.set_headers}
    assert headers["retry-after"] == "1"
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert headers["content-type"] == "application/json"
    body = json.loads(reply.body)
    assert body["error"]["code"] == 429
    assert "retry later" in body["error"]["message"]
    assert rig.controller.queued == 2
    assert sample(rig, "epp_flow_control_requests_total", outcome="rejected", priority="0",
                  fairness_id="default-flow") == 1  # fmt: skip
    for task in waiting:
        task.cancel()
    await settle()


async def test_a_full_band_sheds_from_the_flow_that_holds_the_most_of_it() -> None:
    rig = make_rig(band=template(max_requests=4))
    hold(rig)
    flood = [rig.submit(f"bursty-{i}", flow="bursty") for i in range(3)]
    steady = rig.submit("steady-0", flow="steady")
    await settle()
    assert rig.controller.queued == 4
    # The band is full: a steady request pushes out the flooding tenant's newest.
    second = rig.submit("steady-1", flow="steady")
    await settle()
    assert flood[2].done()
    with pytest.raises(QueueFull, match="its flow holds the most of it"):
        flood[2].result()
    assert [t.done() for t in (flood[0], flood[1], second)] == [False, False, False]
    assert rig.controller.queued == 4
    # Now both hold two: a newcomer of either flow is shed itself.
    with pytest.raises(QueueFull, match="priority band 0 holds its maximum of 4 requests"):
        await rig.controller.admit("steady-2", 0, "steady", 10)
    with pytest.raises(QueueFull, match="priority band 0 holds its maximum of 4 requests"):
        await rig.controller.admit("bursty-3", 0, "bursty", 10)
    assert sample(rig, "epp_flow_control_requests_total", outcome="rejected", priority="0",
                  fairness_id="bursty") == 2  # fmt: skip
    # The others are served in their turn.
    release(rig)
    await settle()
    assert sorted(rig.dispatched) == ["bursty-0", "bursty-1", "steady-0", "steady-1"]
    for task in [*flood, steady, second]:
        task.cancel()
    await settle()


async def test_the_byte_bound_and_the_global_bound_shed_too() -> None:
    rig = make_rig(band=template(max_bytes=100))
    hold(rig)
    task = rig.submit("a", size=60)
    await settle()
    with pytest.raises(QueueFull, match="would exceed its maximum of 100 bytes"):
        await rig.controller.admit("b", 0, "default-flow", 60)
    task.cancel()

    rig = make_rig(max_requests=1)
    hold(rig)
    task = rig.submit("a", priority=3)
    await settle()
    with pytest.raises(QueueFull, match=r"maximum of 1 requests \(maxRequests\)"):
        await rig.controller.admit("b", -2, "default-flow", 1)
    task.cancel()
    await settle()


async def test_ttl_sheds_with_429_and_the_timer_is_the_only_wake_up() -> None:
    rig = make_rig(ttl_s=5.0)
    hold(rig)
    task = rig.submit("late")
    await settle()
    # One timer: the next of the TTL (5 s) and the saturation recheck (a refresh).
    assert rig.sleep.requested == [pytest.approx(0.05)]
    rig.clock.advance(5.0)
    rig.sleep.fire()
    await settle()
    assert task.done()
    with pytest.raises(QueueTimeout, match=r"waited 5s in flow control") as info:
        task.result()
    assert info.value.status == 429
    assert info.value.response_headers == (
        ("retry-after", "1"),
        ("x-llm-d-request-dropped-reason", "rejected-ttl-expired"),
    )
    assert rig.controller.queued == 0
    assert sample(rig, "epp_flow_control_requests_total", outcome="ttl_expired", priority="0",
                  fairness_id="default-flow") == 1  # fmt: skip
    assert sample(rig, "epp_flow_control_request_queue_duration_seconds_count",
                  outcome="ttl_expired", priority="0") == 1  # fmt: skip


async def test_ttl_with_no_endpoint_left_is_a_503() -> None:
    rig = make_rig(ttl_s=2.0)
    hold(rig)
    task = rig.submit("orphan")
    await settle()
    rig.datastore.replace_all([])
    rig.clock.advance(3.0)
    rig.controller.notify()
    await settle()
    with pytest.raises(QueueTimeoutNoEndpoints) as info:
        task.result()
    assert info.value.status == 503
    assert ("retry-after", "5") in info.value.response_headers


async def test_on_wait_is_called_only_for_a_request_that_is_queued() -> None:
    """The hook the ext_proc server watches its stream by: called from the caller's
    task, once, when the request is queued; never for one dispatched at once."""
    rig = make_rig()
    calls: list[asyncio.Task[object] | None] = []

    def on_wait() -> None:
        calls.append(asyncio.current_task())

    passed = asyncio.get_running_loop().create_task(
        rig.controller.admit("a", 0, "default-flow", 1, on_wait=on_wait)
    )
    await settle()
    assert passed.done()
    assert calls == []
    rig.controller.picked(passed.result())
    hold(rig)
    waiting = asyncio.get_running_loop().create_task(
        rig.controller.admit("b", 0, "default-flow", 1, on_wait=on_wait)
    )
    await settle()
    assert calls == [waiting]
    assert rig.controller.queued == 1
    waiting.cancel()
    await settle()
    assert rig.controller.queued == 0
    release(rig)


async def test_a_failing_on_wait_hook_does_not_strand_the_request() -> None:
    rig = make_rig()
    hold(rig)

    def on_wait() -> None:
        raise RuntimeError("broken hook")

    waiting = asyncio.get_running_loop().create_task(
        rig.controller.admit("a", 0, "default-flow", 1, on_wait=on_wait)
    )
    await settle()
    assert rig.controller.queued == 1
    release(rig)
    await settle()
    assert waiting.done()
    rig.controller.picked(waiting.result())
    assert rig.controller.queued == 0


async def test_a_cancelled_request_leaves_its_queue_at_once() -> None:
    rig = make_rig()
    hold(rig)
    tasks = [rig.submit("a", flow="x", size=7), rig.submit("b", flow="y", size=5)]
    await settle()
    assert rig.controller.queued == 2
    assert sample(rig, "epp_flow_control_queue_size", priority="0", fairness_id="x") == 1
    tasks[0].cancel()
    await settle()
    assert rig.controller.queued == 1
    assert rig.controller.queued_bytes == 5
    assert sample(rig, "epp_flow_control_queue_size", priority="0", fairness_id="x") == 0
    assert sample(rig, "epp_flow_control_requests_total", outcome="cancelled", priority="0",
                  fairness_id="x") == 1  # fmt: skip
    tasks[1].cancel()
    await settle()
    assert rig.controller.queued == 0
    # Nothing waits: no timer is left running.
    assert rig.controller._timer is None
    release(rig)
    await settle()
    assert rig.dispatched == []


async def test_dispatch_resumes_when_a_request_finishes_without_polling() -> None:
    rig = make_rig(endpoints=1)
    rig.detector.by_in_flight(per_endpoint=1)  # one request fills the pool
    endpoint = rig.endpoints[0]
    first = rig.submit("first", pick=False)
    await settle()
    assert rig.dispatched == ["first"]
    rig.datastore.acquire(endpoint)  # the director's pick: in flight there
    rig.controller.picked(first.result())
    second = rig.submit("second")
    await settle()
    assert rig.dispatched == ["first"]
    passes, reads = rig.controller.passes, rig.detector.calls
    # Time goes by and nothing happens: no pass runs, the detector is not read.
    for _ in range(50):
        rig.clock.advance(0.5)
        await asyncio.sleep(0)
    assert (rig.controller.passes, rig.detector.calls) == (passes, reads)
    # The first request ends: the director releases it and tells the controller.
    rig.datastore.release(endpoint)
    rig.controller.notify()
    await settle()
    assert rig.dispatched == ["first", "second"]
    assert second.done()
    assert rig.controller.passes == passes + 1


async def test_the_metrics_refresh_recheck_opens_the_gate_when_metrics_change() -> None:
    rig = make_rig()
    hold(rig)
    task = rig.submit("a")
    await settle()
    passes = rig.controller.passes
    rig.detector.value = 0.3  # a new scrape says there is room
    rig.sleep.fire()  # the recheck timer, one refresh interval later
    await settle()
    assert task.done()
    assert rig.controller.passes == passes + 1


async def test_an_idle_pool_is_never_held_back_whatever_the_detector_says() -> None:
    rig = make_rig(endpoints=1, saturation=1.0)  # stuck at 1.0: stale, broken, wrong
    endpoint = rig.endpoints[0]
    tasks = [rig.submit("a", pick=False), rig.submit("b", pick=False)]
    await settle()
    # Nothing of ours in flight: one request goes, the other waits for it.
    assert rig.dispatched == ["a"]
    rig.datastore.acquire(endpoint)
    rig.controller.picked(tasks[0].result())
    await settle()
    assert rig.dispatched == ["a"]
    # `a` ends: the pool is idle again, so `b` goes (one at a time, never frozen).
    rig.datastore.release(endpoint)
    rig.controller.notify()
    await settle()
    assert rig.dispatched == ["a", "b"]
    rig.controller.picked(tasks[1].result())


async def test_picks_under_way_are_bounded_by_the_endpoints() -> None:
    rig = make_rig(endpoints=2)
    tasks = [rig.submit(f"r{i}", pick=False) for i in range(4)]
    await settle()
    assert rig.dispatched == ["r0", "r1"]
    assert rig.controller.picking == 2
    rig.controller.picked(tasks[0].result())
    await settle()
    assert rig.dispatched == ["r0", "r1", "r2"]
    for task in tasks[1:3]:
        rig.controller.picked(task.result())
    await settle()
    rig.controller.picked(tasks[3].result())
    assert rig.controller.picking == 0


async def test_explain_tells_where_a_request_would_wait() -> None:
    rig = make_rig()
    facts = rig.controller.explain(0, "tenant")
    assert facts["wouldQueue"] is False
    assert facts["fairnessPolicy"] == "global-strict-fairness-policy"
    hold(rig)
    task = rig.submit("a", priority=5)
    await settle()
    facts = rig.controller.explain(0, "tenant")
    assert facts["band"] == 0
    assert facts["queuedAhead"] == 1
    assert facts["wouldQueue"] is True
    assert "wait first" in facts["reason"]
    task.cancel()
    await settle()


async def test_requests_passing_through_leave_no_state_behind() -> None:
    rig = make_rig()
    tasks = [rig.submit(f"r{i}", flow=f"tenant-{i}") for i in range(500)]
    await asyncio.gather(*tasks)
    assert rig.controller.queued == 0
    assert all(not band.flows for band in rig.controller._bands.values())
    assert len(rig.controller._deadlines) <= 64
    assert rig.controller._timer is None
