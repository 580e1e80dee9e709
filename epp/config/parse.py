"""Step 1 of loading a config: parse and validate.

Contract: `read_yaml(text)` gives the YAML document and its node tree (for the
lines of errors) or raises `InvalidConfig` for text that is not YAML.
`validate(data, registry)` gives a `ValidatedConfig` or raises `Rejected` with
every problem found, each at its path in the file. It resolves plugin types
through the registry and decodes their parameters, but builds nothing and adds
nothing the file does not say (that is the defaults step's work).

Validation runs in two rounds. The first checks the file's shape: known keys,
types of values, unique names, plugin types that resolve, parameters that decode.
If that fails, only dangling plugin references are added to its report: the
second round needs every plugin's class. The second checks meaning: references
(profiles, dataLayer, saturationDetector) name plugins that play the part asked
of them, weights are usable, the profile handler is not ambiguous.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import yaml

from epp.config.document import (
    DataLayerDecl,
    Extraction,
    PluginDecl,
    ProfileDecl,
    ScorerRef,
    ValidatedConfig,
    roles_of,
)
from epp.config.errors import ConfigError, ConfigPath, InvalidConfig, Problems, Rejected
from epp.config.flowcontrol import (
    FLOW_CONTROL_GATE,
    FlowControlSpec,
    check_flow_control,
    decode_flow_control,
    feature_gates,
)
from epp.scheduling.interfaces import (
    DataExtractor,
    DataSource,
    Filter,
    NoParameters,
    Picker,
    ProfileHandler,
    SaturationDetector,
    Scorer,
)
from epp.scheduling.registry import PluginRegistry, UnknownPluginType

# GIE's, and llm-d-router's (where GIE's EPP now lives: v1alpha1, and v1 in its
# newer configs).
API_VERSIONS: Final = (
    "inference.networking.x-k8s.io/v1alpha1",
    "llm-d.ai/v1alpha1",
    "llm-d.ai/v1",
)
KIND: Final = "EndpointPickerConfig"

# Sections of GIE's schema this EPP accepts but does not act on: a config written
# for GIE loads, and the log says what is ignored.
IGNORED_GIE_SECTIONS: Final = ("parser",)

SECTIONS: Final = frozenset(
    {
        "apiVersion",
        "kind",
        "plugins",
        "schedulingProfiles",
        "saturationDetector",
        "dataLayer",
        "inferenceObjectives",
        # llm-d's feature gates and flow control (epp/config/flowcontrol.py).
        "featureGates",
        "flowControl",
        *IGNORED_GIE_SECTIONS,
    }
)


# ---------------------------------------------------------------------------
# Wire structs: the sections' shapes. Unknown keys are errors.


class PluginSpec(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    parameters: dict[str, Any] | None = None


class ProfilePluginRef(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str
    weight: float | None = None


class ProfileSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    plugins: list[ProfilePluginRef] = []


class PluginRef(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str


class DataSourceSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str
    extractors: list[PluginRef] = []


class DataLayerSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    sources: list[DataSourceSpec] = []
    # GIE: false turns off the default metrics source.
    inject_defaults: bool = True


class ObjectiveSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    # UNSET: not given, so the defaults step gives it DEFAULT_PRIORITY (null stays
    # an error).
    priority: msgspec.UnsetType | int = msgspec.UNSET


# ---------------------------------------------------------------------------
# YAML


@dataclass(frozen=True)
class YamlDocument:
    data: object  # what the YAML holds ({} for an empty file)
    root: yaml.Node | None  # its node tree, for the lines of errors

    def with_lines(self, errors: list[ConfigError]) -> list[ConfigError]:
        """`errors` with their lines, in the order of the file."""
        located = [
            e if e.line is not None else ConfigError(e.path, e.message, line_of(self.root, e.path))
            for e in errors
        ]
        located.sort(key=lambda e: e.line if e.line is not None else 0)
        return located


def read_yaml(text: str, source: str) -> YamlDocument:
    """The YAML in `text`, or `InvalidConfig` (with the line, when YAML tells it)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise InvalidConfig(source, [ConfigError((), f"not valid YAML: {exc}", line)]) from None
    except RecursionError:
        # PyYAML composes recursively: a document nested thousands deep exhausts the
        # stack. It is bad input like any other, not a crash of `epp validate`, of the
        # start, or of the reloader.
        raise InvalidConfig(
            source, [ConfigError((), "not valid YAML: nested too deeply")]
        ) from None
    return YamlDocument(data if data is not None else {}, root)


