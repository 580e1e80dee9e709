"""The EndpointPickerConfig file: decoding, validation, and building the scheduler.

The file has GIE's shape (see DESIGN §3.3):

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: max-score-picker          # registered name or package.module:Class
      name: picker                    # optional, defaults to the type
      parameters: {maxNumOfEndpoints: 2}
    schedulingProfiles:
    - name: default
      plugins:
      - {pluginRef: picker}
      - {pluginRef: some-scorer, weight: 2}
    saturationDetector: {pluginRef: utilization-detector}   # optional (GIE)
    dataLayer:                                              # optional (GIE)
      sources:
      - pluginRef: metrics-data-source
        extractors: [{pluginRef: core-metrics-extractor}]
    inferenceObjectives:                                    # optional (this EPP)
    - {name: batch, priority: -1}

`inferenceObjectives` plays the part of GIE's InferenceObjective resources: a
request's `x-gateway-inference-objective` header names one, and its `priority`
(default 0) is the request's; an unknown objective, or none, is priority 0. A
negative priority is sheddable: while the saturation detector says the pool is
saturated, such requests get a 429. Without a `saturationDetector` section the
config's one saturation-detector plugin is used, or, if some objective is
sheddable, a default `utilization-detector`. Without a `dataLayer` section, a
config whose plugins read model-server metrics gets a default
`metrics-data-source` (GIE does the same).

Validation collects every error it can find, each with its path in the file (and
its line), so `epp validate` shows them all at once. Nothing is built unless the
whole file is valid: a broken file never yields a half-configured scheduler.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import msgspec
import yaml
from prometheus_client import CollectorRegistry

from epp.datastore import Datastore
from epp.scheduling.interfaces import (
    METRICS,
    Admitter,
    Background,
    DataExtractor,
    DataProducer,
    DataSource,
    Filter,
    NoParameters,
    Picker,
    PluginContext,
    PostResponse,
    PreRequest,
    ProfileHandler,
    SaturationDetector,
    Scorer,
    ServerSettings,
    extension_points,
)
from epp.scheduling.registry import PluginRegistry, UnknownPluginType
from epp.scheduling.scheduler import Scheduler, SchedulerProfile, Slot, WeightedScorer

API_VERSIONS: Final = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
KIND: Final = "EndpointPickerConfig"
DEFAULT_PICKER: Final = "max-score-picker"
DEFAULT_PROFILE_HANDLER: Final = "single-profile-handler"
DEFAULT_METRICS_SOURCE: Final = "metrics-data-source"
DEFAULT_SATURATION_DETECTOR: Final = "utilization-detector"

# Used when no config file is given; manifests/config/default.yaml is the same
# config, commented. Approximate prefix affinity balanced against load, weights
# chosen by measurement (docs/default-profile.md): it needs nothing from the
# engines but their /metrics.
DEFAULT_CONFIG: Final = f"""\
apiVersion: {API_VERSIONS[0]}
kind: {KIND}
plugins:
- type: active-request-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: queue-scorer
- type: {DEFAULT_PICKER}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: active-request-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: {DEFAULT_PICKER}
"""

# Sections of GIE's schema this EPP accepts but does not act on: a config written
# for GIE loads, and the log says what is ignored.
IGNORED_GIE_SECTIONS: Final = (
    "featureGates",
    "flowControl",
    "parser",
)

Path_ = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class ConfigError:
    path: Path_
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = format_path(self.path) or "(top level)"
        line = f"line {self.line}: " if self.line is not None else ""
        return f"{line}{where}: {self.message}"


class InvalidConfig(Exception):
    def __init__(self, source: str, errors: list[ConfigError]) -> None:
        self.source = source
        self.errors = errors
        listing = "\n".join(f"  {e}" for e in errors)
        super().__init__(
            f"{source}: {len(errors)} error(s) in the EndpointPickerConfig:\n{listing}"
        )


def format_path(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


# ---------------------------------------------------------------------------
# Wire structs. Unknown keys are errors.


class PluginSpec(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    parameters: dict[str, Any] | None = None


class ProfilePluginRef(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str
    weight: float | None = None


class ProfileSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    plugins: list[ProfilePluginRef] = []


class PluginRef(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str


class DataSourceSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str
    extractors: list[PluginRef] = []


class DataLayerSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    sources: list[DataSourceSpec] = []
    # GIE: false turns off the default metrics source.
    inject_defaults: bool = True


class ObjectiveSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    priority: int = 0


# ---------------------------------------------------------------------------
# The built configuration.


@dataclass(frozen=True)
class SchedulingConfig:
    """Everything the director runs, built from one valid config file."""

    scheduler: Scheduler
    data_producers: tuple[Slot[DataProducer], ...]
    pre_request: tuple[Slot[PreRequest], ...]
    post_response: tuple[Slot[PostResponse], ...]
    plugins: Mapping[str, object] = field(default_factory=dict)
    # Admission: sheddable requests (negative priority) are shed while the detector
    # says the pool is saturated; then every admitter may refuse a request.
    saturation_detector: Slot[SaturationDetector] | None = None
    admitters: tuple[Slot[Admitter], ...] = ()
    # Objective name (x-gateway-inference-objective) -> priority.
    objectives: Mapping[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    # What the plugins asked the server to run beside the request path.
    background: Background = field(default_factory=Background)


ObserveFactory = Callable[[str, str, str], Callable[[float], None]]
"""(extension point, plugin type, plugin name) -> a duration recorder."""


def _no_observe(extension_point: str, type_name: str, name: str) -> Callable[[float], None]:
    return lambda seconds: None


_MSGSPEC_PATH = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`")


def _validation_error(base: Path_, exc: msgspec.ValidationError) -> tuple[Path_, str]:
    """Split msgspec's "message - at `$.a[0].b`" into a path under `base` and a message."""
    match = _MSGSPEC_PATH.match(str(exc))
    assert match is not None
    message, sub = match.group("message"), match.group("path") or ""
    path: list[str | int] = list(base)
    for key, index in _PATH_PART.findall(sub):
        path.append(int(index) if index else key)
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown:
        path.append(unknown.group(1))
        message = "unknown key"
    message = message.replace("Object missing required field", "missing required key")
    return tuple(path), message


