"""Step 2 of loading a config: fill in every default, here and nowhere else.

Contract: `complete(validated, registry)` gives a `CompleteConfig`, in which
nothing is left implied, or raises `Rejected` when a default the file relies on
cannot be added. It resolves the default plugins' classes through the registry
but builds nothing.

The defaults (GIE's, unless said otherwise):
- a scorer without a weight: DEFAULT_WEIGHT;
- an objective without a priority: DEFAULT_PRIORITY (this EPP's objectives);
- a profile without a picker: DEFAULT_PICKER;
- no profile handler (so one profile): DEFAULT_PROFILE_HANDLER;
- no `saturationDetector` section: the file's one saturation detector; without
  one, DEFAULT_SATURATION_DETECTOR if some objective is sheddable (negative
  priority), else none (nothing could be shed);
- GIE's older `saturationDetector` section, which holds the detector's own
  parameters: DEFAULT_SATURATION_DETECTOR with them;
- the `flowControl` gate on: llm-d's defaults for the section (a band's bounds
  5000 requests and 1 GB, defaultRequestTTL 60s, priority 0 always has a band:
  epp.config.flowcontrol.plan), and its default policies
  (`global-strict-fairness-policy`, `fcfs-ordering-policy`,
  `static-usage-limit-policy`) when the file does not declare them; and
  DEFAULT_SATURATION_DETECTOR when the file names no detector (flow control
  always needs one);
- no data source: DEFAULT_METRICS_SOURCE if the default detector is used (it
  reads metrics), or, unless `dataLayer.injectDefaults` is false, if a plugin
  reads metrics (its `consumes`); the default source is offered every extractor
  of the file (say, a `core-metrics-extractor` with custom engine mappings);
- no `dataLayer` section: each data source is offered every extractor of the file.

A default plugin is named by its type. A plugin of the file with that name is
used in the default's place if it plays the default's part; if it does not, that
is an error: using it would fail on the first request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from epp.config.document import (
    CompleteConfig,
    Extraction,
    IfMetricsRead,
    PluginDecl,
    Profile,
    ValidatedConfig,
    roles_of,
)
from epp.config.errors import ConfigError, ConfigPath, Problems
from epp.config.flowcontrol import POLICY_KINDS, plan
from epp.config.parse import API_VERSIONS, KIND, decode_parameters
from epp.scheduling.interfaces import (
    DataExtractor,
    DataSource,
    Picker,
    ProfileHandler,
    SaturationDetector,
)
from epp.scheduling.registry import PluginRegistry, UnknownPluginType

DEFAULT_WEIGHT: Final = 1.0
DEFAULT_PRIORITY: Final = 0  # also that of a request without an objective, or an unknown one
DEFAULT_PICKER: Final = "max-score-picker"
DEFAULT_PROFILE_HANDLER: Final = "single-profile-handler"
DEFAULT_METRICS_SOURCE: Final = "metrics-data-source"
DEFAULT_SATURATION_DETECTOR: Final = "utilization-detector"

# Used when no config file is given; manifests/config/default.yaml is the same
# config, commented. Predicted-TTFT routing on the approximate prefix index with its
# cache window, the prefill weight's floor, the fit weighted by the prediction
# beyond 300 ms,
# the decode balance, the spread, crowding only for a prefix wanted beyond a pod, the
# tie cap, the faded queue weight, a hot prefix's own, the work weight once
# the fleet has stayed busy and the decode load in a tie (docs/routing.md): it
# needs nothing from the engines but their /metrics. manifests/config/weighted.yaml
# was the default before.
DEFAULT_CONFIG: Final = f"""\
apiVersion: {API_VERSIONS[0]}
kind: {KIND}
plugins:
- type: approx-prefix-cache-producer
  parameters:
    cacheWindow: true
- type: predicted-ttft-producer
  parameters:
    minPrefillWeightMs: 15
    relativeFit: true
    relativeFitFloorMs: 300
- type: predicted-ttft-scorer
  parameters:
    decodeBalanceFactor: 3
    spreadFactor: 2
    spreadByPodRequests: true
    crowdedFromDemandPods: 1
    tieMaxMs: 250
    queueWeight: 2
    queueWeightFade: true
    hotPrefixQueueWeight: 8
    workWeight: 8
    workWeightBusyFrom: 0.8
    workWeightBusyForS: 5
    tieDecodeFactor: 2.5
- type: {DEFAULT_PICKER}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-ttft-scorer
    weight: 1
  - pluginRef: {DEFAULT_PICKER}
