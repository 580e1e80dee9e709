"""`MetricsScraper`: keeps every endpoint's `metrics` snapshot in the datastore
fresh by scraping its model server's /metrics page; `ScrapeSettings`, how; and the
scraper's Prometheus collector (`epp_metrics_scrapes_total`,
`epp_metrics_stale_endpoints`, `epp_metrics_scrape_duration_seconds`).

Contract: a scraper runs on the event loop and owns its targets (per endpoint: the
URL, the kept-alive connection, the scrape in progress, the last page read, the
trouble last logged) and its scrape counts and durations. The one thing it writes
outside itself is an endpoint's snapshot, through `Datastore.set_metrics`, and only
while the endpoint is still in the datastore under the same spec; it follows the
endpoint set through a datastore listener while `run()` runs. Its collector only
reads (the counts, the durations and the datastore), at exposition time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import math
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from epp import defaults
from epp.clock import SYSTEM_CLOCK, Clock
from epp.datastore import Datastore, Endpoint, EndpointMetrics
from epp.promutil import LATENCY_BUCKETS, BucketCounts, add_histogram
from epp.sources.http_fetch import FetchError, KeepAliveFetcher
from epp.sources.metrics.extractor import MetricsExtractor
from epp.sources.metrics.page import PageError

# The package's logger, not this module's: log lines name their logger, and the
# metrics source logs as one.
log = logging.getLogger("epp.sources.metrics")


@dataclass(frozen=True)
class ScrapeSettings:
    """How the scraper scrapes (`metrics-data-source`'s parameters and the server's
    flags)."""

    interval_s: float = defaults.REFRESH_METRICS_INTERVAL.seconds
    timeout_s: float = defaults.METRICS_SCRAPE_TIMEOUT.seconds
    staleness_s: float = defaults.METRICS_STALENESS_THRESHOLD.seconds
    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True
    ca_cert_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    # "fast": plain http:// through KeepAliveFetcher; "aiohttp": everything
    # through the shared aiohttp session (https always is).
    http_client: str = "fast"
    max_page_bytes: int = 16 * 1024 * 1024


@dataclass(eq=False)
class _Target:
    """One endpoint as the scraper scrapes it; the scraper's alone."""

    endpoint: Endpoint
    url: str
    fetcher: KeepAliveFetcher | None = None  # plain http://; else `task`
    task: asyncio.Task[None] | None = None  # the aiohttp scrape in progress
    started_at: float | None = None  # loop time of the scrape in progress
    # The scraper's clock at its start, for its duration: the loop's clock above
    # drives ticks and timeouts, this one is the time facts are dated by.
    began_at: float | None = None
    # The endpoint's `routed` count when the scrape in progress was sent: what the
    # snapshot it produces has seen (`EndpointMetrics.routed_seen`).
    routed_at_begin: int = 0
    last_page: bytes | None = None
    failing: bool = False
    last_error: str | None = None


RESULTS: Final = ("ok", "unchanged", "timeout", "connect_error", "http_error", "bad_page")


