"""The Helm chart (manifests/helm/inferencepool), rendered and linted by the real
Helm library, every object validated against Kubernetes' own schemas (PyPI
kubernetes-validate, strict: unknown fields are errors) for each supported
Kubernetes version, and what it configures checked against the EPP itself: its
config loader, its command line, its ports.

Each values set is rendered once (cached); the tests then read the objects."""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from bench.stack import envoy_binary
from epp.cli import build_parser, kube_options, serve_options
from epp.config import SchedulingConfig, load_config
from epp.kvindex.service import PrecisePrefixService
from epp.scheduling.registry import PluginRegistry
from tests.manifests.chart import (
    CHART,
    EPP,
    EXAMPLE,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    ROOT,
    Obj,
    Rendered,
    deep_merge,
    lint,
    render,
)
from tests.manifests.crd_schemas import CUSTOM_RESOURCE_SCHEMAS
from tests.manifests.example_plugin import example_src, registry_with_example

POOL_LABELS: Final = {"app": "vllm-llama3-8b-instruct"}
REQUIRED: Final[dict[str, Any]] = {"inferencePool": {"modelServers": {"matchLabels": POOL_LABELS}}}
APPROX_PREFIX_YAML: Final = ROOT / "manifests" / "config" / "approx-prefix.yaml"
PRECISE_PREFIX_YAML: Final = ROOT / "manifests" / "config" / "precise-prefix.yaml"

# manifests/config/approx-prefix.yaml written as plain chart values.
APPROX_PREFIX_VALUES: Final[dict[str, Any]] = {
    "inferenceExtension": {
        "scheduling": {
            "scorers": {
                "prefix-cache-scorer": {
                    "weight": 3,
                    "parameters": {
                        "blockSizeTokens": 16,
                        "maxPrefixBlocksToMatch": 256,
                        "lruCapacityPerServer": 31250,
                    },
                },
                "queue-scorer": {"weight": 2},
                "kv-cache-utilization-scorer": {"weight": 2},
                # The chart's default profile's scorer, not in GIE's shape.
                "predicted-ttft-scorer": {"enabled": False},
            },
            "plugins": [
                {
                    "type": "utilization-detector",
                    "parameters": {"queueDepthThreshold": 5, "kvCacheUtilThreshold": 0.8},
                }
            ],
            "saturationDetector": "utilization-detector",
        }
    },
    "inferenceObjectives": [{"name": "batch", "priority": -1}],
}


FLOW_CONTROL_TTL_S: Final = 1200.0
FLOW_CONTROL_VALUES: Final[dict[str, Any]] = {
    "envoy": {
        "enabled": True,
        "timeouts": {"streamIdle": "300s", "request": "30s", "route": "600s"},
    },
    "inferenceExtension": {
        "failureMode": "FailOpen",
        "flowControl": {
            "enabled": True,
            "defaultRequestTTL": "20m",
            "maxRequests": 2000,
            "maxBytes": "1Gi",
            "defaultPriorityBand": {"maxRequests": 500, "orderingPolicyRef": "edf"},
            "priorityBands": [
                {
                    "priority": 10,
                    "maxRequests": 100,
                    "fairnessPolicyRef": "round-robin-fairness-policy",
                }
            ],
            "usageLimitPolicyPluginRef": "soft-reflective-ceiling-policy",
        },
        "scheduling": {
            "plugins": [
                {"type": "round-robin-fairness-policy"},
                {"type": "edf-ordering-policy", "name": "edf"},
                {"type": "soft-reflective-ceiling-policy"},
            ],
        },
    },
    "inferenceObjectives": [{"name": "interactive", "priority": 10}],
}


def _example_values() -> dict[str, Any]:
    # Parsed the way `helm install -f` reads a values file.
    text = (EXAMPLE / "values.yaml").read_text(encoding="utf-8")
    return helm.values_from_yaml(text)


VALUE_SETS: Final[dict[str, dict[str, Any]]] = {
    "default": REQUIRED,
    "replicas-pdb": deep_merge(
        REQUIRED,
        {"inferenceExtension": {"replicas": 3, "podDisruptionBudget": {"enabled": True}}},
    ),
    "servicemonitor": deep_merge(
        REQUIRED,
        {
            "inferenceExtension": {
                "monitoring": {
                    "interval": "15s",
                    "prometheus": {"enabled": True, "labels": {"release": "prometheus"}},
                }
            }
        },
    ),
    "standalone-envoy": deep_merge(
        REQUIRED,
        {
            "envoy": {"enabled": True},
            "inferenceExtension": {"replicas": 2, "failureMode": "FailOpen"},
        },
    ),
    "tls-envoy": deep_merge(
        REQUIRED,
        {
            "envoy": {"enabled": True},
            "inferenceExtension": {
                "secureServing": {"enabled": True, "certSecretName": "epp-tls"},
                "flags": {"max-concurrent-streams": 5000},
            },
        },
    ),
    # FailOpen with TLS to the picker and two target ports.
    "tls-envoy-fail-open": deep_merge(
        REQUIRED,
        {
            "envoy": {"enabled": True},
            "inferenceExtension": {
                "failureMode": "FailOpen",
                "secureServing": {"enabled": True},
            },
            "inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]},
        },
    ),
    "tls-self-signed": deep_merge(
        REQUIRED, {"inferenceExtension": {"secureServing": {"enabled": True}}}
    ),
    "custom-config": deep_merge(
        REQUIRED,
        {
            "inferenceExtension": {
                "pluginsConfigFile": "approx-prefix.yaml",
                "pluginsCustomConfig": {
                    "approx-prefix.yaml": APPROX_PREFIX_YAML.read_text(encoding="utf-8")
                },
            }
        },
    ),
    "scorer-weights": deep_merge(REQUIRED, APPROX_PREFIX_VALUES),
    # The shipped precise profile, each model's tokenizer from the Hub through a
    # cache filled beforehand (offline), a gated model's token, one local tokenizer.
    "precise-hub-offline": deep_merge(
        REQUIRED,
        {
            "inferenceExtension": {
                "pluginsConfigFile": "precise-prefix.yaml",
                "pluginsCustomConfig": {
                    "precise-prefix.yaml": PRECISE_PREFIX_YAML.read_text(encoding="utf-8")
                },
                "kvEvents": {"port": 5557, "replayPort": 5558},
                "huggingFace": {
                    "cache": {"existingClaim": "hf-tokenizers", "readOnly": True},
                    "offline": True,
                    "token": {"secretName": "hf-token", "secretKey": "HF_TOKEN"},
                },
                "flags": {"tokenizer-dir": "my-model=/tokenizers/my-model"},
            }
        },
    ),
    # Prefill/decode disaggregation from plain values: llm-d's threshold decider.
    "pd-prefix-decider": deep_merge(
        REQUIRED, {"inferenceExtension": {"disaggregation": {"enabled": True}}}
    ),
    # ... and the predicted-TTFT decider, on the default scheduling values (whose
    # producers it reads).
    "pd-predicted-ttft": deep_merge(
        REQUIRED,
        {
            "inferenceExtension": {
                "disaggregation": {
                    "enabled": True,
                    "decider": "predicted-ttft-pd-decider",
                    "deciderParameters": {"predicted-ttft-pd-decider": {"streamDelayWeight": 0.5}},
                },
            }
        },
    ),
    # Flow control from plain values, behind the standalone Envoy with FailOpen (its
    # BUFFERED request body is where Envoy's ext_proc message timeout applies) and
    # finite HTTP timeouts, all below a 20-minute TTL: the chart raises them.
    "flow-control-envoy": deep_merge(REQUIRED, FLOW_CONTROL_VALUES),
    "hub-cache-size-limit": deep_merge(
        REQUIRED,
        {"inferenceExtension": {"huggingFace": {"cache": {"sizeLimit": "2Gi"}}}},
    ),
    "example-plugin": _example_values(),
    "selector-no-pool": deep_merge(
        REQUIRED,
        {
            "inferencePool": {
                "enabled": False,
                "targetPorts": [{"number": 8000}, {"number": 8001}],
            },
            "inferenceExtension": {"kvEvents": {"port": 5557, "replayPort": 5567}},
        },
    ),
    "v1alpha2-sglang": deep_merge(
        REQUIRED,
        {
            "inferencePool": {
                "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                "modelServerType": "sglang",
            },
            "inferenceExtension": {
                "scheduling": {
                    "filters": [{"type": "stale-metrics-filter", "name": "fresh-only"}],
                    "scorers": {
                        "queue-scorer": {"weight": 1.5},
                        "kv-cache-utilization-scorer": {"weight": 0},
                        "load-aware-scorer": {"enabled": False},
                        "inflight": {"type": "active-request-scorer"},
                        # The chart's default scorer turned off.
                        "predicted-ttft-scorer": {"enabled": False},
                    },
                    "picker": {"type": "weighted-random-picker"},
                },
                "flags": {
                    "v": 3,
                    "debug-endpoints": True,
                    "log-prompts": False,
                    "config-reload-interval": "5s",
                    "refresh-metrics-interval": "100ms",
                },
            },
        },
    ),
}
SETS: Final = sorted(VALUE_SETS)
FLOW_CONTROL: Final = [
    s
    for s in SETS
    if VALUE_SETS[s].get("inferenceExtension", {}).get("flowControl", {}).get("enabled")
]
WITH_ENVOY: Final = [s for s in SETS if VALUE_SETS[s].get("envoy", {}).get("enabled")]
FAIL_OPEN: Final = [
    s for s in WITH_ENVOY if VALUE_SETS[s]["inferenceExtension"].get("failureMode") == "FailOpen"
]


