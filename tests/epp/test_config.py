"""EndpointPickerConfig: decoding, validation with paths and lines, and the built scheduler."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint
from pathlib import Path

import msgspec
import pytest
import yaml
from epp.plugins.max_score_picker import MaxScorePicker
from epp.plugins.round_robin_picker import RoundRobinPicker
from epp.plugins.single_profile_handler import SingleProfileHandler
from prometheus_client import CollectorRegistry

from epp import cli
from epp.config import (
    DEFAULT_CONFIG,
    ConfigError,
    InvalidConfig,
    SchedulingConfig,
    defaults,
    format_path,
    load_config,
    load_config_file,
    parse,
)
from epp.config.build import BuildResources, build, no_observe
from epp.config.errors import Rejected
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.requests import Api, InferenceRequest
from epp.scheduling import (
    CycleState,
    PluginContext,
    ResponseInfo,
    SchedulingResult,
)
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry, UnknownPluginType

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


# ---------------------------------------------------------------------------
# Plugins used by the tests, referenced by import path.


class MyScorer:
    """Scores endpoints by name from its parameters; unnamed endpoints score 0."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True):
        scores: dict[str, float] = {}

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.scores = params.scores
        self.context = context
        self.saw_at_build = sorted(context.plugins)

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        return {e: self.scores[e.name] for e in endpoints if e.name in self.scores}


