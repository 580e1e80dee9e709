"""Config sections for metrics, admission and objectives: GIE's `dataLayer` and
`saturationDetector`, this EPP's `inferenceObjectives`, and the defaults."""

from __future__ import annotations

import textwrap

import pytest
from epp.plugins.core_metrics_extractor import CoreMetricsExtractor
from epp.plugins.metrics_data_source import MetricsDataSource
from epp.plugins.utilization_detector import UtilizationDetector

from epp.config import ConfigError, InvalidConfig, SchedulingConfig, load_config
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry.from_entry_points()


def load(text: str, registry: PluginRegistry, **kwargs: object) -> SchedulingConfig:
    return load_config(HEADER + textwrap.dedent(text), registry, **kwargs)  # type: ignore[arg-type]


def errors_of(text: str, registry: PluginRegistry) -> list[ConfigError]:
    with pytest.raises(InvalidConfig) as info:
        load(text, registry)
    return info.value.errors


def sources(config: SchedulingConfig) -> list[MetricsDataSource]:
    return [p for p in config.plugins.values() if isinstance(p, MetricsDataSource)]


GIE_CONFIG = """\
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters: {scheme: http, path: /metrics, insecureSkipVerify: true}
- type: core-metrics-extractor
  parameters:
    engineLabelKey: inference.networking.k8s.io/engine-type
    defaultEngine: vllm
    engineConfigs:
    - name: my-engine
      queuedRequestsSpec: "custom_queue{status=waiting}"
      runningRequestsSpec: custom_running
      kvUsageSpec: custom_kv
- type: utilization-detector
  parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8, metricsStalenessThreshold: 200ms}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: max-score-picker}
saturationDetector: {pluginRef: utilization-detector}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""


def test_a_gie_config_loads_unchanged(registry: PluginRegistry) -> None:
    config = load(GIE_CONFIG, registry)
    (source,) = sources(config)
    extractor = config.plugins["core-metrics-extractor"]
    assert isinstance(extractor, CoreMetricsExtractor)
    assert source.scraper.extractor is extractor
    assert {"my-engine", "vllm"} <= set(extractor.engines)
    assert config.saturation_detector is not None
    assert config.saturation_detector.name == "utilization-detector"
    assert list(config.services) == ["metrics-data-source"]
    # featureGates: [flowControl] turns flow control on (docs/flow-control.md), with
    # the file's detector as its gate.
    assert config.warnings == ()
    assert config.flow_control is not None


def test_metrics_readers_get_the_default_source_with_the_flags(registry: PluginRegistry) -> None:
    settings = ServerSettings(
        refresh_metrics_interval_s=0.2,
        metrics_staleness_threshold_s=5.0,
        metrics_scrape_timeout_s=0.5,
    )
    config = load(
        """\
        plugins:
        - type: queue-scorer
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}]
        """,
        registry,
        settings=settings,
    )
    (source,) = sources(config)
    assert (source.settings.interval_s, source.settings.staleness_s, source.settings.timeout_s) == (
        0.2,
        5.0,
        0.5,
    )
    assert list(config.services) == ["metrics-data-source"]


def test_the_default_source_takes_a_declared_extractor(registry: PluginRegistry) -> None:
    # No source declared, but an extractor with a custom engine is: the default
    # source must scrape with that extractor, or the custom engine's pods would be
    # read with the built-in names and scored as if idle.
    config = load(
        """\
        plugins:
        - type: queue-scorer
        - type: core-metrics-extractor
          parameters:
            defaultEngine: my-engine
            engineConfigs:
            - {name: my-engine, queuedRequestsSpec: q, runningRequestsSpec: r, kvUsageSpec: k}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}]
        """,
        registry,
    )
    (source,) = sources(config)
    assert source.scraper.extractor is config.plugins["core-metrics-extractor"]


def test_nothing_is_scraped_when_no_plugin_reads_metrics(registry: PluginRegistry) -> None:
    config = load(
        """\
        plugins:
        - type: active-request-scorer
        - type: prefix-cache-scorer
          parameters: {autoTune: false}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: active-request-scorer}, {pluginRef: prefix-cache-scorer}]
        """,
        registry,
    )
    assert sources(config) == []
    assert config.services == {}


def test_inject_defaults_false_turns_the_default_source_off(registry: PluginRegistry) -> None:
    config = load(
        """\
        plugins: [{type: queue-scorer}]
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}]
        dataLayer: {injectDefaults: false}
        """,
        registry,
    )
    assert sources(config) == []


def test_data_layer_references_are_checked(registry: PluginRegistry) -> None:
    errors = errors_of(
        """\
        plugins:
        - type: metrics-data-source
        - type: queue-scorer
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}]
        dataLayer:
          sources:
          - pluginRef: nowhere
          - pluginRef: metrics-data-source
            extractors: [{pluginRef: queue-scorer}, {pluginRef: ghost}]
        """,
        registry,
    )
    messages = {(str(e).split(": ", 1)[1]) for e in errors}
    assert any("dataLayer.sources[0].pluginRef: no plugin named 'nowhere'" in m for m in messages)
    assert any(
        "extractors[0].pluginRef: 'queue-scorer' is not a data extractor" in m for m in messages
    )
    assert any("extractors[1].pluginRef: no plugin named 'ghost'" in m for m in messages)


def test_a_data_source_has_no_place_in_a_profile(registry: PluginRegistry) -> None:
    errors = errors_of(
        """\
        plugins: [{type: metrics-data-source}]
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: metrics-data-source}]
        """,
        registry,
    )
    assert "is not a filter, scorer or picker" in str(errors[0])


def test_bad_extractor_specs_are_errors(registry: PluginRegistry) -> None:
    errors = errors_of(
        """\
        plugins:
        - type: core-metrics-extractor
          parameters:
            defaultEngine: nope
        - type: core-metrics-extractor
          name: second
          parameters:
            engineConfigs: [{name: x, queuedRequestsSpec: "bad{spec"}]
        schedulingProfiles: [{name: default}]
        """,
        registry,
    )
    text = "\n".join(str(e) for e in errors)
    assert "defaultEngine 'nope'" in text
    assert "queuedRequestsSpec" in text


def test_gie_v1_saturation_detector_section_with_parameters(registry: PluginRegistry) -> None:
    config = load(
        """\
        schedulingProfiles: [{name: default}]
        saturationDetector:
          queueDepthThreshold: 7
          kvCacheUtilThreshold: 0.9
          metricsStalenessThreshold: 1s
        """,
        registry,
    )
    assert config.saturation_detector is not None
    detector = config.saturation_detector.plugin
    assert isinstance(detector, UtilizationDetector)
    assert (detector.queue_threshold, detector.kv_threshold, detector.staleness_s) == (7, 0.9, 1.0)
    assert len(sources(config)) == 1  # the detector reads metrics
    errors = errors_of(
        """\
        schedulingProfiles: [{name: default}]
        saturationDetector: {queueDepthThreshold: -1}
        """,
        registry,
    )
    assert "saturationDetector.queueDepthThreshold" in str(errors[0])


def test_objectives_and_the_default_detector(registry: PluginRegistry) -> None:
    config = load(
        """\
        schedulingProfiles: [{name: default}]
        inferenceObjectives:
        - {name: batch, priority: -1}
        - {name: chat}
        """,
        registry,
    )
    assert config.objectives == {"batch": -1, "chat": 0}
    # A sheddable objective brings GIE's default detector (and the metrics it reads).
    assert config.saturation_detector is not None
    assert isinstance(config.saturation_detector.plugin, UtilizationDetector)
    assert len(sources(config)) == 1
    plain = load(
        "schedulingProfiles: [{name: default}]\ninferenceObjectives: [{name: a, priority: 3}]\n",
        registry,
    )
    assert plain.saturation_detector is None  # nothing could be shed


def test_objective_and_detector_errors(registry: PluginRegistry) -> None:
    errors = errors_of(
        """\
        plugins:
        - type: utilization-detector
        - {type: utilization-detector, name: other}
        schedulingProfiles: [{name: default}]
        inferenceObjectives:
        - {name: a, priority: 1}
        - {name: a, priority: x}
        - {name: a}
        """,
        registry,
    )
    text = "\n".join(str(e) for e in errors)
    assert "inferenceObjectives[1].priority" in text
    assert "duplicate objective 'a'" in text
    errors = errors_of(
        """\
        plugins:
        - type: utilization-detector
        - {type: utilization-detector, name: other}
        schedulingProfiles: [{name: default}]
        """,
        registry,
    )
    assert "several saturation detectors" in str(errors[0])
    errors = errors_of(
        """\
        plugins: [{type: queue-scorer}]
        schedulingProfiles: [{name: default}]
        saturationDetector: {pluginRef: queue-scorer}
        """,
        registry,
    )
    assert "saturationDetector.pluginRef: 'queue-scorer' is not a saturation detector" in str(
        errors[0]
    )


def test_a_plugin_named_like_the_default_source_is_fine_while_nothing_reads_metrics(
    registry: PluginRegistry,
) -> None:
    # Whether the default source is needed is known only once the plugins are built
    # (prefix-cache-scorer reads metrics only to auto-tune), and so is whether its
    # name being taken matters.
    text = """\
        plugins:
        - type: prefix-cache-scorer
          name: metrics-data-source
          parameters: {autoTune: %s}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: metrics-data-source}]
        """
    config = load(text % "false", registry)
    assert sources(config) == []
    (error,) = errors_of(text % "true", registry)
    assert error.path == ("plugins",)
    assert "the default 'metrics-data-source' is needed" in error.message


def test_the_default_detector_refusing_its_parameters_is_an_error(
    registry: PluginRegistry,
) -> None:
    (error,) = errors_of(
        """\
        schedulingProfiles: [{name: default}]
        saturationDetector: {metricsStalenessThreshold: 0s}
        """,
        registry,
    )
    assert error.path == ("saturationDetector",)
    assert "metricsStalenessThreshold must be positive" in error.message
    assert error.line == 4
