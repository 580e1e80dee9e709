"""Kubernetes objects as the endpoint source needs them: the InferencePool's spec,
the pods it selects, and the endpoints a pod yields.

InferencePool, in its two API versions (docs/architecture.md, "Kubernetes"):

    inference.networking.k8s.io/v1           inference.networking.x-k8s.io/v1alpha2
    spec.selector.matchLabels {k: v}         spec.selector {k: v}
    spec.targetPorts [{number: 8000}, ...]   spec.targetPortNumber 8000
    spec.endpointPickerRef {name, port,      spec.extensionRef {name, portNumber,
                            failureMode}                        failureMode}

A pod is an endpoint while it has an IP, is not being deleted (no
`deletionTimestamp`) and its `Ready` condition is `True`. With several target
ports a pod gives one endpoint per port, named `<pod>-rank-<i>` (GIE's names); a
pod that exists but is not Ready stays in the datastore as a not-ready endpoint,
so its metrics and prefix-index state survive a readiness flap. GIE's
`active-ports` annotation restricts a pod to some of the ports. `port_problem`
words odd port facts for a warning (an annotation naming ports the pool does not
target, or not a list of ports; a target port the containers do not declare).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from epp.datastore import EndpointSpec

V1_GROUP: Final = "inference.networking.k8s.io"
V1ALPHA2_GROUP: Final = "inference.networking.x-k8s.io"
POOL_VERSIONS: Final = {V1_GROUP: "v1", V1ALPHA2_GROUP: "v1alpha2"}
POOL_PLURAL: Final = "inferencepools"
# GIE: a pod may restrict which of the pool's target ports it serves.
ACTIVE_PORTS_ANNOTATION: Final = "inference.networking.k8s.io/active-ports"
MAX_TARGET_PORTS: Final = 8  # the v1 API's bound

# Label syntax (k8s.io/apimachinery validation): an optional DNS-subdomain prefix
# and a name of up to 63 characters; values up to 63 characters, may be empty.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY: Final = re.compile(
    rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$"
)
_LABEL_VALUE: Final = re.compile(rf"^({_LABEL_NAME})?$")


class InvalidPool(ValueError):
    """An InferencePool (or the standalone flags) the EPP cannot serve."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the EPP takes from an InferencePool: which pods, which ports."""

    selector: tuple[tuple[str, str], ...]  # sorted (key, value) pairs: comparable
    target_ports: tuple[int, ...]
    # For the logs only: the gateway, not the EPP, acts on these.
    picker_ref: str | None = None
    failure_mode: str | None = None

    @property
    def label_selector(self) -> str:
        """The selector as the API's `labelSelector` query parameter."""
        return ",".join(f"{k}={v}" for k, v in self.selector)

    def describe(self) -> str:
        ports = ",".join(str(p) for p in self.target_ports)
        return f"selector {self.label_selector or '(none)'}, target ports {ports}"


