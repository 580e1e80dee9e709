"""A real Envoy in front of a real `epp serve` process and recording upstreams:
`stack` speaks GIE's protocol (manifests/envoy/envoy.yaml), `lean_stack` lean mode
(manifests/envoy/envoy-lean.yaml)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.stack import (
    EppPorts,
    ManagedProcess,
    envoy_config,
    free_ports,
    start_envoy,
    start_epp_on_free_ports,
    write_endpoints_file,
)
from tests.integration.upstream import Upstreams

MAX_BODY_BYTES = 2 * 1024 * 1024

# Requests name their upstream with the header-based testing filter; without the
# header, max-score-picker chooses among all (every score is 0: a random choice).
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: max-score-picker
"""


@dataclass
class Stack:
    upstreams: Upstreams
    epp: ManagedProcess
    envoy: ManagedProcess
    epp_ports: EppPorts
    envoy_port: int
    envoy_admin_port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.epp_ports.metrics}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin_port}"


@contextlib.contextmanager
def running_stack(
    workdir: Path,
    *,
    lean: bool = False,
    endpoints_file: Path | None = None,
    config_text: str = CONFIG,
    max_body_bytes: int = MAX_BODY_BYTES,
    change_envoy: Callable[[dict[str, Any]], None] | None = None,
    epp_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """Upstreams, `epp serve` and Envoy with manifests/envoy/envoy.yaml (GIE's
    protocol) or envoy-lean.yaml (`lean`), all stopped on exit.

    With `endpoints_file` (a simulator fleet's, say) the EPP routes to those
    endpoints instead, and no recording upstream is started. `change_envoy` edits
    Envoy's bootstrap (a dict) before Envoy starts; `epp_args` are more `epp serve`
    flags."""
    with contextlib.ExitStack() as cleanup:
        upstreams = Upstreams(3 if endpoints_file is None else 0).start()
        cleanup.callback(upstreams.stop)
        endpoints = endpoints_file or write_endpoints_file(
            workdir / "endpoints.yaml", [(u.name, u.address) for u in upstreams]
        )
        config = workdir / "config.yaml"
        config.write_text(config_text)
        epp, ports = start_epp_on_free_ports(
            endpoints,
            workdir,
            config_file=config,
            extra_args=[
                "--debug-endpoints",
                "--max-body-bytes",
                str(max_body_bytes),
                *epp_args,
            ],
        )
        cleanup.callback(epp.stop)
        envoy_port, admin_port = free_ports(2)
        bootstrap = envoy_config(
            listen_port=envoy_port, epp_port=ports.grpc, admin_port=admin_port, lean=lean
        )
        if change_envoy is not None:
            change_envoy(bootstrap)
        envoy = start_envoy(bootstrap, workdir)
        cleanup.callback(envoy.stop)
        yield Stack(upstreams, epp, envoy, ports, envoy_port, admin_port, workdir)


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack")) as running:
        yield running


@pytest.fixture(scope="package")
def lean_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("lean-stack"), lean=True) as running:
        yield running


@pytest.fixture
def clean_stack(stack: Stack) -> Stack:
    stack.upstreams.clear()
    return stack


@pytest.fixture
def clean_lean_stack(lean_stack: Stack) -> Stack:
    lean_stack.upstreams.clear()
    return lean_stack
