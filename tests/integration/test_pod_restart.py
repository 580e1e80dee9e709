"""A simulated pod killed (SIGKILL) and started again mid-run, behind real Envoy and
`epp serve`: with precise prefix routing and the stale-metrics filter, and with
the built-in default config, which has no filter.

What must hold: the only requests that fail are those the EPP sent to the pod
before it could know it was gone (in flight at the kill, or routed in the moment
before the next scrape was refused); the EPP knows at its next scrape, not after
the staleness threshold; the restarted pod's index entries are those of the new
engine (the old ones are cleared); and traffic goes to it again once it answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from epp.config.defaults import DEFAULT_CONFIG
from tests.integration.faults import (
    MODEL,
    Load,
    debug_endpoints,
    eventually,
    index_in_step,
    precise_config,
    prompt,
    running,
    send,
    sim_pods,
)

# Far longer than the test: only the refused connection can make the pod stale.
EPP_ARGS = ["--metrics-staleness-threshold", "60s"]


async def test_a_pod_killed_and_restarted_mid_run(tmp_path: Path) -> None:
    pods = sim_pods(tmp_path, 3)
    with running(tmp_path, pods, config=precise_config(), epp_args=EPP_ARGS) as stack:
        async with aiohttp.ClientSession() as session:

            async def entries() -> dict[str, dict[str, Any]]:
                return await debug_endpoints(session, stack)

            async def all_up() -> bool:
                found = await entries()
                return all(
                    not e["metrics"]["stale"] and e["index"]["state"] == "live"
                    for e in found.values()
                )

            await eventually(all_up, "every pod scraped and its KV events live")
            # sim-1 caches a prefix of its own, indexed, before it dies: the new
            # engine will not have it, so the EPP must forget it.
            sim1 = f"http://{pods['sim-1'].address}"
            assert await send(session, sim1, prompt(98, 0)) == (200, "sim-1")
            await eventually(
                lambda: index_in_step(session, stack, pods["sim-1"]), "sim-1's blocks indexed"
            )
            old_blocks = (await entries())["sim-1"]["index"]["blocks"]
            assert old_blocks > 0
            load = Load(stack.url).start()
            await asyncio.sleep(1.5)
            killed = time.monotonic()
            pods.kill("sim-1")

            async def sim1_gone() -> dict[str, Any] | None:
                entry = (await entries())["sim-1"]
                return entry if entry["metrics"]["stale"] else None

            gone = await eventually(sim1_gone, "sim-1 seen as gone")
            detected = time.monotonic()
            assert str(gone["metrics"]["reason"]).startswith("unreachable: ")
            # Well before the 60 s staleness threshold: the refused scrape did it.
            assert detected - killed < 20.0
            await asyncio.sleep(1.0)
            restarted = time.monotonic()
            pods.start("sim-1")

            async def sim1_back() -> dict[str, Any] | None:
                entry = (await entries())["sim-1"]
                back = not entry["metrics"]["stale"] and entry["index"]["restarts"] >= 1
                return entry if back else None

            await eventually(sim1_back, "sim-1 scraped again and its new engine followed")
            # Traffic returns: a prefix only the new engine caches draws its requests.
            status, pod = await send(session, sim1, prompt(99, 0))
            assert (status, pod) == (200, "sim-1")
            await eventually(
                lambda: index_in_step(session, stack, pods["sim-1"]), "sim-1's new blocks indexed"
            )
            for n in range(1, 4):
                assert await send(session, stack.url, prompt(99, n)) == (200, "sim-1")
            await asyncio.sleep(0.5)
            outcomes = await load.stop()
            # Every index is the engine's true state: the killed engine's blocks are
            # gone from the EPP, the new engine's are there.
            for name in pods.pods:
                await eventually(
                    lambda name=name: index_in_step(session, stack, pods[name]),
                    f"the index of {name} in step with its engine",
                )
            # No request is left counted in flight (those that failed included).
            total = sum(e["inFlight"] for e in (await entries()).values())
            assert total == 0

    failed = [o for o in outcomes if not o.ok]
    # Only requests sent before the EPP knew: in flight at the kill or routed just
    # after it. Everything later succeeded, the dead pod avoided.
    assert all(o.started < detected for o in failed), failed
    assert all(o.ended >= killed for o in failed), failed
    assert [o for o in outcomes if o.started >= detected and not o.ok] == []
    during = [o for o in outcomes if detected <= o.started and o.ended < restarted]
    assert during
    assert all(o.pod != "sim-1" for o in during)
    assert len([o for o in outcomes if o.started >= restarted]) > 0


async def test_no_config_sends_requests_to_a_killed_pod(tmp_path: Path) -> None:
    # The built-in default has no stale-metrics filter, and a dead pod's requests
    # fail at once, so by its own in-flight count it reads as the least loaded pod:
    # left among the candidates it drew more than its share until it came back.
    pods = sim_pods(tmp_path, 3)
    with running(tmp_path, pods, config=DEFAULT_CONFIG, epp_args=EPP_ARGS) as stack:
        async with aiohttp.ClientSession() as session:

            async def entries() -> dict[str, dict[str, Any]]:
                return await debug_endpoints(session, stack)

            async def all_scraped() -> bool:
                return all(not e["metrics"]["stale"] for e in (await entries()).values())

            await eventually(all_scraped, "every pod scraped")
            load = Load(stack.url).start()
            await asyncio.sleep(1.5)
            killed = time.monotonic()
            pods.kill("sim-1")

            async def sim1_gone() -> bool:
                return bool((await entries())["sim-1"]["metrics"]["unreachable"])

            await eventually(sim1_gone, "sim-1's scrape refused")
            detected = time.monotonic()
            async with session.post(
                stack.admin_url() + "/debug/explain",
                json={"path": "/v1/completions", "body": {"model": MODEL, "prompt": prompt(1, 0)}},
            ) as response:
                assert response.status == 200
                explained = await response.json()
            assert explained["down"] == ["sim-1"]
            assert "sim-1" not in [c["name"] for c in explained["candidates"]]
            await asyncio.sleep(1.5)
            restarted = time.monotonic()
            pods.start("sim-1")

            async def sim1_serves_again() -> bool:
                return any(o.pod == "sim-1" and o.started >= restarted for o in load.outcomes)

            await eventually(sim1_serves_again, "a request served by the restarted sim-1")
            outcomes = await load.stop()

    failed = [o for o in outcomes if not o.ok]
    assert all(killed <= o.ended and o.started < detected for o in failed), failed
    during = [o for o in outcomes if detected <= o.started and o.ended < restarted]
    assert len(during) > 20
    assert all(o.ok and o.pod != "sim-1" for o in during), during