class _Loader:
    """One validation + build pass over a parsed document."""

    def __init__(
        self,
        document: object,
        registry: PluginRegistry,
        datastore: Datastore,
        metrics: CollectorRegistry,
        observe: ObserveFactory,
        settings: ServerSettings,
    ) -> None:
        self.document = document
        self.registry = registry
        self.datastore = datastore
        self.metrics = metrics
        self.observe = observe
        self.settings = settings
        self.background = Background()
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []

    def error(self, path: Path_, message: str) -> None:
        self.errors.append(ConfigError(path, message))

    def convert(self, value: object, type_: type[Any], path: Path_) -> Any:
        try:
            return msgspec.convert(value, type_)
        except msgspec.ValidationError as exc:
            self.error(*_validation_error(path, exc))
            return None

    def load(self) -> SchedulingConfig | None:
        doc = self.document
        if not isinstance(doc, dict):
            self.error((), "the file must hold a YAML mapping (apiVersion, kind, plugins, ...)")
            return None
        known = {
            "apiVersion",
            "kind",
            "plugins",
            "schedulingProfiles",
            "saturationDetector",
            "dataLayer",
            "inferenceObjectives",
            *IGNORED_GIE_SECTIONS,
        }
        for key in doc:
            if key not in known:
                self.error((str(key),), f"unknown key; expected one of {', '.join(sorted(known))}")
        for key in IGNORED_GIE_SECTIONS:
            if key in doc:
                self.warnings.append(f"{key}: accepted for GIE compatibility but ignored")
        if doc.get("apiVersion") not in API_VERSIONS:
            self.error(
                ("apiVersion",),
                f"got {doc.get('apiVersion')!r}; expected one of {', '.join(API_VERSIONS)}",
            )
        if doc.get("kind") != KIND:
            self.error(("kind",), f"got {doc.get('kind')!r}; expected {KIND!r}")

        specs = self.plugin_specs(doc.get("plugins", []))
        profiles = self.profile_specs(doc.get("schedulingProfiles", []))
        detector_ref: PluginRef | None = None
        detector_params: dict[str, Any] | None = None
        if "saturationDetector" in doc:
            raw = doc["saturationDetector"]
            if isinstance(raw, dict) and "pluginRef" not in raw:
                # GIE before its pluggable detectors: the section held the
                # utilization detector's own parameters.
                detector_params = raw
            else:
                detector_ref = self.convert(raw, PluginRef, ("saturationDetector",))
        data_layer: DataLayerSpec | None = None
        if "dataLayer" in doc:
            data_layer = self.convert(doc["dataLayer"] or {}, DataLayerSpec, ("dataLayer",))
        objectives = self.objective_specs(doc.get("inferenceObjectives", []))
        classes = self.resolve_types(specs)
        params = self.decode_parameters(specs, classes)
        if self.errors:
            # Nothing can be built; still report dangling references with the rest.
            self.check_references(specs, profiles)
            return None
        plugins = self.build_plugins(specs, classes, params)
        if self.errors:
            return None
        types = {name: spec.type for name, (_, spec) in specs.items()}
        self.wire_data_layer(data_layer, plugins, types)
        detector = self.saturation_detector(
            detector_ref, detector_params, objectives, plugins, types
        )
        if self.errors:
            return None
        built = self.assemble(specs, plugins, profiles, types)
        if built is None:
            return None
        return replace(
            built,
            saturation_detector=detector,
            objectives=objectives,
            admitters=tuple(
                self.slot("admitter", n, types[n], p)
                for n, p in plugins.items()
                if isinstance(p, Admitter)
            ),
        )

    def plugin_specs(self, raw: object) -> dict[str, tuple[int, PluginSpec]]:
        if not isinstance(raw, list):
            self.error(("plugins",), "must be a list of plugins")
            return {}
        specs: dict[str, tuple[int, PluginSpec]] = {}
        for i, item in enumerate(raw):
            spec = self.convert(item, PluginSpec, ("plugins", i))
            if spec is None:
                continue
            name = spec.name or spec.type
            if name in specs:
                self.error(
                    ("plugins", i, "name"),
                    f"plugin name {name!r} is already used by plugins[{specs[name][0]}]"
                    " (a name defaults to the type: give each instance its own name)",
                )
                continue
            specs[name] = (i, spec)
        return specs

    def profile_specs(self, raw: object) -> list[ProfileSpec]:
        if not isinstance(raw, list) or not raw:
            self.error(("schedulingProfiles",), "must be a non-empty list of profiles")
            return []
        profiles: list[ProfileSpec] = []
        seen: set[str] = set()
        for j, item in enumerate(raw):
            profile = self.convert(item, ProfileSpec, ("schedulingProfiles", j))
            if profile is None:
                continue
            if profile.name in seen:
                self.error(("schedulingProfiles", j, "name"), f"duplicate profile {profile.name!r}")
            seen.add(profile.name)
            profiles.append(profile)
        return profiles

    def objective_specs(self, raw: object) -> dict[str, int]:
        if not isinstance(raw, list):
            self.error(("inferenceObjectives",), "must be a list of {name, priority}")
            return {}
        objectives: dict[str, int] = {}
        for i, item in enumerate(raw):
            spec = self.convert(item, ObjectiveSpec, ("inferenceObjectives", i))
            if spec is None:
                continue
            if spec.name in objectives:
                self.error(("inferenceObjectives", i, "name"), f"duplicate objective {spec.name!r}")
            objectives[spec.name] = spec.priority
        return objectives

    def wire_data_layer(
        self,
        data_layer: DataLayerSpec | None,
        plugins: dict[str, object],
        types: dict[str, str],
    ) -> None:
        """Hand each data source its extractors; add the default metrics source
        when a plugin reads metrics and nothing provides them."""
        if data_layer is not None:
            for j, source_spec in enumerate(data_layer.sources):
                path: Path_ = ("dataLayer", "sources", j)
                source = self.plugin_of(
                    source_spec.plugin_ref,
                    DataSource,
                    "a data source",
                    (*path, "pluginRef"),
                    plugins,
                )
                for k, ref in enumerate(source_spec.extractors):
                    ref_path: Path_ = (*path, "extractors", k, "pluginRef")
                    extractor = self.plugin_of(
                        ref.plugin_ref, DataExtractor, "a data extractor", ref_path, plugins
                    )
                    if source is None or extractor is None:
                        continue
                    try:
                        source.add_extractor(extractor)
                    except ValueError as exc:
                        self.error(ref_path, str(exc))
        else:
            # GIE without a dataLayer section: each source takes the extractors it can use.
            extractors = [p for p in plugins.values() if isinstance(p, DataExtractor)]
            for plugin in plugins.values():
                if isinstance(plugin, DataSource):
                    for extractor in extractors:
                        with contextlib.suppress(ValueError):
                            plugin.add_extractor(extractor)
        if data_layer is not None and not data_layer.inject_defaults:
            return
        if any(isinstance(p, DataSource) for p in plugins.values()):
            return
        consumers = [n for n, p in plugins.items() if METRICS in getattr(p, "consumes", ())]
        if consumers:
            self.default_metrics_source(plugins, types)

    def default_metrics_source(self, plugins: dict[str, object], types: dict[str, str]) -> None:
        """Add the default `metrics-data-source`, handing it the extractors the file
        declares (say, a `core-metrics-extractor` with custom engine mappings)."""
        name = self.default_plugin(DEFAULT_METRICS_SOURCE, DataSource, plugins, types)
        source = plugins.get(name) if name is not None else None
        if not isinstance(source, DataSource):
            return
        for extractor in [p for p in plugins.values() if isinstance(p, DataExtractor)]:
            # A source takes the extractors it can use; it refuses the others.
            with contextlib.suppress(ValueError):
                source.add_extractor(extractor)

    def plugin_of(
        self,
        name: str,
        interface: type,
        kind: str,
        path: Path_,
        plugins: dict[str, object],
    ) -> Any:
        plugin = plugins.get(name)
        if plugin is None:
            self.error(
                path,
                f"no plugin named {name!r} in plugins (defined: {', '.join(sorted(plugins))})",
            )
            return None
        if not isinstance(plugin, interface):
            self.error(path, f"{name!r} is not {kind}")
            return None
        return plugin

    def saturation_detector(
        self,
        ref: PluginRef | None,
        params: dict[str, Any] | None,
        objectives: Mapping[str, int],
        plugins: dict[str, object],
        types: dict[str, str],
    ) -> Slot[SaturationDetector] | None:
        if params is not None:
            built = self.default_plugin(
                DEFAULT_SATURATION_DETECTOR,
                SaturationDetector,
                plugins,
                types,
                (("saturationDetector",), params),
            )
            if built is None:
                return None
            if not any(isinstance(p, DataSource) for p in plugins.values()):
                self.default_metrics_source(plugins, types)
            return self.slot("saturation_detector", built, types[built], plugins[built])
        if ref is not None:
            plugin = self.plugin_of(
                ref.plugin_ref,
                SaturationDetector,
                "a saturation detector",
                ("saturationDetector", "pluginRef"),
                plugins,
            )
            if plugin is None:
                return None
            return self.slot("saturation_detector", ref.plugin_ref, types[ref.plugin_ref], plugin)
        detectors = [n for n, p in plugins.items() if isinstance(p, SaturationDetector)]
        if len(detectors) > 1:
            self.error(
                ("saturationDetector",),
                f"several saturation detectors ({', '.join(detectors)}): name the one that"
                " decides admission with saturationDetector: {pluginRef: ...}",
            )
            return None
        if detectors:
            name = detectors[0]
            return self.slot("saturation_detector", name, types[name], plugins[name])
        if not any(priority < 0 for priority in objectives.values()):
            return None  # nothing could ever be shed
        default = self.default_plugin(
            DEFAULT_SATURATION_DETECTOR, SaturationDetector, plugins, types
        )
        if default is None:
            return None
        detector = self.slot("saturation_detector", default, types[default], plugins[default])
        # The default detector reads metrics: it may need the default source too.
        if not any(isinstance(p, DataSource) for p in plugins.values()):
            self.default_metrics_source(plugins, types)
        return detector

    def check_references(
        self, specs: dict[str, tuple[int, PluginSpec]], profiles: list[ProfileSpec]
    ) -> None:
        """Every pluginRef names a plugin."""
        for j, profile in enumerate(profiles):
            for k, ref in enumerate(profile.plugins):
                if ref.plugin_ref not in specs:
                    self.error(
                        ("schedulingProfiles", j, "plugins", k, "pluginRef"),
                        f"no plugin named {ref.plugin_ref!r} in plugins"
                        f" (defined: {', '.join(sorted(specs)) or 'none'})",
                    )

    def resolve_types(self, specs: dict[str, tuple[int, PluginSpec]]) -> dict[str, type]:
        classes: dict[str, type] = {}
        for name, (i, spec) in specs.items():
            try:
                classes[name] = self.registry.resolve(spec.type)
            except UnknownPluginType as exc:
                self.error(("plugins", i, "type"), str(exc))
        return classes

    def decode_parameters(
        self, specs: dict[str, tuple[int, PluginSpec]], classes: dict[str, type]
    ) -> dict[str, msgspec.Struct]:
        params: dict[str, msgspec.Struct] = {}
        for name, plugin_class in classes.items():
            i, spec = specs[name]
            params_type = getattr(plugin_class, "Parameters", None)
            if params_type is None:
                if spec.parameters:
                    self.error(
                        ("plugins", i, "parameters"),
                        f"plugin type {spec.type!r} takes no parameters",
                    )
                    continue
                params[name] = NoParameters()
                continue
            value = self.convert(spec.parameters or {}, params_type, ("plugins", i, "parameters"))
            if value is not None:
                params[name] = value
        return params

    def build_plugins(
        self,
        specs: dict[str, tuple[int, PluginSpec]],
        classes: dict[str, type],
        params: dict[str, msgspec.Struct],
    ) -> dict[str, object]:
        plugins: dict[str, object] = {}
        for name, plugin_class in classes.items():
            i, spec = specs[name]
            context = PluginContext(
                name=name,
                type_name=spec.type,
                datastore=self.datastore,
                metrics=self.metrics,
                plugins=dict(plugins),
                background=self.background,
                settings=self.settings,
            )
            try:
                plugin = plugin_class(params[name], context)
            except Exception as exc:
                self.error(("plugins", i), f"cannot build plugin {name!r}: {exc}")
                continue
            if not extension_points(plugin):
                self.error(
                    ("plugins", i, "type"),
                    f"{spec.type!r} implements none of the plugin interfaces"
                    " (filter, score, pick, select_profiles/process_results, prepare,"
                    " pre_request, post_response, saturation, admit, add_extractor, extract)",
                )
                continue
            plugins[name] = plugin
        return plugins

    def slot(self, extension_point: str, name: str, type_name: str, plugin: Any) -> Slot[Any]:
        return Slot(name, type_name, plugin, self.observe(extension_point, type_name, name))

    def default_plugin(
        self,
        type_name: str,
        interface: type,
        plugins: dict[str, object],
        types: dict[str, str],
        parameters: tuple[Path_, dict[str, Any]] | None = None,
    ) -> str | None:
        """Add a default plugin of `type_name` (unless one by that name exists), or
        report why it cannot be used. `parameters`: (where they are in the file,
        their values) for a default configured in place (GIE's older sections)."""
        existing = plugins.get(type_name)
        if existing is not None and not isinstance(existing, interface):
            # A user's plugin took the default's name (a name defaults to the type):
            # using it in the default's place would fail on the first request.
            self.error(
                ("plugins",),
                f"the default {type_name!r} is needed, but that name belongs to a plugin of"
                f" type {types[type_name]!r}: give that plugin another name",
            )
            return None
        if existing is None:
            plugin_class = self.registry.resolve(type_name)
            params_type = getattr(plugin_class, "Parameters", None)
            if params_type is None:
                params: Any = NoParameters()
            elif parameters is None:
                params = msgspec.convert({}, params_type)
            else:
                params = self.convert(parameters[1], params_type, parameters[0])
                if params is None:
                    return None
            plugins[type_name] = plugin_class(
                params,
                PluginContext(
                    type_name,
                    type_name,
                    self.datastore,
                    self.metrics,
                    dict(plugins),
                    self.background,
                    self.settings,
                ),
            )
            types[type_name] = type_name
        return type_name

    def assemble(
        self,
        specs: dict[str, tuple[int, PluginSpec]],
        plugins: dict[str, object],
        profile_specs: list[ProfileSpec],
        types: dict[str, str],
    ) -> SchedulingConfig | None:
        self.check_references(specs, profile_specs)
        profiles: dict[str, SchedulerProfile] = {}
        for j, profile in enumerate(profile_specs):
            filters: list[Slot[Filter]] = []
            scorers: list[WeightedScorer] = []
            picker: Slot[Picker] | None = None
            for k, ref in enumerate(profile.plugins):
                path: Path_ = ("schedulingProfiles", j, "plugins", k)
                plugin = plugins.get(ref.plugin_ref)
                if plugin is None:
                    continue  # reported by check_references
                type_name = types[ref.plugin_ref]
                used = False
                if isinstance(plugin, Filter):
                    filters.append(self.slot("filter", ref.plugin_ref, type_name, plugin))
                    used = True
                if isinstance(plugin, Scorer):
                    weight = 1.0 if ref.weight is None else ref.weight
                    # NaN or infinity would turn every total into NaN.
                    if not (math.isfinite(weight) and weight >= 0):
                        self.error(
                            (*path, "weight"),
                            f"a scorer weight must be a finite number >= 0, got {weight}",
                        )
                    scorers.append(
                        WeightedScorer(
                            self.slot("scorer", ref.plugin_ref, type_name, plugin), weight
                        )
                    )
                    used = True
                elif ref.weight is not None:
                    self.error(
                        (*path, "weight"),
                        f"{ref.plugin_ref!r} is not a scorer: a weight only applies to scorers",
                    )
                if isinstance(plugin, Picker):
                    if picker is not None:
                        self.error(
                            (*path, "pluginRef"),
                            f"profile {profile.name!r} already has picker {picker.name!r}",
                        )
                    picker = self.slot("picker", ref.plugin_ref, type_name, plugin)
                    used = True
                if not used:
                    self.error(
                        (*path, "pluginRef"),
                        f"{ref.plugin_ref!r} is not a filter, scorer or picker, so it has no place"
                        " in a profile",
                    )
            if picker is None:
                name = self.default_plugin(DEFAULT_PICKER, Picker, plugins, types)
                if name is None:
                    continue
                picker = self.slot("picker", name, types[name], plugins[name])
            profiles[profile.name] = SchedulerProfile(
                profile.name, tuple(filters), tuple(scorers), picker
            )

        handlers = [name for name, p in plugins.items() if isinstance(p, ProfileHandler)]
        if len(handlers) > 1:
            self.error(("plugins",), f"more than one profile handler: {', '.join(handlers)}")
        elif not handlers:
            if len(profiles) > 1:
                self.error(
                    ("plugins",),
                    "several scheduling profiles need a profile handler plugin to choose"
                    " among them",
                )
            else:
                default = self.default_plugin(
                    DEFAULT_PROFILE_HANDLER, ProfileHandler, plugins, types
                )
                handlers = [default] if default is not None else []
        if self.errors:
            return None
        handler = handlers[0]
        try:
            plugins[handler].check_profiles(tuple(profiles))  # type: ignore[attr-defined]
        except ValueError as exc:
            self.error(("schedulingProfiles",), f"profile handler {handler!r}: {exc}")
            return None
        scheduler = Scheduler(
            profiles, self.slot("profile_handler", handler, types[handler], plugins[handler])
        )
        return SchedulingConfig(
            scheduler=scheduler,
            data_producers=tuple(
                self.slot("data_producer", n, types[n], p)
                for n, p in plugins.items()
                if isinstance(p, DataProducer)
            ),
            pre_request=tuple(
                self.slot("pre_request", n, types[n], p)
                for n, p in plugins.items()
                if isinstance(p, PreRequest)
            ),
            post_response=tuple(
                self.slot("post_response", n, types[n], p)
                for n, p in plugins.items()
                if isinstance(p, PostResponse)
            ),
            plugins=plugins,
            warnings=tuple(self.warnings),
            background=self.background,
        )


