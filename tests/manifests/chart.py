"""Rendering the Helm chart with the real Helm library (PyPI helm-python-sdk: Helm
v4's Go SDK through its C ABI, no helm binary), and reading what it rendered."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import helm_python as helm
import yaml

ROOT: Final = Path(__file__).resolve().parents[2]
CHART: Final = ROOT / "manifests" / "helm" / "inferencepool"
EXAMPLE: Final = ROOT / "docs" / "examples" / "label-preference-scorer"
RELEASE: Final = "llama3"
NAMESPACE: Final = "inference"
EPP: Final = f"{RELEASE}-epp"

# The Kubernetes versions every rendered object is validated against.
KUBE_VERSIONS: Final = ("1.30", "1.31", "1.32", "1.33", "1.34")

Obj = dict[str, Any]


@dataclass
class Rendered:
    """The objects of one render, in template order."""

    objects: list[Obj]
    notes: str = ""
    files: dict[str, str] = field(default_factory=dict)

    def all(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj | None:
        for obj in self.all(kind):
            if obj["metadata"]["name"] == name:
                return obj
        return None

    def one(self, kind: str, name: str = EPP) -> Obj:
        obj = self.get(kind, name)
        assert obj is not None, f"no {kind} {name} in {[self.key(o) for o in self.objects]}"
        return obj

    @staticmethod
    def key(obj: Obj) -> str:
        return f"{obj['kind']}/{obj['metadata']['name']}"

    # The picker's pieces, used by most tests.

    @property
    def epp_pod(self) -> Obj:
        spec: Obj = self.one("Deployment")["spec"]["template"]
        return spec

    @property
    def epp_container(self) -> Obj:
        containers: list[Obj] = self.epp_pod["spec"]["containers"]
        return next(c for c in containers if c["name"] == "epp")

    @property
    def epp_args(self) -> list[str]:
        args: list[str] = self.epp_container["args"]
        return args

    @property
    def config_files(self) -> dict[str, str]:
        data: dict[str, str] = self.one("ConfigMap")["data"]
        return data


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def render(values: Mapping[str, Any], *, name: str = RELEASE) -> Rendered:
    """Render the chart as `helm install NAME chart -n NAMESPACE` would; raises the
    Helm library's errors (HelmValuesError for a schema violation, HelmRenderError
    for a template's `fail`)."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(dict(values), name=name, namespace=NAMESPACE, is_install=True)
    objects: list[Obj] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(objects, notes, files)


def lint(values: Mapping[str, Any], kube_version: str) -> list[dict[str, Any]]:
    """`helm lint --strict --kube-version` findings worse than info (empty: clean)."""
    report = helm.lint(
        CHART, dict(values), strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}.0"
    )
    messages: list[dict[str, Any]] = report["messages"]
    problems = [m for m in messages if m["severity"] >= 2]
    problems.extend({"severity": 3, "error": e} for e in report["errors"])
    return problems


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    result: list[tuple[str, str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result
