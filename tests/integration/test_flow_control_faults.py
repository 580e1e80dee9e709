"""Flow control under faults, through a real Envoy in front of `epp serve`: what
the client of a request that waits in the EPP's queue sees when Envoy's timeouts
run, when its TTL runs out, when a pod is lost, when the EPP is killed and started
again, and when the pods' metrics stop coming. Every request is either served or
answered with a clear status; none hangs.

Recording upstreams (tests/integration/upstream.py) serve no metrics, so the
utilization detector's dispatch reading judges every upstream by this EPP's own
requests in flight there, one at most (`staleMaxConcurrency: 1`): with every
upstream busy (a streamed answer held open), the gate is closed and new requests
wait. The scrape-outage test uses simulated pods, whose metrics are real until the
outage.

Short TTLs and one- or two-upstream pools keep the module fast."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.stack import (
    DESTINATION_HEADER,
    EppPorts,
    ManagedProcess,
    add_epp_listener,
    envoy_config,
    free_ports,
    start_envoy,
    start_epp,
    start_epp_on_free_ports,
    write_endpoints_file,
)
from tests.integration.faults import (
    MODEL,
    POD_HEADER,
    debug_endpoints,
    eventually,
    prompt,
    sim_pods,
)
from tests.integration.faults import running as running_sims
from tests.integration.upstream import NAME_HEADER, Upstreams

TTL_S = 3.0
# Envoy's envoy.filters.http.ext_proc.remote_close_timeout_milliseconds default.
REMOTE_CLOSE_TIMEOUT_S = 1.0
# A queued request whose client hung up is out of the queue within this (measured:
# 10-40 ms, the metric's polling included).
QUEUE_LEAVE_S = 0.2
SELECT_HEADER = "test-epp-endpoint-selection"  # header-based-testing-filter
FALLBACK = "pool_fallback"


def config(ttl_s: float = TTL_S) -> str:
    return f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: header-based-testing-filter
- type: max-score-picker
- type: utilization-detector
  parameters: {{staleMaxConcurrency: 1}}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: max-score-picker
flowControl:
  defaultRequestTTL: {ttl_s:g}s
  defaultPriorityBand: {{maxRequests: 20}}
"""


# -- Envoy: listeners in front of the one EPP, each with its own settings ----------------


def _listener(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        item for item in bootstrap["static_resources"]["listeners"] if item["name"] == name
    )
    return found


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _ext_proc(listener: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(
        f["typed_config"]
        for f in _hcm(listener)["http_filters"]
        if f["name"] == "envoy.filters.http.ext_proc"
    )
    return found


def _routes(listener: dict[str, Any]) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = _hcm(listener)["route_config"]["virtual_hosts"][0]["routes"]
    return routes


def _fail_open(bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]) -> None:
    """FailOpen as docs/reliability.md and the Helm chart set it up: a BUFFERED
    request body (Envoy ignores failure_mode_allow in FULL_DUPLEX_STREAMED), and a
    fallback route round robin over the pool for a request the EPP did not route."""
    ext_proc = _ext_proc(listener)
    ext_proc["failure_mode_allow"] = True
    ext_proc["processing_mode"]["request_body_mode"] = "BUFFERED"
    routes = _routes(listener)
    (picked,) = routes
    picked["match"]["headers"] = [{"name": DESTINATION_HEADER, "present_match": True}]
    unpicked = copy.deepcopy(picked)
    del unpicked["match"]["headers"]
    unpicked["route"]["cluster"] = FALLBACK
    routes.append(unpicked)
    _hcm(listener)["route_config"]["internal_only_headers"] = [DESTINATION_HEADER]
    clusters = bootstrap["static_resources"]["clusters"]
    if not any(c["name"] == FALLBACK for c in clusters):
        endpoints = [
            {
                "endpoint": {
                    "address": {
                        "socket_address": {
                            "address": a.rsplit(":", 1)[0],
                            "port_value": int(a.rsplit(":", 1)[1]),
                        }
                    }
                }
            }
            for a in pool
        ]
        clusters.append(
            {
                "name": FALLBACK,
                "type": "STATIC",
                "connect_timeout": "5s",
                "lb_policy": "ROUND_ROBIN",
                "load_assignment": {
                    "cluster_name": FALLBACK,
                    "endpoints": [{"lb_endpoints": endpoints}],
                },
            }
        )


# What each listener of `LISTENERS` changes in manifests/envoy/envoy.yaml's.


