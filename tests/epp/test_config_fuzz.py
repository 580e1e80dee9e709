"""Property-based tests of the EndpointPickerConfig loader: random text, and the
shipped configs (manifests/config/) with random mutations.

The invariants: `load_config` returns a configuration or raises `InvalidConfig`
(never another exception: the same loader runs `epp validate`, the start and the
reload of a ConfigMap), and every error it lists has a message and a path in the
file (or says it is about the whole document)."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.config import ConfigError, InvalidConfig, SchedulingConfig, load_config
from epp.scheduling.registry import PluginRegistry
from tests.fuzzing import examples

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "manifests" / "config").glob("*.yaml"))


@functools.cache
def registry() -> PluginRegistry:
    return PluginRegistry.from_entry_points()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)  # plugins warn about odd but valid parameters
    yield
    logging.disable(logging.NOTSET)


def outcome(text: str) -> SchedulingConfig | InvalidConfig:
    try:
        return load_config(text, registry(), source="fuzz.yaml")
    except InvalidConfig as exc:
        return exc


def assert_clear(error: InvalidConfig) -> None:
    assert error.errors, "an InvalidConfig without errors"
    assert str(error).startswith("fuzz.yaml: ")
    for item in error.errors:
        assert isinstance(item, ConfigError)
        assert item.message.strip()
        assert str(item)  # "line N: path: message", or "(top level): message"


def test_regression_a_deeply_nested_document_is_invalid_not_a_crash() -> None:
    """Found by fuzzing: PyYAML's recursion ran out of stack (RecursionError)."""
    error = outcome("[" * 600 + "]" * 600)
    assert isinstance(error, InvalidConfig)
    assert "nested too deeply" in str(error)


yaml_text = st.text(
    st.sampled_from(list("ab:-[]{}&*!|>'\"#?,\n 0.1x")) | st.characters(), max_size=200
)


@settings(max_examples=examples(300))
@given(yaml_text)
def test_any_text_loads_or_is_refused_clearly(text: str) -> None:
    result = outcome(text)
    if isinstance(result, InvalidConfig):
        assert_clear(result)


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=10,
)
# Keys a config really has, so that mutations land where the loader looks.
known_keys = st.sampled_from(
    ["apiVersion", "kind", "plugins", "schedulingProfiles", "type", "name", "parameters",
     "pluginRef", "weight", "saturationDetector", "inferenceObjectives", "priority", "dataLayer",
     "blockSizeTokens", "maxPrefixBlocksToMatch", "maxNumOfEndpoints", "featureGates"]
)  # fmt: skip


def _containers(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every dict and list in a document."""
    found = [path] if isinstance(node, dict | list) else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _containers(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _containers(value, (*path, i))
    return found


def _at(document: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        document = document[part]
    return document


@st.composite
def mutated_configs(draw: st.DrawFn) -> str:
    document = copy.deepcopy(yaml.safe_load(draw(st.sampled_from(SHIPPED)).read_text()))
    for _ in range(draw(st.integers(1, 3))):
        target = _at(document, draw(st.sampled_from(_containers(document))))
        action = draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
        if isinstance(target, dict):
            keys = list(target)
            if action == "add" or not keys:
                target[draw(known_keys | st.text(max_size=8))] = draw(yaml_values)
            elif action == "delete":
                del target[draw(st.sampled_from(keys))]
            else:
                target[draw(st.sampled_from(keys))] = draw(yaml_values | known_keys)
        elif isinstance(target, list):
            if action == "add" or not target:
                target.append(draw(yaml_values))
            elif action == "delete":
                del target[draw(st.integers(0, len(target) - 1))]
            elif action == "duplicate":
                target.append(copy.deepcopy(target[draw(st.integers(0, len(target) - 1))]))
            else:
                target[draw(st.integers(0, len(target) - 1))] = draw(yaml_values)
    return yaml.safe_dump(document)


def test_the_shipped_configs_load() -> None:
    assert SHIPPED
    for path in SHIPPED:
        result = outcome(path.read_text())
        assert isinstance(result, SchedulingConfig), f"{path}: {result}"


@settings(max_examples=examples(200))
@given(mutated_configs())
def test_a_mutated_config_loads_or_names_what_is_wrong(text: str) -> None:
    result = outcome(text)
    if isinstance(result, InvalidConfig):
        assert_clear(result)
        # Errors about a place in the file carry its line, so `epp validate` can say
        # where to look.
        assert any(e.line is not None or not e.path for e in result.errors), result
