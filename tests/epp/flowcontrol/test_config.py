"""The `featureGates` / `flowControl:` configuration: llm-d's shape, its two sample
configs, its defaults, and one clear error (with its path) per kind of mistake."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
from epp.plugins.program_aware_fairness import ProgramAwareFairness
from epp.plugins.round_robin_fairness_policy import RoundRobinFairnessPolicy
from epp.plugins.soft_reflective_ceiling_policy import SoftReflectiveCeilingPolicy

from epp import cli
from epp.clock import VirtualClock
from epp.config import InvalidConfig, SchedulingConfig, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry

# llm-d-router's deploy/config/sim-program-aware-config.yaml: its plugins, gate and
# section, as llm-d documents them.
SIM_PROGRAM_AWARE_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: program-aware-fairness
- type: queue-scorer
- type: max-score-picker
- type: single-profile-handler
featureGates:
- flowControl
flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: program-aware-fairness
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""

# llm-d-router's deploy/config/soft-reflective-ceiling-epp-config.yaml, likewise.
SOFT_REFLECTIVE_CEILING_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates:
- flowControl
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: soft-reflective-ceiling-policy
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2.0
  - pluginRef: kv-cache-utilization-scorer
    weight: 2.0
  - pluginRef: prefix-cache-scorer
    weight: 3.0
flowControl:
  usageLimitPolicyPluginRef: soft-reflective-ceiling-policy
"""

HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
PROFILES = "schedulingProfiles:\n- name: default\n"


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry.from_entry_points()


def load(text: str, registry: PluginRegistry, **kwargs: object) -> SchedulingConfig:
    return load_config(text, registry, **kwargs)  # type: ignore[arg-type]


def errors_of(text: str, registry: PluginRegistry) -> list[str]:
    with pytest.raises(InvalidConfig) as info:
        load(HEADER + textwrap.dedent(text), registry)
    return [str(e) for e in info.value.errors]


def route_once(config: SchedulingConfig, datastore: Datastore, clock: VirtualClock) -> str:
    director = Director(datastore, config, Telemetry(datastore), clock=clock)
    request = parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={"content-type": "application/json", "x-llm-d-inference-fairness-id": "prog-1"},
        body=b'{"model": "m", "prompt": "hello"}',
    )

    async def go() -> str:
        decision = await director.pick_endpoint(request)
        director.finish(decision, ResponseInfo(completed=True))
        return decision.endpoint.name

    return asyncio.run(go())


def pool() -> Datastore:
    datastore = Datastore()
    datastore.replace_all(
        [EndpointSpec("pod-a", "10.0.0.1:8000"), EndpointSpec("pod-b", "10.0.0.2:8000")]
    )
    return datastore


def test_the_program_aware_sample_loads_and_routes(registry: PluginRegistry) -> None:
    datastore, clock = pool(), VirtualClock(10.0)
    config = load(SIM_PROGRAM_AWARE_CONFIG, registry, datastore=datastore, clock=clock)
    assert config.warnings == ()
    controller = config.flow_control
    assert controller is not None
    default = controller.settings.default_band
    assert isinstance(default.fairness, ProgramAwareFairness)
    assert default.ordering_name == "fcfs-ordering-policy"
    assert (default.max_requests, default.max_bytes) == (5000, 1_000_000_000)
    # Priority 0 always has a band, a copy of the default band (llm-d's): the
    # sample's requests (no objective) are shared out by program.
    (zero,) = controller.settings.bands
    assert zero.priority == 0
    assert zero.fairness_name == "program-aware-fairness"
    assert controller.settings.usage_limit_name == "static-usage-limit-policy"
    assert controller.settings.default_request_ttl_s == 60.0
    assert config.saturation_detector is not None
    assert config.saturation_detector.type_name == "utilization-detector"
    assert route_once(config, datastore, clock) in ("pod-a", "pod-b")
    # The policy is also a post-response hook: the program was charged.
    assert "program-aware-fairness" in [s.name for s in config.post_response]


def test_the_soft_reflective_ceiling_sample_loads_and_routes(registry: PluginRegistry) -> None:
    datastore, clock = pool(), VirtualClock(10.0)
    config = load(SOFT_REFLECTIVE_CEILING_CONFIG, registry, datastore=datastore, clock=clock)
    controller = config.flow_control
    assert controller is not None
    assert isinstance(controller.settings.usage_limit, SoftReflectiveCeilingPolicy)
    assert route_once(config, datastore, clock) in ("pod-a", "pod-b")