def _buffered(bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]) -> None:
    _ext_proc(listener)["processing_mode"]["request_body_mode"] = "BUFFERED"


def _message_1s(bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]) -> None:
    _buffered(bootstrap, listener, pool)
    _ext_proc(listener)["message_timeout"] = "1s"


def _fail_open_message_1s(
    bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]
) -> None:
    _fail_open(bootstrap, listener, pool)
    _ext_proc(listener)["message_timeout"] = "1s"


def _duplex_message_1s(
    bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]
) -> None:
    _ext_proc(listener)["message_timeout"] = "1s"


def _stream_idle_half_s(
    bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]
) -> None:
    _hcm(listener)["stream_idle_timeout"] = "0.5s"
    for route in _routes(listener):
        del route["route"]["idle_timeout"]  # 0s there would override it


def _request_1s(bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]) -> None:
    _hcm(listener)["request_timeout"] = "1s"


def _grpc_1s(bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]) -> None:
    _ext_proc(listener)["grpc_service"]["timeout"] = "1s"


def _route_1s(bootstrap: dict[str, Any], listener: dict[str, Any], pool: Sequence[str]) -> None:
    for route in _routes(listener):
        route["route"]["timeout"] = "1s"


LISTENERS = {
    "fail_open": _fail_open,
    "message_1s": _message_1s,
    "fail_open_message_1s": _fail_open_message_1s,
    "duplex_message_1s": _duplex_message_1s,
    "stream_idle_half_s": _stream_idle_half_s,
    "request_1s": _request_1s,
    "grpc_1s": _grpc_1s,
    "route_1s": _route_1s,
}


@dataclass
class Stack:
    upstreams: Upstreams
    epp: ManagedProcess
    epp_ports: EppPorts
    envoy: ManagedProcess
    ports: dict[str, int]  # listener -> port; "shipped" is envoy.yaml unchanged
    workdir: Path
    endpoints: Path
    config_file: Path

    def url(self, listener: str = "shipped") -> str:
        return f"http://127.0.0.1:{self.ports[listener]}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.epp_ports.metrics}"

    def kill_epp(self) -> None:
        process = self.epp.process
        assert process is not None
        process.kill()
        process.wait()

    def restart_epp(self) -> None:
        """A new `epp serve` on the same ports (a restarted pod behind its Service)."""
        self.epp = start_epp(
            self.endpoints,
            self.workdir / "epp-again",
            self.epp_ports,
            config_file=self.config_file,
            extra_args=["--debug-endpoints"],
        )

    def set_pool(self, names: Sequence[str]) -> None:
        """Rewrite the endpoints file (as Kubernetes changes the pool), atomically:
        the EPP re-reads it within a second."""
        chosen = [(u.name, u.address) for u in self.upstreams if u.name in names]
        staging = write_endpoints_file(self.workdir / "endpoints.next.yaml", chosen)
        os.replace(staging, self.endpoints)

    def completions(self, upstream: str) -> list[dict[str, str]]:
        """The headers of the completions `upstream` received."""
        return [
            r.headers
            for r in self.upstreams.by_name(upstream).received
            if r.path == "/v1/completions"
        ]


@contextlib.contextmanager
def running(
    workdir: Path, upstreams: int, listeners: Sequence[str] = (), ttl_s: float = TTL_S
) -> Iterator[Stack]:
    """`upstreams` recording upstreams, `epp serve` with flow control, and one Envoy:
    the "shipped" listener (manifests/envoy/envoy.yaml) and the named `LISTENERS`,
    all asking the same EPP."""
    with contextlib.ExitStack() as cleanup:
        pool = Upstreams(upstreams).start()
        cleanup.callback(pool.stop)
        endpoints = write_endpoints_file(
            workdir / "endpoints.yaml", [(u.name, u.address) for u in pool]
        )
        config_file = workdir / "config.yaml"
        config_file.write_text(config(ttl_s))
        epp, epp_ports = start_epp_on_free_ports(
            endpoints,
            workdir / "epp",
            config_file=config_file,
            extra_args=["--debug-endpoints"],
        )
        stack_ref: list[Stack] = []
        cleanup.callback(lambda: stack_ref[0].epp.stop() if stack_ref else epp.stop())
        # Envoy's ports drawn together: drawn one at a time, two can be the same.
        drawn = free_ports(len(listeners) + 2)
        ports = {"shipped": drawn[0]}
        bootstrap = envoy_config(
            listen_port=ports["shipped"], epp_port=epp_ports.grpc, admin_port=drawn[1]
        )
        bootstrap["static_resources"]["listeners"][0]["name"] = "shipped"
        for name, port in zip(listeners, drawn[2:], strict=True):
            ports[name] = port
            add_epp_listener(bootstrap, name, ports[name], epp_ports.grpc)
            listener = _listener(bootstrap, name)
            listener["address"]["socket_address"]["address"] = "127.0.0.1"
            LISTENERS[name](bootstrap, listener, [u.address for u in pool])
        envoy = start_envoy(bootstrap, workdir / "envoy")
        cleanup.callback(envoy.stop)
        stack = Stack(pool, epp, epp_ports, envoy, ports, workdir, endpoints, config_file)
        stack_ref.append(stack)
        yield stack


