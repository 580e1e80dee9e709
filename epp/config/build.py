"""Step 3 of loading a config: build it.

Contract: `build(complete, resources)` builds every plugin of a `CompleteConfig`
as `plugin_class(parameters, context)` (the file's first, in its order, then the
defaults), hands each data source its extractors, has the profile handler check
the profiles, and assembles the `SchedulingConfig` the director runs. Or it
raises `Rejected` with what failed: a constructor refusing its parameters, a
source refusing an extractor the file gives it, the handler refusing the
profiles. It adds nothing the document does not say, with one exception the
document spells out: the default metrics source, which only the built plugins can
tell is needed (`IfMetricsRead`).

Building starts no I/O (`epp validate` builds too). A plugin class that declares
a service (its `Service` attribute) gets it built here, from the plugin's own
parameters, before the plugin itself; the server runs the config's services once
the whole config is built (epp/reload.py) and the plugins only read them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry

from epp.clock import SYSTEM_CLOCK, Clock
from epp.config.document import BandPlan, CompleteConfig, FlowControlPlan, PluginDecl
from epp.config.errors import Problems
from epp.datastore import Datastore, Endpoint
from epp.flowcontrol import (
    BandConfig,
    BandTemplate,
    DispatchSaturation,
    FairnessPolicy,
    FlowController,
    FlowControlMetrics,
    FlowControlSettings,
    OrderingPolicy,
    UsageLimitPolicy,
)
from epp.scheduling.interfaces import (
    METRICS,
    Admitter,
    DataExtractor,
    DataProducer,
    DataSource,
    DescribesEndpoints,
    PluginContext,
    PostResponse,
    PreRequest,
    ProfileHandler,
    ResponseFirstChunk,
    SaturationDetector,
    ServerSettings,
    Service,
    ServiceContext,
    ServiceFactory,
    Sleep,
)
from epp.scheduling.scheduler import Scheduler, SchedulerProfile, Slot, WeightedScorer


@dataclass(frozen=True)
class SchedulingConfig:
    """Everything the director runs, built from one valid config file."""

    scheduler: Scheduler
    data_producers: tuple[Slot[DataProducer], ...]
    pre_request: tuple[Slot[PreRequest], ...]
    response_first_chunk: tuple[Slot[ResponseFirstChunk], ...]
    post_response: tuple[Slot[PostResponse], ...]
    plugins: Mapping[str, object] = field(default_factory=dict)
    # Admission: sheddable requests (negative priority) are shed while the detector
    # says the pool is saturated; then every admitter may refuse a request.
    saturation_detector: Slot[SaturationDetector] | None = None
    admitters: tuple[Slot[Admitter], ...] = ()
    # Objective name (x-gateway-inference-objective) -> priority.
    objectives: Mapping[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    # The plugins' services, by the name of the plugin that declared each: the
    # server runs them while this config is in use.
    services: Mapping[str, Service] = field(default_factory=dict)
    # The `flowControl` gate on: requests wait here for capacity before their pick
    # (and are never shed by the saturation detector directly). None: gate off.
    flow_control: FlowController | None = None

    def endpoint_describers(self) -> list[DescribesEndpoints]:
        """The services and plugins with facts for /debug/endpoints, services first."""
        found: list[DescribesEndpoints] = list(self.services.values())
        found += [p for p in self.plugins.values() if isinstance(p, DescribesEndpoints)]
        return found


ObserveFactory = Callable[[str, str, str], Callable[[float], None]]
"""(extension point, plugin type, plugin name) -> a duration recorder."""


def no_observe(extension_point: str, type_name: str, name: str) -> Callable[[float], None]:
    return lambda seconds: None


@dataclass(frozen=True)
class BuildResources:
    """What the plugins of one config share with the server."""

    datastore: Datastore
    metrics: CollectorRegistry  # the config's own registry for its plugins' metrics
    observe: ObserveFactory
    settings: ServerSettings
    clock: Clock = SYSTEM_CLOCK
    # How plugins wait (`PluginContext.sleep`); handed to them unchanged.
    sleep: Sleep = asyncio.sleep
    # The run's seed (`PluginContext.seed`); None: plugins draw unseeded.
    seed: int | None = None


def build(config: CompleteConfig, resources: BuildResources) -> SchedulingConfig:
    """The running configuration, or `Rejected`."""
    problems = Problems()
    plugins = _Plugins(resources, problems)
    for decl in config.plugins:
        plugins.build(decl)
    problems.stop_if_any()

    extractions = list(config.extractions)
    maybe = config.if_metrics_read
    if maybe is not None and plugins.read_metrics():
        problems.extend(maybe.problems)
        if maybe.plugin is not None:
            plugins.build(maybe.plugin)
            extractions += maybe.extractions
    for decl in config.defaults:
        plugins.build(decl)
    problems.stop_if_any()

    for extraction in extractions:
        source = plugins.built.get(extraction.source)
        extractor = plugins.built.get(extraction.extractor)
        assert isinstance(source, DataSource)
        assert isinstance(extractor, DataExtractor)
        try:
            source.add_extractor(extractor)
        except ValueError as exc:
            # An implied offer the source refuses is simply not for it.
            if extraction.path is not None:
                problems.add(extraction.path, str(exc))
    problems.stop_if_any()

    detector = (
        plugins.slot("saturation_detector", config.saturation_detector)
        if config.saturation_detector is not None
        else None
    )
    profiles = {
        p.name: SchedulerProfile(
            p.name,
            tuple(plugins.slot("filter", name) for name in p.filters),
            tuple(WeightedScorer(plugins.slot("scorer", name), w) for name, w in p.scorers),
            plugins.slot("picker", p.picker),
        )
        for p in config.profiles
    }
    handler = plugins.built[config.profile_handler]
    assert isinstance(handler, ProfileHandler)
    try:
        handler.check_profiles(tuple(profiles))
    except ValueError as exc:
        problems.add(("schedulingProfiles",), f"profile handler {config.profile_handler!r}: {exc}")
    problems.stop_if_any()

    flow_control = (
        _flow_controller(config.flow_control, plugins, detector, resources)
        if config.flow_control is not None
        else None
    )
    return SchedulingConfig(
        scheduler=Scheduler(profiles, plugins.slot("profile_handler", config.profile_handler)),
        data_producers=plugins.slots("data_producer", DataProducer),
        pre_request=plugins.slots("pre_request", PreRequest),
        response_first_chunk=plugins.slots("response_first_chunk", ResponseFirstChunk),
        post_response=plugins.slots("post_response", PostResponse),
        plugins=plugins.built,
        saturation_detector=detector,
        admitters=plugins.slots("admitter", Admitter),
        objectives=config.objectives,
        warnings=config.warnings,
        services=plugins.services,
        flow_control=flow_control,
    )


def _flow_controller(
    plan: FlowControlPlan,
    plugins: _Plugins,
    detector: Slot[SaturationDetector] | None,
    resources: BuildResources,
) -> FlowController:
    """The controller of a config whose `flowControl` gate is on. Every policy it
    names was checked (parse) and added if a default (defaults)."""

    def band(band_plan: BandPlan) -> BandTemplate:
        fairness = plugins.built[band_plan.fairness]
        ordering = plugins.built[band_plan.ordering]
        assert isinstance(fairness, FairnessPolicy)
        assert isinstance(ordering, OrderingPolicy)
        return BandTemplate(
            band_plan.max_requests,
            band_plan.max_bytes,
            fairness,
            ordering,
            band_plan.fairness,
            band_plan.ordering,
        )

    usage_limit = plugins.built[plan.usage_limit]
    assert isinstance(usage_limit, UsageLimitPolicy)
    bands: tuple[BandConfig, ...] = tuple(band(b).band(b.priority) for b in plan.bands)
    settings = FlowControlSettings(
        bands=bands,
        default_band=band(plan.default_band),
        default_negative_band=(
            band(plan.default_negative_band) if plan.default_negative_band is not None else None
        ),
        usage_limit=usage_limit,
        usage_limit_name=plan.usage_limit,
        max_requests=plan.max_requests,
        max_bytes=plan.max_bytes,
        default_request_ttl_s=plan.default_request_ttl_s,
        no_endpoint_request_ttl_s=plan.no_endpoint_request_ttl_s,
        recheck_interval_s=resources.settings.refresh_metrics_interval_s,
    )
    controller = FlowController(
        settings,
        _saturation_reader(detector),
        resources.datastore,
        clock=resources.clock,
        sleep=resources.sleep,
    )
    controller.metrics = FlowControlMetrics(resources.metrics, controller.flows)
    return controller


def _saturation_reader(
    detector: Slot[SaturationDetector] | None,
) -> Callable[[Sequence[Endpoint]], float]:
    """The gate's reading: the detector's dispatch reading when it has one (it does
    not freeze on stale data), else its saturation; timed like any plugin call."""
    if detector is None:
        return lambda endpoints: 0.0  # not reached: the defaults add a detector
    plugin = detector.plugin
    read = (
        plugin.dispatch_saturation if isinstance(plugin, DispatchSaturation) else plugin.saturation
    )

    def saturation(endpoints: Sequence[Endpoint]) -> float:
        t0 = time.perf_counter()
        try:
            return read(endpoints)
        finally:
            detector.observe(time.perf_counter() - t0)

    return saturation


class _Plugins:
    """The plugins of one config, built one by one: each sees those built before it."""

    def __init__(self, resources: BuildResources, problems: Problems) -> None:
        self.resources = resources
        self.problems = problems
        self.decls: dict[str, PluginDecl] = {}
        self.built: dict[str, object] = {}
        self.services: dict[str, Service] = {}

    def build(self, decl: PluginDecl) -> None:
        r = self.resources
        try:
            service = self._service(decl)
            context = PluginContext(
                name=decl.name,
                type_name=decl.type_name,
                datastore=r.datastore,
                metrics=r.metrics,
                plugins=MappingProxyType(self.built),
                settings=r.settings,
                clock=r.clock,
                sleep=r.sleep,
                service=service,
                seed=r.seed,
            )
            plugin = decl.plugin_class(decl.parameters, context)
        except Exception as exc:
            self.problems.add(decl.path, f"cannot build plugin {decl.name!r}: {exc}")
            return
        if service is not None:
            self.services[decl.name] = service
            collector = service.collector()
            if collector is not None:
                r.metrics.register(collector)
        self.decls[decl.name] = decl
        self.built[decl.name] = plugin

    def _service(self, decl: PluginDecl) -> Service | None:
        """The service the plugin's class declares, built from its parameters."""
        factory: ServiceFactory | None = getattr(decl.plugin_class, "Service", None)
        if factory is None:
            return None
        r = self.resources
        context = ServiceContext(decl.name, r.datastore, r.settings, r.clock)
        return factory(decl.parameters, context)

    def read_metrics(self) -> bool:
        """Whether a plugin built so far reads the model-server metrics."""
        return any(METRICS in getattr(p, "consumes", ()) for p in self.built.values())

    def slot(self, extension_point: str, name: str) -> Slot[Any]:
        type_name = self.decls[name].type_name
        observe = self.resources.observe(extension_point, type_name, name)
        return Slot(name, type_name, self.built[name], observe)

    def slots(self, extension_point: str, interface: type) -> tuple[Slot[Any], ...]:
        """A slot for each plugin implementing `interface`, in build order."""
        return tuple(
            self.slot(extension_point, name)
            for name, decl in self.decls.items()
            if decl.does(interface)
        )
