"""Plugin types by name.

A config file names a plugin's `type` in one of two ways:
- a registered name (`max-score-picker`): registered through the Python entry-point
  group `epp.plugins` (the built-ins in `plugins/` are registered this way by this
  project's own pyproject.toml; a third-party package does the same in its own);
- an import path `package.module:ClassName`, for a class that is importable but not
  registered.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

ENTRY_POINT_GROUP = "epp.plugins"

log = logging.getLogger(__name__)


class UnknownPluginType(Exception):
    pass


class PluginRegistry:
    def __init__(self, entries: Iterable[EntryPoint] = ()) -> None:
        self._entry_points: dict[str, EntryPoint] = {}
        self._classes: dict[str, type] = {}
        for entry in entries:
            if entry.name in self._entry_points:
                log.warning(
                    "plugin type %r is registered twice (%s and %s); using the first",
                    entry.name,
                    self._entry_points[entry.name].value,
                    entry.value,
                )
                continue
            self._entry_points[entry.name] = entry

    @classmethod
    def from_entry_points(cls) -> PluginRegistry:
        """All plugin types installed in this environment, built-ins included."""
        return cls(entry_points(group=ENTRY_POINT_GROUP))

    def register(self, type_name: str, plugin_class: type) -> None:
        self._classes[type_name] = plugin_class

    def known_types(self) -> list[str]:
        return sorted({*self._entry_points, *self._classes})

    def resolve(self, type_name: str) -> type:
        """The class for a plugin type, or `UnknownPluginType` saying why not."""
        if type_name in self._classes:
            return self._classes[type_name]
        entry = self._entry_points.get(type_name)
        if entry is not None:
            try:
                loaded = entry.load()
            except Exception as exc:
                raise UnknownPluginType(
                    f"plugin type {type_name!r} is registered as {entry.value!r} but cannot be"
                    f" loaded: {type(exc).__name__}: {exc}"
                ) from exc
            return self._checked(type_name, loaded)
        if ":" in type_name:
            return self._checked(type_name, _import_path(type_name))
        raise UnknownPluginType(
            f"unknown plugin type {type_name!r}; known types: {', '.join(self.known_types())}."
            " A custom plugin is named by its import path, 'package.module:ClassName'."
        )

    def _checked(self, type_name: str, obj: object) -> type:
        if not isinstance(obj, type):
            raise UnknownPluginType(
                f"plugin type {type_name!r} names {obj!r}, which is not a class"
            )
        self._classes[type_name] = obj
        return obj


def _import_path(path: str) -> object:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UnknownPluginType(
            f"plugin type {path!r}: cannot import module {module_name!r}:"
            f" {type(exc).__name__}: {exc}"
        ) from exc
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UnknownPluginType(
                f"plugin type {path!r}: module {module_name!r} has no {attr!r}"
            ) from None
    return obj