# -- requests --------------------------------------------------------------------------


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer
    headers: dict[str, str]
    body: bytes
    seconds: float  # from sending to the end of the answer
    ended: float  # time.monotonic() at the end of the answer
    error: str | None = None

    def json(self) -> Any:
        return json.loads(self.body)


async def ask(
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 20.0,
) -> Answer:
    """One completion; what came back, however it ended (a timeout is a failure of
    the test: nothing may hang)."""
    started = time.monotonic()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                url + "/v1/completions",
                json=body or {"model": "m", "prompt": "queued"},
                headers=headers or {},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response,
        ):
            data = await response.read()
            return Answer(
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                data,
                time.monotonic() - started,
                time.monotonic(),
            )
    except aiohttp.ClientError as exc:
        ended = time.monotonic()
        return Answer(None, {}, b"", ended - started, ended, type(exc).__name__)


@contextlib.asynccontextmanager
async def held(stack: Stack, key: str, upstream: str | None = None) -> AsyncIterator[None]:
    """A streamed answer held open on `upstream` (any, if None) while inside: that
    upstream is busy. On exit it is released and read to its end (or its cut)."""
    headers = {}
    if upstream is not None:
        headers[SELECT_HEADER] = stack.upstreams.by_name(upstream).address
    body = {"model": "m", "prompt": "running", "stream": True, "hold": key}
    async with aiohttp.ClientSession() as session:
        response = await session.post(stack.url() + "/v1/completions", json=body, headers=headers)
        try:
            assert response.status == 200
            await response.content.readline()  # the first event: in flight upstream
            yield
        finally:
            stack.upstreams.release(key)
            with contextlib.suppress(aiohttp.ClientError):
                await asyncio.wait_for(response.read(), 10.0)
            response.release()


async def metric(stack: Stack, name: str, labels: str = "") -> float:
    async with aiohttp.ClientSession() as session, session.get(stack.admin_url + "/metrics") as r:
        text = await r.text()
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def queued(stack: Stack) -> float:
    return await metric(
        stack, "epp_flow_control_queue_size", 'fairness_id="default-flow",priority="0"'
    )