@functools.cache
def rendered(name: str) -> Rendered:
    return render(VALUE_SETS[name])


@pytest.fixture(params=SETS)
def chart(request: pytest.FixtureRequest) -> Rendered:
    name: str = request.param
    return rendered(name)


def _registry(monkeypatch: pytest.MonkeyPatch) -> PluginRegistry:
    monkeypatch.syspath_prepend(str(example_src()))
    return registry_with_example()


def _serve_args(chart: Rendered) -> Any:
    parser = build_parser()
    try:
        return parser.parse_args(["serve", *chart.epp_args])
    except SystemExit as exc:  # argparse reports and exits
        raise AssertionError(f"`epp serve` refuses the chart's args {chart.epp_args}") from exc


def _epp_config_text(chart: Rendered) -> str:
    """The config file the picker is told to load, from the ConfigMap it mounts."""
    path = Path(_serve_args(chart).config_file)
    assert path.parent == Path("/config"), path
    return chart.config_files[path.name]


def _load(text: str, monkeypatch: pytest.MonkeyPatch) -> SchedulingConfig:
    return load_config(text, _registry(monkeypatch), source="ConfigMap")


def _weights(config: SchedulingConfig) -> dict[str, float]:
    profile = config.scheduler.profiles["default"]
    return {s.slot.name: s.weight for s in profile.scorers}


# ---------------------------------------------------------------------------
# Helm itself: lint, schema, render-time checks


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", SETS)
def test_lint_is_clean(name: str, kube_version: str) -> None:
    assert lint(VALUE_SETS[name], kube_version) == []


def test_chart_metadata() -> None:
    with helm.Chart.load(CHART) as chart:
        assert chart.name == "inferencepool"
        assert chart.schema is not None, "values.schema.json is missing"
        # The defaults pass the schema, and every key of the schema's top level exists.
        chart.validate_schema(REQUIRED)
        assert chart.metadata["kubeVersion"] == ">=1.30.0-0"


