"""The config's `featureGates` and `flowControl:` sections (llm-d-router's shape),
read in the loader's three steps like the rest of the file.

    featureGates: [flowControl]          # a name, or "name=true" / "name=false"
    flowControl:
      maxRequests: 0                     # across all bands; 0 or absent: no bound
      maxBytes: 0                        #   (Kubernetes quantities: 1k, 500M, 1Gi)
      defaultRequestTTL: 60s             # queue-wait budget; 0s: none
      noEndpointRequestTTL: 60s          # accepted (see docs/flow-control.md)
      defaultPriorityBand:               # template for priorities without a band
        maxRequests: 5000                #   per band; 0 or absent: 5000
        maxBytes: 1G                     #   per band; 0 or absent: 1 GB
        fairnessPolicyRef: global-strict-fairness-policy
        orderingPolicyRef: fcfs-ordering-policy
      defaultNegativePriorityBand: {...} # the same, for priorities below 0
      priorityBands:
      - {priority: 10, maxRequests: 100, fairnessPolicyRef: ..., orderingPolicyRef: ...}
      usageLimitPolicyPluginRef: static-usage-limit-policy
      saturationDetector: {pluginRef: utilization-detector}
      enableEviction: false              # accepted; true is not supported (warning)

Policy references name plugins of the file's `plugins:`; the three defaults
(`global-strict-fairness-policy`, `fcfs-ordering-policy`,
`static-usage-limit-policy`) may be named without being declared, as in llm-d,
which injects them. With the gate off the section is checked, then ignored (with a
warning), except `saturationDetector`, which admission uses too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Final

import msgspec

from epp.config.document import (
    BandDecl,
    BandPlan,
    FlowControlDecl,
    FlowControlPlan,
    PluginDecl,
)
from epp.config.errors import ConfigPath, Problems
from epp.durations import Duration, parse_duration
from epp.flowcontrol.interfaces import FairnessPolicy, OrderingPolicy, UsageLimitPolicy

FLOW_CONTROL_GATE: Final = "flowControl"
# Gates this EPP knows, and their defaults (llm-d's registered gates; the others
# llm-d has concern parts this EPP does not have and are ignored with a warning).
FEATURE_GATES: Final = {FLOW_CONTROL_GATE: False}

DEFAULT_FAIRNESS_POLICY: Final = "global-strict-fairness-policy"
DEFAULT_ORDERING_POLICY: Final = "fcfs-ordering-policy"
DEFAULT_USAGE_LIMIT_POLICY: Final = "static-usage-limit-policy"
DEFAULT_BAND_MAX_REQUESTS: Final = 5000
DEFAULT_BAND_MAX_BYTES: Final = 1_000_000_000
DEFAULT_REQUEST_TTL_S: Final = 60.0

# The kind of plugin each reference must name, and the default it may name.
POLICY_KINDS: Final[Mapping[str, tuple[type, str, str]]] = {
    "fairnessPolicyRef": (FairnessPolicy, "a fairness policy", DEFAULT_FAIRNESS_POLICY),
    "orderingPolicyRef": (OrderingPolicy, "an ordering policy", DEFAULT_ORDERING_POLICY),
    "usageLimitPolicyPluginRef": (
        UsageLimitPolicy,
        "a usage limit policy",
        DEFAULT_USAGE_LIMIT_POLICY,
    ),
}

Quantity = int | str


class PriorityBandSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    priority: int | msgspec.UnsetType = msgspec.UNSET
    max_bytes: Quantity | None = None
    max_requests: Quantity | None = None
    fairness_policy_ref: str = ""
    ordering_policy_ref: str = ""


class DetectorRefSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str


class FlowControlSpec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    max_bytes: Quantity | None = None
    max_requests: Quantity | None = None
    default_request_ttl: Duration | None = msgspec.field(default=None, name="defaultRequestTTL")
    no_endpoint_request_ttl: Duration | None = msgspec.field(
        default=None, name="noEndpointRequestTTL"
    )
    default_priority_band: PriorityBandSpec | None = None
    default_negative_priority_band: PriorityBandSpec | None = None
    priority_bands: list[PriorityBandSpec] = []
    usage_limit_policy_plugin_ref: str = ""
    saturation_detector: DetectorRefSpec | None = None
    enable_eviction: bool = False


# ---------------------------------------------------------------------------
# Parse


def feature_gates(raw: object, problems: Problems) -> tuple[dict[str, bool], list[str]]:
    """The gates' values (every known gate, with its default if not set) and the
    warnings about gates this EPP does not know."""
    gates = dict(FEATURE_GATES)
    warnings: list[str] = []
    if raw is None:
        return gates, warnings
    if not isinstance(raw, list):
        problems.add(("featureGates",), "must be a list of gate names, e.g. [flowControl]")
        return gates, warnings
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item.strip():
            problems.add(
                ("featureGates", i), f"a gate is a name (optionally =true/=false), got {item!r}"
            )
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        enabled = True
        if value:
            text = value.strip().lower()
            if text not in ("true", "false", "1", "0", "t", "f"):
                problems.add(
                    ("featureGates", i),
                    f"{value.strip()!r} is not a valid value for feature gate {name!r}"
                    " (true or false)",
                )
                continue
            enabled = text in ("true", "1", "t")
        if name in FEATURE_GATES:
            gates[name] = enabled
        else:
            warnings.append(
                f"featureGates: {name!r} is not a feature gate of this EPP"
                f" (known: {', '.join(FEATURE_GATES)}); accepted for llm-d compatibility"
                " but ignored"
            )
    return gates, warnings


_QUANTITY = re.compile(
    r"^(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)|[eE](?P<exponent>[+-]?[0-9]+))?$"
)
_SUFFIXES: Final = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def quantity(value: Quantity | None, path: ConfigPath, problems: Problems) -> int | None:
    """A Kubernetes quantity ("1Gi", "500M", "1k", 100) as a whole number, rounded
    up as Kubernetes' `Value()` does; None if absent or after recording why not."""
    if value is None:
        return None
    if isinstance(value, int):
        if value < 0:
            problems.add(path, f"must be >= 0, got {value}")
            return None
        return value
    match = _QUANTITY.match(value.strip())
    if match is None:
        problems.add(
            path,
            f"{value!r} is not a quantity (a number with an optional suffix such as"
            " k, M, G, Ki, Mi, Gi: 5000, 1G, 500Mi)",
        )
        return None
    try:
        number = Decimal(match.group("number"))
        if match.group("exponent") is not None:
            number *= Decimal(10) ** int(match.group("exponent"))
        else:
            number *= _SUFFIXES[match.group("suffix") or ""]
        result = math.ceil(number)
    except (InvalidOperation, OverflowError, ValueError):
        problems.add(path, f"{value!r} is too large a quantity")
        return None
    if result > 2**63 - 1:
        problems.add(path, f"{value!r} is too large a quantity")
        return None
    return result


