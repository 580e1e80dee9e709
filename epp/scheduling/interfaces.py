"""The plugin interfaces: the whole extension API of the EPP.

A plugin is a class. The framework builds it once, at start-up, as

    PluginClass(parameters, context)

where `parameters` is an instance of the class's `Parameters` struct (a
`msgspec.Struct`, decoded strictly from the config file's `parameters:`; a class
without one takes no parameters and gets `NoParameters()`), and `context` is a
`PluginContext`. The class then implements one or more of the protocols below; a
plugin implementing several (a scorer that is also a pre-request hook, say) is
called at each of its extension points.

Rules every plugin follows:
- Plugins *read* the datastore and endpoint state; they never change it. Only
  sources write the datastore, and only the director counts in-flight requests.
- `filter`, `score`, `pick`, `pre_request`, `response_first_chunk` and
  `post_response` run on the event loop
  of every request: they must be quick and must not block. Slow work (tokenizing,
  I/O) goes in `DataProducer.prepare`, which is async, or in a `Service`.
- Time is read from `PluginContext.clock`, a plugin that waits awaits
  `PluginContext.sleep`, and randomness comes from a seed, so the same plugin
  decides the same way on the wall clock and in a simulation.
- `/debug/explain` runs admission, data producers, filters, scorers and pickers
  exactly as a real pick does, but never `pre_request` or `post_response`. So
  anything a pick must change (a speculative index entry, a session table) belongs
  in `pre_request`, and the others must be free of side effects.
- A plugin that reads the model-server metrics (`Endpoint.metrics`) says so with a
  class attribute `consumes = frozenset({METRICS})`: a config without a `dataLayer`
  section then gets the default metrics source (`metrics-data-source`), as in GIE.
  Metrics may be stale or incomplete (`EndpointMetrics.known`): score those
  endpoints neutrally rather than on numbers nobody vouches for.

Order of a request: candidates (ready endpoints, Envoy's subset hint, less those
whose server is down by its metrics scrapes or whose engine has stalled) -> admission
(the saturation detector sheds a request whose objective has a negative priority
while the pool is saturated; then `Admitter`s) -> data producers -> scheduling
profiles (filters -> scorers -> picker) -> in-flight count and `PreRequest` ->
`ResponseFirstChunk` (the first token) -> `PostResponse`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Protocol, TypeVar, runtime_checkable

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from epp import defaults
from epp.clock import SYSTEM_CLOCK, Clock
from epp.datastore import Datastore, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling.types import (
    CycleState,
    DisaggDecision,
    ProfileResult,
    ResponseInfo,
    SchedulingResult,
    ScoredEndpoint,
)

Sleep = Callable[[float], Awaitable[None]]
"""Waits the given seconds: `asyncio.sleep` on the wall clock, a simulation's own
awaitable on virtual time (`PluginContext.sleep`)."""

METRICS: Final = "metrics"
"""Data a plugin may consume (its `consumes` class attribute): the model-server
metrics a metrics data source keeps in `Endpoint.metrics`."""


class NoParameters(msgspec.Struct, forbid_unknown_fields=True):
    """The parameters of a plugin that takes none."""


class PickerParameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """The parameters GIE's pickers share."""

    # How many endpoints to return: the primary, then fallbacks for the proxy to
    # retry on. (Plain Envoy's ORIGINAL_DST cluster reads one address: keep 1 there.)
    max_num_of_endpoints: Annotated[int, msgspec.Meta(ge=1)] = 1
    # This EPP's: seed the picker's random choices (tie-breaks, draws), so that a
    # run can be repeated exactly (the routing lab, a test); none: seeded afresh at
    # every start.
    seed: int | None = None


@runtime_checkable
class Service(Protocol):
    """A subsystem with one owner (the precise prefix index with its KV-event feed,
    the metrics scraper): plugins read it, never build it.

    A plugin class that needs one names its factory in a class attribute `Service`,
    a callable `(parameters, ServiceContext) -> Service`; the config's build step
    calls it with the plugin's decoded parameters and hands the result to the
    plugin as `PluginContext.service`. Building starts nothing (`epp validate`
    builds too): the server runs `run()` once the whole config is built, and cancels
    it when the config stops. Tests and simulations build a service directly and
    drive it without a server."""

    async def run(self) -> None:
        """Do the service's work beside the request path, until cancelled."""

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, Any]:
        """What the service knows of `endpoint`, for /debug/endpoints."""

    def collector(self) -> Collector | None:
        """The service's Prometheus metrics (registered with its config's)."""


@dataclass(frozen=True, slots=True)
class ServiceContext:
    """What a service factory receives."""

    name: str  # the name of the plugin that declared it
    datastore: Datastore  # services that are sources write it; the others read it
    settings: ServerSettings
    clock: Clock = SYSTEM_CLOCK


ServiceFactory = Callable[[Any, ServiceContext], Service]


