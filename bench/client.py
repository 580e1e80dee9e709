"""The benchmark's load generator: streams OpenAI chat requests and times them.

Arrivals (all in simulated seconds; the client sleeps `x time_scale` of wall time):

- `poisson`: open loop, sessions start at the times of a Poisson process of `rate`
  per second (exponential gaps from a generator seeded by the run's seed, so every
  policy sees the same schedule); `rate` = inf starts them all at once. With
  `burst` = N > 1 sessions arrive N at a time, the bursts a Poisson process of
  `rate` / N: the same mean rate with N requests picked at the same instant, before
  any pod's load or cache reflects the others (what a stale view gets wrong);
- `trace`: open loop at the sessions' own arrival times (trace replay; the
  tenants workload); with a `rate`, those times scaled so that their mean rate over
  the span is `rate` (as the lab scales them: `scaled_starts`);
- `closed`: `concurrency` clients, each starting the next session when its previous
  one is done.

A session's turns go one after the other, the next only once the previous answer has
ended (plus the session's think time); a failed turn ends its session, and its
remaining turns are recorded as errors ("skipped").

Every request has a scheduled time, when it was due, and the time it was actually
sent (`Record.scheduled_s`, `Record.sent_s`), and its TTFT and end-to-end time are
measured from the scheduled time, not from the send: a client that falls behind
its schedule (a busy event loop, a slow machine) then shows its delay in the
latencies instead of hiding the queueing it caused ("coordinated omission"). The
difference, sent - scheduled, is the client's lag, reported beside the latencies;
the latency from the send is TTFT - lag. The scheduled time is:

- open loop (`poisson`, `trace`): a session's first turn is due at its arrival time
  in the schedule, whenever the client gets round to sending it;
- a later turn of a session is due when the previous turn's answer ended (its
  `data: [DONE]`) plus the session's think time: it cannot be scheduled earlier,
  since its request carries that answer, so the schedule of a conversation follows
  its own answers (a slow answer delays the next turn's schedule, a slow client
  only its send);
- closed loop (`closed`): a session's first turn is due when its client slot became
  free: at the start for the first `concurrency` sessions, then when the slot's
  previous session ended (its last answer, or the failure that ended it).

Per request: TTFT = until the first chunk carrying answer text (the chat role chunk
has none), end-to-end = until `data: [DONE]`, both from the scheduled time, measured
in wall time and divided by the time scale; the last chunk carrying answer text
(`last_token_s`, from the scheduled time too), and from it the time per output
token, TPOT = (last token - first token) / (output tokens - 1) (`Record.tpot_s`; None
for an answer of one token, which has no gap); output and cached tokens from the
usage chunk; the pod from the `x-sim-pod` response header (None when a router does
not pass it on); for a prefill/decode fleet, the prefill pod the router named for
the request (`prefill_pod`: the `x-prefiller-host-port` the EPP set, which the
benchmark's Envoy echoes back as `x-bench-prefiller`; None when the request was
served whole); the status and, for a failure, what failed: an HTTP status, a
connection error, a timeout, or a stream that ended without `[DONE]`.

Headers: a turn's own request headers (`Turn.headers`: the tenants workload's
objective and fairness id) go with its request, beside the content type.

Shed requests: a 429 or 503 the router answered itself (flow control's bound or
TTL, the admission's shedding, an EPP without a ready endpoint) is recorded as shed,
`error` = "shed: <status> <why>" (`is_shed`), not as a failure: a client can act on
it (retry later), and it is not retried here. The router's answer is told from
Envoy's own (no upstream, a reset: plain text) by flow control's
`x-llm-d-request-dropped-reason` header or a JSON body, which the EPP's answers
carry and Envoy's local replies do not.

When the router let a request go: bench run's Envoy adds ROUTED_HEADER to every
response, the microseconds from the request's arrival at Envoy to its first byte
sent upstream (the wait in the EPP's queue and the pick, Envoy's own time), from
which `Record.routed_s` is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import aiohttp

from bench.workloads import Session, Workload

ArrivalKind = Literal["poisson", "trace", "closed"]


@dataclass(frozen=True)
class Arrivals:
    kind: ArrivalKind
    # poisson: sessions per second; trace: the mean rate the timestamps are scaled
    # to (None: as they are).
    rate: float | None = None
    concurrency: int | None = None
    burst: int = 1  # poisson: sessions arriving at the same instant
    # `bench run --load`: the offered load as a multiple of the fleet's capacity
    # (docs/lab.md#capacity); the runner sets `rate` from it (`with_capacity`) once
    # the workload and the fleet are known.
    load: float | None = None

    def __post_init__(self) -> None:
        if self.load is not None and not (self.load > 0 and math.isfinite(self.load)):
            raise ValueError("a load must be a finite number > 0")
        if self.kind == "poisson" and self.load is None and (self.rate is None or self.rate <= 0):
            raise ValueError("poisson arrivals need a rate > 0")
        if (
            self.kind == "trace"
            and self.rate is not None
            and not (self.rate > 0 and math.isfinite(self.rate))
        ):
            raise ValueError("a trace's timestamps are scaled to a finite rate > 0")
        if self.kind == "closed" and self.load is not None:
            raise ValueError("a load is offered open loop (poisson or trace arrivals)")
        if self.kind == "closed" and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("closed-loop arrivals need a concurrency >= 1")
        if self.burst < 1:
            raise ValueError("bursts need at least 1 session each")
        if self.burst > 1 and self.kind != "poisson":
            raise ValueError("bursts are for Poisson arrivals (--rate)")

    def label(self) -> str:
        load = f"load {self.load:g}, " if self.load is not None else ""
        # A rate computed from a load is shown to 4 digits; one given, as given.
        rate = "?" if self.rate is None else format(self.rate, "g" if self.load is None else ".4g")
        if self.kind == "poisson":
            bursts = f" in bursts of {self.burst}" if self.burst > 1 else ""
            return f"{load}rate {rate}/s{bursts}"
        if self.kind == "closed":
            return f"concurrency {self.concurrency}"
        if self.rate is not None:
            return f"{load}timestamps at {rate}/s"
        return "trace timestamps"

    def with_capacity(self, capacity_rps: float, sessions_per_request: float = 1.0) -> Arrivals:
        """These arrivals with `rate` set from `load` x the fleet's capacity (requests
        per second); Poisson arrivals start sessions, so their rate is that many
        requests' worth of sessions. Unchanged without a load."""
        if self.load is None:
            return self
        offered = self.load * capacity_rps
        rate = offered * sessions_per_request if self.kind == "poisson" else offered
        return replace(self, rate=rate)

    def to_json(self) -> dict[str, Any]:
        rate = self.rate
        return {
            "kind": self.kind,
            "rate": None if rate is None or math.isinf(rate) else rate,
            "rate_is_infinite": rate is not None and math.isinf(rate),
            "concurrency": self.concurrency,
            "burst": self.burst,
            "load": self.load,
        }