class MyFilter:
    """Removes the endpoints named in its parameters."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True):
        drop: list[str] = []

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.drop = set(params.drop)

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return [e for e in endpoints if e.name not in self.drop]


class MyHooks:
    """A pre-request and post-response hook, no parameters."""

    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        pass

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        pass


class MyProducer:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        pass


class Nothing:
    """Implements no plugin interface."""

    def __init__(self, params: object, context: PluginContext) -> None:
        pass


class Broken:
    def __init__(self, params: object, context: PluginContext) -> None:
        raise RuntimeError("no GPU here")

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        return {}


class Counted:
    """A scorer that counts how often it is built."""

    built = 0

    def __init__(self, params: object, context: PluginContext) -> None:
        type(self).built += 1

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        return {}


def not_a_class() -> None:
    pass


SCORER = f"{__name__}:MyScorer"
FILTER = f"{__name__}:MyFilter"


# ---------------------------------------------------------------------------
# Helpers


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry.from_entry_points()


def load(text: str, registry: PluginRegistry, **kwargs: object) -> SchedulingConfig:
    return load_config(HEADER + textwrap.dedent(text), registry, **kwargs)  # type: ignore[arg-type]


def errors_of(text: str, registry: PluginRegistry, header: str = HEADER) -> list[ConfigError]:
    with pytest.raises(InvalidConfig) as info:
        load_config(header + textwrap.dedent(text), registry)
    assert info.value.errors
    return info.value.errors


def one_error(text: str, registry: PluginRegistry) -> ConfigError:
    errors = errors_of(text, registry)
    assert len(errors) == 1, errors
    return errors[0]


def line_of(text: str, needle: str) -> int:
    """The 1-based line of `needle` in HEADER + text."""
    for number, line in enumerate((HEADER + textwrap.dedent(text)).splitlines(), 1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in the text")


def endpoints(*names: str) -> list[Endpoint]:
    return [Endpoint(EndpointSpec(name, f"10.0.0.{i + 1}:8000")) for i, name in enumerate(names)]


def request() -> InferenceRequest:
    return InferenceRequest(
        request_id="r", path="/v1/completions", method="POST", api=Api.COMPLETIONS
    )


# ---------------------------------------------------------------------------
# Valid files


def test_design_example_shape(registry: PluginRegistry) -> None:
    registry.register("precise-prefix-cache-scorer", MyScorer)
    registry.register("queue-scorer", MyScorer)
    registry.register("kv-cache-utilization-scorer", MyScorer)
    config = load(
        """\
        plugins:
        - type: precise-prefix-cache-scorer
          name: prefix
          parameters: {scores: {a: 1.0}}
        - type: queue-scorer
        - type: kv-cache-utilization-scorer
        - type: max-score-picker
        schedulingProfiles:
        - name: default
          plugins:
          - {pluginRef: prefix, weight: 3}
          - {pluginRef: queue-scorer, weight: 2}
          - {pluginRef: kv-cache-utilization-scorer, weight: 2}
          - {pluginRef: max-score-picker}
        """,
        registry,
    )
    (profile,) = config.scheduler.profiles.values()
    assert profile.name == "default"
    assert profile.filters == ()
    assert [(s.slot.name, s.slot.type_name, s.weight) for s in profile.scorers] == [
        ("prefix", "precise-prefix-cache-scorer", 3),
        ("queue-scorer", "queue-scorer", 2),
        ("kv-cache-utilization-scorer", "kv-cache-utilization-scorer", 2),
    ]
    assert profile.weight_sum == 7
    assert profile.picker.name == "max-score-picker"
    assert isinstance(profile.picker.plugin, MaxScorePicker)
    assert isinstance(config.scheduler.handler.plugin, SingleProfileHandler)
    assert config.warnings == ()
    prefix = config.plugins["prefix"]
    assert isinstance(prefix, MyScorer)
    assert prefix.scores == {"a": 1.0}
    assert prefix.context.name == "prefix"
    assert prefix.context.type_name == "precise-prefix-cache-scorer"


def test_default_config_loads(registry: PluginRegistry) -> None:
    config = load_config(DEFAULT_CONFIG, registry)
    assert list(config.scheduler.profiles) == ["default"]
    weights = {s.slot.name: s.weight for s in config.scheduler.profiles["default"].scorers}
    assert weights == {"predicted-ttft-scorer": 1}
    # The scorer reads the model's producer, which reads the approximate prefix index.
    assert list(config.plugins)[:2] == ["approx-prefix-cache-producer", "predicted-ttft-producer"]


def test_the_shipped_default_yaml_is_the_built_in_default() -> None:
    # The commented copy users read must not drift from what `epp serve` runs.
    shipped = Path(__file__).parents[2] / "manifests" / "config" / "default.yaml"
    assert yaml.safe_load(shipped.read_text()) == yaml.safe_load(DEFAULT_CONFIG)


def test_the_default_s_lab_profile_is_the_default() -> None:
    # docs/routing.md cites the lab's runs of this profile as the default's figures.
    lab = Path(__file__).parents[2] / "bench" / "profiles" / "predicted-ttft-crowd-demand.yaml"
    assert yaml.safe_load(lab.read_text()) == yaml.safe_load(DEFAULT_CONFIG)


def test_llm_d_api_version_is_accepted(registry: PluginRegistry) -> None:
    text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
    text += "schedulingProfiles:\n- name: default\n"
    assert list(load_config(text, registry).scheduler.profiles) == ["default"]


def test_name_defaults_to_type(registry: PluginRegistry) -> None:
    config = load(
        f"""\
        plugins:
        - type: {SCORER}
        - type: random-picker
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: {SCORER}
          - pluginRef: random-picker
        """,
        registry,
    )
    assert set(config.plugins) == {SCORER, "random-picker", "single-profile-handler"}
    (profile,) = config.scheduler.profiles.values()
    assert profile.scorers[0].slot.name == SCORER
    assert profile.scorers[0].weight == 1.0  # default weight
    assert profile.picker.name == "random-picker"


def test_filters_scorers_and_parameters(registry: PluginRegistry) -> None:
    config = load(
        f"""\
        plugins:
        - {{type: {FILTER}, name: drop-b, parameters: {{drop: [b]}}}}
        - {{type: {SCORER}, name: s, parameters: {{scores: {{a: 0.5}}}}}}
        - {{type: max-score-picker, parameters: {{maxNumOfEndpoints: 2}}}}
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: drop-b
          - pluginRef: s
          - pluginRef: max-score-picker
        """,
        registry,
    )
    (profile,) = config.scheduler.profiles.values()
    assert [f.name for f in profile.filters] == ["drop-b"]
    picker = profile.picker.plugin
    assert isinstance(picker, MaxScorePicker)
    assert picker.max_endpoints == 2


def test_plugin_context_sees_plugins_built_before_then_all(registry: PluginRegistry) -> None:
    datastore = Datastore()
    config = load(
        f"""\
        plugins:
        - {{type: {SCORER}, name: first}}
        - {{type: {SCORER}, name: second}}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: first}}, {{pluginRef: second}}]
        """,
        registry,
        datastore=datastore,
    )
    first, second = config.plugins["first"], config.plugins["second"]
    assert isinstance(first, MyScorer)
    assert isinstance(second, MyScorer)
    assert first.saw_at_build == []
    assert second.saw_at_build == ["first"]
    # Once the config is built, every plugin sees all of them (a plugin naming a
    # later one resolves it then), read-only.
    assert first.context.plugins["second"] is second
    assert set(first.context.plugins) == set(config.plugins)
    with pytest.raises(TypeError):
        first.context.plugins["third"] = second  # type: ignore[index]
    assert second.context.datastore is datastore


def test_hooks_and_producers_are_collected(registry: PluginRegistry) -> None:
    seen: list[tuple[str, str, str]] = []

    def observe(point: str, type_name: str, name: str):  # type: ignore[no-untyped-def]
        seen.append((point, type_name, name))
        return lambda seconds: None

    config = load(
        f"""\
        plugins:
        - {{type: {__name__}:MyHooks, name: hooks}}
        - {{type: {__name__}:MyProducer, name: producer}}
        - type: round-robin-picker
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: round-robin-picker}}]
        """,
        registry,
        observe=observe,
    )
    assert [s.name for s in config.data_producers] == ["producer"]
    assert [s.name for s in config.pre_request] == ["hooks", "round-robin-picker"]
    assert [s.name for s in config.post_response] == ["hooks"]
    assert isinstance(config.pre_request[1].plugin, RoundRobinPicker)
    assert ("picker", "round-robin-picker", "round-robin-picker") in seen
    assert ("data_producer", f"{__name__}:MyProducer", "producer") in seen
    assert ("profile_handler", "single-profile-handler", "single-profile-handler") in seen


def test_default_picker_and_handler_are_injected(registry: PluginRegistry) -> None:
    config = load(
        f"""\
        plugins:
        - type: {SCORER}
        schedulingProfiles:
        - name: only
          plugins: [{{pluginRef: {SCORER}}}]
        """,
        registry,
    )
    profile = config.scheduler.profiles["only"]
    assert profile.picker.name == "max-score-picker"
    assert isinstance(profile.picker.plugin, MaxScorePicker)
    assert config.scheduler.handler.name == "single-profile-handler"
    assert isinstance(config.scheduler.handler.plugin, SingleProfileHandler)
    assert isinstance(config.plugins["max-score-picker"], MaxScorePicker)


def test_profile_without_plugins(registry: PluginRegistry) -> None:
    config = load("schedulingProfiles:\n- name: bare\n", registry)
    profile = config.scheduler.profiles["bare"]
    assert profile.scorers == ()
    assert profile.picker.name == "max-score-picker"


def test_gie_only_sections_are_accepted_with_a_warning(registry: PluginRegistry) -> None:
    config = load(
        """\
        featureGates: [prepareDataPlugins]
        flowControl: {}
        parser: {}
        schedulingProfiles:
        - name: default
        """,
        registry,
    )
    assert len(config.warnings) == 3
    for section in ("featureGates", "flowControl", "parser"):
        assert any(w.startswith(f"{section}:") and "ignored" in w for w in config.warnings)


def test_profile_handler_in_config_is_used(registry: PluginRegistry) -> None:
    config = load(
        """\
        plugins:
        - {type: single-profile-handler, name: handler}
        schedulingProfiles:
        - name: default
        """,
        registry,
    )
    assert config.scheduler.handler.name == "handler"
    assert "single-profile-handler" not in config.plugins


# ---------------------------------------------------------------------------
# The built scheduler


def test_weighted_combination(registry: PluginRegistry) -> None:
    config = load(
        f"""\
        plugins:
        - {{type: {SCORER}, name: s1, parameters: {{scores: {{a: 1.0, b: 0.2, c: 0.5}}}}}}
        - {{type: {SCORER}, name: s2, parameters: {{scores: {{a: 0.0, b: 1.0, c: 0.5}}}}}}
        - {{type: {SCORER}, name: s3, parameters: {{scores: {{a: 0.3}}}}}}
        schedulingProfiles:
        - name: p
          plugins:
          - {{pluginRef: s1, weight: 3}}
          - {{pluginRef: s2, weight: 1.5}}
          - {{pluginRef: s3, weight: 0.5}}
        """,
        registry,
    )
    eps = endpoints("a", "b", "c")
    result = config.scheduler.schedule(request(), CycleState(), eps)
    scored = {s.endpoint.name: s.score for s in result.profiles["p"].scored}
    scores = {
        "a": (1.0, 0.0, 0.3),
        "b": (0.2, 1.0, 0.0),
        "c": (0.5, 0.5, 0.0),
    }
    for name, (x, y, z) in scores.items():
        assert scored[name] == pytest.approx((3 * x + 1.5 * y + 0.5 * z) / 5.0)
    # a: 3.15/5, b: 2.1/5, c: 2.25/5 -> the max-score picker takes a.
    assert [e.name for e in result.targets] == ["a"]
    assert result.primary_profile == "p"


def test_zero_weights_score_everything_zero(registry: PluginRegistry) -> None:
    config = load(
        f"""\
        plugins:
        - {{type: {SCORER}, name: s, parameters: {{scores: {{a: 1.0}}}}}}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: s, weight: 0}}]
        """,
        registry,
    )
    result = config.scheduler.schedule(request(), CycleState(), endpoints("a", "b"))
    assert [s.score for s in result.profiles["p"].scored] == [0.0, 0.0]
    assert len(result.targets) == 1


# ---------------------------------------------------------------------------
# Errors


def test_duplicate_names(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: max-score-picker
        - type: random-picker
          name: max-score-picker
        schedulingProfiles:
        - name: p
        """
    error = one_error(text, registry)
    assert error.path == ("plugins", 1, "name")
    assert "'max-score-picker'" in error.message
    assert "plugins[0]" in error.message
    assert error.line == line_of(text, "name: max-score-picker")