def line_of(root: yaml.Node | None, path: ConfigPath) -> int | None:
    """The 1-based line of `path` in the YAML node tree (the deepest node found)."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in path:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:
                if key.value == part:
                    child = value
                    line = key.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


# ---------------------------------------------------------------------------
# Validation


@dataclass(frozen=True)
class _Shape:
    """The first round's findings: the sections decoded, plugin types resolved."""

    specs: dict[str, tuple[int, PluginSpec]]  # plugin name -> (index, spec)
    profiles: list[ProfileSpec]
    detector_ref: PluginRef | None
    detector_parameters: dict[str, Any] | None
    data_layer: DataLayerSpec | None
    objectives: dict[str, int | None]
    warnings: tuple[str, ...]
    plugins: dict[str, PluginDecl]  # resolved and decoded, by name
    gates: dict[str, bool]  # every known feature gate's value
    flow_control: FlowControlSpec | None  # the section, if the file has one
    detector_path: ConfigPath = ("saturationDetector", "pluginRef")


def validate(data: object, registry: PluginRegistry) -> ValidatedConfig:
    """The validated document, or `Rejected` with every problem found."""
    problems = Problems()
    shape = _check_shape(data, registry, problems)
    if shape is None:
        raise Rejected(problems.errors)
    if problems:
        # The second round needs what failed; still report dangling references
        # with the rest.
        _check_references(shape.specs, shape.profiles, problems)
        raise Rejected(problems.errors)
    return _check_meaning(shape, problems)


def _check_shape(data: object, registry: PluginRegistry, problems: Problems) -> _Shape | None:
    """The first round; None if the document is not even a mapping."""
    if not isinstance(data, dict):
        problems.add((), "the file must hold a YAML mapping (apiVersion, kind, plugins, ...)")
        return None
    for key in data:
        if key not in SECTIONS:
            problems.add((str(key),), f"unknown key; expected one of {', '.join(sorted(SECTIONS))}")
    warnings = [
        f"{key}: accepted for GIE compatibility but ignored"
        for key in IGNORED_GIE_SECTIONS
        if key in data
    ]
    gates, gate_warnings = feature_gates(data.get("featureGates"), problems)
    warnings = gate_warnings + warnings
    if data.get("apiVersion") not in API_VERSIONS:
        problems.add(
            ("apiVersion",),
            f"got {data.get('apiVersion')!r}; expected one of {', '.join(API_VERSIONS)}",
        )
    if data.get("kind") != KIND:
        problems.add(("kind",), f"got {data.get('kind')!r}; expected {KIND!r}")

    specs = _plugin_specs(data.get("plugins", []), problems)
    profiles = _profile_specs(data.get("schedulingProfiles", []), problems)
    detector_ref: PluginRef | None = None
    detector_parameters: dict[str, Any] | None = None
    if "saturationDetector" in data:
        raw = data["saturationDetector"]
        if isinstance(raw, dict) and "pluginRef" not in raw:
            # GIE before its pluggable detectors: the section held the
            # utilization detector's own parameters.
            detector_parameters = raw
        else:
            detector_ref = problems.decode(raw, PluginRef, ("saturationDetector",))
    detector_path: ConfigPath = ("saturationDetector", "pluginRef")
    flow_control: FlowControlSpec | None = None
    if "flowControl" in data:
        flow_control = decode_flow_control(data["flowControl"], problems)
        if flow_control is not None and flow_control.saturation_detector is not None:
            # llm-d: the newer place of the detector; it wins over the top-level one.
            detector_ref = PluginRef(flow_control.saturation_detector.plugin_ref)
            detector_parameters = None
            detector_path = ("flowControl", "saturationDetector", "pluginRef")
    data_layer: DataLayerSpec | None = None
    if "dataLayer" in data:
        data_layer = problems.decode(data["dataLayer"] or {}, DataLayerSpec, ("dataLayer",))
    objectives = _objectives(data.get("inferenceObjectives", []), problems)
    plugins = _plugin_decls(specs, registry, problems)
    return _Shape(
        specs,
        profiles,
        detector_ref,
        detector_parameters,
        data_layer,
        objectives,
        tuple(warnings),
        plugins,
        gates,
        flow_control,
        detector_path,
    )