def start_times(sessions: Sequence[Session], arrivals: Arrivals, seed: int) -> list[float]:
    """Each session's start, simulated seconds after the run starts (open loop)."""
    if arrivals.kind == "trace":
        return scaled_starts(sessions, arrivals.rate)
    if arrivals.kind != "poisson" or arrivals.rate is None:
        raise ValueError("start times are for open-loop arrivals")
    return poisson_starts(len(sessions), arrivals.rate, seed, arrivals.burst)


def natural_rate(sessions: Sequence[Session]) -> float:
    """Sessions per second of their own arrival times, over their span."""
    starts = [s.arrival_s or 0.0 for s in sessions]
    span = max(starts) - min(starts) if starts else 0.0
    return len(starts) / span if span > 0 else math.inf


def trace_speed(sessions: Sequence[Session], rate: float | None) -> float:
    """How many times faster than their own timestamps sessions arrive at `rate`
    (1.0 for None: as they are)."""
    return 1.0 if rate is None else rate / natural_rate(sessions)


def scaled_starts(sessions: Sequence[Session], rate: float | None) -> list[float]:
    """The sessions' own arrival times, divided by `trace_speed` (the lab's
    `_scaled`): the mean rate over their span becomes `rate`."""
    speed = trace_speed(sessions, rate)
    return [(s.arrival_s or 0.0) / speed for s in sessions]


def poisson_starts(count: int, rate: float, seed: int, burst: int = 1) -> list[float]:
    """`count` start times of Poisson arrivals at `rate` per second, in bursts of
    `burst` (see the module docstring), from a generator seeded by (seed, rate):
    `bench run` and the lab draw the same schedule for the same seed."""
    if burst < 1:
        raise ValueError("bursts need at least 1 session each")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals:{seed}:{rate!r}")
    now = 0.0
    times = []
    for i in range(count):
        if i % burst == 0:
            now += rng.expovariate(rate / burst)
        times.append(now)
    return times


