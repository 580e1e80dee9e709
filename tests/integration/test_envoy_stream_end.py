"""Envoy stays up however an ext_proc stream ends, with the shipped config.

Envoy 1.36 to 1.40 (at least) crash when `ext_proc_graceful_grpc_close` is on and a
worker's cached ext_proc gRPC client is dropped while a stream still waits for the
EPP's status: the stream loses its client without its HTTP/2 stream being reset,
and the status is then delivered to freed memory (docs/reliability.md, "Ending
ext_proc streams"). The cache drops a client once no new stream has asked for it
for `max_cached_entry_idle_duration` (50 s by default): any response that outlives
50 s with no new request behind it. The shipped configs keep the graceful close
(the EPP's memory needs it) and keep the client for a year.

- `test_streams_that_outlive_the_client_cache_idle_time_keep_envoy_up` is the
  reproduction with the shipped config as it is: Envoy died in it before. In
  `make test` its streams outlive Envoy's minimum idle time (5 s), which kills Envoy
  without the shipped setting (the next test); the full reproduction, past Envoy's
  default 50 s, runs with EPP_STRESS=1 (`make stress`).
- `test_without_the_cache_setting_envoy_dies` shows the defect in seconds (the idle
  time at Envoy's minimum, 5 s): it proves the first test's method reaches the
  crash, and fails the day an Envoy release fixes it; with Envoy's default close
  (no flag) the same sequence is survived.
- `test_a_mixed_load_ends_every_stream_cleanly` runs every kind of stream end under
  load and checks each request's outcome and the EPP's books afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.stack import ENVOY_YAML, envoy_version
from tests.integration.conftest import Stack, running_stack
from tests.integration.load_mix import EXPECTED, KINDS, MAX_BODY_BYTES, closed_loop

DEFAULT_PROFILE = (ENVOY_YAML.parent.parent / "config" / "default.yaml").read_text()

# Envoy's default max_cached_entry_idle_duration, and its minimum.
ENVOY_DEFAULT_IDLE_S = 50.0
ENVOY_MINIMUM_IDLE_S = 5.0


def alive(stack: Stack) -> bool:
    assert stack.envoy.process is not None
    return stack.envoy.process.poll() is None


async def epp_metrics(stack: Stack) -> dict[str, float]:
    """The EPP's samples, keyed `name{label=value,...}`."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(stack.admin_url + "/metrics") as response,
    ):
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