def _plugin_specs(raw: object, problems: Problems) -> dict[str, tuple[int, PluginSpec]]:
    if not isinstance(raw, list):
        problems.add(("plugins",), "must be a list of plugins")
        return {}
    specs: dict[str, tuple[int, PluginSpec]] = {}
    for i, item in enumerate(raw):
        spec = problems.decode(item, PluginSpec, ("plugins", i))
        if spec is None:
            continue
        name = spec.name or spec.type
        if name in specs:
            problems.add(
                ("plugins", i, "name"),
                f"plugin name {name!r} is already used by plugins[{specs[name][0]}]"
                " (a name defaults to the type: give each instance its own name)",
            )
            continue
        specs[name] = (i, spec)
    return specs


def _profile_specs(raw: object, problems: Problems) -> list[ProfileSpec]:
    if not isinstance(raw, list) or not raw:
        problems.add(("schedulingProfiles",), "must be a non-empty list of profiles")
        return []
    profiles: list[ProfileSpec] = []
    seen: set[str] = set()
    for j, item in enumerate(raw):
        profile = problems.decode(item, ProfileSpec, ("schedulingProfiles", j))
        if profile is None:
            continue
        if profile.name in seen:
            problems.add(("schedulingProfiles", j, "name"), f"duplicate profile {profile.name!r}")
        seen.add(profile.name)
        profiles.append(profile)
    return profiles


def _objectives(raw: object, problems: Problems) -> dict[str, int | None]:
    if not isinstance(raw, list):
        problems.add(("inferenceObjectives",), "must be a list of {name, priority}")
        return {}
    objectives: dict[str, int | None] = {}
    for i, item in enumerate(raw):
        spec = problems.decode(item, ObjectiveSpec, ("inferenceObjectives", i))
        if spec is None:
            continue
        if spec.name in objectives:
            problems.add(("inferenceObjectives", i, "name"), f"duplicate objective {spec.name!r}")
        objectives[spec.name] = None if spec.priority is msgspec.UNSET else spec.priority
    return objectives


def _plugin_decls(
    specs: dict[str, tuple[int, PluginSpec]], registry: PluginRegistry, problems: Problems
) -> dict[str, PluginDecl]:
    """Each plugin's class (through the registry) and its decoded parameters."""
    decls: dict[str, PluginDecl] = {}
    for name, (i, spec) in specs.items():
        try:
            plugin_class = registry.resolve(spec.type)
        except UnknownPluginType as exc:
            problems.add(("plugins", i, "type"), str(exc))
            continue
        parameters = decode_parameters(
            plugin_class, spec.type, spec.parameters, ("plugins", i, "parameters"), problems
        )
        if parameters is not None:
            decls[name] = PluginDecl(
                name, spec.type, plugin_class, parameters, roles_of(plugin_class), ("plugins", i)
            )
    return decls