def _line_of(root: yaml.Node | None, path: Path_) -> int | None:
    """The 1-based line of `path` in the YAML node tree (the deepest node found)."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in path:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:
                if key.value == part:
                    child = value
                    line = key.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def load_config(
    text: str,
    registry: PluginRegistry,
    *,
    source: str = "<config>",
    datastore: Datastore | None = None,
    metrics: CollectorRegistry | None = None,
    observe: ObserveFactory = _no_observe,
    settings: ServerSettings | None = None,
) -> SchedulingConfig:
    """Validate `text` and build its scheduling configuration, or raise
    `InvalidConfig` listing every error found."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise InvalidConfig(source, [ConfigError((), f"not valid YAML: {exc}", line)]) from None
    except RecursionError:
        # PyYAML composes recursively: a document nested thousands deep exhausts the
        # stack. It is bad input like any other, not a crash of `epp validate`, of the
        # start, or of the reloader.
        raise InvalidConfig(
            source, [ConfigError((), "not valid YAML: nested too deeply")]
        ) from None
    loader = _Loader(
        document if document is not None else {},
        registry,
        datastore if datastore is not None else Datastore(),
        metrics if metrics is not None else CollectorRegistry(),
        observe,
        settings if settings is not None else ServerSettings(),
    )
    built = loader.load()
    if built is None:
        errors = [ConfigError(e.path, e.message, _line_of(root, e.path)) for e in loader.errors]
        errors.sort(key=lambda e: e.line if e.line is not None else 0)
        raise InvalidConfig(source, errors)
    return built


def load_config_file(path: str | Path, registry: PluginRegistry, **kwargs: Any) -> SchedulingConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(str(path), [ConfigError((), f"cannot read the file: {exc}")]) from None
    return load_config(text, registry, source=str(path), **kwargs)