@runtime_checkable
class DescribesEndpoints(Protocol):
    """A plugin with per-endpoint state worth showing in /debug/endpoints (its
    approximate prefix index, say)."""

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server-wide settings from the command line that plugins may need (GIE's flags)."""

    # --refresh-metrics-interval: how often each endpoint's /metrics is scraped.
    refresh_metrics_interval_s: float = defaults.REFRESH_METRICS_INTERVAL.seconds
    # --metrics-staleness-threshold: metrics older than this are not trusted.
    metrics_staleness_threshold_s: float = defaults.METRICS_STALENESS_THRESHOLD.seconds
    # --metrics-scrape-timeout: a scrape without an answer by then has failed.
    metrics_scrape_timeout_s: float = defaults.METRICS_SCRAPE_TIMEOUT.seconds
    # --tokenizer-dir MODEL=DIR: (model, local tokenizer directory) pairs that win
    # over the precise prefix scorers' configured tokenizers for those models.
    tokenizer_dirs: tuple[tuple[str, str], ...] = ()


_P = TypeVar("_P")


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What a plugin receives when it is built."""

    name: str  # its name in the config (defaults to its type)
    type_name: str  # its type, as written in the config
    datastore: Datastore  # read-only for plugins
    metrics: CollectorRegistry  # register the plugin's own Prometheus metrics here
    # The config's plugins by name, read-only: those declared before this one are
    # there while it is built; those declared after it once the whole config is
    # (a plugin that names a later one resolves it then, e.g. in check_profiles).
    plugins: Mapping[str, object]
    settings: ServerSettings = field(default_factory=ServerSettings)
    # The time every decision is made at: read it here, never from the time module.
    clock: Clock = SYSTEM_CLOCK
    # How a plugin waits (burst-prefix-cache-producer's batch window): await this,
    # never asyncio.sleep itself, so that a simulation on a virtual `clock` can hand
    # in a sleep that ends when its virtual time has moved on. Paired with `clock`:
    # a plugin that waits reads the time it waited from `clock`.
    sleep: Sleep = asyncio.sleep
    # The service the plugin class declared (its `Service` attribute), built from
    # the same parameters; None for plugins that declare none.
    service: Service | None = None
    # The run's seed (the routing lab's --seed, a test's): a plugin that draws at
    # random and has no `seed` parameter of its own draws from `rng()`, seeded by
    # this and its name, so that a whole run repeats exactly. None: unseeded.
    seed: int | None = None

    def declared(self, name: str, kind: type[_P], parameter: str, type_name: str) -> _P:
        """The plugin called `name`, declared before this one, of class `kind`. A clear
        error otherwise, naming the `parameter` that names it and the plugin `type_name`
        to declare above this one."""
        plugin = self.plugins.get(name)
        if plugin is None:
            declared = ", ".join(sorted(self.plugins)) or "none"
            raise ValueError(
                f"{parameter} {name!r}: no plugin of that name is declared before this one"
                f" (declared before it: {declared}); add `- type: {type_name}` above it"
                " in plugins:"
            )
        if not isinstance(plugin, kind):
            raise ValueError(
                f"{parameter} {name!r} names a plugin of class {type(plugin).__name__},"
                f" where {type_name} is needed"
            )
        return plugin

    def rng(self, own_seed: int | None = None) -> random.Random:
        """The plugin's random generator: seeded by its own `seed` parameter if it
        has one, else by the run's seed and the plugin's name, else afresh."""
        if own_seed is not None:
            return random.Random(own_seed)
        if self.seed is not None:
            return random.Random(f"{self.seed}:{self.name}")
        return random.Random()


@runtime_checkable
class DataSource(Protocol):
    """GIE's data layer: a plugin that keeps endpoint state fresh from outside the
    request path (the metrics scraper), named in the config's
    `dataLayer.sources[].pluginRef`. Its work runs in the `Service` it declares.

    `add_extractor` is called at build time with each plugin named in that source's
    `extractors` (without a `dataLayer` section: with every extractor of the config);
    it raises `ValueError` for an extractor whose data it does not produce."""

    def add_extractor(self, extractor: object) -> None: ...


@runtime_checkable
class DataExtractor(Protocol):
    """GIE's data layer: turns what a data source fetched from an endpoint into what
    the datastore keeps about it (for `core-metrics-extractor`: a /metrics page into
    an `EndpointMetrics`). What `data` is, is agreed between an extractor and the
    sources that accept it."""

    def extract(self, data: Any, endpoint: Endpoint) -> Any: ...


@runtime_checkable
class SaturationDetector(Protocol):
    """Tells how saturated the pool is (GIE's `saturationDetector`): 1.0 or more
    means saturated. Requests whose objective has a negative priority are shed (429)
    while it says so; others are always admitted. Called with the request's
    candidate endpoints; must be quick and free of side effects."""

    def saturation(self, endpoints: Sequence[Endpoint]) -> float: ...


@runtime_checkable
class Admitter(Protocol):
    """Decides whether a request may be scheduled at all, before any data producer
    runs. Raise an `EppError` (usually `epp.errors.Shed`, a 429) to refuse it; return
    to admit. The request's priority is `cycle.get(PRIORITY)`. Must be quick and
    free of side effects (/debug/explain runs it)."""

    def admit(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None: ...


@runtime_checkable
class DataProducer(Protocol):
    """Prepares data for the other plugins of a request, before any filter runs
    (tokenizing the prompt, looking it up in an index). Its results go into the
    `CycleState`. Errors are logged and the pick goes on without the data."""

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None: ...


@runtime_checkable
class Filter(Protocol):
    """Keeps the endpoints that may serve the request, in their original order.
    Returning no endpoint ends the pick with a 429 (every endpoint ruled out); a
    filter that knows better why may raise an `EppError` (a `Shed` with its reason)."""

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores each endpoint for this request: higher is better.

    Returns a score in [0, 1] per endpoint (values outside are clamped, NaN counts as
    0, a missing endpoint scores 0). A profile combines its scorers as
    `sum(weight * score) / sum(weight)`, so each scorer normalises its own signal:
    1 for the best possible endpoint, not merely the best of this set, where that
    can be told apart."""

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the endpoints the request goes to from the scored survivors.
    Returns them primary first, then the fallbacks Envoy may retry on; an empty
    sequence means none could be picked (429)."""

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]: ...


@runtime_checkable
class ProfileHandler(Protocol):
    """Decides which scheduling profiles run, and how their results combine.

    `select_profiles` is called repeatedly with the results so far; it returns the
    names of the profiles to run next, or nothing when done. `process_results` then
    names the primary profile, whose targets are where the request goes.
    `check_profiles` runs once at start-up with the configured profile names and
    raises `ValueError` if the handler cannot work with them."""

    def check_profiles(self, profiles: Sequence[str]) -> None: ...

    def select_profiles(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]: ...

    def process_results(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        results: Mapping[str, ProfileResult],
    ) -> SchedulingResult: ...


@runtime_checkable
class DisaggregationDecider(Protocol):
    """Decides whether a stage of a request runs on endpoints of its own: its
    prefill on a prefill endpoint (prefill/decode disaggregation, llm-d's "pd
    decider"), or its encoding on encode endpoints (llm-d's encode decider). Not
    called by the framework: a disaggregating profile handler
    (`disagg-profile-handler`) names its deciders in its parameters and asks each
    at most once per request.

    Gets the request, its cycle state (what the data producers left there, such as
    the prefix match info of a prefix producer) and `decode`, the endpoint the
    decode profile has already picked: the decision is about that endpoint, since
    what it already caches is what it would not have to prefill itself. `decode` is
    None only for an encode decider asked before the decode profile ran
    (`stageOrder: prefill-first`); a prefill decider always gets an endpoint.

    Returns a `DisaggDecision`: whether to disaggregate, and why. It only reads:
    no state of its own changes and nothing is written to the cycle state (the
    handler records the decision for /debug/explain), because /debug/explain asks
    it too. Quick, like a filter."""

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint | None
    ) -> DisaggDecision: ...


@runtime_checkable
class PreRequest(Protocol):
    """Runs once the request's endpoint is chosen, before it is sent there."""

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None: ...


@runtime_checkable
class PostResponse(Protocol):
    """Runs once per routed request when it ends: its response complete, or the
    request aborted (`response.completed` is False)."""

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None: ...


@runtime_checkable
class ResponseFirstChunk(Protocol):
    """Runs once per routed request when the first chunk of a successful (2xx)
    response body reaches the EPP: for a streamed completion, the engine's first
    token, the end of the request's prefill. `elapsed_s` is the time from the pick
    on `PluginContext.clock`: the time to first token as this EPP sees it for the
    endpoint it picked (what `predicted-ttft-producer` learns from). Never called
    when the proxy does not send response bodies to the EPP, nor after
    `post_response`."""

    def response_first_chunk(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        elapsed_s: float,
    ) -> None: ...


EXTENSION_POINTS: tuple[tuple[str, type], ...] = (
    ("data_source", DataSource),
    ("data_extractor", DataExtractor),
    ("saturation_detector", SaturationDetector),
    ("admitter", Admitter),
    ("data_producer", DataProducer),
    ("filter", Filter),
    ("scorer", Scorer),
    ("picker", Picker),
    ("profile_handler", ProfileHandler),
    ("disaggregation_decider", DisaggregationDecider),
    ("pre_request", PreRequest),
    ("response_first_chunk", ResponseFirstChunk),
    ("post_response", PostResponse),
)


def extension_points(plugin: object) -> list[str]:
    """The extension points a plugin object implements."""
    return [name for name, protocol in EXTENSION_POINTS if isinstance(plugin, protocol)]
