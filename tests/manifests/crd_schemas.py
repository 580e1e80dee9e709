"""JSON schemas for the custom resources the chart renders, which
kubernetes-validate does not know (it ships the built-in kinds only).

Written for these tests from the resources' published field definitions
(docs/architecture.md, "Kubernetes", for InferencePool): the fields, types, bounds
and enums the chart may use, with unknown fields refused, like kubernetes-validate's
strict schemas and like the API server's structural-schema pruning would make them
vanish silently. They check what the chart writes, not every field the CRDs allow.
"""

from __future__ import annotations

from typing import Any, Final

_DNS_SUBDOMAIN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DNS_LABEL: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_KEY: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# Prometheus Operator's duration syntax (monitoring.coreos.com Duration).
_PROM_DURATION: Final = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)

_PORT: Final[dict[str, Any]] = {"type": "integer", "minimum": 1, "maximum": 65535}

_LABELS: Final[dict[str, Any]] = {
    "type": "object",
    "propertyNames": {"pattern": _LABEL_KEY},
    "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE},
}

_METADATA: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["name", "namespace"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": _DNS_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": _DNS_LABEL},
        "labels": _LABELS,
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

_FAILURE_MODE: Final[dict[str, Any]] = {"type": "string", "enum": ["FailOpen", "FailClose"]}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


# inference.networking.k8s.io/v1: spec.selector.matchLabels (1-64 labels),
# spec.targetPorts (1-8 unique {number}), spec.appProtocol, spec.endpointPickerRef
# {group, kind (default Service), name, port {number} (needed for a Service),
# failureMode FailOpen|FailClose}.
INFERENCE_POOL_V1: Final = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    {
        "type": "object",
        "required": ["selector", "targetPorts"],
        "additionalProperties": False,
        "properties": {
            "selector": {
                "type": "object",
                "required": ["matchLabels"],
                "additionalProperties": False,
                "properties": {"matchLabels": {**_LABELS, "minProperties": 1, "maxProperties": 64}},
            },
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "items": {
                    "type": "object",
                    "required": ["number"],
                    "additionalProperties": False,
                    "properties": {"number": _PORT},
                },
            },
            "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "group": {"type": "string", "maxLength": 253},
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT},
                    },
                    "failureMode": _FAILURE_MODE,
                },
                # A Service reference (the default kind) needs its port.
                "if": {
                    "anyOf": [
                        {"not": {"required": ["kind"]}},
                        {"properties": {"kind": {"const": "Service"}}},
                    ]
                },
                "then": {"required": ["port"]},
            },
        },
    },
)

# inference.networking.x-k8s.io/v1alpha2 (the older API): the labels directly
# under spec.selector, a single spec.targetPortNumber, spec.extensionRef {group,
# kind, name, portNumber, failureMode}.
INFERENCE_POOL_V1ALPHA2: Final = _resource(
    "inference.networking.x-k8s.io/v1alpha2",
    "InferencePool",
    {
        "type": "object",
        "required": ["selector", "targetPortNumber", "extensionRef"],
        "additionalProperties": False,
        "properties": {
            "selector": {**_LABELS, "minProperties": 1, "maxProperties": 64},
            "targetPortNumber": _PORT,
            "extensionRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "group": {"type": "string", "maxLength": 253},
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "portNumber": _PORT,
                    "failureMode": _FAILURE_MODE,
                },
            },
        },
    },
)

# monitoring.coreos.com/v1 ServiceMonitor (Prometheus Operator): spec.selector (a
# label selector, required), spec.namespaceSelector {any, matchNames},
# spec.endpoints[] {port (a Service port name), path, scheme, interval, ...}.
SERVICE_MONITOR_V1: Final = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector"],
        "additionalProperties": False,
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
            },
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
            },
            "jobLabel": {"type": "string"},
            "endpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": _PROM_DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _PROM_DURATION},
                        "honorLabels": {"type": "boolean"},
                    },
                },
            },
        },
    },
)

# (apiVersion, kind) -> schema.
CUSTOM_RESOURCE_SCHEMAS: Final[dict[tuple[str, str], dict[str, Any]]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_V1,
    ("inference.networking.x-k8s.io/v1alpha2", "InferencePool"): INFERENCE_POOL_V1ALPHA2,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_V1,
}
