"""The example plugin package (docs/examples/label-preference-scorer) as the EPP sees
it once installed: its `epp.plugins` entry points, read from its pyproject.toml, in
a registry next to the installed ones. Nothing is pip-installed; the registry
loads the entry point exactly as it loads an installed one."""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Final

from epp.scheduling.registry import ENTRY_POINT_GROUP, PluginRegistry
from tests.manifests.chart import EXAMPLE

EXAMPLE_SRC: Final = EXAMPLE / "src"


def example_entry_points() -> list[EntryPoint]:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))
    group: dict[str, str] = project["project"]["entry-points"][ENTRY_POINT_GROUP]
    return [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in group.items()]


def registry_with_example() -> PluginRegistry:
    """The installed plugins plus the example's (its `src` must be importable)."""
    return PluginRegistry([*entry_points(group=ENTRY_POINT_GROUP), *example_entry_points()])


def example_src() -> Path:
    return EXAMPLE_SRC
