"""What scraping model-server metrics costs the EPP: CPU per endpoint per second.

    .venv/bin/python -m tests.perf.scrape_cost --endpoints 128 --interval 0.05 --seconds 20

Servers: `--servers` separate processes (asyncio, prebuilt answers, so they take
little of the machine), each listening on its share of `--endpoints` ports and
answering every GET with a realistic vLLM page (about
45 KB: process metrics, vLLM's gauges, counters and histograms, LoRA and cache
info, the HTTP middleware's histograms). Each answer is one of 16 pages that
differ in their numbers, with a KV usage no other answer has, so every scrape
reads a changed page, as on a busy pod (`--idle`: always the same page, as on an
idle one).

Client: this process runs the EPP's real `MetricsScraper` (the `metrics-data-source`
code) over a real datastore of those endpoints, and measures its own CPU time
(user + system, `time.process_time`) over `--seconds` after a warm-up, and the
scrapes done. The servers' CPU is not counted (they run at a lower priority: they
stand in for pods on other machines); on a small machine they still compete for
the cores, which can only make the client look slower.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import resource
import shlex
import sys
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from bench.provenance import provenance
from epp.datastore import Datastore, EndpointSpec
from epp.sources.metrics import MetricsExtractor, MetricsScraper, ScrapeSettings
from tests.epp.sources.pages import vllm_page

PAGES = 16


def _serve(
    ports: Sequence[int],
    idle: bool,
    ready: multiprocessing.synchronize.Event,
    cpus: set[int] | None = None,
) -> None:
    # The servers stand in for pods on other machines: when the cores are scarce,
    # the scraper (what is measured) goes first; with `cpus`, they keep off its core.
    os.nice(int(os.environ.get("SCRAPE_COST_SERVER_NICE", "10")))
    if cpus:
        os.sched_setaffinity(0, cpus)

    # The KV usage is different in every answer (a busy pod's moves all the time),
    # the queue and batch sizes take 16 values: what a reader may remember from
    # one page to the next is what a real fleet would let it remember.
    placeholder = b"0.@@@@@@"
    pages = [
        vllm_page(waiting=i % 7, running=i, kv_usage=placeholder.decode(), seed=i)
        for i in range(PAGES)
    ]
    # Whole answers, built once around the KV value: the servers only stand in for
    # pods, and the less CPU they take from this machine's cores, the less they
    # disturb the scraper.
    answers = []
    for page in pages:
        head, tail = page.split(placeholder)
        answers.append(
            (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                + f"Content-Length: {len(page)}\r\n\r\n".encode()
                + head,
                tail,
            )
        )
    answered = itertools.count()

    class Pod(asyncio.Protocol):
        """Answers every GET on the connection with the next page (`--idle`: always
        the same one), so no scrape sees the page it saw before."""

        def __init__(self) -> None:
            self.turn = 0
            self.pending = b""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.pending += data
            while (end := self.pending.find(b"\r\n\r\n")) >= 0:
                self.pending = self.pending[end + 4 :]
                self.turn += 1
                if idle:
                    head, tail = answers[0]
                    self.transport.write(head + b"0.420000" + tail)
                else:
                    head, tail = answers[self.turn % PAGES]
                    usage = b"0.%06d" % (next(answered) % 1_000_000)
                    self.transport.write(head + usage + tail)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            await loop.create_server(Pod, "127.0.0.1", port, backlog=1024)
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


async def measure(
    addresses: Sequence[str], settings: ScrapeSettings, seconds: float, warmup_s: float
) -> dict[str, float]:
    datastore = Datastore()
    datastore.replace_all(EndpointSpec(f"pod-{i}", a) for i, a in enumerate(addresses))
    registry = CollectorRegistry()
    scraper = MetricsScraper(datastore, MetricsExtractor(), settings)
    registry.register(scraper.collector())

    def count(result: str) -> float:
        return registry.get_sample_value("epp_metrics_scrapes_total", {"result": result}) or 0.0

    def scrapes() -> float:
        return count("ok") + count("unchanged")

    def failures() -> float:
        total = 0.0
        for result in ("timeout", "connect_error", "http_error", "bad_page"):
            total += registry.get_sample_value("epp_metrics_scrapes_total", {"result": result}) or 0
        return total

    task = asyncio.create_task(scraper.run())
    try:
        await asyncio.sleep(warmup_s)
        count0, fail0, cpu0, wall0 = scrapes(), failures(), time.process_time(), time.monotonic()
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        unchanged0 = count("unchanged")
        await asyncio.sleep(seconds)
        count1, fail1, cpu1, wall1 = scrapes(), failures(), time.process_time(), time.monotonic()
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        unchanged = count("unchanged") - unchanged0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    wall, cpu, done = wall1 - wall0, cpu1 - cpu0, count1 - count0
    endpoints = len(addresses)
    return {
        "endpoints": endpoints,
        "interval_s": settings.interval_s,
        "wall_s": round(wall, 2),
        "scrapes_per_s": round(done / wall, 1),
        "target_scrapes_per_s": round(endpoints / settings.interval_s, 1),
        "failed_scrapes": fail1 - fail0,
        "unchanged_pages": unchanged,
        "cpu_share_of_one_core": round(cpu / wall, 4),
        "cpu_us_per_scrape": round(cpu / done * 1e6, 1) if done else float("nan"),
        "cpu_us_per_endpoint_per_s": round(cpu / wall / endpoints * 1e6, 1),
        # The kernel's share: sending, receiving and polling the sockets.
        "system_share_of_cpu": round((usage1.ru_stime - usage0.ru_stime) / cpu, 3) if cpu else 0.0,
        "fresh_endpoints": sum(
            1 for e in datastore.all_endpoints() if not e.metrics.stale(time.monotonic())
        ),
    }


def run(
    endpoints: int,
    interval_s: float,
    seconds: float,
    servers: int = 2,
    idle: bool = False,
    http_client: str = "fast",
    warmup_s: float = 2.0,
    pin: bool = False,
) -> dict[str, float]:
    """`pin`: the scraper on one CPU, the servers on the others (the way pods on
    other machines would leave the EPP's core and caches alone)."""
    ports = _free_ports(endpoints)
    context = multiprocessing.get_context("spawn")
    processes = []
    cpus = sorted(os.sched_getaffinity(0))
    if pin and len(cpus) < 2:
        raise ValueError("--pin needs at least 2 CPUs")
    scraper_cpus, server_cpus = ({cpus[0]}, set(cpus[1:])) if pin else (set(cpus), None)
    try:
        for i in range(servers):
            ready = context.Event()
            process = context.Process(
                target=_serve, args=(ports[i::servers], idle, ready, server_cpus), daemon=True
            )
            process.start()
            processes.append(process)
            if not ready.wait(30):
                raise RuntimeError("a metrics server did not start")
        settings = ScrapeSettings(interval_s=interval_s, timeout_s=1.0, http_client=http_client)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, scraper_cpus)
        try:
            result = asyncio.run(measure(addresses, settings, seconds, warmup_s))
        finally:
            os.sched_setaffinity(0, previous)
        result["page_bytes"] = len(vllm_page())
        result["idle_pages"] = idle
        result["http_client"] = http_client  # type: ignore[assignment]
        result["cpus"] = os.cpu_count() or 0
        result["pinned"] = pin
        return result
    finally:
        for process in processes:
            process.terminate()
            process.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=128)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between scrapes")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window")
    parser.add_argument("--servers", type=int, default=2, help="server processes")
    parser.add_argument("--idle", action="store_true", help="pages never change")
    parser.add_argument("--http-client", choices=["fast", "aiohttp"], default="fast")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the scraper on one CPU and the servers on the others (needs 2 CPUs or more)",
    )
    args = parser.parse_args()
    try:
        result = run(
            args.endpoints,
            args.interval,
            args.seconds,
            args.servers,
            args.idle,
            args.http_client,
            pin=args.pin,
        )
    except ValueError as exc:
        parser.error(str(exc))
    command = "python -m tests.perf.scrape_cost " + shlex.join(sys.argv[1:])
    print(json.dumps({**provenance(command), **result}, indent=2))


if __name__ == "__main__":
    main()