class MetricsScraper:
    """Keeps every endpoint's `metrics` snapshot fresh. Built without I/O; `run()`
    scrapes until cancelled, following the endpoint set as it changes.

    One clock for all endpoints: every `interval_s` (on multiples of it on the
    loop's clock) each endpoint whose previous scrape has ended gets a new one, so
    the answers come back together and are read in a few wakeups of the event loop
    (spreading the scrapes over the period cost about 40% more CPU per scrape:
    one wakeup and context switch each). A scrape still waiting for its answer is
    not doubled; once `timeout_s` has passed it is dropped as a timeout.

    `clock` dates the snapshots (`updated_at`) and times each scrape, from its
    start to its facts written to the datastore (`scrape_durations`); ticks and
    timeouts run on the event loop's own clock."""

    def __init__(
        self,
        datastore: Datastore,
        extractor: MetricsExtractor,
        settings: ScrapeSettings,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.datastore = datastore
        self.extractor = extractor
        self.settings = settings
        self.clock = clock
        self._targets: dict[Endpoint, _Target] = {}
        self._session: aiohttp.ClientSession | None = None
        # Built at the first https:// scrape (it reads certificate files).
        self._ssl: ssl.SSLContext | None = None
        self._running = False
        # Scrapes by result, exposed as a counter at exposition time: a
        # prometheus_client Counter's lock and checks were a tenth of a scrape's CPU.
        self.results = dict.fromkeys(RESULTS, 0)
        # Seconds from a scrape's start to its facts in the datastore, for the scrapes
        # that wrote facts (ok, unchanged): how old a snapshot is when it lands, at
        # most (the page was rendered somewhere in between).
        self.scrape_durations = BucketCounts(LATENCY_BUCKETS)

    # -- the Service contract (epp.scheduling.Service) -------------------------------

    def collector(self) -> Collector:
        """`epp_metrics_scrapes_total`, `epp_metrics_stale_endpoints` and
        `epp_metrics_scrape_duration_seconds`."""
        return _ScraperCollector(self)

    def describe_endpoint(self, endpoint: Endpoint) -> dict[str, object]:
        # /debug/endpoints shows every endpoint's metrics snapshot already.
        return {}

    def url_for(self, endpoint: Endpoint) -> str:
        if endpoint.spec.metrics_url:
            return endpoint.spec.metrics_url
        s = self.settings
        return f"{s.scheme}://{endpoint.address}{s.path}"

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.interval_s
        self._running = True
        self.datastore.add_listener(self._membership)
        try:
            for endpoint in self.datastore.all_endpoints():
                self._start(endpoint)
            next_at = (math.floor(loop.time() / interval) + 1) * interval
            while True:
                await asyncio.sleep(next_at - loop.time())
                self._tick(loop)
                next_at += interval
                now = loop.time()
                if next_at <= now:
                    # The tick overran its period (a busy loop): go on at the next
                    # one, without a burst of catch-up scrapes.
                    next_at = (math.floor(now / interval) + 1) * interval
        finally:
            self._running = False
            self.datastore.remove_listener(self._membership)
            targets = list(self._targets.values())
            self._targets.clear()
            tasks = [t.task for t in targets if t.task is not None]
            for target in targets:
                self._stop(target)
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._session is not None:
                await self._session.close()
                self._session = None

    def _ssl_context(self) -> ssl.SSLContext:
        s = self.settings
        if s.insecure_skip_verify and not s.ca_cert_path:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=s.ca_cert_path)
        if s.client_cert_path:
            context.load_cert_chain(s.client_cert_path, s.client_key_path)
        return context

    def _membership(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        if not self._running:
            return
        for endpoint in removed:
            target = self._targets.pop(endpoint, None)
            if target is not None:
                self._stop(target)
        for endpoint in added:
            self._start(endpoint)

    def _start(self, endpoint: Endpoint) -> None:
        if endpoint in self._targets:
            return
        url = self.url_for(endpoint)
        target = _Target(endpoint, url)
        if self.settings.http_client == "fast" and urlsplit(url).scheme == "http":
            target.fetcher = KeepAliveFetcher(
                url,
                lambda status, page: self._answered(target, status, page),
                lambda exc: self._errored(target, exc),
                self.settings.max_page_bytes,
            )
        self._targets[endpoint] = target

    @staticmethod
    def _stop(target: _Target) -> None:
        target.started_at = None
        target.began_at = None
        if target.task is not None:
            target.task.cancel()
            target.task = None
        if target.fetcher is not None:
            target.fetcher.abort()

    # -- scraping ----------------------------------------------------------------

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        timeout = self.settings.timeout_s
        for target in tuple(self._targets.values()):
            if target.started_at is not None:
                if now - target.started_at < timeout:
                    continue  # still waiting for its answer
                self._expire(target)
            self._begin(target, now)
        if timeout < self.settings.interval_s:
            # A timeout shorter than the period is noticed before the next tick.
            loop.call_at(now + timeout, self._expire_overdue, now)

    def _begin(self, target: _Target, now: float) -> None:
        target.started_at = now
        target.began_at = self.clock()
        target.routed_at_begin = target.endpoint.routed
        try:
            if target.fetcher is not None:
                target.fetcher.request()
            else:
                target.task = asyncio.get_running_loop().create_task(
                    self._scrape_with_aiohttp(target), name=f"metrics:{target.endpoint.name}"
                )
        except Exception:
            # A bug must not silently end this endpoint's scraping.
            target.started_at = None
            log.exception("metrics scrape of %s failed to start", target.endpoint.name)

    def _expire_overdue(self, started_at: float) -> None:
        # The scrapes of that tick, and no later ones: `_begin` stored this same
        # float, so equality is exact.
        for target in tuple(self._targets.values()):
            if target.started_at == started_at:
                self._expire(target)

    def _expire(self, target: _Target) -> None:
        self._stop(target)
        self._failed(target, "timeout", f"no answer within {self.settings.timeout_s:g}s")

    async def _scrape_with_aiohttp(self, target: _Target) -> None:
        try:
            status, page = await self._fetch_with_aiohttp(target)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if target.task is asyncio.current_task():
                target.task = None
                self._errored(target, exc)
            return
        if target.task is asyncio.current_task():
            target.task = None
            self._answered(target, status, page)

    async def _fetch_with_aiohttp(self, target: _Target) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
            )
        ssl_context: ssl.SSLContext | bool = False
        if target.url.startswith("https:"):
            if self._ssl is None:
                self._ssl = self._ssl_context()
            ssl_context = self._ssl
        async with self._session.get(
            target.url, ssl=ssl_context, allow_redirects=False
        ) as response:
            limit = self.settings.max_page_bytes
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > limit:
                    raise FetchError(f"the page is over {limit} bytes")
                chunks.append(chunk)
            return response.status, b"".join(chunks)

    def _errored(self, target: _Target, exc: Exception) -> None:
        """A scrape ended without an answer; never raises."""
        target.started_at = None
        try:
            if isinstance(exc, FetchError):
                self._failed(target, "bad_page", str(exc))
            elif isinstance(exc, (OSError, aiohttp.ClientError)):
                self._failed(
                    target,
                    "connect_error",
                    f"{type(exc).__name__}: {exc}",
                    unreachable=_refused(exc),
                )
            else:
                raise exc
        except Exception:
            log.exception("metrics scrape of %s failed unexpectedly", target.endpoint.name)

    def _answered(self, target: _Target, status: int, page: bytes) -> None:
        """A scrape's answer; never raises for bad input."""
        target.started_at = None
        try:
            self._read(target, status, page)
        except Exception:
            # A bug must not break the connection's callbacks or the scraping.
            log.exception("metrics scrape of %s failed unexpectedly", target.endpoint.name)

    def _read(self, target: _Target, status: int, page: bytes) -> None:
        endpoint = target.endpoint
        now = self.clock()
        if status != 200:
            self._failed(target, "http_error", f"HTTP {status} from {target.url}")
            return
        if page == target.last_page and not target.failing:
            # The same page as last time (an idle pod): same facts, fresh time.
            snapshot = dataclasses.replace(
                endpoint.metrics, updated_at=now, routed_seen=target.routed_at_begin
            )
            if self._store(target, snapshot):
                self._timed(target)
            self.results["unchanged"] += 1
            return
        try:
            snapshot = self.extractor.extract(
                page,
                endpoint,
                now=now,
                staleness_s=self.settings.staleness_s,
                routed_seen=target.routed_at_begin,
            )
        except PageError as exc:
            target.last_page = None
            self._failed(target, "bad_page", str(exc))
            return
        target.last_page = page
        if self._store(target, snapshot):
            self._timed(target)
        self.results["ok"] += 1
        if target.failing:
            target.failing = False
            target.last_error = None
            log.info("metrics of %s are back (%s)", endpoint.name, target.url)

    def _store(self, target: _Target, snapshot: EndpointMetrics) -> bool:
        """Write `snapshot` to the datastore; False if the endpoint is gone."""
        endpoint = target.endpoint
        # A removed endpoint, or one replaced by a new spec under the same name,
        # must not receive this scrape.
        if self._targets.get(endpoint) is target and self.datastore.get(endpoint.name) is endpoint:
            self.datastore.set_metrics(endpoint.name, snapshot)
            return True
        return False

    def _timed(self, target: _Target) -> None:
        """The scrape's facts are in the datastore: its duration is known."""
        began, target.began_at = target.began_at, None
        if began is not None:
            self.scrape_durations.observe(self.clock() - began)

    def _failed(
        self, target: _Target, result: str, message: str, unreachable: bool = False
    ) -> None:
        self.results[result] += 1
        endpoint = target.endpoint
        previous = endpoint.metrics
        # Keep the last good values (and their time: they turn stale by age, or at
        # once if the server is gone), and say what went wrong.
        self._store(
            target,
            dataclasses.replace(
                previous,
                error=message,
                staleness_s=self.settings.staleness_s,
                unreachable=unreachable,
                unanswered=not unreachable and result in ("timeout", "connect_error"),
            ),
        )
        if not target.failing or message != target.last_error:
            # Once per change of trouble, not 20 times a second.
            log.warning("metrics of %s (%s): %s", endpoint.name, target.url, message)
        target.failing = True
        target.last_error = message


