"""A flow controller on a fake clock, a fake detector and a real datastore, with the
real policy plugins: what the flow-control tests drive."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.plugins.edf_ordering_policy import EdfOrderingPolicy
from epp.plugins.fcfs_ordering_policy import FcfsOrderingPolicy
from epp.plugins.global_strict_fairness_policy import GlobalStrictFairnessPolicy
from epp.plugins.round_robin_fairness_policy import RoundRobinFairnessPolicy
from epp.plugins.static_usage_limit_policy import StaticUsageLimitPolicy
from prometheus_client import CollectorRegistry

from epp.clock import VirtualClock
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.flowcontrol import (
    BandTemplate,
    FlowController,
    FlowControlMetrics,
    FlowControlSettings,
    QueueItem,
    UsageLimitPolicy,
)
from epp.scheduling import NoParameters
from tests.plugins.helpers import context


class FakeDetector:
    """Saturation as the test sets it: a value, or `by_in_flight` (each endpoint
    full at `per_endpoint` requests in flight, the pool's mean)."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value
        self.per_endpoint: int | None = None
        self.calls = 0

    def by_in_flight(self, per_endpoint: int) -> None:
        self.per_endpoint = per_endpoint

    def __call__(self, endpoints: Sequence[Endpoint]) -> float:
        self.calls += 1
        if self.per_endpoint is not None:
            return sum(e.in_flight / self.per_endpoint for e in endpoints) / len(endpoints)
        return self.value


class ManualSleep:
    """A `sleep` that ends only when the test says so: timers never fire on their
    own, so a test sees exactly which events ran a dispatch pass."""

    def __init__(self) -> None:
        self.requested: list[float] = []
        self._release = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.requested.append(seconds)
        await self._release.wait()

    def fire(self) -> None:
        """End every pending sleep (the timers' passes then run)."""
        self._release.set()
        self._release = asyncio.Event()


@dataclass
class Rig:
    controller: FlowController
    detector: FakeDetector
    clock: VirtualClock
    sleep: ManualSleep
    datastore: Datastore
    registry: CollectorRegistry
    dispatched: list[str] = field(default_factory=list)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.datastore.ready_endpoints()

    def submit(
        self,
        request_id: str,
        priority: int = 0,
        flow: str = "default-flow",
        size: int = 10,
        *,
        pick: bool = True,
    ) -> asyncio.Task[QueueItem]:
        """A request waiting in flow control, as a task; its id goes to
        `dispatched` when it is let through. `pick`: its pick ends at once (as the
        director's would, in flight nowhere); else the test calls `picked`."""

        async def wait() -> QueueItem:
            item = await self.controller.admit(request_id, priority, flow, size)
            self.dispatched.append(request_id)
            if pick:
                self.controller.picked(item)
            return item

        return asyncio.get_running_loop().create_task(wait(), name=request_id)


def template(
    fairness: str = "global-strict", ordering: str = "fcfs", **bounds: int
) -> BandTemplate:
    ctx = context("policy")
    fairness_policy = (
        RoundRobinFairnessPolicy(NoParameters(), ctx)
        if fairness == "round-robin"
        else GlobalStrictFairnessPolicy(NoParameters(), ctx)
    )
    ordering_policy = (
        EdfOrderingPolicy(NoParameters(), ctx)
        if ordering == "edf"
        else FcfsOrderingPolicy(NoParameters(), ctx)
    )
    return BandTemplate(
        bounds.get("max_requests", 5000),
        bounds.get("max_bytes", 1_000_000_000),
        fairness_policy,
        ordering_policy,
        f"{fairness}-fairness-policy",
        f"{ordering}-ordering-policy",
    )


def make_rig(
    *,
    endpoints: int = 2,
    saturation: float = 0.0,
    band: BandTemplate | None = None,
    ttl_s: float = 60.0,
    max_requests: int = 0,
    threshold: float = 1.0,
    usage_limit: UsageLimitPolicy | None = None,
) -> Rig:
    datastore = Datastore()
    datastore.replace_all(
        [EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(endpoints)]
    )
    band = band or template()
    clock = VirtualClock(100.0)
    sleep = ManualSleep()
    detector = FakeDetector(saturation)
    settings = FlowControlSettings(
        bands=(band.band(0),),
        default_band=band,
        default_negative_band=None,
        usage_limit=usage_limit
        or StaticUsageLimitPolicy(
            StaticUsageLimitPolicy.Parameters(threshold=threshold), context("limit")
        ),
        usage_limit_name="static-usage-limit-policy" if usage_limit is None else "usage-limit",
        max_requests=max_requests,
        default_request_ttl_s=ttl_s,
        recheck_interval_s=0.05,
    )
    controller = FlowController(settings, detector, datastore, clock=clock, sleep=sleep)
    registry = CollectorRegistry()
    controller.metrics = FlowControlMetrics(registry, controller.flows)
    return Rig(controller, detector, clock, sleep, datastore, registry)


async def settle() -> None:
    """Let every task that can run, run (no time passes on the fake clock)."""
    for _ in range(5):
        await asyncio.sleep(0)
