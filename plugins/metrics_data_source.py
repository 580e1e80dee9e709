"""`metrics-data-source`: scrapes every endpoint's model-server /metrics page (GIE's
data source of the same name) and keeps its `EndpointMetrics` in the datastore.

Contract: a data source (`add_extractor` takes one `core-metrics-extractor`; without
one the default engines are used). The scraper is its service: built by the
framework from these parameters and the server's flags, run once the server
starts (building starts nothing). It scrapes each
endpoint every `--refresh-metrics-interval` (or `interval`), gives up on a scrape
after `--metrics-scrape-timeout` (or `timeout`), and marks snapshots older than
`--metrics-staleness-threshold` stale. A config whose plugins read metrics gets one
of these with the defaults unless it has its own (GIE does the same).

Parameters (GIE's): `scheme` (http), `path` (/metrics; an endpoint's `metricsUrl`
overrides both), `insecureSkipVerify` (true), `caCertPath`, `clientCertPath`,
`clientKeyPath`, `interval`. This EPP's own: `timeout`, and `httpClient`: `fast`
(plain http:// pages through a minimal kept-alive HTTP/1.1 client, about a quarter
of aiohttp's CPU per scrape) or `aiohttp` (every page through one aiohttp session;
https always goes that way).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from epp.durations import Duration, parse_duration
from epp.scheduling import PluginContext, ServiceContext
from epp.sources.metrics import MetricsExtractor, MetricsScraper, ScrapeSettings


class MetricsDataSourceParameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    scheme: Literal["http", "https"] = "http"
    path: Annotated[str, msgspec.Meta(pattern="^/")] = "/metrics"
    insecure_skip_verify: bool = True
    ca_cert_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    interval: Duration | None = None
    timeout: Duration | None = None
    http_client: Literal["fast", "aiohttp"] = "fast"


def metrics_scraper(params: MetricsDataSourceParameters, context: ServiceContext) -> MetricsScraper:
    """The scraper for these parameters; the server's flags fill what they leave out.
    Raises ValueError for parameters that cannot work."""
    if bool(params.client_cert_path) != bool(params.client_key_path):
        raise ValueError("clientCertPath and clientKeyPath go together")
    server = context.settings
    interval = parse_duration(params.interval) if params.interval else None
    timeout = parse_duration(params.timeout) if params.timeout else None
    if (interval is not None and interval <= 0) or (timeout is not None and timeout <= 0):
        raise ValueError("interval and timeout must be positive")
    settings = ScrapeSettings(
        interval_s=interval or server.refresh_metrics_interval_s,
        timeout_s=timeout or server.metrics_scrape_timeout_s,
        staleness_s=server.metrics_staleness_threshold_s,
        scheme=params.scheme,
        path=params.path,
        insecure_skip_verify=params.insecure_skip_verify,
        ca_cert_path=params.ca_cert_path,
        client_cert_path=params.client_cert_path,
        client_key_path=params.client_key_path,
        http_client=params.http_client,
    )
    return MetricsScraper(context.datastore, MetricsExtractor(), settings)


class MetricsDataSource:
    Parameters = MetricsDataSourceParameters
    Service = staticmethod(metrics_scraper)

    def __init__(self, params: MetricsDataSourceParameters, context: PluginContext) -> None:
        assert isinstance(context.service, MetricsScraper)
        self.scraper: MetricsScraper = context.service
        self.settings = self.scraper.settings
        self._extractor_added = False

    def add_extractor(self, extractor: object) -> None:
        if not isinstance(extractor, MetricsExtractor):
            raise ValueError(
                f"{type(extractor).__name__} does not read /metrics pages:"
                " metrics-data-source takes a core-metrics-extractor"
            )
        if self._extractor_added:
            raise ValueError("metrics-data-source takes one core-metrics-extractor")
        self._extractor_added = True
        self.scraper.extractor = extractor