def decode_parameters(
    plugin_class: type,
    type_name: str,
    raw: Mapping[str, Any] | None,
    path: ConfigPath,
    problems: Problems,
) -> msgspec.Struct | None:
    """A plugin's parameters as its `Parameters` struct (`NoParameters()` for a class
    without one), or None after recording why not."""
    params_type = getattr(plugin_class, "Parameters", None)
    if params_type is None:
        if raw:
            problems.add(path, f"plugin type {type_name!r} takes no parameters")
            return None
        return NoParameters()
    decoded: msgspec.Struct | None = problems.decode(raw or {}, params_type, path)
    return decoded


def _check_meaning(shape: _Shape, problems: Problems) -> ValidatedConfig:
    plugins = shape.plugins
    for decl in plugins.values():
        if not decl.roles:
            problems.add(
                (*decl.path, "type"),
                f"{decl.type_name!r} implements none of the plugin interfaces"
                " (filter, score, pick, select_profiles/process_results, disaggregate,"
                " prepare, pre_request, response_first_chunk, post_response, saturation,"
                " admit, add_extractor, extract; flow control's pick_flow, order_key,"
                " compute_limits)",
            )
    data_layer = _data_layer(shape.data_layer, plugins, problems)
    detector = _saturation_detector(shape, problems)
    warnings = list(shape.warnings)
    flow_control = None
    if shape.gates[FLOW_CONTROL_GATE] or shape.flow_control is not None:
        # Checked even with the gate off: an error is an error, whether or not the
        # section is used today.
        flow_control = check_flow_control(
            shape.flow_control or FlowControlSpec(), plugins, problems, warnings
        )
        if not shape.gates[FLOW_CONTROL_GATE]:
            flow_control = None
            warnings.append(
                "flowControl: ignored, the flowControl feature gate is off"
                " (featureGates: [flowControl] turns it on); only its saturationDetector"
                " is used"
            )
    _check_references(shape.specs, shape.profiles, problems)
    profiles = tuple(
        _profile(j, profile, plugins, problems) for j, profile in enumerate(shape.profiles)
    )
    handlers = [name for name, decl in plugins.items() if decl.does(ProfileHandler)]
    if len(handlers) > 1:
        problems.add(("plugins",), f"more than one profile handler: {', '.join(handlers)}")
    elif not handlers and len(profiles) > 1:
        problems.add(
            ("plugins",),
            "several scheduling profiles need a profile handler plugin to choose among them",
        )
    problems.stop_if_any()
    return ValidatedConfig(
        plugins=tuple(plugins.values()),
        profiles=profiles,
        data_layer=data_layer,
        saturation_detector=detector,
        detector_parameters=shape.detector_parameters,
        objectives=shape.objectives,
        warnings=tuple(warnings),
        flow_control=flow_control,
    )


def _plugin_of(
    name: str,
    interface: type,
    kind: str,
    path: ConfigPath,
    plugins: Mapping[str, PluginDecl],
    problems: Problems,
) -> PluginDecl | None:
    """The plugin `name` if it is a `kind`, else None after recording why not."""
    decl = plugins.get(name)
    if decl is None:
        problems.add(
            path, f"no plugin named {name!r} in plugins (defined: {', '.join(sorted(plugins))})"
        )
        return None
    if not decl.roles:
        return None  # reported: it implements nothing at all
    if not decl.does(interface):
        problems.add(path, f"{name!r} is not {kind}")
        return None
    return decl


