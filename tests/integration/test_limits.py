"""`--max-concurrent-streams` through a real Envoy: a request beyond the limit gets
a 503 with the OpenAI error body whatever Envoy's failure_mode_allow (the EPP
answers it with an ImmediateResponse rather than failing the gRPC stream, which
Envoy would turn into a bare 500, or under FailOpen pass on without a
destination)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.listeners import SecurityStack, security_stack
from tests.integration.test_envoy import error_of
from tests.integration.upstream import NAME_HEADER


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecurityStack]:
    with security_stack(
        tmp_path_factory.mktemp("limits"),
        {"epp": ["--max-concurrent-streams", "1"]},
        [("fail-close", "epp", None, False), ("fail-open", "epp", None, True)],
    ) as running:
        yield running


async def active_streams(stack: SecurityStack) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.admin_url("epp") + "/metrics") as response,
    ):
        text = await response.text()
    for line in text.splitlines():
        if line.startswith("epp_extproc_active_streams "):
            return float(line.split()[-1])
    return -1.0


async def post(
    session: aiohttp.ClientSession, stack: SecurityStack, route: str, body: dict[str, object]
) -> tuple[int, dict[str, str], bytes]:
    async with session.post(
        stack.url(route), data=json.dumps(body), headers={"content-type": "application/json"}
    ) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        return response.status, headers, await response.read()


async def test_a_request_over_the_limit_gets_a_503_in_both_failure_modes(
    stack: SecurityStack,
) -> None:
    async with aiohttp.ClientSession() as session:
        # One streamed response held open by its upstream: one ext_proc stream in use.
        held = asyncio.create_task(
            post(
                session,
                stack,
                "fail-close",
                {"model": "m", "prompt": "long", "stream": True, "hold": "limits"},
            )
        )
        deadline = asyncio.get_running_loop().time() + 10
        while await active_streams(stack) != 1:
            assert asyncio.get_running_loop().time() < deadline, "the held stream never opened"
            await asyncio.sleep(0.02)

        for route in ("fail-close", "fail-open"):
            status, headers, body = await post(session, stack, route, {"model": "m", "prompt": "x"})
            assert status == 503, (route, body)
            assert headers["content-type"] == "application/json"
            error = error_of(body)
            assert error["code"] == 503
            assert error["type"] == "service_unavailable"
            assert "--max-concurrent-streams" in error["message"]

        # The held request was never disturbed; once it ends, requests pass again.
        stack.upstreams.release("limits")
        status, headers, body = await held
        assert status == 200
        assert b"[DONE]" in body
        status, headers, _ = await post(session, stack, "fail-open", {"model": "m", "prompt": "y"})
        assert status == 200
        assert headers[NAME_HEADER.lower()] in {u.name for u in stack.upstreams}
