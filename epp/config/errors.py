"""How the config loader names a problem: where in the file (a path of keys and
indexes, and its line), and what is wrong.

Every step of the loader (parse, defaults, build) reports its problems as
`ConfigError`s without a line and stops with `Rejected`; `load_config` then looks
each path up in the YAML it read, adds the line, and raises `InvalidConfig` with
the whole list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

ConfigPath = tuple[str | int, ...]
"""Keys and list indexes from the top of the document: ("plugins", 2, "type")."""


def format_path(path: ConfigPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


@dataclass(frozen=True, slots=True)
class ConfigError:
    path: ConfigPath
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


class Rejected(Exception):
    """A step found problems and produced nothing; `load_config` adds their lines."""

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__(f"{len(errors)} error(s)")
        self.errors = errors


class Problems:
    """The problems one step has found so far. A step records every problem it can
    find before it stops, so that `epp validate` shows them all at once."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def __bool__(self) -> bool:
        return bool(self.errors)

    def add(self, path: ConfigPath, message: str) -> None:
        self.errors.append(ConfigError(path, message))

    def extend(self, errors: Iterable[ConfigError]) -> None:
        self.errors.extend(errors)

    def stop_if_any(self) -> None:
        """Stop the step here if anything was found: what follows relies on it."""
        if self.errors:
            raise Rejected(self.errors)

    def decode(self, value: object, type_: type[Any], path: ConfigPath) -> Any:
        """`value` as a `type_` (a msgspec struct), or None after recording why not,
        each problem at its own path under `path`."""
        try:
            return msgspec.convert(value, type_)
        except msgspec.ValidationError as exc:
            self.add(*_validation_error(path, exc))
            return None


_MSGSPEC_PATH = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`")


def _validation_error(base: ConfigPath, exc: msgspec.ValidationError) -> tuple[ConfigPath, str]:
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