"""


def complete(validated: ValidatedConfig, registry: PluginRegistry) -> CompleteConfig:
    """`validated` with every default filled in, or `Rejected`."""
    problems = Problems()
    implied = _ImpliedPlugins(validated.plugins, registry, problems)
    declared = validated.plugins
    extractors = [d.name for d in declared if d.does(DataExtractor)]

    objectives = {
        name: DEFAULT_PRIORITY if priority is None else priority
        for name, priority in validated.objectives.items()
    }
    detectors = [d.name for d in declared if d.does(SaturationDetector)]
    flow_control = plan(validated.flow_control) if validated.flow_control is not None else None
    default_detector = validated.detector_parameters is not None or (
        validated.saturation_detector is None
        and not detectors
        and (flow_control is not None or any(priority < 0 for priority in objectives.values()))
    )
    if flow_control is not None:
        # llm-d injects its default policies; here only those the section uses
        # without declaring them.
        wanted = {flow_control.usage_limit: "usageLimitPolicyPluginRef"}
        for band in (*flow_control.bands, flow_control.default_band):
            wanted.setdefault(band.fairness, "fairnessPolicyRef")
            wanted.setdefault(band.ordering, "orderingPolicyRef")
        if flow_control.default_negative_band is not None:
            wanted.setdefault(flow_control.default_negative_band.fairness, "fairnessPolicyRef")
            wanted.setdefault(flow_control.default_negative_band.ordering, "orderingPolicyRef")
        for name, key in wanted.items():
            interface, _, default = POLICY_KINDS[key]
            if name == default:
                implied.plugin(default, interface)

    data_layer = validated.data_layer
    if data_layer is not None:
        extractions = list(data_layer.extractions)
    else:
        # GIE without a dataLayer section: each source takes the extractors it can use.
        extractions = [
            extraction
            for source in declared
            if source.does(DataSource)
            for extraction in _offer(source.name, extractors)
        ]
    if_metrics_read: IfMetricsRead | None = None
    if not any(d.does(DataSource) for d in declared):
        if default_detector:
            # The default detector reads metrics: it needs a source, whatever the
            # dataLayer section says.
            source = implied.plugin(DEFAULT_METRICS_SOURCE, DataSource)
            if source is not None:
                extractions += _offer(source, extractors)
        elif data_layer is None or data_layer.inject_defaults:
            if_metrics_read = implied.if_metrics_read(DEFAULT_METRICS_SOURCE, extractors)

    detector: str | None = None
    if validated.detector_parameters is not None:
        detector = implied.plugin(
            DEFAULT_SATURATION_DETECTOR,
            SaturationDetector,
            (("saturationDetector",), validated.detector_parameters),
        )
    elif validated.saturation_detector is not None:
        detector = validated.saturation_detector
    elif detectors:
        detector = detectors[0]  # the validated file has at most one
    elif default_detector:
        detector = implied.plugin(DEFAULT_SATURATION_DETECTOR, SaturationDetector)

    profiles: list[Profile] = []
    for profile in validated.profiles:
        picker = profile.picker
        if picker is None:
            picker = implied.plugin(DEFAULT_PICKER, Picker)
        if picker is None:
            continue  # reported
        scorers = tuple(
            (s.name, DEFAULT_WEIGHT if s.weight is None else s.weight) for s in profile.scorers
        )
        profiles.append(Profile(profile.name, profile.filters, scorers, picker))

    # The validated file has at most one handler, and with none, one profile.
    handlers = [d.name for d in declared if d.does(ProfileHandler)]
    handler = handlers[0] if handlers else implied.plugin(DEFAULT_PROFILE_HANDLER, ProfileHandler)

    problems.stop_if_any()
    assert handler is not None
    return CompleteConfig(
        plugins=declared,
        defaults=tuple(implied.added),
        if_metrics_read=if_metrics_read,
        profiles=tuple(profiles),
        profile_handler=handler,
        saturation_detector=detector,
        extractions=tuple(extractions),
        objectives=objectives,
        warnings=validated.warnings,
        flow_control=flow_control,
    )


def _offer(source: str, extractors: Iterable[str]) -> list[Extraction]:
    """Offer a source every extractor: it takes those it can use."""
    return [Extraction(source, extractor, None) for extractor in extractors]


class _ImpliedPlugins:
    """The default plugins one config needs, added as they are asked for."""

    def __init__(
        self, declared: Iterable[PluginDecl], registry: PluginRegistry, problems: Problems
    ) -> None:
        self.registry = registry
        self.problems = problems
        self.by_name = {d.name: d for d in declared}
        self.added: list[PluginDecl] = []

    def plugin(
        self,
        type_name: str,
        interface: type,
        parameters: tuple[ConfigPath, Mapping[str, Any]] | None = None,
    ) -> str | None:
        """The name of the plugin playing the default `type_name`'s part (added
        unless the file has it), or None after recording why there is none.
        `parameters`: (where they are in the file, their values) for a default
        configured in place (GIE's older sections)."""
        existing = self.by_name.get(type_name)
        if existing is not None:
            if existing.does(interface):
                return existing.name
            self.problems.extend([_name_taken(type_name, existing)])
            return None
        decl = self._declare(type_name, parameters, self.problems)
        if decl is None:
            return None
        self.by_name[type_name] = decl
        self.added.append(decl)
        return decl.name

    def if_metrics_read(self, type_name: str, extractors: list[str]) -> IfMetricsRead:
        """The default source, to be built only if a plugin reads metrics (see
        IfMetricsRead); a problem with it is reported only then, too."""
        existing = self.by_name.get(type_name)
        if existing is not None:
            # Not a data source: the caller asks only when the file has none.
            return IfMetricsRead(None, (), (_name_taken(type_name, existing),))
        problems = Problems()
        decl = self._declare(type_name, None, problems)
        if decl is None:
            return IfMetricsRead(None, (), tuple(problems.errors))
        return IfMetricsRead(decl, tuple(_offer(decl.name, extractors)), ())

    def _declare(
        self,
        type_name: str,
        parameters: tuple[ConfigPath, Mapping[str, Any]] | None,
        problems: Problems,
    ) -> PluginDecl | None:
        """The default plugin `type_name`, or None after recording why not."""
        try:
            plugin_class = self.registry.resolve(type_name)
        except UnknownPluginType as exc:
            problems.add(("plugins",), f"the default {type_name!r} is needed: {exc}")
            return None
        where, values = parameters if parameters is not None else (("plugins",), None)
        decoded = decode_parameters(plugin_class, type_name, values, where, problems)
        if decoded is None:
            return None
        return PluginDecl(
            type_name, type_name, plugin_class, decoded, roles_of(plugin_class), where
        )


def _name_taken(type_name: str, existing: PluginDecl) -> ConfigError:
    # A name defaults to the type, so a plugin of the file may hold the default's name.
    return ConfigError(
        ("plugins",),
        f"the default {type_name!r} is needed, but that name belongs to a plugin of"
        f" type {existing.type_name!r}: give that plugin another name",
    )