def _duration(value: str | None, path: ConfigPath, problems: Problems) -> float | None:
    if value is None:
        return None
    seconds = parse_duration(value)
    if seconds < 0:
        problems.add(path, f"must not be negative, got {value!r}")
        return None
    return seconds


def _band(spec: PriorityBandSpec, path: ConfigPath, problems: Problems) -> BandDecl:
    return BandDecl(
        priority=None if spec.priority is msgspec.UNSET else spec.priority,
        max_requests=quantity(spec.max_requests, (*path, "maxRequests"), problems),
        max_bytes=quantity(spec.max_bytes, (*path, "maxBytes"), problems),
        fairness=spec.fairness_policy_ref or None,
        ordering=spec.ordering_policy_ref or None,
    )


def decode_flow_control(raw: object, problems: Problems) -> FlowControlSpec | None:
    """The section's shape (None: absent, or wrong; recorded)."""
    spec: FlowControlSpec | None = problems.decode(
        raw if raw is not None else {}, FlowControlSpec, ("flowControl",)
    )
    return spec


def check_flow_control(
    spec: FlowControlSpec,
    plugins: Mapping[str, PluginDecl],
    problems: Problems,
    warnings: list[str],
) -> FlowControlDecl:
    """The section's meaning: values in range, unique bands, references to plugins
    of the right kind."""
    root: ConfigPath = ("flowControl",)
    if spec.enable_eviction:
        warnings.append(
            "flowControl.enableEviction: in-flight eviction is not supported by this EPP;"
            " ignored (queued requests are still shed by their band's bounds and TTL)"
        )
    bands: list[BandDecl] = []
    seen: dict[int, int] = {}
    for i, band_spec in enumerate(spec.priority_bands):
        path: ConfigPath = (*root, "priorityBands", i)
        if band_spec.priority is msgspec.UNSET:
            problems.add((*path, "priority"), "missing required key: a band's priority")
        elif band_spec.priority in seen:
            problems.add(
                (*path, "priority"),
                f"priority {band_spec.priority} already has a band"
                f" (flowControl.priorityBands[{seen[band_spec.priority]}])",
            )
        else:
            seen[band_spec.priority] = i
        bands.append(_band(band_spec, path, problems))
        _check_refs(band_spec, path, plugins, problems)
    default_band = None
    if spec.default_priority_band is not None:
        path = (*root, "defaultPriorityBand")
        default_band = _band(spec.default_priority_band, path, problems)
        _check_refs(spec.default_priority_band, path, plugins, problems)
    negative_band = None
    if spec.default_negative_priority_band is not None:
        path = (*root, "defaultNegativePriorityBand")
        negative_band = _band(spec.default_negative_priority_band, path, problems)
        _check_refs(spec.default_negative_priority_band, path, plugins, problems)
    usage_limit = spec.usage_limit_policy_plugin_ref or None
    if usage_limit is not None:
        policy_ref(
            usage_limit, "usageLimitPolicyPluginRef", (*root, "usageLimitPolicyPluginRef"),
            plugins, problems,
        )  # fmt: skip
    return FlowControlDecl(
        max_requests=quantity(spec.max_requests, (*root, "maxRequests"), problems) or 0,
        max_bytes=quantity(spec.max_bytes, (*root, "maxBytes"), problems) or 0,
        default_request_ttl_s=_duration(
            spec.default_request_ttl, (*root, "defaultRequestTTL"), problems
        ),
        no_endpoint_request_ttl_s=_duration(
            spec.no_endpoint_request_ttl, (*root, "noEndpointRequestTTL"), problems
        ),
        default_band=default_band,
        default_negative_band=negative_band,
        bands=tuple(bands),
        usage_limit=usage_limit,
    )


