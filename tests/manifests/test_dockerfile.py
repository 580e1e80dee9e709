"""The Dockerfile agrees with the Helm chart and the project: no image can be built
here, so what the chart relies on is read from the Dockerfile itself."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any, Final

import helm_python as helm

from tests.manifests.chart import CHART, ROOT, dockerfile_instructions, render

DOCKERFILE: Final = ROOT / "Dockerfile"
REQUIRED: Final = {"inferencePool": {"modelServers": {"matchLabels": {"app": "vllm"}}}}


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for step in dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if step[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(step)
    return stages


def _values() -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.values


def test_multi_stage_with_a_slim_runtime() -> None:
    build, runtime = _stages()
    assert build[0] == ("FROM", "${PYTHON_IMAGE} AS build")
    assert runtime[0] == ("FROM", "${PYTHON_IMAGE}")
    args = dict(
        a.split("=", 1) for w, a in dockerfile_instructions(DOCKERFILE.read_text()) if w == "ARG"
    )
    assert re.fullmatch(r"python:3\.1[1-9]-slim-\w+", args["PYTHON_IMAGE"])
    # Only the built environment reaches the runtime stage.
    copies = [a for w, a in runtime if w == "COPY"]
    assert copies == ["--from=build /opt/epp /opt/epp"]


def test_protos_are_generated_in_the_build_stage_with_the_pinned_generator() -> None:
    build, _ = _stages()
    run = " ".join(a for w, a in build if w == "RUN")
    assert "protos/generate.py" in run
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [p for p in project["project"]["optional-dependencies"]["test"] if "grpcio-tools" in p]
    assert pins, "pyproject.toml pins no grpcio-tools"
    assert pins[0] in run, f"the Dockerfile's grpcio-tools is not the project's {pins[0]}"


def test_runs_as_the_chart_s_numeric_non_root_user() -> None:
    _, runtime = _stages()
    users = [a for w, a in runtime if w == "USER"]
    assert users == ["10001:10001"]
    pod = _values()["inferenceExtension"]["podSecurityContext"]
    assert users[0] == f"{pod['runAsUser']}:{pod['runAsGroup']}"


def test_entrypoint_ports_and_writable_paths_match_the_chart() -> None:
    _, runtime = _stages()
    entrypoint = [json.loads(a) for w, a in runtime if w == "ENTRYPOINT"]
    assert entrypoint == [["epp", "serve"]]
    chart = render(REQUIRED)
    # The chart gives flags only: the image's entrypoint is the command.
    assert "command" not in chart.epp_container
    assert all(a.startswith("--") for a in chart.epp_args)
    exposed = {int(p) for w, a in runtime if w == "EXPOSE" for p in a.split()}
    assert exposed == {p["port"] for p in chart.one("Service")["spec"]["ports"]}
    # HOME (and Hugging Face's cache) on the one writable mount.
    env = " ".join(a for w, a in runtime if w == "ENV")
    assert "HOME=/tmp" in env
    assert "HF_HOME=/tmp/" in env
    mounts = {m["mountPath"] for m in chart.epp_container["volumeMounts"]}
    assert {"/tmp", "/config"} <= mounts
    assert any(a.startswith("--config=/config/") for a in chart.epp_args)


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    build, _ = _stages()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for word, args in build:
        if word != "COPY" or args.startswith("--from"):
            continue
        *sources, _ = args.split()
        for source in sources:
            assert source.rstrip("/") in included, f"{source} is not in the build context"
            assert (ROOT / source).exists(), source
    # Generated code is never taken from a working tree.
    assert "epp/_proto/" in patterns