@pytest.mark.parametrize("text", [SIM_PROGRAM_AWARE_CONFIG, SOFT_REFLECTIVE_CEILING_CONFIG])
def test_epp_validate_accepts_the_samples(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    assert cli.main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"{path}: valid" in out
    assert "warning" not in err


def test_the_whole_section(registry: PluginRegistry) -> None:
    config = load(
        HEADER
        + PROFILES
        + textwrap.dedent(
            """\
            featureGates: ["flowControl=true", "somethingElse"]
            plugins:
            - type: round-robin-fairness-policy
              name: rr
            - type: edf-ordering-policy
            - type: static-usage-limit-policy
              name: limit
              parameters: {threshold: 0.8}
            flowControl:
              maxRequests: 10k
              maxBytes: 2Gi
              defaultRequestTTL: 30s
              defaultPriorityBand: {fairnessPolicyRef: rr, maxRequests: 100}
              defaultNegativePriorityBand: {maxRequests: 5, maxBytes: 1M}
              priorityBands:
              - {priority: 10, orderingPolicyRef: edf-ordering-policy, maxBytes: "1.5k"}
              - {priority: 0, fairnessPolicyRef: rr}
              usageLimitPolicyPluginRef: limit
            """
        ),
        registry,
    )
    controller = config.flow_control
    assert controller is not None
    s = controller.settings
    assert (s.max_requests, s.max_bytes) == (10_000, 2 * 2**30)
    assert s.default_request_ttl_s == 30.0
    assert s.no_endpoint_request_ttl_s == 30.0  # follows defaultRequestTTL
    assert s.default_band.max_requests == 100
    assert isinstance(s.default_band.fairness, RoundRobinFairnessPolicy)
    assert s.default_negative_band is not None
    assert (s.default_negative_band.max_requests, s.default_negative_band.max_bytes) == (5, 10**6)
    bands = {b.priority: b for b in s.bands}
    assert bands[10].ordering_name == "edf-ordering-policy"
    assert bands[10].max_bytes == 1500
    assert bands[10].max_requests == 5000
    assert bands[0].fairness_name == "rr"
    assert s.usage_limit_name == "limit"
    assert list(s.usage_limit.compute_limits(0.5, [10, 0])) == [0.8, 0.8]
    assert config.warnings == (
        "featureGates: 'somethingElse' is not a feature gate of this EPP (known: flowControl);"
        " accepted for llm-d compatibility but ignored",
    )


def test_gate_off_keeps_the_section_out_with_a_warning(registry: PluginRegistry) -> None:
    config = load(
        HEADER + PROFILES + "featureGates: [flowControl=false]\nflowControl: {maxRequests: 3}\n",
        registry,
    )
    assert config.flow_control is None
    assert any(w.startswith("flowControl: ignored") for w in config.warnings)


def test_flow_control_saturation_detector_wins_over_the_top_level_one(
    registry: PluginRegistry,
) -> None:
    config = load(
        HEADER
        + PROFILES
        + textwrap.dedent(
            """\
            featureGates: [flowControl]
            plugins:
            - {type: utilization-detector, name: old}
            - {type: utilization-detector, name: new, parameters: {queueDepthThreshold: 9}}
            saturationDetector: {pluginRef: old}
            flowControl:
              saturationDetector: {pluginRef: new}
            """
        ),
        registry,
    )
    assert config.saturation_detector is not None
    assert config.saturation_detector.name == "new"


# -- one clear error per kind of mistake, with its path ---------------------------------


def test_an_unknown_policy_is_named_with_its_path(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES
        + "featureGates: [flowControl]\n"
        + "flowControl:\n  defaultPriorityBand: {fairnessPolicyRef: wfq-fairness-policy}\n",
        registry,
    )
    assert len(errors) == 1
    assert "flowControl.defaultPriorityBand.fairnessPolicyRef" in errors[0]
    assert "no plugin named 'wfq-fairness-policy' in plugins" in errors[0]


def test_a_policy_of_the_wrong_kind_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES
        + "featureGates: [flowControl]\nplugins:\n- type: fcfs-ordering-policy\n"
        + "flowControl:\n  priorityBands:\n"
        + "  - {priority: 1, fairnessPolicyRef: fcfs-ordering-policy}\n",
        registry,
    )
    assert errors == [
        "line 10: flowControl.priorityBands[0].fairnessPolicyRef: 'fcfs-ordering-policy'"
        " (type 'fcfs-ordering-policy') is not a fairness policy"
    ]


def test_a_bad_quantity_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES + "featureGates: [flowControl]\nflowControl:\n  maxBytes: lots\n", registry
    )
    assert len(errors) == 1
    assert "flowControl.maxBytes: 'lots' is not a quantity" in errors[0]


def test_a_negative_bound_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES
        + "featureGates: [flowControl]\nflowControl:\n  priorityBands:\n"
        + "  - {priority: 2, maxRequests: -1}\n",
        registry,
    )
    assert errors == ["line 8: flowControl.priorityBands[0].maxRequests: must be >= 0, got -1"]


def test_a_bad_ttl_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES + "featureGates: [flowControl]\nflowControl:\n  defaultRequestTTL: soon\n",
        registry,
    )
    assert len(errors) == 1
    assert errors[0].startswith("line 7: flowControl.defaultRequestTTL:")


def test_duplicate_band_priorities_are_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES
        + "featureGates: [flowControl]\nflowControl:\n  priorityBands:\n"
        + "  - {priority: 2}\n  - {priority: 2}\n",
        registry,
    )
    assert errors == [
        "line 9: flowControl.priorityBands[1].priority: priority 2 already has a band"
        " (flowControl.priorityBands[0])"
    ]


def test_a_band_without_priority_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES
        + "featureGates: [flowControl]\nflowControl:\n  priorityBands:\n  - {maxRequests: 2}\n",
        registry,
    )
    assert len(errors) == 1
    assert "flowControl.priorityBands[0].priority: missing required key" in errors[0]


def test_an_unknown_key_in_the_section_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES + "featureGates: [flowControl]\nflowControl:\n  maxQueue: 3\n", registry
    )
    assert errors == ["line 7: flowControl.maxQueue: unknown key"]


def test_a_bad_gate_value_is_refused(registry: PluginRegistry) -> None:
    errors = errors_of(PROFILES + "featureGates: [flowControl=maybe]\n", registry)
    assert errors == [
        "line 5: featureGates[0]: 'maybe' is not a valid value for feature gate 'flowControl'"
        " (true or false)"
    ]


def test_bad_policy_parameters_are_refused(registry: PluginRegistry) -> None:
    errors = errors_of(
        PROFILES
        + "featureGates: [flowControl]\nplugins:\n- type: static-usage-limit-policy\n"
        + "  parameters: {threshold: 1.5}\n",
        registry,
    )
    assert len(errors) == 1
    assert "plugins[0].parameters.threshold" in errors[0]
    assert "<= 1.0" in errors[0]
