"""The custom scorer plugin shipped as an example package
(docs/examples/label-preference-scorer): found through its `epp.plugins` entry
point, scoring as documented, and enabled through the Helm chart's values."""

from __future__ import annotations

import re
import tomllib
from typing import Any

import helm_python as helm
import pytest
import yaml

from epp.config import InvalidConfig, load_config
from epp.datastore import Endpoint, EndpointSpec
from epp.scheduling import CycleState, Scorer
from epp.scheduling.registry import PluginRegistry
from tests.manifests.chart import CHART, EXAMPLE, Rendered, dockerfile_instructions, render
from tests.manifests.example_plugin import example_entry_points, example_src, registry_with_example
from tests.plugins.helpers import make_request

TYPE = "label-preference-scorer"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> PluginRegistry:
    # What `pip install` of the example package gives the EPP: its module importable,
    # its entry point in the `epp.plugins` group.
    monkeypatch.syspath_prepend(str(example_src()))
    return registry_with_example()


def _config(parameters: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [{"type": TYPE, "parameters": parameters}, {"type": "max-score-picker"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": TYPE}, {"pluginRef": "max-score-picker"}],
                }
            ],
        }
    )


def test_the_package_registers_its_scorer_by_entry_point(registry: PluginRegistry) -> None:
    assert [e.name for e in example_entry_points()] == [TYPE]
    plugin_class = registry.resolve(TYPE)
    assert plugin_class.__module__ == "epp_label_preference.scorer"
    assert plugin_class.__name__ == "LabelPreferenceScorer"
    # Without the package, the type is unknown: the entry point is what enables it.
    with pytest.raises(InvalidConfig, match="unknown plugin type 'label-preference-scorer'"):
        load_config(_config({"labelKey": "gpu"}), PluginRegistry.from_entry_points())


def test_it_scores_endpoints_by_their_label(registry: PluginRegistry) -> None:
    config = load_config(
        _config({"labelKey": "gpu", "scores": {"h100": 1.0, "a100": 0.6}, "defaultScore": 0.2}),
        registry,
    )
    scorer = config.plugins[TYPE]
    assert isinstance(scorer, Scorer)
    endpoints = {
        name: Endpoint(EndpointSpec(name, f"10.0.0.{i}:8000", labels=labels))
        for i, (name, labels) in enumerate(
            [("h", {"gpu": "h100"}), ("a", {"gpu": "a100"}), ("l", {"gpu": "l4"}), ("none", {})],
            start=1,
        )
    }
    scores = scorer.score(make_request(), CycleState(), list(endpoints.values()))
    assert {name: scores[e] for name, e in endpoints.items()} == {
        "h": 1.0,
        "a": 0.6,
        "l": 0.2,
        "none": 0.2,
    }
    profile = config.scheduler.profiles["default"]
    assert [(s.slot.type_name, s.weight) for s in profile.scorers] == [(TYPE, 1.0)]


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ({}, r"plugins\[0\]\.parameters: .*labelKey"),
        ({"labelKey": "gpu", "scores": {"h100": 1.5}}, r"plugins\[0\]\.parameters\.scores"),
        ({"labelKey": "gpu", "defaultScore": -1}, r"plugins\[0\]\.parameters\.defaultScore"),
        ({"labelKey": "gpu", "weights": {}}, r"plugins\[0\]\.parameters.*weights"),
    ],
)
def test_bad_parameters_are_config_errors(
    registry: PluginRegistry, parameters: dict[str, Any], error: str
) -> None:
    with pytest.raises(InvalidConfig) as caught:
        load_config(_config(parameters), registry)
    assert re.search(error, str(caught.value)), str(caught.value)


@pytest.fixture(scope="module")
def chart() -> Rendered:
    values = helm.values_from_yaml((EXAMPLE / "values.yaml").read_text(encoding="utf-8"))
    return render(values)


def test_the_chart_values_enable_it(chart: Rendered, registry: PluginRegistry) -> None:
    assert chart.epp_container["image"] == "registry.example.com/envoy-epp-label-preference:0.1.0"
    text = chart.config_files["default-plugins.yaml"]
    config = load_config(text, registry)
    profile = config.scheduler.profiles["default"]
    assert {s.slot.name: (s.slot.type_name, s.weight) for s in profile.scorers} == {
        TYPE: (TYPE, 1),
        # The chart's default scorer stays.
        "predicted-ttft-scorer": ("predicted-ttft-scorer", 1),
    }
    plugin = next(p for p in yaml.safe_load(text)["plugins"] if p["type"] == TYPE)
    assert plugin["parameters"] == {
        "labelKey": "gpu",
        "scores": {"h100": 1.0, "a100": 0.6},
        "defaultScore": 0.2,
    }


def test_the_example_image_extends_the_picker_image() -> None:
    steps = dockerfile_instructions((EXAMPLE / "Dockerfile").read_text(encoding="utf-8"))
    with helm.Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
        pod = chart.values["inferenceExtension"]["podSecurityContext"]
    assert ("ARG", f"EPP_IMAGE=envoy-epp:{app_version}") in steps
    assert ("FROM", "${EPP_IMAGE}") in steps
    run = " ".join(args for word, args in steps if word == "RUN")
    # Installed without touching the picker's pinned dependencies, then checked.
    assert "pip install --no-cache-dir --no-deps /tmp/plugin" in run
    assert "entry_points(group='epp.plugins')" in run
    users = [args for word, args in steps if word == "USER"]
    assert users[-1] == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))
    assert (EXAMPLE / "src" / "epp_label_preference" / "scorer.py").is_file()
    assert project["project"]["entry-points"]["epp.plugins"] == {
        TYPE: "epp_label_preference.scorer:LabelPreferenceScorer"
    }