@pytest.mark.parametrize(
    ("values", "offending"),
    [
        pytest.param({"inferenceExtension": {"replica": 3}}, "replica", id="top-level key"),
        pytest.param(
            {"inferenceExtension": {"scheduling": {"scorers": {"queue-scorer": {"wieght": 2}}}}},
            "wieght",
            id="scorer field",
        ),
        pytest.param({"inferencePool": {"targetPort": [8000]}}, "targetPort", id="pool field"),
        pytest.param({"envoy": {"enabeld": True}}, "enabeld", id="envoy field"),
        pytest.param({"inferenceObjective": []}, "inferenceObjective", id="root key"),
        pytest.param(
            {"inferenceExtension": {"flags": {"log-fromat": "json"}}}, "log-fromat", id="flag name"
        ),
        pytest.param(
            {"inferenceExtension": {"flags": {"pool-name": "other"}}},
            "pool-name",
            id="flag the chart sets",
        ),
        pytest.param({"inferencePool": {"modelServerType": "vllm2"}}, "modelServerType", id="enum"),
        pytest.param(
            {"inferenceExtension": {"failureMode": "FailOpened"}}, "failureMode", id="failure mode"
        ),
        pytest.param({"inferenceExtension": {"replicas": "3"}}, "replicas", id="type"),
        pytest.param({"inferenceExtension": {"extProcPort": 70000}}, "extProcPort", id="port"),
        pytest.param(
            {"inferenceExtension": {"scheduling": {"scorers": {"queue-scorer": {"weight": -1}}}}},
            "weight",
            id="negative weight",
        ),
        pytest.param(
            {"inferenceExtension": {"shutdownGrace": "2 minutes"}}, "shutdownGrace", id="duration"
        ),
        pytest.param(
            {"inferencePool": {"modelServers": {"matchLabels": {"app": "not a label"}}}},
            "matchLabels",
            id="label value",
        ),
        pytest.param(
            {"inferenceExtension": {"huggingFace": {"cache": {"existingClam": "pvc"}}}},
            "existingClam",
            id="hub cache field",
        ),
        pytest.param(
            {"inferenceExtension": {"huggingFace": {"cache": {"sizeLimit": "lots"}}}},
            "sizeLimit",
            id="hub cache size",
        ),
        pytest.param(
            {"inferenceExtension": {"huggingFace": {"token": {"secretName": "HF Token"}}}},
            "secretName",
            id="hub token secret name",
        ),
        pytest.param(
            {"inferenceExtension": {"flags": {"tokenizer-dir": "/tokenizers/m"}}},
            "tokenizer-dir",
            id="tokenizer dir without a model",
        ),
        pytest.param(
            {"inferenceExtension": {"disaggregation": {"enabled": True, "decider": "x"}}},
            "decider",
            id="unknown P/D decider",
        ),
        pytest.param(
            {"inferenceExtension": {"flowControl": {"enabled": True, "ttl": "30s"}}},
            "ttl",
            id="flow control: unknown field",
        ),
        pytest.param(
            {"inferenceExtension": {"flowControl": {"defaultRequestTTL": "30"}}},
            "defaultRequestTTL",
            id="flow control: TTL without a unit",
        ),
        pytest.param(
            {"inferenceExtension": {"flowControl": {"priorityBands": [{"maxRequests": 5}]}}},
            "priority",
            id="flow control: a band without its priority",
        ),
        pytest.param(
            {"inferenceExtension": {"flowControl": {"maxBytes": "lots"}}},
            "maxBytes",
            id="flow control: bytes not a quantity",
        ),
        pytest.param(
            {"envoy": {"timeouts": {"streamIdle": "5m"}}},
            "streamIdle",
            id="envoy timeout not a protobuf duration",
        ),
    ],
)
def test_a_typo_fails_at_render_time_with_a_schema_error(
    values: dict[str, Any], offending: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(deep_merge(REQUIRED, values))
    message = str(caught.value)
    assert "schema" in message
    assert offending in message


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {},
            "inferencePool.modelServers.matchLabels is required",
            id="no pool labels",
        ),
        pytest.param(
            {"inferenceExtension": {"pluginsConfigFile": "mine.yaml"}},
            "neither default-plugins.yaml nor a key of inferenceExtension.pluginsCustomConfig",
            id="config file not in the ConfigMap",
        ),
        pytest.param(
            {"inferenceExtension": {"pluginsCustomConfig": {"default-plugins.yaml": "x: 1"}}},
            "must not define default-plugins.yaml",
            id="custom config hiding the built one",
        ),
        pytest.param(
            {
                "inferenceExtension": {
                    "scheduling": {
                        "filters": [{"type": "stale-metrics-filter", "name": "queue-scorer"}],
                        "scorers": {"queue-scorer": {}},
                    }
                }
            },
            'plugin name "queue-scorer" is used twice',
            id="duplicate plugin name",
        ),
        pytest.param(
            {"inferenceExtension": {"scheduling": {"saturationDetector": "detector"}}},
            'saturationDetector "detector" names no plugin',
            id="dangling saturation detector",
        ),
        pytest.param(
            {"inferenceExtension": {"kvEvents": {"replayPort": 5558}}},
            "replayPort needs inferenceExtension.kvEvents.port",
            id="replay port alone",
        ),
        pytest.param(
            {
                "inferencePool": {
                    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                    "targetPorts": [{"number": 8000}, {"number": 8001}],
                }
            },
            "has a single target port",
            id="v1alpha2 with two ports",
        ),
        pytest.param(
            {"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8000}]}},
            "lists port 8000 twice",
            id="duplicate target port",
        ),
        pytest.param(
            {
                "inferenceExtension": {
                    "disaggregation": {"enabled": True},
                    "scheduling": {"filters": [{"type": "decode-filter"}]},
                }
            },
            'plugin name "decode-filter" is used twice',
            id="a role filter the P/D profiles add already",
        ),
        pytest.param(
            {"inferenceExtension": {"secureServing": {"certSecretName": "epp-tls"}}},
            "certSecretName is only used with inferenceExtension.secureServing.enabled",
            id="a TLS secret without TLS",
        ),
        pytest.param(
            {
                "inferenceExtension": {
                    "flowControl": {"enabled": True},
                    "pluginsConfigFile": "mine.yaml",
                    "pluginsCustomConfig": {"mine.yaml": "kind: EndpointPickerConfig"},
                }
            },
            "put featureGates: [flowControl] and a flowControl: section in that file",
            id="flow control values with a custom config file",
        ),
        pytest.param(
            {
                "inferenceExtension": {
                    "flowControl": {
                        "enabled": True,
                        "priorityBands": [
                            {"priority": 1, "fairnessPolicyRef": "round-robin-fairness-policy"}
                        ],
                    }
                }
            },
            'priorityBands[0].fairnessPolicyRef "round-robin-fairness-policy" names no plugin',
            id="an undeclared flow-control policy",
        ),
        pytest.param(
            {
                "inferenceExtension": {
                    "flowControl": {"enabled": True, "priorityBands": [{"priority": 1}] * 2}
                }
            },
            "lists priority 1 twice",
            id="two bands with one priority",
        ),
        pytest.param(
            {
                "envoy": {"enabled": True},
                "inferenceExtension": {"flowControl": {"enabled": True, "defaultRequestTTL": "0s"}},
            },
            "flow control without a TTL (defaultRequestTTL 0s)",
            id="no TTL behind the standalone Envoy",
        ),
        pytest.param(
            {
                "envoy": {"enabled": True},
                "inferenceExtension": {
                    "pluginsConfigFile": "mine.yaml",
                    "pluginsCustomConfig": {
                        "mine.yaml": "featureGates: [flowControl]\n"
                        "flowControl: {defaultRequestTTL: 0s}\n"
                    },
                },
            },
            "flow control without a TTL (defaultRequestTTL 0s)",
            id="no TTL in a custom config behind the standalone Envoy",
        ),
    ],
)
def test_values_the_schema_cannot_judge_fail_with_a_message(
    values: dict[str, Any], message: str
) -> None:
    # `{}`: not even the required values.
    with pytest.raises(helm.HelmRenderError) as caught:
        render(deep_merge(REQUIRED, values) if values else {})
    assert message in str(caught.value)


# ---------------------------------------------------------------------------
# Every object is valid Kubernetes


def _distinct(objects: list[Obj]) -> Iterator[Obj]:
    seen: set[str] = set()
    for obj in objects:
        key = json.dumps(obj, sort_keys=True)
        if key not in seen:
            seen.add(key)
            yield obj


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_for_the_kubernetes_version(kube_version: str) -> None:
    objects = [obj for name in SETS for obj in rendered(name).objects]
    kinds: set[str] = set()
    invalid: list[str] = []
    for obj in _distinct(objects):
        kinds.add(obj["kind"])
        custom = CUSTOM_RESOURCE_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        try:
            if custom is not None:
                # Not part of Kubernetes: checked against our schema of the CRD.
                jsonschema.Draft202012Validator(custom).validate(obj)
            else:
                kubernetes_validate.validate(obj, kube_version, strict=True)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            invalid.append(f"{Rendered.key(obj)} at {where or '/'}: {exc.message}")
    assert invalid == []
    # Every kind the chart can produce was seen in some values set.
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "InferencePool",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    }


