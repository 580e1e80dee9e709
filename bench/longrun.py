"""Pieces shared by the long-running measurements (`python -m bench soak`,
`python -m bench agreement`): prompts as token ids drawn from a large prefix space,
an open-loop client that records every request, and readers of the EPP's /metrics.

Prompts are token ids (`/v1/completions` with `prompt: [ids]`): the pods skip
tokenization and the EPP hashes the ids as they are, so a long run measures the
EPP's index and routing, not a tokenizer, and needs no tokenizer files.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from epp.sources.metrics import read_series

MODEL = "sim-model"
POD_HEADER = "x-sim-pod"
# Token ids stay below the vocabulary of a small model.
VOCABULARY = 150_000


@dataclass(frozen=True)
class PrefixSpace:
    """`groups` system prompts of `system_len` tokens, each followed by a question of
    `question_len` tokens of its own. Groups are drawn with Zipf weights
    (rank^-`skew`; 0 = uniform): a few hot prefixes and a long tail, as in shared
    system prompts and documents."""

    groups: int
    system_len: int = 256
    question_len: int = 32
    skew: float = 1.0
    seed: int = 0
    _cumulative: list[float] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.groups < 1 or self.system_len < 0 or self.question_len < 1:
            raise ValueError("groups and question_len must be >= 1, system_len >= 0")
        total = 0.0
        for rank in range(1, self.groups + 1):
            total += rank**-self.skew
            self._cumulative.append(total)

    def draw(self, rng: random.Random) -> int:
        """A group, by its weight."""
        point = rng.random() * self._cumulative[-1]
        return min(bisect.bisect_left(self._cumulative, point), self.groups - 1)

    def system(self, group: int) -> list[int]:
        rng = random.Random(f"system:{self.seed}:{group}")
        return [rng.randrange(1, VOCABULARY) for _ in range(self.system_len)]

    def prompt(self, group: int, question: int) -> list[int]:
        rng = random.Random(f"question:{self.seed}:{question}")
        return self.system(group) + [rng.randrange(1, VOCABULARY) for _ in range(self.question_len)]


@dataclass
class Outcome:
    started: float  # time.monotonic()
    ended: float
    status: int | None  # None: no HTTP answer (timeout, connection error)
    pod: str | None
    group: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


class OpenLoop:
    """Requests through `url` at `rate` per second (Poisson arrivals), each its own
    task, so a slow or hung request never holds the next one back."""

    def __init__(
        self,
        url: str,
        space: PrefixSpace,
        rate: float,
        *,
        seed: int = 0,
        max_tokens: int = 8,
        timeout_s: float = 60.0,
        limit: int | None = None,
        on_done: Callable[[Outcome], None] | None = None,
    ) -> None:
        if rate <= 0 or math.isnan(rate):
            raise ValueError("rate must be > 0")
        self.url = url
        self.space = space
        self.rate = rate
        self.rng = random.Random(f"arrivals:{seed}")
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.limit = limit
        self.on_done = on_done
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self.groups_sent: list[int] = []  # in the order sent
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> list[Outcome]:
        """Send until stopped (or `limit` requests), then wait for the answers."""
        tasks: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            next_at = time.monotonic()
            while not self._stop.is_set() and (self.limit is None or self.sent < self.limit):
                group = self.space.draw(self.rng)
                task = asyncio.create_task(self._one(session, group, self.sent))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self.sent += 1
                self.groups_sent.append(group)
                # Paced on a schedule: a late wakeup does not slow the rate down.
                next_at += self.rng.expovariate(self.rate)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks)
        return self.outcomes

    async def _one(self, session: aiohttp.ClientSession, group: int, n: int) -> None:
        body = {
            "model": MODEL,
            "prompt": self.space.prompt(group, n),
            "max_tokens": self.max_tokens,
        }
        started = time.monotonic()
        try:
            async with session.post(
                self.url + "/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as response:
                await response.read()
                outcome = Outcome(
                    started,
                    time.monotonic(),
                    response.status,
                    response.headers.get(POD_HEADER),
                    group,
                    None if response.status == 200 else f"HTTP {response.status}",
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = Outcome(started, time.monotonic(), None, None, group, type(exc).__name__)
        self.outcomes.append(outcome)
        if self.on_done is not None:
            self.on_done(outcome)


# -- the EPP's /metrics --------------------------------------------------------------------


def _series(page: bytes, name: str) -> list[tuple[Mapping[str, str], float]]:
    """The samples of the series `name` on a Prometheus text page, as (labels,
    value), read by the EPP's own reader. A line of that series that cannot be read
    raises ValueError: a measurement must not sum a series it half read."""
    read = read_series(page, name)
    if read.problems:
        raise ValueError("; ".join(read.problems))
    return [(sample.labels, sample.value) for sample in read.samples]


def total(page: bytes, name: str, **labels: str) -> float:
    """The sum of the series `name` over its label sets that carry `labels`
    (all of them when none are given); 0 when absent."""
    return sum(
        value
        for found, value in _series(page, name)
        if all(found.get(key) == want for key, want in labels.items())
    )


def histogram(page: bytes, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts, upper bound -> count (summed over
    other labels)."""
    buckets: dict[float, float] = {}
    for labels, value in _series(page, name + "_bucket"):
        bound = float(labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + value
    return dict(sorted(buckets.items()))


def quantile(
    q: float, now: Mapping[float, float], before: Mapping[float, float] | None = None
) -> float | None:
    """The q-quantile of the observations between two readings of a cumulative
    histogram, interpolated inside its bucket as Prometheus' histogram_quantile
    does; None without observations. Above the last finite bound: that bound."""
    bounds = sorted(now)
    counts = [now[b] - (before or {}).get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return bounds[-1]


async def fetch_page(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> bytes:
    """A page's body as bytes (what the EPP's metrics reader reads)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        return await response.read()


async def fetch_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        return await response.json()


async def wait_for(check: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    """Poll the async `check` until it returns something truthy (that value), or
    None once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(interval_s)