def check_selector(selector: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The selector as sorted pairs; InvalidPool if it is empty or malformed."""
    if not selector:
        raise InvalidPool("the selector is empty: it would select every pod in the namespace")
    for key, value in selector.items():
        if not isinstance(key, str) or len(key) > 316 or not _LABEL_KEY.match(key):
            raise InvalidPool(f"selector key {key!r} is not a valid label key")
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            raise InvalidPool(f"selector value {value!r} (key {key!r}) is not a valid label value")
    return tuple(sorted(selector.items()))


def check_ports(ports: Sequence[object]) -> tuple[int, ...]:
    if not ports:
        raise InvalidPool("no target port")
    if len(ports) > MAX_TARGET_PORTS:
        raise InvalidPool(f"{len(ports)} target ports; at most {MAX_TARGET_PORTS}")
    checked: list[int] = []
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidPool(f"target port {port!r} is not a port number (1-65535)")
        if port in checked:
            raise InvalidPool(f"target port {port} is listed twice")
        checked.append(port)
    return tuple(checked)


def parse_selector_flag(text: str) -> dict[str, str]:
    """`--endpoint-selector app=vllm,tier=gpu` (GIE's flag); ValueError if malformed."""
    selector: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if value.startswith("="):  # k==v, the API's other spelling of equality
            value = value[1:]
        if not sep or not key.strip():
            raise ValueError(f"{part!r} is not key=value")
        selector[key.strip()] = value.strip()
    try:
        check_selector(selector)
    except InvalidPool as exc:
        raise ValueError(str(exc)) from None
    return selector


def parse_ports_flag(text: str) -> tuple[int, ...]:
    """`--endpoint-target-ports 8000[,8001]`; ValueError if malformed."""
    try:
        ports: list[object] = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of ports") from None
    try:
        return check_ports(ports)
    except InvalidPool as exc:
        raise ValueError(str(exc)) from None


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidPool(f"{where} must be an object")
    return value


def parse_pool(obj: Mapping[str, Any]) -> PoolSpec:
    """The spec of an InferencePool object (v1 or v1alpha2 field names);
    InvalidPool saying what is wrong with it."""
    spec = _mapping(obj.get("spec"), "spec")
    raw_selector = _mapping(spec.get("selector"), "spec.selector")
    if "matchLabels" in raw_selector:  # v1: a LabelSelector
        labels = _mapping(raw_selector.get("matchLabels"), "spec.selector.matchLabels")
        if raw_selector.get("matchExpressions"):
            raise InvalidPool("spec.selector.matchExpressions is not supported (matchLabels only)")
    else:  # v1alpha2: the labels themselves
        labels = raw_selector
    try:
        selector = check_selector(dict(labels))
    except InvalidPool as exc:
        raise InvalidPool(f"spec.selector: {exc}") from None
    if "targetPorts" in spec:
        raw_ports = spec.get("targetPorts")
        if not isinstance(raw_ports, list):
            raise InvalidPool("spec.targetPorts must be a list of {number: port}")
        numbers: list[object] = [
            p.get("number") if isinstance(p, Mapping) else p for p in raw_ports
        ]
    elif "targetPortNumber" in spec:
        numbers = [spec.get("targetPortNumber")]
    else:
        raise InvalidPool("spec.targetPorts (v1) or spec.targetPortNumber (v1alpha2) is missing")
    try:
        ports = check_ports(numbers)
    except InvalidPool as exc:
        raise InvalidPool(f"spec.targetPorts: {exc}") from None
    ref = spec.get("endpointPickerRef") or spec.get("extensionRef")
    picker_ref = failure_mode = None
    if isinstance(ref, Mapping):
        port = ref.get("port")
        number = port.get("number") if isinstance(port, Mapping) else ref.get("portNumber")
        picker_ref = f"{ref.get('name')}:{number}" if number else str(ref.get("name"))
        mode = ref.get("failureMode")
        failure_mode = str(mode) if mode else None
    return PoolSpec(selector, ports, picker_ref, failure_mode)


# ---------------------------------------------------------------------------
# Pods


@dataclass(frozen=True, slots=True)
class PodInfo:
    """The facts of a pod the endpoints depend on; decoded off the event loop."""

    name: str
    ip: str | None
    ready: bool
    terminating: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    # None: every target port (no active-ports annotation, or a malformed one).
    active_ports: frozenset[int] | None = None
    # The ports the pod's containers declare (`containerPort`); empty: none declared.
    # Informational in Kubernetes (traffic reaches undeclared ports too), so only
    # used to warn about a pool that targets a port the pod does not declare.
    container_ports: frozenset[int] = frozenset()
    # Why the active-ports annotation was ignored, if it was.
    annotation_error: str | None = None


def _active_ports(raw: object) -> tuple[frozenset[int] | None, str | None]:
    """The active-ports annotation's ports, or (None, why it is ignored)."""
    if raw is None:
        return None, None
    if isinstance(raw, str):
        try:
            ports = frozenset(int(p) for p in raw.split(",") if p.strip())
        except ValueError:
            ports = frozenset()
        if ports and all(0 < p < 65536 for p in ports):
            return ports, None
    # A malformed annotation restricts nothing rather than hiding the pod.
    return None, (
        f"annotation {ACTIVE_PORTS_ANNOTATION}={raw!r} is not a comma-separated list of"
        " ports; ignored (every target port is served)"
    )


def _container_ports(spec: Mapping[str, Any]) -> frozenset[int]:
    ports: set[int] = set()
    for container in spec.get("containers") or ():
        if not isinstance(container, Mapping):
            continue
        for port in container.get("ports") or ():
            number = port.get("containerPort") if isinstance(port, Mapping) else None
            if isinstance(number, int) and not isinstance(number, bool):
                ports.add(number)
    return frozenset(ports)


def pod_info(obj: Mapping[str, Any]) -> PodInfo:
    metadata = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ready = any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    active, annotation_error = _active_ports(annotations.get(ACTIVE_PORTS_ANNOTATION))
    return PodInfo(
        name=str(metadata.get("name", "")),
        ip=status.get("podIP") or None,
        ready=ready,
        terminating=metadata.get("deletionTimestamp") is not None,
        labels={str(k): str(v) for k, v in labels.items()},
        active_ports=active,
        container_ports=_container_ports(obj.get("spec") or {}),
        annotation_error=annotation_error,
    )


def port_problem(pod: PodInfo, ports: Sequence[int]) -> str | None:
    """What is odd about `pod`'s ports for a pool targeting `ports`, for a warning
    (None: nothing). Never changes which endpoints the pod gives."""
    problems: list[str] = []
    if pod.annotation_error is not None:
        problems.append(pod.annotation_error)
    if pod.active_ports is not None:
        unknown = sorted(pod.active_ports - set(ports))
        if unknown:
            problems.append(
                f"annotation {ACTIVE_PORTS_ANNOTATION} names port(s)"
                f" {', '.join(map(str, unknown))} that the pool does not target"
                f" ({', '.join(map(str, ports))}); ignored"
            )
        if not pod.active_ports & set(ports):
            problems.append("none of its active ports is a target port: it has no endpoint")
    if pod.container_ports:
        undeclared = [p for p in ports if p not in pod.container_ports]
        if undeclared:
            problems.append(
                f"target port(s) {', '.join(map(str, undeclared))} not among its containers'"
                f" declared ports ({', '.join(map(str, sorted(pod.container_ports)))});"
                " routed anyway: requests fail if nothing listens there"
            )
    return f"pod {pod.name}: " + "; ".join(problems) if problems else None


@dataclass(frozen=True, slots=True)
class KvEventPorts:
    """Where each rank's engine publishes KV events: base port + rank (vLLM's rule
    for data-parallel ranks); None: the endpoint names no KV-event socket (the
    precise scorer's own `socketPort` then applies)."""

    port: int | None = None
    replay_port: int | None = None


def host_port(ip: str, port: int) -> str:
    """`ip:port`, with an IPv6 address in brackets (the form Envoy parses)."""
    try:
        v6 = ipaddress.ip_address(ip).version == 6
    except ValueError:
        v6 = ":" in ip
    return f"[{ip}]:{port}" if v6 else f"{ip}:{port}"


def pod_endpoints(
    pod: PodInfo, ports: Sequence[int], kv: KvEventPorts
) -> tuple[list[EndpointSpec], bool]:
    """(the endpoints of `pod`, whether they are ready). No endpoints for a pod
    without an IP or one being deleted: it will not serve again."""
    if pod.ip is None or pod.terminating:
        return [], False
    specs: list[EndpointSpec] = []
    several = len(ports) > 1
    for rank, port in enumerate(ports):
        if pod.active_ports is not None and port not in pod.active_ports:
            continue
        specs.append(
            EndpointSpec(
                name=f"{pod.name}-rank-{rank}" if several else pod.name,
                address=host_port(pod.ip, port),
                kv_events=f"tcp://{host_port(pod.ip, kv.port + rank)}"
                if kv.port is not None
                else None,
                kv_events_replay=f"tcp://{host_port(pod.ip, kv.replay_port + rank)}"
                if kv.replay_port is not None and kv.port is not None
                else None,
                labels=pod.labels,
            )
        )
    return specs, pod.ready
