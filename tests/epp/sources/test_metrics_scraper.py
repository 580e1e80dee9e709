"""The metrics scraper against real HTTP servers: freshness, staleness, every kind
of bad answer, and endpoints coming and going."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from epp.clock import Clock, VirtualClock
from epp.datastore import WAITING, Datastore, Endpoint, EndpointSpec
from epp.sources.metrics import MetricsExtractor, MetricsScraper, ScrapeSettings, describe_metrics
from tests.epp.sources.metrics_server import MetricsServer
from tests.epp.sources.pages import vllm_page

FAST = ScrapeSettings(interval_s=0.02, timeout_s=0.2, staleness_s=0.4)


class Running:
    def __init__(self, datastore: Datastore, scraper: MetricsScraper) -> None:
        self.datastore = datastore
        self.scraper = scraper

    def endpoint(self, name: str) -> Endpoint:
        found = self.datastore.get(name)
        assert found is not None
        return found

    async def until(self, check: Callable[[], bool], timeout_s: float = 3.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def scraping(
    servers: dict[str, MetricsServer | str],
    settings: ScrapeSettings = FAST,
    clock: Clock = time.monotonic,
) -> AsyncIterator[tuple[Running, CollectorRegistry]]:
    datastore = Datastore()
    datastore.replace_all(
        EndpointSpec(name, s.address if isinstance(s, MetricsServer) else s)
        for name, s in servers.items()
    )
    registry = CollectorRegistry()
    scraper = MetricsScraper(datastore, MetricsExtractor(), settings, clock=clock)
    registry.register(scraper.collector())
    task = asyncio.create_task(scraper.run())
    try:
        yield Running(datastore, scraper), registry
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def servers() -> AsyncIterator[list[MetricsServer]]:
    running = [await MetricsServer(page=vllm_page(waiting=i + 1)).start() for i in range(3)]
    yield running
    for server in running:
        await server.stop()


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def test_every_endpoint_gets_fresh_metrics(servers: list[MetricsServer]) -> None:
    pods = {f"pod-{i}": s for i, s in enumerate(servers)}
    async with scraping(pods) as (run, registry):
        await run.until(lambda: all(run.endpoint(n).metrics.updated_at > 0 for n in pods))
        for i in range(3):
            metrics = run.endpoint(f"pod-{i}").metrics
            assert metrics.waiting_requests == i + 1
            assert metrics.running_requests == 12
            assert metrics.kv_cache_usage == 0.42
            assert not metrics.stale(time.monotonic())
            assert metrics.error is None
        servers[0].page = vllm_page(waiting=40, kv_usage=0.9)
        await run.until(lambda: run.endpoint("pod-0").metrics.waiting_requests == 40)
        assert run.endpoint("pod-0").metrics.kv_cache_usage == 0.9
        # Idle pods serve the same page: it is not parsed again, only re-dated.
        await run.until(
            lambda: sample(registry, "epp_metrics_scrapes_total", {"result": "unchanged"}) > 3
        )
        assert sample(registry, "epp_metrics_stale_endpoints") == 0
    # One connection per endpoint, kept alive across scrapes.
    assert all(len(s.peers) == 1 for s in servers)


@pytest.mark.parametrize("http_client", ["fast", "aiohttp"])
async def test_a_scrape_is_timed_from_its_start_to_its_facts_in_the_datastore(
    servers: list[MetricsServer], http_client: str
) -> None:
    """Every scrape takes 0.25 s on the scraper's clock (the server moves it while
    answering): each is observed as exactly that, and the facts are dated by that
    clock too. A failed scrape writes no facts and is not timed."""
    clock = VirtualClock(1000.0)
    servers[0].on_request = lambda: clock.advance(0.25)
    settings = ScrapeSettings(
        interval_s=0.02, timeout_s=0.2, staleness_s=60.0, http_client=http_client
    )
    async with scraping({"pod": servers[0]}, settings, clock) as (run, registry):
        durations = run.scraper.scrape_durations
        await run.until(lambda: durations.count >= 3)
        assert durations.sum == 0.25 * durations.count
        assert sample(registry, "epp_metrics_scrape_duration_seconds_count") == durations.count
        assert sample(registry, "epp_metrics_scrape_duration_seconds_bucket", {"le": "0.1"}) == 0
        assert sample(
            registry, "epp_metrics_scrape_duration_seconds_bucket", {"le": "0.25"}
        ) == sample(registry, "epp_metrics_scrape_duration_seconds_bucket", {"le": "+Inf"})
        # Dated on the injected clock, at the end of a 0.25 s scrape.
        updated_at = run.endpoint("pod").metrics.updated_at
        assert updated_at >= 1000.25
        assert (updated_at - 1000.0) % 0.25 == 0
        servers[0].status = 500
        await run.until(lambda: run.endpoint("pod").metrics.error is not None)
        timed = durations.count
        failed = sample(registry, "epp_metrics_scrapes_total", {"result": "http_error"})
        await run.until(
            lambda: (
                sample(registry, "epp_metrics_scrapes_total", {"result": "http_error"})
                >= failed + 3
            )
        )
        assert durations.count == timed


async def test_a_hung_metrics_endpoint_turns_stale_with_the_reason(
    servers: list[MetricsServer],
) -> None:
    async with scraping({"pod": servers[0]}) as (run, registry):
        await run.until(lambda: run.endpoint("pod").metrics.updated_at > 0)
        servers[0].delay_s = 0.6  # longer than the 0.2s timeout
        await run.until(lambda: run.endpoint("pod").metrics.error is not None)
        metrics = run.endpoint("pod").metrics
        assert "no answer within 0.2s" in (metrics.error or "")
        assert metrics.waiting_requests == 1  # the last good values are kept...
        assert metrics.unanswered
        assert not metrics.unreachable
        assert not metrics.down(time.monotonic())  # ...and one silence is not death
        await run.until(
            lambda: run.endpoint("pod").metrics.stale(time.monotonic())
        )  # ...until too old: then the server is taken as hung
        described = describe_metrics(run.endpoint("pod").metrics)
        assert described["stale"] is True
        assert described["unanswered"] is True
        assert described["down"] is True
        assert "stale: last good scrape" in str(described["reason"])
        assert "no answer within" in str(described["reason"])
        assert sample(registry, "epp_metrics_scrapes_total", {"result": "timeout"}) >= 1
        assert sample(registry, "epp_metrics_stale_endpoints") == 1
        servers[0].delay_s = 0.0
        await run.until(lambda: not run.endpoint("pod").metrics.stale(time.monotonic()))
        metrics = run.endpoint("pod").metrics
        assert metrics.error is None
        assert not metrics.unanswered
        assert not metrics.down(time.monotonic())


@pytest.mark.parametrize(
    ("change", "result", "message"),
    [
        ({"status": 500}, "http_error", "HTTP 500"),
        ({"page": b"<html>oops</html>"}, "bad_page", "none of the vllm engine's metrics"),
        ({"page": bytes(range(256)) * 100}, "bad_page", "none of the vllm engine's metrics"),
    ],
    ids=["http-500", "html", "binary"],
)
async def test_bad_answers_are_errors_never_numbers(
    servers: list[MetricsServer], change: dict[str, object], result: str, message: str
) -> None:
    async with scraping({"pod": servers[0]}) as (run, registry):
        await run.until(lambda: run.endpoint("pod").metrics.updated_at > 0)
        for key, value in change.items():
            setattr(servers[0], key, value)
        await run.until(lambda: run.endpoint("pod").metrics.error is not None)
        assert message in (run.endpoint("pod").metrics.error or "")
        await run.until(lambda: run.endpoint("pod").metrics.stale(time.monotonic()))
        assert sample(registry, "epp_metrics_scrapes_total", {"result": result}) >= 1
        # Stale, but the server answered: it is up, whatever its page says.
        metrics = run.endpoint("pod").metrics
        assert not metrics.unanswered
        assert not metrics.down(time.monotonic())


async def test_nan_and_negative_values_leave_the_fact_unknown(
    servers: list[MetricsServer],
) -> None:
    servers[0].page = vllm_page(waiting="NaN", kv_usage="-1")
    async with scraping({"pod": servers[0]}) as (run, _):
        await run.until(lambda: run.endpoint("pod").metrics.updated_at > 0)
        metrics = run.endpoint("pod").metrics
        assert not metrics.known(WAITING, time.monotonic())
        assert metrics.known("running", time.monotonic())
        described = describe_metrics(metrics)
        assert "is NaN" in str(described["reason"])
        assert "negative" in str(described["reason"])


async def test_an_unreachable_endpoint_is_never_fresh() -> None:
    async with scraping({"gone": "127.0.0.1:1"}) as (run, registry):
        await run.until(lambda: run.endpoint("gone").metrics.error is not None)
        metrics = run.endpoint("gone").metrics
        assert metrics.stale(time.monotonic())
        assert "never scraped" in str(describe_metrics(metrics)["reason"])
        assert sample(registry, "epp_metrics_scrapes_total", {"result": "connect_error"}) >= 1


async def test_a_server_that_goes_away_is_stale_at_the_next_scrape() -> None:
    """A refused connection is not a slow answer: the pod is gone (killed,
    restarting), so its metrics stop being trusted at once, not after the
    staleness threshold; and they are trusted again once it answers."""
    settings = ScrapeSettings(interval_s=0.02, timeout_s=0.5, staleness_s=60.0)
    server = await MetricsServer(page=vllm_page(waiting=4)).start()
    port = server.port
    async with scraping({"pod": server}, settings) as (run, registry):
        await run.until(lambda: run.endpoint("pod").metrics.updated_at > 0)
        assert not run.endpoint("pod").metrics.stale(time.monotonic())
        await server.stop()
        await run.until(lambda: run.endpoint("pod").metrics.stale(time.monotonic()))
        metrics = run.endpoint("pod").metrics
        assert metrics.unreachable
        assert metrics.age(time.monotonic()) < 5.0  # stale long before the 60 s threshold
        assert metrics.waiting_requests == 4  # the last values are kept, not trusted
        described = describe_metrics(metrics)
        assert str(described["reason"]).startswith("unreachable: ")
        assert described["unreachable"] is True
        assert described["down"] is True
        assert sample(registry, "epp_metrics_stale_endpoints") == 1
        # The same server back on its port: fresh again at the next scrape.
        server = await MetricsServer(page=vllm_page(waiting=5)).start(port)
        try:
            await run.until(lambda: run.endpoint("pod").metrics.waiting_requests == 5)
            metrics = run.endpoint("pod").metrics
            assert not metrics.stale(time.monotonic())
            assert not metrics.unreachable
            assert metrics.error is None
        finally:
            await server.stop()


async def test_endpoints_added_and_removed_start_and_stop_being_scraped(
    servers: list[MetricsServer],
) -> None:
    async with scraping({"pod-0": servers[0]}) as (run, _):
        await run.until(lambda: run.endpoint("pod-0").metrics.updated_at > 0)
        run.datastore.replace_all(
            [EndpointSpec("pod-0", servers[0].address), EndpointSpec("pod-1", servers[1].address)]
        )
        await run.until(lambda: run.endpoint("pod-1").metrics.waiting_requests == 2)
        run.datastore.replace_all([EndpointSpec("pod-1", servers[1].address)])
        await asyncio.sleep(0.1)
        seen = servers[0].requests
        await asyncio.sleep(0.2)
        assert servers[0].requests == seen  # no longer scraped
        assert servers[1].requests > 0
        # A new address under the same name is a new endpoint, scraped afresh.
        run.datastore.replace_all([EndpointSpec("pod-1", servers[2].address)])
        await run.until(lambda: run.endpoint("pod-1").metrics.waiting_requests == 3)
    assert run.scraper._targets == {}


async def test_the_aiohttp_client_path_reads_the_same(servers: list[MetricsServer]) -> None:
    settings = ScrapeSettings(
        interval_s=0.02, timeout_s=0.5, staleness_s=1.0, http_client="aiohttp"
    )
    servers[0].chunked = True
    # The facts at the very end of a long page: the whole body must be read.
    servers[0].page = b"# filler comment line\n" * 20_000 + vllm_page(waiting=9)
    async with scraping({"pod": servers[0]}, settings) as (run, _):
        await run.until(lambda: run.endpoint("pod").metrics.updated_at > 0)
        assert run.endpoint("pod").metrics.waiting_requests == 9
        assert run.endpoint("pod").metrics.num_gpu_blocks == 27500


async def test_metrics_url_and_path_are_honoured(servers: list[MetricsServer]) -> None:
    datastore = Datastore()
    datastore.replace_all(
        [
            EndpointSpec("a", "10.9.9.9:8000", metrics_url=f"http://{servers[0].address}/metrics"),
            EndpointSpec("b", servers[1].address),
        ]
    )
    scraper = MetricsScraper(
        datastore, MetricsExtractor(), ScrapeSettings(interval_s=0.02, path="/other/path")
    )
    assert scraper.url_for(datastore.get("a")) == f"http://{servers[0].address}/metrics"  # type: ignore[arg-type]
    assert scraper.url_for(datastore.get("b")) == f"http://{servers[1].address}/other/path"  # type: ignore[arg-type]
    task = asyncio.create_task(scraper.run())
    try:
        deadline = time.monotonic() + 3
        while not all(e.metrics.updated_at for e in datastore.all_endpoints()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_slow_scrape_is_not_doubled_and_a_short_timeout_needs_no_tick(
    servers: list[MetricsServer],
) -> None:
    # An answer takes 5 intervals: the endpoint gets one request at a time, not one
    # per tick.
    servers[0].delay_s = 0.1
    async with scraping({"pod": servers[0]}) as (run, _):
        await run.until(lambda: run.endpoint("pod").metrics.updated_at > 0)
        start = servers[0].requests
        await asyncio.sleep(0.5)
        assert 2 <= servers[0].requests - start <= 6
        assert run.endpoint("pod").metrics.error is None
    # A timeout shorter than the interval is noticed long before the next tick.
    servers[0].delay_s = 1.5
    slow_ticks = ScrapeSettings(interval_s=2.0, timeout_s=0.1, staleness_s=60.0)
    before = servers[0].requests
    async with scraping({"pod": servers[0]}, slow_ticks) as (run, registry):
        await run.until(lambda: servers[0].requests > before, timeout_s=5.0)
        asked = time.monotonic()
        await run.until(lambda: run.endpoint("pod").metrics.error is not None)
        assert time.monotonic() - asked < 1.0  # the next tick is 2 s after the request
        assert "no answer within 0.1s" in (run.endpoint("pod").metrics.error or "")
        assert sample(registry, "epp_metrics_scrapes_total", {"result": "timeout"}) == 1


@pytest.mark.parametrize("http_client", ["fast", "aiohttp"])
async def test_a_snapshot_knows_the_requests_routed_after_its_scrape_was_sent(
    servers: list[MetricsServer], http_client: str
) -> None:
    # One request is routed to the pod while each scrape is out (as it reaches the
    # server): the page cannot count it, so the snapshot must not claim to have
    # seen it, whether the page changed (the first) or not (the later ones).
    settings = dataclasses.replace(FAST, http_client=http_client)
    async with scraping({"pod": servers[0]}, settings) as (run, registry):
        endpoint = run.endpoint("pod")
        for _ in range(3):
            Datastore.acquire(endpoint)  # before any scrape: seen by the first
        servers[0].on_request = lambda: Datastore.acquire(endpoint)
        await run.until(lambda: endpoint.metrics.updated_at > 0)
        assert endpoint.metrics.routed_seen >= 3
        await run.until(lambda: endpoint.metrics.routed_seen >= 6)
        assert sample(registry, "epp_metrics_scrapes_total", {"result": "unchanged"}) > 0
        assert endpoint.routed - endpoint.metrics.routed_seen in (1, 2)
        assert endpoint.unseen_routed == endpoint.routed - endpoint.metrics.routed_seen