def _check_refs(
    spec: PriorityBandSpec,
    path: ConfigPath,
    plugins: Mapping[str, PluginDecl],
    problems: Problems,
) -> None:
    if spec.fairness_policy_ref:
        policy_ref(
            spec.fairness_policy_ref, "fairnessPolicyRef", (*path, "fairnessPolicyRef"),
            plugins, problems,
        )  # fmt: skip
    if spec.ordering_policy_ref:
        policy_ref(
            spec.ordering_policy_ref, "orderingPolicyRef", (*path, "orderingPolicyRef"),
            plugins, problems,
        )  # fmt: skip


def policy_ref(
    name: str, key: str, path: ConfigPath, plugins: Mapping[str, PluginDecl], problems: Problems
) -> None:
    """Check that `name` names a plugin of the kind `key` asks for (or that kind's
    default, which the defaults step adds)."""
    interface, kind, default = POLICY_KINDS[key]
    decl = plugins.get(name)
    if decl is None:
        if name == default:
            return
        problems.add(
            path,
            f"no plugin named {name!r} in plugins: declare {kind} there and name it here"
            f" (declared: {', '.join(sorted(plugins)) or 'none'}; {default!r} may be"
            " named without being declared)",
        )
        return
    if not decl.roles:
        return  # reported: it implements nothing at all
    if not decl.does(interface):
        problems.add(path, f"{name!r} (type {decl.type_name!r}) is not {kind}")


def used_policies(decl: FlowControlDecl) -> set[str]:
    """The names of every policy the section refers to, defaults included."""
    names = {decl.usage_limit or DEFAULT_USAGE_LIMIT_POLICY}
    for band in (*decl.bands, decl.default_band, decl.default_negative_band):
        if band is not None:
            names.add(band.fairness or DEFAULT_FAIRNESS_POLICY)
            names.add(band.ordering or DEFAULT_ORDERING_POLICY)
    names.add(DEFAULT_FAIRNESS_POLICY)
    names.add(DEFAULT_ORDERING_POLICY)
    return names


# ---------------------------------------------------------------------------
# Defaults


def plan(decl: FlowControlDecl) -> FlowControlPlan:
    """`decl` with llm-d's defaults filled in: a band's 0 or absent bounds are the
    defaults (5000 requests, 1 GB), its policies the template's, then
    global-strict and FCFS; priority 0 always has a band (llm-d provisions it)."""

    def complete(band: BandDecl | None, template: BandPlan | None, priority: int) -> BandPlan:
        base = template or BandPlan(
            0,
            DEFAULT_BAND_MAX_REQUESTS,
            DEFAULT_BAND_MAX_BYTES,
            DEFAULT_FAIRNESS_POLICY,
            DEFAULT_ORDERING_POLICY,
        )
        if band is None:
            return BandPlan(
                priority, base.max_requests, base.max_bytes, base.fairness, base.ordering
            )
        return BandPlan(
            priority,
            band.max_requests or DEFAULT_BAND_MAX_REQUESTS,
            band.max_bytes or DEFAULT_BAND_MAX_BYTES,
            band.fairness or base.fairness,
            band.ordering or base.ordering,
        )

    default_band = complete(decl.default_band, None, 0)
    negative = (
        complete(decl.default_negative_band, None, 0)
        if decl.default_negative_band is not None
        else None
    )
    bands = [complete(b, None, b.priority) for b in decl.bands if b.priority is not None]
    if not any(b.priority == 0 for b in bands):
        bands.append(complete(None, default_band, 0))
    ttl = decl.default_request_ttl_s
    no_endpoint_ttl = decl.no_endpoint_request_ttl_s
    return FlowControlPlan(
        bands=tuple(bands),
        default_band=default_band,
        default_negative_band=negative,
        max_requests=decl.max_requests,
        max_bytes=decl.max_bytes,
        default_request_ttl_s=DEFAULT_REQUEST_TTL_S if ttl is None else ttl,
        # llm-d: follows defaultRequestTTL when only that one is set.
        no_endpoint_request_ttl_s=(
            no_endpoint_ttl
            if no_endpoint_ttl is not None
            else (ttl if ttl is not None else DEFAULT_REQUEST_TTL_S)
        ),
        usage_limit=decl.usage_limit or DEFAULT_USAGE_LIMIT_POLICY,
    )
