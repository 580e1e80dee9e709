"""The documents the loader's steps hand each other: plain, immutable values.

    parse    -> ValidatedConfig   what the file says, every reference checked
    defaults -> CompleteConfig    plus everything the file leaves implied
    build    -> SchedulingConfig  (epp.config.build) the running objects

A plugin is a `PluginDecl` in both documents: its class and decoded parameters,
ready to build. Plugins are named by their config name everywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from epp.config.errors import ConfigError, ConfigPath
from epp.flowcontrol.interfaces import FLOW_CONTROL_POINTS
from epp.scheduling.interfaces import EXTENSION_POINTS


def roles_of(plugin_class: type) -> frozenset[type]:
    """The plugin interfaces (`epp.scheduling.interfaces` protocols, and flow
    control's policies, `epp.flowcontrol.interfaces`) a class implements. Decided on
    the class, so that the whole config can be checked and completed before any
    plugin is built."""
    return frozenset(
        protocol
        for _, protocol in (*EXTENSION_POINTS, *FLOW_CONTROL_POINTS)
        if issubclass(plugin_class, protocol)
    )


@dataclass(frozen=True)
class PluginDecl:
    """One plugin to build, as `plugin_class(parameters, context)`."""

    name: str  # its name in the config (defaults to its type)
    type_name: str  # its type, as written (a default's: its registered name)
    plugin_class: type
    parameters: msgspec.Struct  # decoded and validated against the class's Parameters
    roles: frozenset[type]  # see roles_of
    path: ConfigPath  # where a failure to build it is reported

    def does(self, interface: type) -> bool:
        return interface in self.roles


@dataclass(frozen=True)
class Extraction:
    """Hand `extractor` to data source `source` (`add_extractor`).

    `path`: where the file's `dataLayer` asks for it; a source refusing the
    extractor is an error there. None: implied (a config without `dataLayer`, or
    the default source), and a refusal only means the source cannot use it."""

    source: str
    extractor: str
    path: ConfigPath | None


# ---------------------------------------------------------------------------
# Flow control (epp/config/flowcontrol.py reads the section).


@dataclass(frozen=True)
class BandDecl:
    """A band as written: None where the file leaves the value to the defaults."""

    priority: int | None  # None: a template (defaultPriorityBand, ...)
    max_requests: int | None
    max_bytes: int | None
    fairness: str | None
    ordering: str | None


@dataclass(frozen=True)
class FlowControlDecl:
    """The `flowControl` section of a file whose `flowControl` gate is on."""

    max_requests: int
    max_bytes: int
    default_request_ttl_s: float | None
    no_endpoint_request_ttl_s: float | None
    default_band: BandDecl | None
    default_negative_band: BandDecl | None
    bands: tuple[BandDecl, ...]
    usage_limit: str | None


@dataclass(frozen=True)
class BandPlan:
    priority: int  # templates: 0 (unused)
    max_requests: int
    max_bytes: int
    fairness: str  # plugin names
    ordering: str


@dataclass(frozen=True)
class FlowControlPlan:
    """Flow control with nothing left implied, ready to build."""

    bands: tuple[BandPlan, ...]  # priority 0 always among them
    default_band: BandPlan
    default_negative_band: BandPlan | None
    max_requests: int
    max_bytes: int
    default_request_ttl_s: float
    no_endpoint_request_ttl_s: float
    usage_limit: str


# ---------------------------------------------------------------------------
# What the file says (parse).


@dataclass(frozen=True)
class ScorerRef:
    name: str
    weight: float | None  # None: not given


@dataclass(frozen=True)
class ProfileDecl:
    """A scheduling profile as written: its plugins sorted by the part they play."""

    name: str
    filters: tuple[str, ...]
    scorers: tuple[ScorerRef, ...]
    picker: str | None  # None: not given


@dataclass(frozen=True)
class DataLayerDecl:
    """The file's `dataLayer` section."""

    extractions: tuple[Extraction, ...]
    inject_defaults: bool  # GIE's switch: false turns the default metrics source off


@dataclass(frozen=True)
class ValidatedConfig:
    """A valid file: every key known, every value of its type, every plugin type
    resolved with its parameters decoded, every reference to a plugin that exists
    and plays the part asked of it."""

    plugins: tuple[PluginDecl, ...]  # in the file's order
    profiles: tuple[ProfileDecl, ...]
    data_layer: DataLayerDecl | None  # None: no dataLayer section
    # `saturationDetector: {pluginRef: ...}`, if given.
    saturation_detector: str | None
    # GIE's older `saturationDetector` section, which held the default detector's
    # own parameters (as written; decoded by the defaults step, which owns that
    # plugin). None: not that form.
    detector_parameters: Mapping[str, Any] | None
    objectives: Mapping[str, int | None]  # objective name -> priority (None: not given)
    warnings: tuple[str, ...]
    # The `flowControl` section when the `flowControl` feature gate is on; None:
    # the gate is off (admission sheds sheddable requests, as before).
    flow_control: FlowControlDecl | None = None


# ---------------------------------------------------------------------------
# Everything to build (defaults).


@dataclass(frozen=True)
class Profile:
    name: str
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]  # (plugin name, weight)
    picker: str


@dataclass(frozen=True)
class IfMetricsRead:
    """The default metrics source, needed only if one of the file's plugins reads
    model-server metrics (its `consumes`). A plugin may decide that from its
    parameters (prefix-cache-scorer reads them only to auto-tune), so only the
    built plugins can tell: the build step builds this (or reports `problems`)
    right after the file's plugins, and only then."""

    plugin: PluginDecl | None  # None: it cannot be added, see `problems`
    extractions: tuple[Extraction, ...]
    # Why it cannot be added (its name is taken, its type is not registered): errors
    # only if it is needed.
    problems: tuple[ConfigError, ...]


@dataclass(frozen=True)
class CompleteConfig:
    """A valid file with nothing left implied: every profile has its picker and
    weights, and the plugins the file relies on without naming them are declared."""

    plugins: tuple[PluginDecl, ...]  # the file's, in its order
    defaults: tuple[PluginDecl, ...]  # implied plugins, built after the file's
    if_metrics_read: IfMetricsRead | None
    profiles: tuple[Profile, ...]
    profile_handler: str
    saturation_detector: str | None  # None: nothing is ever shed
    extractions: tuple[Extraction, ...]
    objectives: Mapping[str, int]
    warnings: tuple[str, ...]
    flow_control: FlowControlPlan | None = None  # None: the gate is off
