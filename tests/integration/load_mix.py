"""A mixed load for the stress tests: every kind of request end an ext_proc stream
can see, sent through Envoy to the upstreams of tests/integration/upstream.py.

Each request has a kind and an outcome it must end with:

    stream-short   SSE, a few events                          -> 200, ends with [DONE]
    stream-long    SSE, hundreds of events, paced             -> 200, ends with [DONE]
    stream-big     SSE, a 100 kB first event                  -> 200, ends with [DONE]
    json           a plain completion                         -> 200, a JSON answer
    get            GET /v1/models (a header-only request)     -> 200
    cancel         SSE; the client hangs up after a chunk     -> cancelled (by design)
    bad-json       a body that is not JSON                    -> 400 (the EPP answers)
    too-big        a body over the EPP's --max-body-bytes     -> 413 (the EPP answers)
    upstream-500   the model server answers 500               -> 500
    upstream-abort the model server drops the connection      -> 502 (Envoy answers, if
                   mid-answer                                    the response had not
                                                                 started), else aborted
                                                                 (a cut response)

Anything else (a 503 from Envoy, a connection refused, a timeout, a cut response
where a whole one was due) is unexpected: the stress tests and the load ladder
count those, and Envoy's and the EPP's survival, not latencies.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

# The EPP's --max-body-bytes for stress stacks: small, so that a too-big request is
# cheap to send.
MAX_BODY_BYTES = 64 * 1024

KINDS: dict[str, int] = {  # kind -> weight in the mix
    "stream-short": 30,
    "stream-long": 12,
    "stream-big": 3,
    "json": 20,
    "get": 4,
    "cancel": 10,
    "bad-json": 6,
    "too-big": 3,
    "upstream-500": 6,
    "upstream-abort": 6,
}

EXPECTED: dict[str, frozenset[str]] = {
    "stream-short": frozenset({"200"}),
    "stream-long": frozenset({"200"}),
    "stream-big": frozenset({"200"}),
    "json": frozenset({"200"}),
    "get": frozenset({"200"}),
    "cancel": frozenset({"cancelled"}),
    "bad-json": frozenset({"400"}),
    "too-big": frozenset({"413"}),
    "upstream-500": frozenset({"500"}),
    "upstream-abort": frozenset({"502", "aborted"}),
}


@dataclass
class Tally:
    """Outcomes by kind, and the unexpected ones spelled out."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    latencies_s: dict[str, list[float]] = field(default_factory=dict)  # by kind
    sent_s: float = 0.0  # open loop: when the last request was sent, from the first

    def record(self, kind: str, outcome: str, latency_s: float) -> None:
        self.outcomes[kind, outcome] += 1
        self.latencies_s.setdefault(kind, []).append(latency_s)

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    @property
    def unexpected(self) -> dict[str, int]:
        return {
            f"{kind}: {outcome}": n
            for (kind, outcome), n in sorted(self.outcomes.items())
            if outcome not in EXPECTED[kind]
        }

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.outcomes.items()):
            table.setdefault(kind, {})[outcome] = n
        return table


def choose_kind(rng: random.Random) -> str:
    kinds = list(KINDS)
    return rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]


def _body(kind: str, rng: random.Random) -> bytes:
    prompt = "hello " * rng.randint(1, 300)
    document: dict[str, object] = {"model": "m", "prompt": prompt, "max_tokens": 4}
    if kind == "stream-short":
        document.update(stream=True, max_tokens=rng.randint(1, 10))
    elif kind == "stream-long":
        document.update(stream=True, max_tokens=rng.randint(100, 400), event_delay=0.005)
    elif kind == "stream-big":
        document.update(stream=True, max_tokens=20, big_event=100_000)
    elif kind == "cancel":
        document.update(stream=True, max_tokens=200, event_delay=0.005)
    elif kind == "too-big":
        document["prompt"] = "x" * (MAX_BODY_BYTES + 1024)
    elif kind == "upstream-500":
        document["fail"] = "status"
    elif kind == "upstream-abort":
        document.update(stream=True, fail="abort")
    return json.dumps(document).encode()


async def send_one(
    http: aiohttp.ClientSession, url: str, kind: str, rng: random.Random, timeout_s: float
) -> str:
    """Send one request of `kind`; its outcome: an HTTP status, `cancelled`,
    `aborted` (the response was cut), `truncated` (a stream without [DONE]), or the
    name of the client error."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if kind == "get":
            async with http.get(url + "/v1/models", timeout=timeout) as response:
                await response.read()
                return str(response.status)
        data = b"{not json" if kind == "bad-json" else _body(kind, rng)
        headers = {"content-type": "application/json"}
        async with http.post(
            url + "/v1/completions", data=data, headers=headers, timeout=timeout
        ) as response:
            if kind == "cancel" and response.status == 200:
                await response.content.readany()
                response.close()  # drops the connection: Envoy resets the request
                return "cancelled"
            body = await response.read()
            if response.status == 200 and kind.startswith("stream"):
                return "200" if body.endswith(b"data: [DONE]\n\n") else "truncated"
            return str(response.status)
    except aiohttp.ClientPayloadError:
        return "aborted"
    except TimeoutError:
        return "timeout"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def closed_loop(
    url: str,
    requests: int,
    concurrency: int,
    seed: int,
    timeout_s: float = 30.0,
    keep_going: Callable[[], bool] = lambda: True,
) -> Tally:
    """`requests` requests, `concurrency` at a time; stops early once `keep_going`
    says so (Envoy died, say)."""
    rng = random.Random(seed)
    tally = Tally()
    todo = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client() -> None:
            for _ in todo:
                if not keep_going():
                    return
                kind = choose_kind(rng)
                started = time.perf_counter()
                outcome = await send_one(http, url, kind, rng, timeout_s)
                tally.record(kind, outcome, time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return tally


async def open_loop(
    url: str, requests: int, rate: float, seed: int, timeout_s: float = 30.0
) -> Tally:
    """`requests` requests at Poisson arrivals of `rate` a second, each its own
    task: a slow request never holds the next one back."""
    rng = random.Random(seed)
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(kind: str, request_rng: random.Random) -> None:
            started = time.perf_counter()
            outcome = await send_one(http, url, kind, request_rng, timeout_s)
            tally.record(kind, outcome, time.perf_counter() - started)

        tasks = []
        start = time.perf_counter()
        at = 0.0
        for _ in range(requests):
            at += rng.expovariate(rate)
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            kind = choose_kind(rng)
            tasks.append(asyncio.create_task(one(kind, random.Random(rng.random()))))
        tally.sent_s = time.perf_counter() - start
        await asyncio.gather(*tasks)
    return tally