async def wait_queued(stack: Stack, expected: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (found := await queued(stack)) != expected:
        assert time.monotonic() < deadline, f"queue at {found}, never {expected}"
        await asyncio.sleep(0.02)


def assert_ttl_answer(answer: Answer) -> None:
    """The EPP's answer to a request whose TTL ran out with endpoints in the pool."""
    assert answer.status == 429, answer
    assert answer.headers["retry-after"] == "1"
    assert answer.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == 429
    assert error["type"] == "rate_limit_error"
    assert f"waited {TTL_S:g}s in flow control" in error["message"]
    assert TTL_S - 0.1 <= answer.seconds < TTL_S + 2.0, answer.seconds


# -- Envoy's timeouts and the TTL: one upstream, held busy ------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(tmp_path_factory.mktemp("fc-envoy"), 1, listeners=list(LISTENERS)) as s:
        yield s


async def test_ttl_expiry_through_envoy_is_a_429_with_retry_after(stack: Stack) -> None:
    stack.upstreams.clear()
    async with held(stack, "ttl"):
        # FailClose as shipped (FULL_DUPLEX_STREAMED body) and FailOpen (BUFFERED):
        # the EPP's ImmediateResponse either way.
        answers = asyncio.gather(ask(stack.url()), ask(stack.url("fail_open")))
        await wait_queued(stack, 2)
        shipped, fail_open = await answers
    for answer in (shipped, fail_open):
        assert_ttl_answer(answer)
    await wait_queued(stack, 0)
    assert len(stack.completions("up-0")) == 1  # the held one only


async def test_what_envoy_does_to_a_request_waiting_in_the_queue(stack: Stack) -> None:
    """One request through each listener while the pool is busy for longer than
    the TTL: which Envoy timeouts fail a queued request before the EPP decides."""
    stack.upstreams.clear()
    names = [
        "duplex_message_1s",
        "request_1s",
        "grpc_1s",
        "message_1s",
        "fail_open_message_1s",
        "stream_idle_half_s",
    ]
    async with held(stack, "timeouts"):
        pending = asyncio.gather(*(ask(stack.url(name)) for name in names))
        answers = dict(zip(names, await pending, strict=True))
    # The shipped body mode, FULL_DUPLEX_STREAMED: Envoy does not time the wait for
    # the EPP's answer with message_timeout, nor with the connection manager's
    # request_timeout (the request has arrived), nor with the ext_proc gRPC
    # service's timeout: the TTL decides, 429.
    assert_ttl_answer(answers["duplex_message_1s"])
    assert_ttl_answer(answers["request_1s"])
    assert_ttl_answer(answers["grpc_1s"])
    # A BUFFERED body (FailOpen's mode) is timed by message_timeout: FailClose
    # fails the request with a bare 504 ...
    late = answers["message_1s"]
    assert (late.status, late.body) == (504, b""), late
    assert 0.9 <= late.seconds < TTL_S, late.seconds
    # ... and FailOpen routes it around the EPP: flow control bypassed (the
    # fallback route, no destination chosen by the EPP).
    bypassed = answers["fail_open_message_1s"]
    assert bypassed.status == 200, bypassed
    assert bypassed.json()["choices"][0]["text"] == "ok"
    assert 0.9 <= bypassed.seconds < TTL_S, bypassed.seconds
    # The upstream saw two completions: the held one, routed by the EPP, and this
    # one, which no EPP routed.
    assert sorted(DESTINATION_HEADER in h for h in stack.completions("up-0")) == [False, True]
    # A stream idle timeout below the TTL: Envoy's 504, "stream timeout".
    idle = answers["stream_idle_half_s"]
    assert (idle.status, idle.body) == (504, b"stream timeout"), idle
    assert idle.seconds < TTL_S, idle.seconds
    # Every stream Envoy gave up on left the queue with it.
    await wait_queued(stack, 0)


async def test_a_client_that_leaves_leaves_the_queue_in_either_body_mode(stack: Stack) -> None:
    stack.upstreams.clear()
    labels = 'fairness_id="default-flow",outcome="cancelled",priority="0"'
    before = await metric(stack, "epp_flow_control_requests_total", labels)
    async with held(stack, "cancel"):
        waiting = [asyncio.ensure_future(ask(stack.url(n))) for n in ("shipped", "fail_open")]
        await wait_queued(stack, 2)
        for task in waiting:
            task.cancel()  # the client hangs up
        left = time.monotonic()
        await wait_queued(stack, 0)
        # Envoy ends the ext_proc stream gracefully (ext_proc_graceful_grpc_close):
        # a half-close, and a reset only after its remote close timeout (1 s by
        # default). The EPP reads the stream while a request waits, so the
        # half-close takes the request out of the queue at once, well before the
        # reset (it took about 1 s when the EPP waited for the reset).
        assert time.monotonic() - left < QUEUE_LEAVE_S < REMOTE_CLOSE_TIMEOUT_S
        assert await metric(stack, "epp_flow_control_requests_total", labels) == before + 2
    assert len(stack.completions("up-0")) == 1  # neither reached the upstream


async def test_the_route_timeout_does_not_count_the_wait(stack: Stack) -> None:
    stack.upstreams.clear()
    async with held(stack, "route"):
        waiting = asyncio.ensure_future(ask(stack.url("route_1s")))
        await wait_queued(stack, 1)
        await asyncio.sleep(1.5)  # queued past the route's 1 s timeout
        assert not waiting.done()
    answer = await waiting
    # Envoy's router starts the route timeout once the EPP lets the request go.
    assert answer.status == 200, answer
    assert 1.5 <= answer.seconds < TTL_S, answer.seconds


# -- pod loss: two upstreams, both busy -------------------------------------------------


async def test_pod_loss_while_requests_are_queued(tmp_path: Path) -> None:
    with running(tmp_path, 2) as stack:
        await _pod_loss(stack)


async def _pod_loss(stack: Stack) -> None:
    up1 = stack.upstreams.by_name("up-1")
    async with aiohttp.ClientSession() as session:
        # up-1's answer is held, then cut: the pod dies under its request.
        dying = await session.post(
            stack.url() + "/v1/completions",
            json={"model": "m", "prompt": "x", "stream": True, "hold": "die", "fail": "abort"},
            headers={SELECT_HEADER: up1.address},
        )
        await dying.content.readline()
        async with held(stack, "live", "up-0"):
            waiting = [asyncio.ensure_future(ask(stack.url())) for _ in range(3)]
            await wait_queued(stack, 3)
            # Kubernetes takes the pod out of the pool, and the pod dies.
            stack.set_pool(["up-0"])

            async def up1_gone() -> bool:
                return "up-1" not in await debug_endpoints_of(session, stack)

            await eventually(up1_gone, "the EPP drops up-1 from the pool", timeout_s=10)
            stack.upstreams.release("die")
            with pytest.raises(aiohttp.ClientPayloadError):  # its answer is cut short
                await asyncio.wait_for(dying.read(), 10.0)
            dying.release()
            # up-0 is still busy: the queue waits for it rather than for up-1.
            await asyncio.sleep(0.3)
            assert await queued(stack) == 3
        # up-0 frees: the queued requests go to it, one after the other.
        answers = await asyncio.gather(*waiting)
    assert [a.status for a in answers] == [200] * 3, answers
    assert {a.headers[NAME_HEADER] for a in answers} == {"up-0"}
    assert len(stack.completions("up-1")) == 1  # the one that was cut
    await wait_queued(stack, 0)

    # The last pod goes too while requests wait: they are answered 503 at their
    # TTL (no endpoint to go to), with a longer Retry-After; a new request is
    # refused 503 at once.
    async with held(stack, "last", "up-0"):
        waiting = [asyncio.ensure_future(ask(stack.url())) for _ in range(2)]
        await wait_queued(stack, 2)
        stack.set_pool([])
        async with aiohttp.ClientSession() as session:

            async def empty() -> bool:
                return not await debug_endpoints_of(session, stack)

            await eventually(empty, "the EPP's pool empty", timeout_s=10)
        refused = await ask(stack.url())
        answers = await asyncio.gather(*waiting)
    assert refused.status == 503, refused
    assert refused.seconds < 2.0  # at once: nothing to wait for
    for answer in answers:
        assert answer.status == 503, answer
        assert answer.headers["retry-after"] == "5"
        assert answer.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
        assert "no endpoint is ready" in answer.json()["error"]["message"]
        assert answer.seconds < TTL_S + 2.0
    await wait_queued(stack, 0)
    # The pool comes back: served again.
    stack.set_pool(["up-0", "up-1"])
    async with aiohttp.ClientSession() as session:

        async def back() -> bool:
            return len(await debug_endpoints_of(session, stack)) == 2

        await eventually(back, "the EPP's pool back", timeout_s=10)
    assert (await ask(stack.url())).status == 200


async def debug_endpoints_of(session: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    async with session.get(stack.admin_url + "/debug/endpoints") as response:
        assert response.status == 200
        return {e["name"]: e for e in await response.json()}


# -- the EPP killed and restarted with requests queued ---------------------------------


async def test_epp_restart_with_requests_queued(tmp_path: Path) -> None:
    with running(tmp_path, 1, listeners=["fail_open"]) as stack:
        await _epp_restart(stack)


async def _epp_restart(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        running_answer = await session.post(
            stack.url() + "/v1/completions",
            json={"model": "m", "prompt": "running", "stream": True, "hold": "kill"},
        )
        await running_answer.content.readline()
        waiting = {
            listener: [asyncio.ensure_future(ask(stack.url(listener))) for _ in range(2)]
            for listener in ("shipped", "fail_open")
        }
        await wait_queued(stack, 4)
        killed = time.monotonic()
        stack.kill_epp()
        answers = {k: await asyncio.gather(*v) for k, v in waiting.items()}
        # The answer that was streaming through the EPP ends too (cut, or let
        # through to its end): it does not hang.
        stack.upstreams.release("kill")
        with contextlib.suppress(aiohttp.ClientError):
            await asyncio.wait_for(running_answer.read(), 10.0)
        running_answer.release()
    # FailClose: Envoy fails the queued requests at once, 500.
    for answer in answers["shipped"]:
        assert answer.status == 500, answer
        assert answer.ended - killed < 2.0  # at once: the stream broke with the EPP
    # FailOpen: Envoy routes them without the EPP (its fallback route): served.
    for answer in answers["fail_open"]:
        assert answer.status == 200, answer
    without_epp = [h for h in stack.completions("up-0") if DESTINATION_HEADER not in h]
    assert len(without_epp) == 2
    stack.upstreams.clear()
    # The new EPP on the same ports routes everything again, through both listeners.
    stack.restart_epp()
    for listener in ("shipped", "fail_open"):
        answer = await ask(stack.url(listener))
        assert answer.status == 200, (listener, answer)
    assert all(DESTINATION_HEADER in h for h in stack.completions("up-0"))
    assert len(stack.completions("up-0")) == 2
    assert await metric(stack, "epp_requests_total", 'outcome="routed"') == 2


# -- a scrape outage under load: simulated pods -------------------------------------------

OUTAGE_CONCURRENCY = 2  # staleMaxConcurrency: requests per pod while its metrics are stale


async def test_a_scrape_outage_under_load_keeps_the_queue_moving(tmp_path: Path) -> None:
    """The pods' /metrics stop answering while a burst waits in the queue: the
    utilization detector judges each pod by this EPP's requests in flight there
    (`staleMaxConcurrency`), so the queue drains at that concurrency instead of
    freezing (stale read as saturated) or trickling one request at a time."""
    # Real-time pods: 40 output tokens take ~0.3 s, so a burst outlasts the scrape.
    pods = sim_pods(tmp_path, 2, ["--time-scale", "1.0"])
    text = f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: active-request-scorer
- type: max-score-picker
- type: utilization-detector
  parameters: {{staleMaxConcurrency: {OUTAGE_CONCURRENCY}}}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: active-request-scorer
  - pluginRef: max-score-picker
flowControl:
  defaultRequestTTL: 30s
"""
    with running_sims(tmp_path, pods, config=text) as stack:
        async with aiohttp.ClientSession() as session:

            async def scraped(stale: bool) -> bool:
                found = await debug_endpoints(session, stack)
                return all(e["metrics"]["stale"] is stale for e in found.values())

            await eventually(lambda: scraped(False), "both pods scraped")
            for pod in pods.pods.values():
                async with session.post(
                    f"http://{pod.address}/sim/metrics-delay", json={"seconds": 120}
                ) as response:
                    assert response.status == 200
            await eventually(lambda: scraped(True), "both pods' metrics stale")

            burst = [asyncio.ensure_future(_complete(session, stack.url, i)) for i in range(16)]
            most_in_flight: dict[str, int] = {}
            most_queued = 0.0
            while not all(task.done() for task in burst):
                for name, entry in (await debug_endpoints(session, stack)).items():
                    most_in_flight[name] = max(most_in_flight.get(name, 0), entry["inFlight"])
                most_queued = max(most_queued, await _queue_size(session, stack.admin_url()))
                await asyncio.sleep(0.02)
            answers = [task.result() for task in burst]
            assert await scraped(True), "the outage lasted the whole burst"
            for pod in pods.pods.values():
                async with session.post(
                    f"http://{pod.address}/sim/metrics-delay", json={"seconds": 0}
                ):
                    pass
    # Everything served, by both pods, none near the TTL.
    assert [status for status, _, _ in answers] == [200] * 16, answers
    assert {pod for _, pod, _ in answers} == {"sim-0", "sim-1"}
    assert max(seconds for _, _, seconds in answers) < 15.0
    # Requests did wait in the queue, and the pods were not held to the idle-pool
    # floor of one request at a time: each ran up to its stale concurrency. (A pass
    # may start a pick per pod before the gate counts them: the overshoot bound.)
    assert most_queued >= 4, most_queued
    assert sum(most_in_flight.values()) > 2, most_in_flight
    assert all(n <= OUTAGE_CONCURRENCY + 2 for n in most_in_flight.values()), most_in_flight


async def _complete(
    session: aiohttp.ClientSession, url: str, n: int
) -> tuple[int, str | None, float]:
    started = time.monotonic()
    async with session.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt(n % 4, n), "max_tokens": 40},
        timeout=aiohttp.ClientTimeout(total=40),
    ) as response:
        await response.read()
        return response.status, response.headers.get(POD_HEADER), time.monotonic() - started


async def _queue_size(session: aiohttp.ClientSession, admin_url: str) -> float:
    async with session.get(admin_url + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("epp_flow_control_queue_size{")
    )