def test_duplicate_profiles(registry: PluginRegistry) -> None:
    errors = errors_of("schedulingProfiles:\n- name: p\n- name: p\n", registry)
    assert any(e.path == ("schedulingProfiles", 1, "name") for e in errors)


def test_unknown_top_level_key(registry: PluginRegistry) -> None:
    text = "schedulingProfiles:\n- name: p\nplugin: []\n"
    error = one_error(text, registry)
    assert error.path == ("plugin",)
    assert "unknown key" in error.message
    assert "plugins" in error.message  # lists the expected keys
    assert error.line == line_of(text, "plugin: []")


def test_unknown_key_inside_a_plugin(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: max-score-picker
          parameter: {maxNumOfEndpoints: 2}
        schedulingProfiles:
        - name: p
        """
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "parameter")
    assert error.message == "unknown key"
    assert str(error) == f"line {line_of(text, 'parameter:')}: plugins[0].parameter: unknown key"


def test_unknown_key_inside_a_profile_ref(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: max-score-picker
        schedulingProfiles:
        - name: p
          plugins:
          - {pluginRef: max-score-picker, weigth: 2}
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 0, "weigth")
    assert error.line == line_of(text, "weigth")


def test_unknown_plugin_type_lists_known_types(registry: PluginRegistry) -> None:
    text = "plugins:\n- type: fancy-scorer\nschedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "type")
    assert "'fancy-scorer'" in error.message
    for known in (
        "max-score-picker",
        "random-picker",
        "weighted-random-picker",
        "round-robin-picker",
        "single-profile-handler",
    ):
        assert known in error.message
    assert "package.module:ClassName" in error.message
    assert error.line == line_of(text, "fancy-scorer")


def test_bad_parameter_type_names_path_and_line(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: random-picker
        - type: max-score-picker
          parameters:
            maxNumOfEndpoints: two
        schedulingProfiles:
        - name: p
          plugins: [{pluginRef: max-score-picker}]
        """
    error = one_error(text, registry)
    assert error.path == ("plugins", 1, "parameters", "maxNumOfEndpoints")
    assert format_path(error.path) == "plugins[1].parameters.maxNumOfEndpoints"
    assert "int" in error.message
    assert error.line == line_of(text, "maxNumOfEndpoints: two")
    assert str(error).startswith(
        f"line {error.line}: plugins[1].parameters.maxNumOfEndpoints: Expected `int`"
    )


def test_max_num_of_endpoints_zero_is_rejected(registry: PluginRegistry) -> None:
    text = "plugins:\n- {type: max-score-picker, parameters: {maxNumOfEndpoints: 0}}\n"
    text += "schedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "parameters", "maxNumOfEndpoints")
    assert ">= 1" in error.message


def test_unknown_parameter(registry: PluginRegistry) -> None:
    text = "plugins:\n- {type: max-score-picker, parameters: {maxEndpoints: 2}}\n"
    text += "schedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "parameters", "maxEndpoints")
    assert error.message == "unknown key"


def test_parameters_on_a_plugin_that_takes_none(registry: PluginRegistry) -> None:
    text = "plugins:\n- {type: single-profile-handler, parameters: {x: 1}}\n"
    text += "schedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "parameters")
    assert "takes no parameters" in error.message


def test_parameters_not_a_mapping(registry: PluginRegistry) -> None:
    text = "plugins:\n- {type: max-score-picker, parameters: [1]}\n"
    text += "schedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "parameters")


def test_plugin_without_type(registry: PluginRegistry) -> None:
    error = one_error("plugins:\n- name: x\nschedulingProfiles:\n- name: p\n", registry)
    assert error.path == ("plugins", 0)
    assert "missing required key `type`" in error.message


def test_dangling_plugin_ref(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: max-score-picker
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: max-score-picker
          - pluginRef: prefix-scorer
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 1, "pluginRef")
    assert "'prefix-scorer'" in error.message
    assert "max-score-picker" in error.message  # lists the defined plugins
    assert error.line == line_of(text, "prefix-scorer")


def test_weight_on_a_non_scorer(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: max-score-picker
        schedulingProfiles:
        - name: p
          plugins:
          - {pluginRef: max-score-picker, weight: 2}
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 0, "weight")
    assert "not a scorer" in error.message


@pytest.mark.parametrize("weight", ["-1", ".nan", ".inf", "-.inf"])
def test_bad_weight(registry: PluginRegistry, weight: str) -> None:
    text = f"""\
        plugins:
        - type: {SCORER}
        schedulingProfiles:
        - name: p
          plugins:
          - {{pluginRef: {SCORER}, weight: {weight}}}
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 0, "weight")
    assert "finite number >= 0" in error.message


def test_weight_not_a_number(registry: PluginRegistry) -> None:
    text = f"""\
        plugins:
        - type: {SCORER}
        schedulingProfiles:
        - name: p
          plugins:
          - {{pluginRef: {SCORER}, weight: heavy}}
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 0, "weight")