async def books_closed(stack: Stack, timeout_s: float = 10.0) -> dict[str, float]:
    """Wait until the EPP holds no stream and no request in flight; its samples."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await epp_metrics(stack)
        open_now = {
            key: value
            for key, value in samples.items()
            if key.startswith(("epp_extproc_active_streams", "epp_in_flight_requests"))
            and value != 0
        }
        if not open_now:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"the EPP still counts open streams or requests: {open_now}")
        await asyncio.sleep(0.1)


async def post(
    http: aiohttp.ClientSession, stack: Stack, body: dict[str, Any]
) -> aiohttp.ClientResponse:
    return await http.post(stack.url + "/v1/completions", json=body)


def held(key: str, **extra: Any) -> dict[str, Any]:
    """A streamed completion its upstream holds open after the first event."""
    return {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 4, "hold": key, **extra}


async def wait_for_exit(stack: Stack, timeout_s: float) -> int | None:
    assert stack.envoy.process is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = stack.envoy.process.poll()
        if code is not None:
            return code
        await asyncio.sleep(0.1)
    return None


@pytest.mark.parametrize(
    "idle_s",
    [
        ENVOY_MINIMUM_IDLE_S + 2,
        pytest.param(
            ENVOY_DEFAULT_IDLE_S + 3,
            marks=pytest.mark.skipif(
                os.environ.get("EPP_STRESS") != "1",
                reason="a minute long: EPP_STRESS=1 (make stress) runs it",
            ),
        ),
    ],
    ids=["past-the-minimum-idle-time", "past-the-default-idle-time"],
)
async def test_streams_that_outlive_the_client_cache_idle_time_keep_envoy_up(
    tmp_path: Path, idle_s: float
) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as http:
            # Three streams opened together, then no new stream for longer than
            # an idle time that drops the client they share without the shipped
            # setting (Envoy's default, or the minimum it accepts).
            cancelled = await post(http, stack, held("cancelled"))
            finished = await post(http, stack, held("finished"))
            cut = await post(http, stack, held("cut", fail="abort"))
            for response in (cancelled, finished, cut):
                assert response.status == 200
                assert (await response.content.readany()).startswith(b"data: ")
            await asyncio.sleep(idle_s)
            assert alive(stack)

            # The client hangs up: Envoy half-closes, the EPP answers with its status
            # a round trip later, when a dropped client has left the stream dangling.
            cancelled.close()
            await asyncio.sleep(0.5)
            stack.upstreams.release("cancelled")  # its upstream handler, left waiting
            stack.upstreams.release("finished")
            assert (await finished.read()).endswith(b"data: [DONE]\n\n")
            stack.upstreams.release("cut")
            try:
                await cut.read()
                raise AssertionError("the upstream's abort did not reach the client")
            except aiohttp.ClientPayloadError:
                pass
            await asyncio.sleep(1.0)  # the EPP's statuses reach Envoy
            assert alive(stack), f"Envoy died:\n{stack.envoy.log_tail()}"

            # And it still serves.
            async with http.post(
                stack.url + "/v1/completions", json={"model": "m", "prompt": "after"}
            ) as response:
                assert response.status == 200
        samples = await books_closed(stack)
        assert samples["epp_responses_total{result=completed}"] >= 2
        assert samples["epp_responses_total{result=aborted}"] >= 2


@pytest.mark.parametrize("graceful", [True, False], ids=["graceful-close", "envoy-default"])
async def test_without_the_cache_setting_envoy_dies(tmp_path: Path, graceful: bool) -> None:
    """With the graceful close (and Envoy's idle time at its minimum), Envoy dies
    when a client hangs up on a stream that outlived the idle time; with Envoy's
    default close (a reset), it does not."""

    def short_idle(bootstrap: dict[str, Any]) -> None:
        bootstrap["grpc_async_client_manager_config"] = {
            "max_cached_entry_idle_duration": f"{ENVOY_MINIMUM_IDLE_S:g}s"
        }
        if not graceful:
            del bootstrap["layered_runtime"]

    with running_stack(tmp_path, change_envoy=short_idle) as stack:
        async with aiohttp.ClientSession() as http:
            response = await post(http, stack, held("cancelled"))
            assert response.status == 200
            await response.content.readany()
            await asyncio.sleep(ENVOY_MINIMUM_IDLE_S + 2)
            assert alive(stack)
            response.close()
            code = await wait_for_exit(stack, timeout_s=5.0)
            stack.upstreams.release("cancelled")
            if not graceful:
                assert code is None, f"Envoy died:\n{stack.envoy.log_tail()}"
                async with http.post(
                    stack.url + "/v1/completions", json={"model": "m", "prompt": "after"}
                ) as after:
                    assert after.status == 200
                return
        assert code == -signal.SIGSEGV, (
            "Envoy survived a stream that outlived its gRPC client cache's idle time with"
            " the graceful close on: if this Envoy release fixed the defect, the shipped"
            " configs' grpc_async_client_manager_config may go (docs/reliability.md,"
            f" 'Ending ext_proc streams'); Envoy {envoy_version()}, exit code {code}"
        )


async def test_a_mixed_load_ends_every_stream_cleanly(tmp_path: Path) -> None:
    with running_stack(
        tmp_path, config_text=DEFAULT_PROFILE, max_body_bytes=MAX_BODY_BYTES
    ) as stack:
        before = await epp_metrics(stack)
        tally = await closed_loop(
            stack.url, requests=1200, concurrency=48, seed=1, keep_going=lambda: alive(stack)
        )
        assert alive(stack), f"Envoy died:\n{stack.envoy.log_tail()}"
        assert tally.total == 1200
        assert set(tally.by_kind()) == set(KINDS)
        assert tally.unexpected == {}, tally.by_kind()
        after = await books_closed(stack)

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    # The EPP's own view of the same requests: nothing broke, nothing left open.
    assert grew("epp_extproc_stream_errors_total{reason=internal}") == 0
    assert grew("epp_extproc_stream_errors_total{reason=protocol}") == 0
    outcomes = tally.by_kind()
    assert grew("epp_requests_total{outcome=bad_request}") == outcomes["bad-json"]["400"]
    assert grew("epp_requests_total{outcome=payload_too_large}") == outcomes["too-big"]["413"]
    answered = sum(n for kind, seen in outcomes.items() for n in seen.values())
    rejected = outcomes["bad-json"]["400"] + outcomes["too-big"]["413"]
    routed = grew("epp_requests_total{outcome=routed}")
    assert routed == answered - rejected
    assert (
        grew("epp_responses_total{result=completed}") + grew("epp_responses_total{result=aborted}")
        == routed
    )
    assert EXPECTED.keys() == KINDS.keys()