_UNREACHABLE_ERRNOS: Final = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


def _refused(exc: BaseException) -> bool:
    """Whether a failed scrape says nothing listens at the address (as opposed to a
    slow or broken answer, which may still come right)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        exc = exc.os_error
    return isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS
    )


class _ScraperCollector(Collector):
    """`epp_metrics_scrapes_total`, `epp_metrics_stale_endpoints` and
    `epp_metrics_scrape_duration_seconds`, computed at exposition time."""

    def __init__(self, scraper: MetricsScraper) -> None:
        self.scraper = scraper
        self.datastore = scraper.datastore

    def collect(self) -> Iterator[Metric]:
        scrapes = CounterMetricFamily(
            "epp_metrics_scrapes",
            "Scrapes of model-server /metrics pages, by result: ok, unchanged (the same"
            " page as before, not parsed again), timeout, connect_error, http_error,"
            " bad_page (none of the engine's metrics on it).",
            labels=["result"],
        )
        for result, count in self.scraper.results.items():
            scrapes.add_metric([result], count)
        yield scrapes
        durations = HistogramMetricFamily(
            "epp_metrics_scrape_duration_seconds",
            "Time from the start of a scrape of one endpoint's model-server /metrics page"
            " to its facts written to the datastore: the request, the model server's"
            " answer, reading the page, and waits on the EPP's event loop. Scrapes that"
            " wrote facts only (results ok and unchanged); failed ones are in"
            " epp_metrics_scrapes_total.",
        )
        add_histogram(durations, [], self.scraper.scrape_durations)
        yield durations
        now = self.scraper.clock()
        family = GaugeMetricFamily(
            "epp_metrics_stale_endpoints",
            "Endpoints whose model-server metrics are older than the staleness threshold"
            " (plugins score them neutrally; /debug/endpoints says why).",
        )
        family.add_metric(
            [], sum(1 for e in self.datastore.all_endpoints() if e.metrics.stale(now))
        )
        yield family