@dataclass
class Record:
    session: int
    turn: int
    group: int
    # Simulated seconds after the run's start the request was due (module docstring:
    # the schedule of open loop, turns and closed loop); TTFT and e2e count from it.
    scheduled_s: float
    # Simulated seconds after the run's start it was actually sent; None for a turn
    # never sent (skipped: an earlier turn of its session failed). The client's lag
    # is sent_s - scheduled_s.
    sent_s: float | None = None
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    pod: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    # Simulated seconds from the scheduled time to the last chunk carrying answer text.
    last_token_s: float | None = None
    # The prefill pod of a disaggregated request (the `x-prefiller-host-port` the
    # EPP set, echoed by Envoy as PREFILLER_ECHO_HEADER; the runner turns the address
    # into the pod's name); None when the request was served whole, or unknown.
    prefill_pod: str | None = None
    # Simulated seconds after the run's start the router let the request go
    # upstream: sent_s plus ROUTED_HEADER (module docstring); None when the router
    # does not say (a peer router, a request that never reached a pod).
    routed_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) /
        (output tokens - 1), simulated seconds; None without two tokens to time."""
        return tpot(self.ttft_s, self.last_token_s, self.output_tokens)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


# The response header the benchmark's Envoy adds with the request's
# `x-prefiller-host-port` (bench/stack.py `echo_prefiller_header`).
PREFILLER_ECHO_HEADER = "x-bench-prefiller"
# The response header the benchmark's Envoy adds with the microseconds from the
# request's arrival at Envoy to its first byte upstream (bench/stack.py
# `add_routed_header`).
ROUTED_HEADER = "x-bench-routed-us"
# Flow control's header on the requests it sheds (epp/flowcontrol/errors.py).
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
SHED_STATUSES = (429, 503)
SHED_PREFIX = "shed:"


def is_shed(record: Record) -> bool:
    """Whether the router answered the request 429/503 itself (module docstring):
    not served, not a failure either."""
    return not record.ok and record.error is not None and record.error.startswith(SHED_PREFIX)


def shed_reason(status: int, headers: Any, body: bytes) -> str | None:
    """`<status> <why>` when a 429/503 is the router's own answer (flow control's
    dropped reason, or the JSON error's type); None for anything else (Envoy's
    plain-text local replies, other statuses)."""
    if status not in SHED_STATUSES:
        return None
    dropped = headers.get(DROPPED_REASON_HEADER)
    if dropped:
        return f"{status} {dropped}"
    if not headers.get("content-type", "").startswith("application/json"):
        return None
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return None
    kind = error.get("type") if isinstance(error, dict) else None
    return f"{status} {kind}" if kind else str(status)


def tpot(
    first_token_s: float | None, last_token_s: float | None, output_tokens: int | None
) -> float | None:
    """TPOT, the mean inter-token latency of one answer: the time from its first to
    its last token over the gaps between them, (last - first) / (tokens - 1), as
    vLLM's benchmark and the lab (bench/lab/run.py) compute it. None when the answer
    has fewer than two tokens or a time is missing."""
    if first_token_s is None or last_token_s is None or output_tokens is None:
        return None
    if output_tokens < 2:
        return None
    return max(0.0, last_token_s - first_token_s) / (output_tokens - 1)


class _StreamError(Exception):
    pass


class _Shed(Exception):
    pass


async def _stream(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: Record,
    started: float,
    scale: float,
    timeout_s: float,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """POST one streaming request (with `headers` beside the content type) and fill
    `record` in."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sent_headers = {"content-type": "application/json", **dict(headers)}
    async with http.post(url, data=body, headers=sent_headers, timeout=timeout) as response:
        record.status = response.status
        record.pod = response.headers.get("x-sim-pod")
        record.prefill_pod = response.headers.get(PREFILLER_ECHO_HEADER) or None
        routed_us = response.headers.get(ROUTED_HEADER)
        if routed_us and record.sent_s is not None:
            # Envoy writes "-" when the request never went upstream.
            with contextlib.suppress(ValueError):
                record.routed_s = record.sent_s + float(routed_us) / 1e6 / scale
        if response.status != 200:
            answer = await response.read()
            reason = shed_reason(response.status, response.headers, answer)
            if reason is not None:
                raise _Shed(reason)
            text = answer[:200].decode(errors="replace")
            raise _StreamError(f"http {response.status}: {text.strip()}")
        pending = b""
        done = False
        first: float | None = None
        last: float | None = None
        usage: dict[str, Any] | None = None
        async for chunk in response.content.iter_any():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                elif b'"content"' in data and _has_text(data):
                    last = time.perf_counter()
                    if first is None:
                        first = last
                if b'"usage"' in data and data != b"[DONE]":
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"]
        end = time.perf_counter()
        if not done:
            raise _StreamError("stream ended without [DONE]")
        if first is not None:
            record.ttft_s = (first - started) / scale
        if last is not None:
            record.last_token_s = (last - started) / scale
        record.e2e_s = (end - started) / scale
        if usage is not None:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")
        if first is None and (record.output_tokens or 0) > 0:
            raise _StreamError("no answer text in the stream")