def test_the_custom_resource_schemas_reject_what_the_api_server_would() -> None:
    pool = rendered("default").one("InferencePool", RELEASE)
    validator = jsonschema.Draft202012Validator(
        CUSTOM_RESOURCE_SCHEMAS[("inference.networking.k8s.io/v1", "InferencePool")]
    )
    validator.validate(pool)
    broken = json.loads(json.dumps(pool))
    broken["spec"]["targetPorts"] = [{"number": 8000}] * 9
    assert not validator.is_valid(broken)
    broken = json.loads(json.dumps(pool))
    broken["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    assert not validator.is_valid(broken)
    broken = json.loads(json.dumps(pool))
    del broken["spec"]["endpointPickerRef"]["port"]
    assert not validator.is_valid(broken)


def test_nothing_is_cluster_scoped_or_outside_the_release_namespace(chart: Rendered) -> None:
    for obj in chart.objects:
        assert obj["metadata"].get("namespace") == NAMESPACE, Rendered.key(obj)
        assert not obj["kind"].startswith("Cluster"), Rendered.key(obj)


# ---------------------------------------------------------------------------
# The picker's config: valid for this EPP, built from the values


def test_the_config_the_picker_loads_is_valid_for_the_epp(
    chart: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _load(_epp_config_text(chart), monkeypatch)
    # One profile, or llm-d's two for prefill/decode disaggregation.
    assert sorted(config.scheduler.profiles) in (["default"], ["decode", "prefill"])
    # default-plugins.yaml is always there and valid, even when another file is used.
    _load(chart.config_files["default-plugins.yaml"], monkeypatch)


def test_the_default_config_is_the_epps_default() -> None:
    built = yaml.safe_load(rendered("default").config_files["default-plugins.yaml"])
    shipped = yaml.safe_load((ROOT / "manifests" / "config" / "default.yaml").read_text())
    assert built == shipped, (
        "the chart's default scheduling values (values.yaml, inferenceExtension.scheduling)"
        " no longer reproduce manifests/config/default.yaml: update them together"
    )


def test_plain_values_reproduce_a_shipped_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    text = rendered("scorer-weights").config_files["default-plugins.yaml"]
    config = _load(text, monkeypatch)
    assert _weights(config) == {
        "prefix-cache-scorer": 3,
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
    }
    assert config.saturation_detector is not None
    assert config.saturation_detector.name == "utilization-detector"
    assert dict(config.objectives) == {"batch": -1}
    assert config.scheduler.profiles["default"].picker.name == "max-score-picker"

    def canonical(doc: dict[str, Any]) -> dict[str, Any]:
        by_name = lambda p: p.get("name", p.get("type", p.get("pluginRef")))  # noqa: E731
        doc["plugins"] = sorted(doc["plugins"], key=by_name)
        for profile in doc["schedulingProfiles"]:
            profile["plugins"] = sorted(profile["plugins"], key=by_name)
        return doc

    built = canonical(yaml.safe_load(text))
    shipped = canonical(yaml.safe_load(APPROX_PREFIX_YAML.read_text()))
    assert built == shipped


def test_filters_scorer_weights_and_picker_from_values(monkeypatch: pytest.MonkeyPatch) -> None:
    chart = rendered("v1alpha2-sglang")
    config = _load(_epp_config_text(chart), monkeypatch)
    profile = config.scheduler.profiles["default"]
    assert [f.name for f in profile.filters] == ["fresh-only"]
    assert [f.type_name for f in profile.filters] == ["stale-metrics-filter"]
    # weight 0 is kept (not turned into the default 1), a disabled scorer is absent,
    # a scorer's type defaults to its key unless given.
    assert _weights(config) == {
        "inflight": 1,
        "kv-cache-utilization-scorer": 0,
        "queue-scorer": 1.5,
    }
    assert {s.slot.name: s.slot.type_name for s in profile.scorers}["inflight"] == (
        "active-request-scorer"
    )
    assert profile.picker.type_name == "weighted-random-picker"
    # A non-vLLM pool reads its engine's metric names.
    doc = yaml.safe_load(chart.config_files["default-plugins.yaml"])
    extractor = next(p for p in doc["plugins"] if p["type"] == "core-metrics-extractor")
    assert extractor["parameters"] == {"defaultEngine": "sglang"}
    assert "metrics-data-source" in config.plugins


@pytest.mark.parametrize(
    ("name", "decider"),
    [
        ("pd-prefix-decider", "prefix-based-pd-decider"),
        ("pd-predicted-ttft", "predicted-ttft-pd-decider"),
    ],
)
def test_disaggregation_values_build_llm_ds_two_profiles(
    name: str, decider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _load(_epp_config_text(rendered(name)), monkeypatch)
    profiles = config.scheduler.profiles
    assert sorted(profiles) == ["decode", "prefill"]
    # Each profile: its role filter first, then the same scorers and picker.
    assert [f.type_name for f in profiles["decode"].filters] == ["decode-filter"]
    assert [f.type_name for f in profiles["prefill"].filters] == ["prefill-filter"]
    scorers = {p: sorted(s.slot.name for s in profiles[p].scorers) for p in profiles}
    assert scorers["decode"] == scorers["prefill"] != []
    handler = config.plugins["disagg-profile-handler"]
    stage = handler.engine.prefill
    assert stage.decider_name == decider
    assert stage.decider is config.plugins[decider]
    if decider == "prefix-based-pd-decider":
        assert stage.decider.non_cached_tokens == 512  # the chart's default
    else:
        assert stage.decider.weight == 0.5


def test_disaggregation_off_keeps_the_single_default_profile() -> None:
    doc = yaml.safe_load(rendered("default").config_files["default-plugins.yaml"])
    assert [p["name"] for p in doc["schedulingProfiles"]] == ["default"]
    assert not {"decode-filter", "disagg-profile-handler"} & {p["type"] for p in doc["plugins"]}


def test_flow_control_values_build_the_flow_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    text = rendered("flow-control-envoy").config_files["default-plugins.yaml"]
    doc = yaml.safe_load(text)
    assert doc["featureGates"] == ["flowControl"]
    assert doc["flowControl"]["defaultRequestTTL"] == "20m"
    controller = _load(text, monkeypatch).flow_control
    assert controller is not None, "the gate is on: the loader must build a flow controller"
    settings = controller.settings
    assert settings.default_request_ttl_s == FLOW_CONTROL_TTL_S
    assert (settings.max_requests, settings.max_bytes) == (2000, 2**30)
    assert settings.usage_limit_name == "soft-reflective-ceiling-policy"
    bands = {band.priority: band for band in settings.bands}
    assert sorted(bands) == [0, 10]
    assert (bands[10].max_requests, bands[10].fairness_name) == (
        100,
        "round-robin-fairness-policy",
    )
    # Priority 0 copies the template: its bound and ordering, the default fairness.
    assert (bands[0].max_requests, bands[0].ordering_name, bands[0].fairness_name) == (
        500,
        "edf",
        "global-strict-fairness-policy",
    )


def test_flow_control_off_by_default() -> None:
    for name in ("default", "standalone-envoy"):
        doc = yaml.safe_load(rendered(name).config_files["default-plugins.yaml"])
        assert "featureGates" not in doc, name
        assert "flowControl" not in doc, name


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def _envoy_timeouts(bootstrap: Mapping[str, Any]) -> dict[str, float]:
    """The inference listener's timeouts, in seconds (0: none)."""
    (listener,) = [
        item for item in bootstrap["static_resources"]["listeners"] if item["name"] == "inference"
    ]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r["route"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
    assert len({r["timeout"] for r in routes}) == len({r["idle_timeout"] for r in routes}) == 1
    return {
        "message_timeout": _seconds(_ext_proc(bootstrap)["message_timeout"]),
        "stream_idle_timeout": _seconds(hcm["stream_idle_timeout"]),
        "request_timeout": _seconds(hcm["request_timeout"]),
        "route idle_timeout": _seconds(routes[0]["idle_timeout"]),
        "route timeout": _seconds(routes[0]["timeout"]),
    }


# A custom config file that turns flow control on itself, with a TTL above the
# default message timeout (1000 s) and the default headroom.
CUSTOM_FLOW_CONTROL: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: ["flowControl=true"]
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
flowControl:
  defaultRequestTTL: 1h
"""


@pytest.mark.parametrize(
    ("values", "ttl_s", "least_s"),
    [
        pytest.param(FLOW_CONTROL_VALUES, FLOW_CONTROL_TTL_S, 1230.0, id="values"),
        pytest.param(
            {
                "envoy": {"enabled": True, "timeouts": {"flowControlHeadroom": "120s"}},
                "inferenceExtension": {
                    "pluginsConfigFile": "mine.yaml",
                    "pluginsCustomConfig": {"mine.yaml": CUSTOM_FLOW_CONTROL},
                },
            },
            3600.0,
            3720.0,
            id="custom config file",
        ),
    ],
)
def test_flow_control_raises_envoy_timeouts_above_the_ttl(
    values: dict[str, Any], ttl_s: float, least_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    chart = render(deep_merge(REQUIRED, values))
    controller = _load(_epp_config_text(chart), monkeypatch).flow_control
    assert controller is not None
    assert controller.settings.default_request_ttl_s == ttl_s
    timeouts = _envoy_timeouts(_envoy_bootstrap(chart))
    # Every timeout that runs while a request waits in the picker's queue is either
    # none (0) or the TTL plus the headroom for the pick: Envoy never fails a queued
    # request first; the picker answers 429 at the TTL.
    for key in ("message_timeout", "stream_idle_timeout", "request_timeout", "route idle_timeout"):
        assert timeouts[key] == 0 or timeouts[key] >= least_s > ttl_s, (key, timeouts)
    assert timeouts["message_timeout"] == least_s  # the one that cannot be none
    given = values["envoy"].get("timeouts", {})
    if "streamIdle" in given:  # finite ones are raised, not turned off
        assert timeouts["stream_idle_timeout"] == timeouts["route idle_timeout"] == least_s
        assert timeouts["request_timeout"] == least_s
    # The route timeout starts once the picker lets the request go: kept as given.
    assert timeouts["route timeout"] == _seconds(given.get("route", "0s"))


def test_timeouts_above_the_ttl_are_kept() -> None:
    values = deep_merge(
        FLOW_CONTROL_VALUES,
        {
            "envoy": {"timeouts": {"streamIdle": "3600s", "request": "0s"}},
            "inferenceExtension": {"flowControl": {"defaultRequestTTL": "30s"}},
        },
    )
    timeouts = _envoy_timeouts(_envoy_bootstrap(render(deep_merge(REQUIRED, values))))
    assert timeouts["message_timeout"] == 1000  # envoy.extProc.messageTimeout, above 30 s + 30 s
    assert timeouts["stream_idle_timeout"] == timeouts["route idle_timeout"] == 3600
    assert timeouts["request_timeout"] == 0  # none stays none


@pytest.mark.parametrize("name", [s for s in WITH_ENVOY if s not in FLOW_CONTROL])
def test_without_flow_control_envoy_keeps_the_shipped_timeouts(name: str) -> None:
    standalone = yaml.safe_load((ROOT / "manifests" / "envoy" / "envoy.yaml").read_text())
    assert _envoy_timeouts(_envoy_bootstrap(rendered(name))) == _envoy_timeouts(standalone)


def test_a_whole_custom_config_is_used_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    chart = rendered("custom-config")
    assert _serve_args(chart).config_file == "/config/approx-prefix.yaml"
    assert yaml.safe_load(chart.config_files["approx-prefix.yaml"]) == yaml.safe_load(
        APPROX_PREFIX_YAML.read_text()
    )
    assert _weights(_load(_epp_config_text(chart), monkeypatch))["prefix-cache-scorer"] == 3


def test_large_numbers_in_parameters_survive_helm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Helm reads numbers as floats; the config must still carry integers.
    chart = render(
        deep_merge(
            REQUIRED,
            {
                "inferenceExtension": {
                    "scheduling": {
                        "scorers": {
                            "prefix-cache-scorer": {
                                "parameters": {
                                    "lruCapacityPerServer": 2000000,
                                    "blockSizeTokens": 64,
                                }
                            }
                        }
                    }
                }
            },
        )
    )
    text = chart.config_files["default-plugins.yaml"]
    (prefix,) = [p for p in yaml.safe_load(text)["plugins"] if p["type"] == "prefix-cache-scorer"]
    params = prefix["parameters"]
    assert params == {"lruCapacityPerServer": 2000000, "blockSizeTokens": 64}
    _load(text, monkeypatch)


def test_the_config_is_reloaded_not_restarted() -> None:
    chart = rendered("default")
    pod = chart.epp_pod
    mount = next(m for m in chart.epp_container["volumeMounts"] if m["name"] == "config")
    # A subPath mount never sees ConfigMap updates; the directory does.
    assert mount["mountPath"] == "/config"
    assert "subPath" not in mount
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == EPP
    # No config checksum on the pod template: a config change must not roll the pods.
    assert not any("checksum" in k for k in pod["metadata"].get("annotations", {}))
    assert _serve_args(chart).config_reload_interval > 0


# ---------------------------------------------------------------------------
# The Deployment's command line, ports, probes, security


def test_the_deployment_args_are_flags_epp_serve_accepts(chart: Rendered) -> None:
    args = _serve_args(chart)
    kube = kube_options(args)
    assert kube is not None, "no Kubernetes endpoint source in the args"
    assert kube.check() == []
    assert args.endpoints_file is None
    assert args.config_text is None
    pool = chart.get("InferencePool", RELEASE)
    if pool is not None:
        assert args.pool_name == RELEASE
        assert args.pool_namespace == NAMESPACE
        assert pool["apiVersion"].split("/")[0] == args.pool_group
    else:
        assert args.pool_name is None
        assert args.endpoint_selector == POOL_LABELS
    # The chart's default flag, and what --shutdown-grace leaves of the grace period.
    assert args.log_format == "json"
    assert args.shutdown_grace < chart.epp_pod["spec"]["terminationGracePeriodSeconds"]


def test_standalone_mode_selects_the_pods_itself() -> None:
    chart = rendered("selector-no-pool")
    args = _serve_args(chart)
    assert chart.get("InferencePool", RELEASE) is None
    assert args.endpoint_selector == POOL_LABELS
    assert args.endpoint_target_ports == (8000, 8001)
    assert (args.kv_events_port, args.kv_events_replay_port) == (5557, 5567)


def test_extra_flags_are_rendered_as_epp_flags() -> None:
    args = _serve_args(rendered("v1alpha2-sglang"))
    assert args.verbosity == 3
    assert args.debug_endpoints is True
    assert args.log_prompts is False
    assert args.config_reload_interval == 5.0
    assert args.refresh_metrics_interval == pytest.approx(0.1)
    assert args.log_format == "json"  # the chart's default flag, merged with these


def test_secure_serving_with_a_secret_serves_its_certificate_and_follows_renewals() -> None:
    chart = rendered("tls-envoy")
    args = _serve_args(chart)
    assert args.secure_serving is True
    assert args.cert_path == "/etc/epp/tls"
    assert args.enable_cert_reload is True
    assert args.max_concurrent_streams == 5000
    serve_options(args)  # a combination `epp serve` accepts
    # The Secret as a whole directory (a subPath mount would never see a renewal).
    mount = {"name": "tls", "mountPath": "/etc/epp/tls", "readOnly": True}
    assert mount in chart.epp_container["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "epp-tls"}} in chart.epp_pod["spec"]["volumes"]


def test_secure_serving_without_a_secret_is_self_signed() -> None:
    chart = rendered("tls-self-signed")
    args = _serve_args(chart)
    assert (args.secure_serving, args.cert_path, args.enable_cert_reload) == (True, None, False)
    assert all(v["name"] != "tls" for v in chart.epp_pod["spec"]["volumes"])


def test_plaintext_by_default() -> None:
    args = _serve_args(rendered("default"))
    assert (args.secure_serving, args.cert_path) == (False, None)


def _service_ports(service: Obj) -> dict[str, int]:
    return {p["name"]: p["port"] for p in service["spec"]["ports"]}


def test_the_service_exposes_grpc_health_and_metrics(chart: Rendered) -> None:
    service = chart.one("Service")
    assert _service_ports(service) == {
        "grpc-ext-proc": 9002,
        "grpc-health": 9003,
        "http-metrics": 9090,
    }
    container_ports = {p["name"]: p["containerPort"] for p in chart.epp_container["ports"]}
    for port in service["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]
    args = _serve_args(chart)
    assert (args.grpc_port, args.grpc_health_port, args.metrics_port) == (9002, 9003, 9090)
    assert service["spec"]["selector"].items() <= chart.epp_pod["metadata"]["labels"].items()


def test_probes_use_the_grpc_health_port(chart: Rendered) -> None:
    container = chart.epp_container
    health_port = _serve_args(chart).grpc_health_port
    for probe, service in [
        ("startupProbe", "liveness"),
        ("livenessProbe", "liveness"),
        ("readinessProbe", "readiness"),
    ]:
        assert container[probe]["grpc"] == {"port": health_port, "service": service}


def _assert_locked_down(pod_spec: Obj, container: Obj, uid: int) -> None:
    pod_sc = pod_spec["securityContext"]
    sc = container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == uid
    assert pod_sc["runAsUser"] != 0
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc or sc["privileged"] is False


def _env(chart: Rendered) -> dict[str, Any]:
    """The picker's environment: name -> value, or valueFrom."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in chart.epp_container["env"]}


def _volume(chart: Rendered, name: str) -> tuple[Obj, Obj]:
    """The picker pod's volume `name` and the container's mount of it."""
    volume = next(v for v in chart.epp_pod["spec"]["volumes"] if v["name"] == name)
    mount = next(m for m in chart.epp_container["volumeMounts"] if m["name"] == name)
    return volume, mount


def test_the_hub_cache_is_an_empty_dir_by_default() -> None:
    """Each pod downloads the tokenizers it needs into a volume of its own; no
    offline mode, no token."""
    chart = rendered("default")
    volume, mount = _volume(chart, "hf-cache")
    assert volume == {"name": "hf-cache", "emptyDir": {}}
    assert mount == {"name": "hf-cache", "mountPath": "/var/cache/huggingface/hub"}
    env = _env(chart)
    assert env["HF_HUB_CACHE"] == "/var/cache/huggingface/hub"
    assert "HF_HUB_OFFLINE" not in env
    assert "HF_TOKEN" not in env
    sized, _ = _volume(rendered("hub-cache-size-limit"), "hf-cache")
    assert sized["emptyDir"] == {"sizeLimit": "2Gi"}


def test_the_hub_cache_on_a_claim_offline_with_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    chart = rendered("precise-hub-offline")
    volume, mount = _volume(chart, "hf-cache")
    assert volume["persistentVolumeClaim"] == {"claimName": "hf-tokenizers", "readOnly": True}
    assert mount["readOnly"] is True
    env = _env(chart)
    assert env["HF_HUB_CACHE"] == mount["mountPath"]
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    # The picker is told where its one local tokenizer is, and loads the shipped
    # profile without any I/O: each model's tokenizer comes from the cache on first use.
    args = _serve_args(chart)
    assert args.tokenizer_dirs == [("my-model", "/tokenizers/my-model")]
    config = _load(_epp_config_text(chart), monkeypatch)
    service = config.services["prefix"]
    assert isinstance(service, PrecisePrefixService)
    assert service.tokenizers.describe() == {
        "*": "per model from the Hugging Face Hub (0 of at most 8 models)"
    }


def test_the_picker_runs_locked_down(chart: Rendered) -> None:
    _assert_locked_down(chart.epp_pod["spec"], chart.epp_container, uid=10001)
    # The one writable place under the read-only root filesystem.
    assert {"name": "tmp", "mountPath": "/tmp"} in chart.epp_container["volumeMounts"]
    assert chart.epp_container["resources"]["limits"]["memory"]


@pytest.mark.parametrize("name", WITH_ENVOY)
def test_envoy_runs_locked_down(name: str) -> None:
    chart = rendered(name)
    pod = chart.one("Deployment", f"{RELEASE}-envoy")["spec"]["template"]["spec"]
    _assert_locked_down(pod, pod["containers"][0], uid=65532)
    assert pod["automountServiceAccountToken"] is False


# ---------------------------------------------------------------------------
# RBAC: what the picker calls, nothing more


def test_rbac_grants_only_reading_pods_and_the_pool(chart: Rendered) -> None:
    role = chart.one("Role")
    expected = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    pool = chart.get("InferencePool", RELEASE)
    if pool is not None:
        group = pool["apiVersion"].split("/")[0]
        expected.append(
            {
                "apiGroups": [group],
                "resources": ["inferencepools"],
                "verbs": ["get", "list", "watch"],
            }
        )
    assert role["rules"] == expected
    binding = chart.one("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": EPP,
    }
    account = chart.one("ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert chart.epp_pod["spec"]["serviceAccountName"] == account
    kinds = {o["kind"] for o in chart.objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}


# ---------------------------------------------------------------------------
# InferencePool, replicas, PDB, ServiceMonitor


def test_the_inferencepool_points_at_the_picker() -> None:
    pool = rendered("default").one("InferencePool", RELEASE)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": POOL_LABELS},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "kind": "Service",
            "name": EPP,
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    old = rendered("v1alpha2-sglang").one("InferencePool", RELEASE)
    assert old["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert old["spec"] == {
        "selector": POOL_LABELS,
        "targetPortNumber": 8000,
        "extensionRef": {"name": EPP, "portNumber": 9002, "failureMode": "FailClose"},
    }


def test_replicas_spread_and_are_protected_by_a_pdb() -> None:
    chart = rendered("replicas-pdb")
    deployment = chart.one("Deployment")
    assert deployment["spec"]["replicas"] == 3
    # Active-active: a rolling update never leaves zero ready pickers.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = chart.epp_pod["metadata"]["labels"]
    pdb = chart.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    anti = chart.epp_pod["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    # One replica: no PDB unless asked, no anti-affinity.
    single = rendered("default")
    assert single.all("PodDisruptionBudget") == []
    assert "affinity" not in single.epp_pod["spec"]


def test_a_pdb_with_min_available() -> None:
    chart = render(
        deep_merge(
            REQUIRED,
            {
                "inferenceExtension": {
                    "replicas": 3,
                    "podDisruptionBudget": {"enabled": True, "minAvailable": 2},
                }
            },
        )
    )
    assert chart.one("PodDisruptionBudget")["spec"]["minAvailable"] == 2
    assert "maxUnavailable" not in chart.one("PodDisruptionBudget")["spec"]


def test_the_servicemonitor_scrapes_the_metrics_port() -> None:
    chart = rendered("servicemonitor")
    monitor = chart.one("ServiceMonitor")
    service = chart.one("Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    matched = [
        s for s in chart.all("Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert matched == [service]
    assert monitor["spec"]["endpoints"] == [
        {"port": "http-metrics", "path": "/metrics", "scheme": "http", "interval": "15s"}
    ]
    assert _service_ports(service)["http-metrics"] == _serve_args(chart).metrics_port
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert rendered("default").all("ServiceMonitor") == []


# ---------------------------------------------------------------------------
# The standalone Envoy


def _envoy_bootstrap(chart: Rendered) -> dict[str, Any]:
    config_map = chart.one("ConfigMap", f"{RELEASE}-envoy")
    bootstrap: dict[str, Any] = yaml.safe_load(config_map["data"]["envoy.yaml"])
    return bootstrap


def _ext_proc(bootstrap: Mapping[str, Any]) -> dict[str, Any]:
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for http_filter in network_filter["typed_config"].get("http_filters", []):
                    if http_filter["name"] == "envoy.filters.http.ext_proc":
                        config: dict[str, Any] = http_filter["typed_config"]
                        return config
    raise AssertionError("no ext_proc filter")


@pytest.mark.parametrize("name", WITH_ENVOY)
def test_the_envoy_bootstrap_is_valid_for_envoy(name: str, tmp_path: Path) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    chart = rendered(name)
    config = tmp_path / "envoy.yaml"
    config.write_text(chart.one("ConfigMap", f"{RELEASE}-envoy")["data"]["envoy.yaml"])
    # The container's own command line, with the mounted file's path replaced.
    container = chart.one("Deployment", f"{RELEASE}-envoy")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["command"] == ["envoy"]
    args: list[str] = list(container["args"])
    at = args.index("--config-path") + 1
    assert args[at] == "/etc/envoy/envoy.yaml"
    assert {"name": "config", "mountPath": "/etc/envoy", "readOnly": True} in container[
        "volumeMounts"
    ]
    args[at] = str(config)
    result = subprocess.run(
        [envoy, *args, "--mode", "validate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", WITH_ENVOY)
def test_envoy_uses_the_projects_ext_proc_settings(name: str) -> None:
    bootstrap = _envoy_bootstrap(rendered(name))
    standalone = yaml.safe_load((ROOT / "manifests" / "envoy" / "envoy.yaml").read_text())
    # The graceful stream end, and the client cache that keeps it from crashing
    # Envoy (docs/reliability.md, "Ending ext_proc streams"): as in envoy.yaml.
    for key in ("layered_runtime", "grpc_async_client_manager_config"):
        assert bootstrap[key] == standalone[key], key
    ours = _ext_proc(bootstrap)
    shipped = _ext_proc(standalone)
    assert ours["metadata_options"] == shipped["metadata_options"]
    if name not in FLOW_CONTROL:  # raised above the TTL (test_flow_control_raises...)
        assert ours["message_timeout"] == shipped["message_timeout"]
    assert ours["grpc_service"]["timeout"] == shipped["grpc_service"]["timeout"]
    assert shipped["failure_mode_allow"] is False
    mode = dict(ours["processing_mode"])
    if name in FAIL_OPEN:
        # Envoy 1.40 ignores failure_mode_allow with a FULL_DUPLEX_STREAMED request
        # body (docs/reliability.md).
        assert ours["failure_mode_allow"] is True
        assert mode.pop("request_body_mode") == "BUFFERED"
        assert shipped["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
        mode["request_body_mode"] = "FULL_DUPLEX_STREAMED"
    else:
        assert ours["failure_mode_allow"] is False
    assert mode == shipped["processing_mode"]


def _inference_routes(bootstrap: Mapping[str, Any]) -> dict[str, Any]:
    (listener,) = (
        entry
        for entry in bootstrap["static_resources"]["listeners"]
        if entry["name"] == "inference"
    )
    route_config: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"
    ]
    return route_config


def _clusters(bootstrap: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


DESTINATION: Final = "x-gateway-destination-endpoint"


@pytest.mark.parametrize("name", FAIL_OPEN)
def test_fail_open_envoy_routes_to_the_pool_without_the_picker(name: str) -> None:
    chart = rendered(name)
    bootstrap = _envoy_bootstrap(chart)
    route_config = _inference_routes(bootstrap)
    # A client cannot pick its upstream while the picker is away.
    assert route_config["internal_only_headers"] == [DESTINATION]
    (host,) = route_config["virtual_hosts"]
    picked, unpicked = host["routes"]
    assert picked["match"] == {
        "prefix": "/",
        "headers": [{"name": DESTINATION, "present_match": True}],
    }
    assert picked["route"]["cluster"] == "original_destination_cluster"
    assert unpicked["match"] == {"prefix": "/"}
    assert unpicked["route"]["cluster"] == "pool_fallback"
    # The two routes time out alike (0s, none, unless envoy.timeouts says otherwise).
    assert picked["route"]["timeout"] == unpicked["route"]["timeout"]
    assert picked["route"]["idle_timeout"] == unpicked["route"]["idle_timeout"]
    if name not in FLOW_CONTROL:
        assert picked["route"]["timeout"] == picked["route"]["idle_timeout"] == "0s"
    clusters = _clusters(bootstrap)
    assert clusters["original_destination_cluster"]["type"] == "ORIGINAL_DST"
    fallback = clusters["pool_fallback"]
    assert fallback["type"] == "STRICT_DNS"
    assert fallback["lb_policy"] == "ROUND_ROBIN"
    assert "transport_socket" not in fallback
    (locality,) = fallback["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in locality["lb_endpoints"]]
    # The pool's pods through their headless Service, on each target port.
    service_name = f"{RELEASE}-pool-pods"
    target_ports = [p["number"] for p in chart.one("InferencePool", RELEASE)["spec"]["targetPorts"]]
    assert addresses == [
        {"address": f"{service_name}.{NAMESPACE}.svc", "port_value": port} for port in target_ports
    ]
    pods = chart.one("Service", service_name)
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["selector"] == POOL_LABELS
    assert [p["targetPort"] for p in pods["spec"]["ports"]] == target_ports
    # Not the picker's pods, nor its scraped Service.
    assert not pods["spec"]["selector"].items() <= chart.epp_pod["metadata"]["labels"].items()


@pytest.mark.parametrize("name", sorted(set(WITH_ENVOY) - set(FAIL_OPEN)))
def test_fail_close_envoy_has_no_fallback(name: str) -> None:
    chart = rendered(name)
    bootstrap = _envoy_bootstrap(chart)
    ext_proc = _ext_proc(bootstrap)
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    route_config = _inference_routes(bootstrap)
    assert "internal_only_headers" not in route_config
    (host,) = route_config["virtual_hosts"]
    (route,) = host["routes"]
    assert route["match"] == {"prefix": "/"}
    assert route["route"]["cluster"] == "original_destination_cluster"
    assert "pool_fallback" not in _clusters(bootstrap)
    assert chart.get("Service", f"{RELEASE}-pool-pods") is None


def _epp_cluster(chart: Rendered) -> dict[str, Any]:
    clusters = _envoy_bootstrap(chart)["static_resources"]["clusters"]
    cluster: dict[str, Any] = next(c for c in clusters if c["name"] == "epp")
    return cluster


def test_envoy_talks_tls_to_a_secure_picker_and_checks_its_health_in_plaintext() -> None:
    cluster = _epp_cluster(rendered("tls-envoy"))
    socket = cluster["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    context = socket["typed_config"]
    assert context["@type"].endswith("UpstreamTlsContext")
    assert context["common_tls_context"]["alpn_protocols"] == ["h2"]
    # The health port (9003) is plaintext: the health check selects a raw socket.
    (health,) = cluster["health_checks"]
    (plain,) = cluster["transport_socket_matches"]
    assert health["transport_socket_match_criteria"] == plain["match"]
    assert plain["transport_socket"]["name"] == "envoy.transport_sockets.raw_buffer"
    # Without secureServing, plaintext throughout.
    plaintext = _epp_cluster(rendered("standalone-envoy"))
    assert "transport_socket" not in plaintext
    assert "transport_socket_matches" not in plaintext
    assert "transport_socket_match_criteria" not in plaintext["health_checks"][0]


def test_envoy_reaches_every_picker_replica() -> None:
    chart = rendered("standalone-envoy")
    bootstrap = _envoy_bootstrap(chart)
    cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp")
    lb_endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address = lb_endpoint["address"]["socket_address"]
    headless_name = f"{RELEASE}-epp-pods"
    assert address == {"address": f"{headless_name}.{NAMESPACE}.svc", "port_value": 9002}
    assert lb_endpoint["health_check_config"]["port_value"] == 9003
    assert cluster["type"] == "STRICT_DNS"
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == (
        "envoy.service.ext_proc.v3.ExternalProcessor"
    )
    headless = chart.one("Service", headless_name)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= chart.epp_pod["metadata"]["labels"].items()
    envoy_service = chart.one("Service", f"{RELEASE}-envoy")
    envoy_pod = chart.one("Deployment", f"{RELEASE}-envoy")["spec"]["template"]
    assert envoy_service["spec"]["selector"].items() <= envoy_pod["metadata"]["labels"].items()
    # The picker's Service and the headless one select the same pods, but only the
    # former is scraped.
    assert _service_ports(envoy_service) == {"http": 8081}
    assert rendered("default").get("Service", headless_name) is None


# ---------------------------------------------------------------------------
# The flags the schema lets through are exactly `epp serve`'s own


# Flags the chart renders itself (so the values cannot set them twice).
CHART_FLAGS: Final = {
    "config",
    "config-file",
    "config-text",
    "endpoints-file",
    "pool-name",
    "pool-namespace",
    "pool-group",
    "endpoint-selector",
    "endpoint-target-ports",
    "grpc-port",
    "grpc-health-port",
    "metrics-port",
    "kv-events-port",
    "kv-events-replay-port",
    "shutdown-grace",
    # From inferenceExtension.secureServing.
    "secure-serving",
    "cert-path",
    "enable-cert-reload",
}


def _serve_flags() -> set[str]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = commands.choices["serve"]
    return {
        option[2:]
        for action in serve._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def test_the_schema_allows_every_epp_serve_flag_the_chart_does_not_set() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = set(schema["properties"]["inferenceExtension"]["properties"]["flags"]["properties"])
    flags = _serve_flags()
    assert flags >= CHART_FLAGS, f"the chart sets flags epp serve lacks: {CHART_FLAGS - flags}"
    assert allowed == flags - CHART_FLAGS, (
        "values.schema.json inferenceExtension.flags is out of step with `epp serve --help`:"
        f" missing {sorted(flags - CHART_FLAGS - allowed)}, unknown {sorted(allowed - flags)}"
    )


def test_notes_tell_how_to_reach_the_pool() -> None:
    assert f"InferencePool {RELEASE}" in rendered("default").notes
    assert f"svc/{RELEASE}-envoy" in rendered("standalone-envoy").notes
