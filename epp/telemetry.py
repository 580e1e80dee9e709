"""The EPP's own Prometheus metrics, in a registry per application (no global state).

Label values are bounded by design: outcomes, extension points, plugin and
endpoint names come from the config and the pool, never from request content.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datastore import Datastore

# Scheduling runs in tens of microseconds; the buckets resolve that and still catch
# a slow plugin.
_FAST_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Telemetry:
    def __init__(self, datastore: Datastore, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        r.register(_EndpointCollector(datastore))
        # The running config's plugins register their metrics in a registry of their
        # own (`plugin_metrics.registry`), swapped with the config on reload: a new
        # config's plugins can then register the same names again.
        self.plugin_metrics = _PluginMetrics()
        r.register(self.plugin_metrics)
        self.config_reloads = Counter(
            "epp_config_reloads",
            "Changes of the --config file seen: applied (the new config serves new"
            " requests), rejected (invalid: the running config stays), unchanged (same"
            " content).",
            ["result"],
            registry=r,
        )
        self.config_last_reload_successful = Gauge(
            "epp_config_last_reload_successful",
            "1 if the last change of the --config file was applied (or there was none),"
            " 0 if it was rejected.",
            registry=r,
        )
        self.config_last_reload_successful.set(1)
        self.config_last_reload_success_time = Gauge(
            "epp_config_last_reload_success_timestamp_seconds",
            "When a config was last applied (Unix time; the start counts).",
            registry=r,
        )
        self.config_last_reload_success_time.set_to_current_time()
        self.configs_draining = Gauge(
            "epp_configs_draining",
            "Replaced configs still held by requests they routed; their plugins'"
            " background tasks stop when the last one ends.",
            registry=r,
        )
        self.requests = Counter(
            "epp_requests",
            "Requests seen by the EPP, by outcome of the request phase (routed, or the"
            " error it was answered with).",
            ["outcome"],
            registry=r,
        )
        self.responses = Counter(
            "epp_responses",
            "Routed requests that ended: completed (the response ended) or aborted.",
            ["result"],
            registry=r,
        )
        self.endpoint_stalls = Counter(
            "epp_endpoint_stalls",
            "Stalls of an endpoint's engine (epp/stalls.py): requests waited there for"
            " their first token past --stall-threshold with nothing progressing; each"
            " left the endpoint out of the candidates for a while.",
            registry=r,
        )
        # The children every request touches, bound once.
        self.routed = self.requests.labels("routed")
        self.completed = self.responses.labels("completed")
        self.aborted = self.responses.labels("aborted")
        self.stream_errors = Counter(
            "epp_extproc_stream_errors",
            "ext_proc streams that broke: protocol violations by the proxy, internal errors,"
            " cancellations before a decision.",
            ["reason"],
            registry=r,
        )
        self.extproc_streams = Gauge(
            "epp_extproc_active_streams",
            "ext_proc streams open now (one per request in the EPP's hands); at"
            " --max-concurrent-streams new requests are answered 503.",
            registry=r,
        )
        self.lean_ends = Counter(
            "epp_lean_request_ends",
            "Lean mode (the response bypasses the EPP): how routed requests were ended."
            " access_log: Envoy's access-log entry for the request arrived; stream_end: no"
            " access-log stream ever connected, so the end of the ext_proc stream had to do;"
            " timeout: no entry within --lean-completion-timeout (ended as aborted);"
            " overflow: too many requests waiting for their entry (the oldest ended as aborted).",
            ["how"],
            registry=r,
        )
        self.lean_handoffs = Counter(
            "epp_lean_handoffs",
            "Lean-mode requests whose ext_proc stream ended before the request did, their"
            " end left to the access log.",
            registry=r,
        )
        self.lean_waiting = Gauge(
            "epp_lean_waiting_requests",
            "Lean-mode requests routed and waiting for their access-log entry.",
            registry=r,
        )
        self.access_log_streams = Counter(
            "epp_access_log_streams",
            "Access-log streams Envoy opened to this EPP (one per Envoy worker thread, opened"
            " at its first flush and again after a break). Lean mode needs at least one.",
            registry=r,
        )
        self.access_log_entries = Counter(
            "epp_access_log_entries",
            "HTTP access-log entries received from Envoy. ended: it ended a routed request;"
            " unknown: no routed request was waiting for its request id (answered by the EPP"
            " itself, already ended, or routed by another EPP replica); not_final: not the end"
            " of a downstream request (periodic or upstream entries).",
            ["result"],
            registry=r,
        )
        self.scheduler_duration = Histogram(
            "epp_scheduler_duration_seconds",
            "Time to pick an endpoint: data producers, filters, scorers, picker.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.request_processing_duration = Histogram(
            "epp_request_processing_duration_seconds",
            "Time from the end of the request body (or header-only request) to the"
            " routing decision sent back to the proxy: what the EPP adds to each request.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.plugin_duration = Histogram(
            "epp_plugin_duration_seconds",
            "Time spent in one plugin call.",
            ["extension_point", "plugin_type", "plugin_name"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "epp_prompt_tokens",
            "Prompt tokens per request, from the response's usage.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.completion_tokens = Histogram(
            "epp_completion_tokens",
            "Completion tokens per request, from the response's usage.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "epp_cached_prompt_tokens",
            "Prompt tokens the model servers reported as served from their prefix cache"
            " (usage.prompt_tokens_details.cached_tokens).",
            registry=r,
        )
        self.prompt_tokens_total = Counter(
            "epp_prompt_tokens_routed",
            "Prompt tokens of routed requests that reported usage; with"
            " epp_cached_prompt_tokens_total it gives the fleet's prefix-cache hit rate.",
            registry=r,
        )

    def plugin_timer(
        self, extension_point: str, type_name: str, name: str
    ) -> Callable[[float], None]:
        return self.plugin_duration.labels(extension_point, type_name, name).observe


class _EndpointCollector(Collector):
    """Endpoint gauges read from the datastore at scrape time: nothing to keep in
    step on the request path, and removed endpoints disappear by themselves."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("epp_endpoints_ready", "Endpoints requests may be routed to.")
        ready.add_metric([], len(self.datastore.ready_endpoints()))
        in_flight = GaugeMetricFamily(
            "epp_in_flight_requests",
            "Requests routed by this EPP that have not finished, by endpoint.",
            labels=["endpoint"],
        )
        for endpoint in self.datastore.all_endpoints():
            in_flight.add_metric([endpoint.name], endpoint.in_flight)
        yield ready
        yield in_flight


class _PluginMetrics(Collector):
    """Serves the running config's plugin registry as part of the application's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def describe(self) -> list[Metric]:
        # Names are checked within the plugin registry, which changes with the
        # config; here there is nothing to reserve.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