def _has_text(data: bytes) -> bool:
    """Whether a chat chunk's delta carries answer text (the role chunk's content is
    empty). Parsed as JSON, so any spelling of an empty content counts as empty."""
    event = json.loads(data)
    return any((choice.get("delta") or {}).get("content") for choice in event.get("choices") or ())


async def send(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: Record,
    scale: float,
    timeout_s: float,
    scheduled: float | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> Record:
    """Send one request (with `headers`) and fill `record` in; TTFT and e2e are
    counted from `scheduled` (a `time.perf_counter()` value: when the request was
    due), or from now when it is None. A 429/503 from the router is recorded as
    shed (module docstring), once: never retried."""
    started = time.perf_counter() if scheduled is None else scheduled
    try:
        await _stream(http, url, body, record, started, scale, timeout_s, headers)
        record.ok = True
    except _Shed as exc:
        record.error = f"{SHED_PREFIX} {exc}"
    except _StreamError as exc:
        record.error = str(exc)
    except TimeoutError:
        record.error = f"timeout after {timeout_s:.0f} wall seconds"
    except aiohttp.ClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


@dataclass
class RunTiming:
    """Wall clock of a run: when the first request went out and the last one ended."""

    first_sent: float = math.inf
    last_done: float = 0.0

    def duration_s(self, scale: float) -> float:
        if self.last_done <= self.first_sent:
            return 0.0
        return (self.last_done - self.first_sent) / scale


async def drive(
    workload: Workload,
    url: str,
    arrivals: Arrivals,
    *,
    model: str,
    time_scale: float,
    seed: int,
    request_timeout_s: float,
    on_done: Callable[[Record], None] | None = None,
) -> tuple[list[Record], RunTiming]:
    """Send every session of `workload` to `url` (an OpenAI base URL) and time it:
    every request from its scheduled time (the module docstring says what that is
    for each kind of arrivals), its send time recorded beside it.

    `request_timeout_s` is in simulated seconds."""
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    timeout_wall = request_timeout_s * time_scale
    records: list[Record] = []
    timing = RunTiming()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    loop_start = time.perf_counter()

    def since_start(wall: float) -> float:
        return (wall - loop_start) / time_scale

    def done(record: Record) -> None:
        records.append(record)
        if on_done is not None:
            on_done(record)

    async with aiohttp.ClientSession(connector=connector) as http:

        async def run_session(session: Session, due: float) -> float:
            """Run `session`'s turns, the first due at `due` (wall, perf_counter);
            returns when it ended (its last answer, or the failure that ended it)."""
            ended = due
            for index, turn in enumerate(session.turns):
                record = Record(session.id, index, session.group, since_start(due))
                body = json.dumps(turn.body(model)).encode()
                sent = time.perf_counter()
                record.sent_s = since_start(sent)
                timing.first_sent = min(timing.first_sent, sent)
                await send(
                    http, endpoint, body, record, time_scale, timeout_wall, due, turn.headers
                )
                ended = time.perf_counter()
                timing.last_done = max(timing.last_done, ended)
                if record.e2e_s is not None:
                    # The answer's end ([DONE]), as e2e measured it.
                    ended = due + record.e2e_s * time_scale
                done(record)
                if not record.ok:
                    for skipped in range(index + 1, len(session.turns)):
                        lost = Record(session.id, skipped, session.group, since_start(ended))
                        lost.error = "skipped: an earlier turn of its session failed"
                        done(lost)
                    return ended
                if index + 1 < len(session.turns):
                    # The next turn is due think time after this answer ended; the
                    # wait is shortened by however late this coroutine resumed.
                    due = ended + session.think_s * time_scale
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
            return ended

        if arrivals.kind == "closed":
            queue = list(workload.sessions)
            queue.reverse()

            async def client() -> None:
                # The slot is free at the start, then whenever its session ends.
                free = loop_start
                while queue:
                    free = await run_session(queue.pop(), free)

            assert arrivals.concurrency is not None
            await asyncio.gather(*(client() for _ in range(arrivals.concurrency)))
        else:
            starts = start_times(workload.sessions, arrivals, seed)
            tasks = []
            for start, session in sorted(
                zip(starts, workload.sessions, strict=True), key=lambda p: (p[0], p[1].id)
            ):
                due = loop_start + start * time_scale
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run_session(session, due)))
            await asyncio.gather(*tasks)
    records.sort(key=lambda r: (r.scheduled_s, r.session, r.turn))
    return records, timing