def _data_layer(
    spec: DataLayerSpec | None, plugins: Mapping[str, PluginDecl], problems: Problems
) -> DataLayerDecl | None:
    """The sources the file's dataLayer names, and the extractors it gives each."""
    if spec is None:
        return None
    extractions: list[Extraction] = []
    for j, source_spec in enumerate(spec.sources):
        path: ConfigPath = ("dataLayer", "sources", j)
        source = _plugin_of(
            source_spec.plugin_ref,
            DataSource,
            "a data source",
            (*path, "pluginRef"),
            plugins,
            problems,
        )
        for k, ref in enumerate(source_spec.extractors):
            ref_path: ConfigPath = (*path, "extractors", k, "pluginRef")
            extractor = _plugin_of(
                ref.plugin_ref, DataExtractor, "a data extractor", ref_path, plugins, problems
            )
            if source is not None and extractor is not None:
                extractions.append(Extraction(source.name, extractor.name, ref_path))
    return DataLayerDecl(tuple(extractions), spec.inject_defaults)


def _saturation_detector(shape: _Shape, problems: Problems) -> str | None:
    """The detector `saturationDetector: {pluginRef: ...}` names, checked; and without
    that section, a check that the file's detectors are not ambiguous."""
    if shape.detector_parameters is not None:
        return None  # the default detector, configured in place: see the defaults step
    if shape.detector_ref is not None:
        decl = _plugin_of(
            shape.detector_ref.plugin_ref,
            SaturationDetector,
            "a saturation detector",
            shape.detector_path,
            shape.plugins,
            problems,
        )
        return decl.name if decl is not None else None
    detectors = [name for name, decl in shape.plugins.items() if decl.does(SaturationDetector)]
    if len(detectors) > 1:
        problems.add(
            ("saturationDetector",),
            f"several saturation detectors ({', '.join(detectors)}): name the one that"
            " decides admission with saturationDetector: {pluginRef: ...}"
            " (or flowControl.saturationDetector)",
        )
    return None


def _check_references(
    specs: Mapping[str, tuple[int, PluginSpec]], profiles: list[ProfileSpec], problems: Problems
) -> None:
    """Every profile's pluginRef names a plugin."""
    for j, profile in enumerate(profiles):
        for k, ref in enumerate(profile.plugins):
            if ref.plugin_ref not in specs:
                problems.add(
                    ("schedulingProfiles", j, "plugins", k, "pluginRef"),
                    f"no plugin named {ref.plugin_ref!r} in plugins"
                    f" (defined: {', '.join(sorted(specs)) or 'none'})",
                )


def _profile(
    j: int, profile: ProfileSpec, plugins: Mapping[str, PluginDecl], problems: Problems
) -> ProfileDecl:
    """The profile's plugins sorted into filters, scorers and its picker; each must
    play at least one of those parts (a plugin may play several)."""
    filters: list[str] = []
    scorers: list[ScorerRef] = []
    picker: str | None = None
    for k, ref in enumerate(profile.plugins):
        path: ConfigPath = ("schedulingProfiles", j, "plugins", k)
        decl = plugins.get(ref.plugin_ref)
        if decl is None or not decl.roles:
            continue  # reported: a dangling reference, or a plugin that implements nothing
        used = False
        if decl.does(Filter):
            filters.append(decl.name)
            used = True
        if decl.does(Scorer):
            # NaN or infinity would turn every total into NaN.
            if ref.weight is not None and not (math.isfinite(ref.weight) and ref.weight >= 0):
                problems.add(
                    (*path, "weight"),
                    f"a scorer weight must be a finite number >= 0, got {ref.weight}",
                )
            scorers.append(ScorerRef(decl.name, ref.weight))
            used = True
        elif ref.weight is not None:
            problems.add(
                (*path, "weight"),
                f"{ref.plugin_ref!r} is not a scorer: a weight only applies to scorers",
            )
        if decl.does(Picker):
            if picker is not None:
                problems.add(
                    (*path, "pluginRef"),
                    f"profile {profile.name!r} already has picker {picker!r}",
                )
            picker = decl.name
            used = True
        if not used:
            problems.add(
                (*path, "pluginRef"),
                f"{ref.plugin_ref!r} is not a filter, scorer or picker, so it has no place"
                " in a profile",
            )
    return ProfileDecl(profile.name, tuple(filters), tuple(scorers), picker)