def test_two_pickers_in_a_profile(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: max-score-picker
        - type: random-picker
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: max-score-picker
          - pluginRef: random-picker
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 1, "pluginRef")
    assert "already has picker 'max-score-picker'" in error.message


def test_profile_handler_referenced_in_a_profile(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: single-profile-handler
        schedulingProfiles:
        - name: p
          plugins: [{pluginRef: single-profile-handler}]
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles", 0, "plugins", 0, "pluginRef")
    assert "no place in a profile" in error.message


def test_plugin_that_implements_no_interface(registry: PluginRegistry) -> None:
    text = f"plugins:\n- type: {__name__}:Nothing\nschedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "type")
    assert "implements none of the plugin interfaces" in error.message


def test_import_path_to_a_non_class(registry: PluginRegistry) -> None:
    text = f"plugins:\n- type: {__name__}:not_a_class\nschedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "type")
    assert "not a class" in error.message


def test_import_path_to_a_missing_module(registry: PluginRegistry) -> None:
    text = "plugins:\n- type: no_such_pkg.mod:Scorer\nschedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0, "type")
    assert "cannot import module 'no_such_pkg.mod'" in error.message
    assert "ModuleNotFoundError" in error.message


def test_import_path_to_a_missing_attribute(registry: PluginRegistry) -> None:
    text = f"plugins:\n- type: {__name__}:NoSuchScorer\nschedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert "has no 'NoSuchScorer'" in error.message


def test_plugin_whose_constructor_fails(registry: PluginRegistry) -> None:
    text = f"plugins:\n- {{type: {__name__}:Broken, name: b}}\nschedulingProfiles:\n- name: p\n"
    error = one_error(text, registry)
    assert error.path == ("plugins", 0)
    assert "cannot build plugin 'b'" in error.message
    assert "no GPU here" in error.message


def test_user_plugin_taking_the_default_picker_name(registry: PluginRegistry) -> None:
    text = f"""\
        plugins:
        - {{type: {SCORER}, name: max-score-picker}}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: max-score-picker}}]
        """
    error = one_error(text, registry)
    assert error.path == ("plugins",)
    assert "default 'max-score-picker'" in error.message


def test_user_plugin_taking_the_default_handler_name(registry: PluginRegistry) -> None:
    text = f"""\
        plugins:
        - {{type: {SCORER}, name: single-profile-handler}}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: single-profile-handler}}]
        """
    error = one_error(text, registry)
    assert error.path == ("plugins",)
    assert "default 'single-profile-handler'" in error.message


def test_two_profiles_without_a_handler(registry: PluginRegistry) -> None:
    error = one_error("schedulingProfiles:\n- name: a\n- name: b\n", registry)
    assert error.path == ("plugins",)
    assert "profile handler" in error.message


def test_two_profiles_with_the_single_profile_handler(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - type: single-profile-handler
        schedulingProfiles:
        - name: a
        - name: b
        """
    error = one_error(text, registry)
    assert error.path == ("schedulingProfiles",)
    assert "exactly one scheduling profile, got 2" in error.message


def test_two_profile_handlers(registry: PluginRegistry) -> None:
    text = """\
        plugins:
        - {type: single-profile-handler, name: h1}
        - {type: single-profile-handler, name: h2}
        schedulingProfiles:
        - name: a
        """
    error = one_error(text, registry)
    assert "more than one profile handler: h1, h2" in error.message


def test_no_profiles(registry: PluginRegistry) -> None:
    error = one_error("plugins: []\n", registry)
    assert error.path == ("schedulingProfiles",)


def test_sections_of_the_wrong_shape(registry: PluginRegistry) -> None:
    errors = errors_of("plugins: {}\nschedulingProfiles: {}\n", registry)
    assert [e.path for e in errors] == [("plugins",), ("schedulingProfiles",)]


def test_several_errors_are_reported_together(registry: PluginRegistry) -> None:
    text = f"""\
        unknownSection: 1
        plugins:
        - type: max-score-picker
          parameters: {{maxNumOfEndpoints: -3}}
        - type: max-score-picker
        - type: nope
        - {{type: {SCORER}, colour: red}}
        schedulingProfiles:
        - name: p
        """
    with pytest.raises(InvalidConfig) as info:
        load_config(HEADER + textwrap.dedent(text), registry, source="my.yaml")
    paths = {format_path(e.path) for e in info.value.errors}
    assert paths == {
        "unknownSection",
        "plugins[0].parameters.maxNumOfEndpoints",
        "plugins[1].name",
        "plugins[2].type",
        "plugins[3].colour",
    }
    assert all(e.line is not None for e in info.value.errors)
    message = str(info.value)
    assert message.startswith("my.yaml: 5 error(s)")
    for error in info.value.errors:
        assert str(error) in message
    assert info.value.source == "my.yaml"


def test_profile_errors_are_reported_together(registry: PluginRegistry) -> None:
    text = f"""\
        plugins:
        - type: {SCORER}
        - type: max-score-picker
        schedulingProfiles:
        - name: p
          plugins:
          - {{pluginRef: {SCORER}, weight: -1}}
          - {{pluginRef: max-score-picker, weight: 1}}
          - {{pluginRef: ghost}}
        """
    paths = [format_path(e.path) for e in errors_of(text, registry)]
    assert paths == [
        "schedulingProfiles[0].plugins[0].weight",
        "schedulingProfiles[0].plugins[1].weight",
        "schedulingProfiles[0].plugins[2].pluginRef",
    ]


def test_invalid_yaml_has_a_line(registry: PluginRegistry) -> None:
    text = "schedulingProfiles:\n- name: p\n   bad: indent\n"
    error = one_error(text, registry)
    assert error.path == ()
    assert "not valid YAML" in error.message
    assert error.line == line_of(text, "bad: indent")


def test_empty_file(registry: PluginRegistry) -> None:
    errors = errors_of("", registry, header="")
    paths = {e.path for e in errors}
    assert ("apiVersion",) in paths
    assert ("kind",) in paths


def test_not_a_mapping(registry: PluginRegistry) -> None:
    errors = errors_of("- a\n- b\n", registry, header="")
    assert len(errors) == 1
    assert "YAML mapping" in errors[0].message


def test_wrong_api_version_and_kind(registry: PluginRegistry) -> None:
    header = "apiVersion: v1\nkind: ConfigMap\n"
    errors = errors_of("schedulingProfiles:\n- name: p\n", registry, header=header)
    by_path = {e.path: e for e in errors}
    assert set(by_path) == {("apiVersion",), ("kind",)}
    assert "'v1'" in by_path[("apiVersion",)].message
    assert "inference.networking.x-k8s.io/v1alpha1" in by_path[("apiVersion",)].message
    assert by_path[("apiVersion",)].line == 1
    assert "'ConfigMap'" in by_path[("kind",)].message
    assert by_path[("kind",)].line == 2


def test_broken_config_builds_no_plugin(registry: PluginRegistry) -> None:
    # An unresolvable type anywhere stops the load before any plugin is built.
    Counted.built = 0
    text = f"""\
        plugins:
        - type: {__name__}:Counted
        - type: nope
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: {__name__}:Counted}}]
        """
    errors_of(text, registry)
    assert Counted.built == 0


def test_broken_profile_never_yields_a_config(registry: PluginRegistry) -> None:
    text = f"""\
        plugins:
        - type: {SCORER}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: {SCORER}}}, {{pluginRef: missing}}]
        """
    with pytest.raises(InvalidConfig):
        load(text, registry)


# ---------------------------------------------------------------------------
# ConfigError, format_path, load_config_file


def test_format_path() -> None:
    assert format_path(()) == ""
    assert format_path(("plugins",)) == "plugins"
    assert format_path(("plugins", 2, "parameters", "x")) == "plugins[2].parameters.x"
    assert format_path(("a", 0, 1, "b")) == "a[0][1].b"


def test_config_error_str() -> None:
    assert str(ConfigError(("kind",), "bad", 2)) == "line 2: kind: bad"
    assert str(ConfigError((), "empty")) == "(top level): empty"


def test_load_config_file(tmp_path: Path, registry: PluginRegistry) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(DEFAULT_CONFIG, encoding="utf-8")
    config = load_config_file(path, registry)
    assert list(config.scheduler.profiles) == ["default"]


def test_load_config_file_errors_name_the_file(tmp_path: Path, registry: PluginRegistry) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(HEADER + "schedulingProfiles: 3\n", encoding="utf-8")
    with pytest.raises(InvalidConfig) as info:
        load_config_file(path, registry)
    assert info.value.source == str(path)
    assert str(info.value).startswith(f"{path}: 1 error(s)")


def test_load_config_file_missing(tmp_path: Path, registry: PluginRegistry) -> None:
    with pytest.raises(InvalidConfig) as info:
        load_config_file(tmp_path / "absent.yaml", registry)
    assert "cannot read the file" in info.value.errors[0].message


def test_load_config_file_not_utf8(tmp_path: Path, registry: PluginRegistry) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(HEADER.encode() + b"# caf\xe9\n")
    with pytest.raises(InvalidConfig) as info:
        load_config_file(path, registry)
    assert "cannot read the file" in info.value.errors[0].message


# ---------------------------------------------------------------------------
# PluginRegistry


def test_registry_register() -> None:
    registry = PluginRegistry()
    assert registry.known_types() == []
    registry.register("my-scorer", MyScorer)
    assert registry.resolve("my-scorer") is MyScorer
    assert registry.known_types() == ["my-scorer"]
    text = HEADER + textwrap.dedent(
        """\
        plugins:
        - {type: my-scorer, parameters: {scores: {a: 0.25}}}
        schedulingProfiles:
        - name: p
          plugins: [{pluginRef: my-scorer, weight: 2}]
        """
    )
    # The defaults the loader injects must be resolvable too.
    registry.register("max-score-picker", MaxScorePicker)
    registry.register("single-profile-handler", SingleProfileHandler)
    config = load_config(text, registry)
    assert isinstance(config.plugins["my-scorer"], MyScorer)


def test_registry_from_entry_points_has_the_built_ins() -> None:
    known = PluginRegistry.from_entry_points().known_types()
    for name in (
        "max-score-picker",
        "random-picker",
        "weighted-random-picker",
        "round-robin-picker",
        "single-profile-handler",
    ):
        assert name in known


def test_registry_entry_point_that_cannot_load() -> None:
    registry = PluginRegistry([EntryPoint("broken", "no_such_pkg:Thing", "epp.plugins")])
    assert registry.known_types() == ["broken"]
    with pytest.raises(UnknownPluginType, match="cannot be loaded"):
        registry.resolve("broken")


def test_registry_entry_point_to_a_non_class() -> None:
    registry = PluginRegistry([EntryPoint("fn", f"{__name__}:not_a_class", "epp.plugins")])
    with pytest.raises(UnknownPluginType, match="not a class"):
        registry.resolve("fn")


def test_registry_first_entry_point_wins() -> None:
    registry = PluginRegistry(
        [
            EntryPoint("s", f"{__name__}:MyScorer", "epp.plugins"),
            EntryPoint("s", f"{__name__}:MyFilter", "epp.plugins"),
        ]
    )
    assert registry.resolve("s") is MyScorer


def test_registry_unknown_type() -> None:
    with pytest.raises(UnknownPluginType, match="unknown plugin type 'x'"):
        PluginRegistry().resolve("x")


# ---------------------------------------------------------------------------
# `epp validate`


def test_cli_validate_valid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        HEADER
        + textwrap.dedent(
            f"""\
            featureGates: [x]
            plugins:
            - {{type: {SCORER}, name: s}}
            - {{type: {FILTER}, name: f}}
            schedulingProfiles:
            - name: default
              plugins: [{{pluginRef: f}}, {{pluginRef: s, weight: 2}}]
            """
        ),
        encoding="utf-8",
    )
    assert cli.main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"{path}: valid" in out
    assert "default (1 filters, 1 scorers, picker max-score-picker)" in out
    assert f"{path}: warning: featureGates" in err


def test_cli_validate_invalid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    text = textwrap.dedent(
        """\
        plugins:
        - type: max-score-picker
          parameters:
            maxNumOfEndpoints: many
        - type: nope
        schedulingProfiles:
        - name: default
        """
    )
    path.write_text(HEADER + text, encoding="utf-8")
    assert cli.main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert str(path) in err
    assert "2 error(s)" in err
    line = line_of(text, "maxNumOfEndpoints")
    assert f"line {line}: plugins[0].parameters.maxNumOfEndpoints" in err
    assert f"line {line_of(text, 'nope')}: plugins[1].type: unknown plugin type" in err


def test_cli_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(tmp_path / "none.yaml")]) == 1
    assert "cannot read the file" in capsys.readouterr().err


def test_scored_endpoint_totals_are_bounded(registry: PluginRegistry) -> None:
    # Every total is a weighted mean of clamped scores, so it stays in [0, 1].
    config = load(
        f"""\
        plugins:
        - {{type: {SCORER}, name: s1, parameters: {{scores: {{a: 7, b: -3, c: .nan}}}}}}
        - {{type: {SCORER}, name: s2, parameters: {{scores: {{a: 1, b: 1, c: 1}}}}}}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: s1, weight: 2}}, {{pluginRef: s2}}]
        """,
        registry,
    )
    result = config.scheduler.schedule(request(), CycleState(), endpoints("a", "b", "c"))
    scored = {s.endpoint.name: s.score for s in result.profiles["p"].scored}
    assert scored["a"] == pytest.approx(1.0)
    assert scored["b"] == pytest.approx(1 / 3)
    assert scored["c"] == pytest.approx(1 / 3)
    assert not any(math.isnan(v) for v in scored.values())


def test_dangling_reference_is_reported_with_plugin_errors(registry: PluginRegistry) -> None:
    # A plugin that cannot be built stops the build, but the reference check still
    # runs: the user sees every mistake in one pass.
    text = """\
        plugins:
        - type: no-such-plugin
        - type: max-score-picker
        schedulingProfiles:
        - name: p
          plugins:
          - {pluginRef: max-score-pickr}
        """
    errors = errors_of(text, registry)
    assert [format_path(e.path) for e in errors] == [
        "plugins[0].type",
        "schedulingProfiles[0].plugins[0].pluginRef",
    ]
    assert "no plugin named 'max-score-pickr'" in errors[1].message
    lines = [e.line for e in errors]
    assert None not in lines
    assert lines == sorted(lines)
    assert lines[0] != lines[1]


# ---------------------------------------------------------------------------
# The three steps: parse, defaults, build


def test_each_step_hands_the_next_a_plain_document(registry: PluginRegistry) -> None:
    text = HEADER + textwrap.dedent(
        f"""\
        plugins:
        - {{type: {SCORER}, name: s}}
        - {{type: {FILTER}, name: f}}
        inferenceObjectives: [{{name: chat}}]
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: f}}, {{pluginRef: s}}]
        """
    )
    validated = parse.validate(parse.read_yaml(text, "<test>").data, registry)
    # What the file says, and nothing more.
    assert [d.name for d in validated.plugins] == ["s", "f"]
    (profile,) = validated.profiles
    assert (profile.filters, profile.picker) == (("f",), None)
    assert [(s.name, s.weight) for s in profile.scorers] == [("s", None)]
    assert validated.objectives == {"chat": None}

    completed = defaults.complete(validated, registry)
    # Every default filled in.
    assert [d.name for d in completed.defaults] == [
        defaults.DEFAULT_PICKER,
        defaults.DEFAULT_PROFILE_HANDLER,
    ]
    (full,) = completed.profiles
    assert full.scorers == (("s", defaults.DEFAULT_WEIGHT),)
    assert full.picker == defaults.DEFAULT_PICKER
    assert completed.profile_handler == defaults.DEFAULT_PROFILE_HANDLER
    assert completed.objectives == {"chat": defaults.DEFAULT_PRIORITY}
    assert completed.saturation_detector is None
    assert completed.if_metrics_read is not None  # no source: one if a plugin reads metrics

    resources = BuildResources(Datastore(), CollectorRegistry(), no_observe, ServerSettings())
    config = build(completed, resources)
    # MyScorer reads no metrics: the default source is not built.
    assert list(config.plugins) == ["s", "f", "max-score-picker", "single-profile-handler"]
    assert config.scheduler.profiles["p"].picker.name == "max-score-picker"


def test_parse_builds_no_plugin(registry: PluginRegistry) -> None:
    Counted.built = 0
    text = HEADER + f"plugins:\n- type: {__name__}:Counted\nschedulingProfiles:\n- name: p\n"
    validated = parse.validate(parse.read_yaml(text, "<test>").data, registry)
    defaults.complete(validated, registry)
    assert Counted.built == 0


def test_steps_report_errors_without_lines(registry: PluginRegistry) -> None:
    with pytest.raises(Rejected) as info:
        parse.validate({"apiVersion": "v1"}, registry)
    assert {e.path for e in info.value.errors} >= {("apiVersion",), ("kind",)}
    assert all(e.line is None for e in info.value.errors)  # load_config adds them


def test_server_settings_default_to_the_flags_defaults() -> None:
    args = cli.build_parser().parse_args(["serve"])
    assert ServerSettings() == ServerSettings(
        refresh_metrics_interval_s=args.refresh_metrics_interval,
        metrics_staleness_threshold_s=args.metrics_staleness_threshold,
        metrics_scrape_timeout_s=args.metrics_scrape_timeout,
    )
