"""Envoy configurations for the security tests: manifests/envoy/envoy.yaml with
more listeners, each asking its own ext_proc cluster (plaintext or TLS, FailClose
or FailOpen), in front of `epp serve` processes started with the flags a test
needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stack import (
    EppPorts,
    ManagedProcess,
    add_epp_listener,
    envoy_config,
    free_ports,
    start_envoy,
    start_epp_on_free_ports,
    write_endpoints_file,
)
from tests.integration.conftest import CONFIG
from tests.integration.upstream import Upstreams

EXT_PROC = "envoy.filters.http.ext_proc"


def tls_transport_socket(
    ca_file: Path | None = None, server_name: str | None = None
) -> dict[str, Any]:
    """An UpstreamTlsContext for an ext_proc cluster. Without `ca_file` it accepts
    any certificate (GIE's setting for its self-signed one); with it, the EPP must
    present a certificate that CA signed, for `server_name`."""
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        # gRPC servers speak HTTP/2 over TLS only when ALPN agrees on it.
        "common_tls_context": {"alpn_protocols": ["h2"]},
    }
    if ca_file is not None:
        assert server_name is not None
        context["sni"] = server_name
        context["common_tls_context"]["validation_context"] = {
            "trusted_ca": {"filename": str(ca_file)},
            "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": server_name}}
            ],
        }
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _listener(config: dict[str, Any], name: str) -> dict[str, Any]:
    listener: dict[str, Any] = next(
        item for item in config["static_resources"]["listeners"] if item["name"] == name
    )
    return listener


def _ext_proc(listener: dict[str, Any]) -> dict[str, Any]:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    found: dict[str, Any] = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC)
    return found


@dataclass
class Route:
    """One listener of the test Envoy and the ext_proc cluster behind it."""

    name: str
    epp_port: int
    port: int  # the listener's
    tls: dict[str, Any] | None = None  # the cluster's transport socket; None: plaintext
    fail_open: bool = False
    cluster: str = ""  # its ext_proc cluster in Envoy (for Envoy's stats)
    # The EPP's gRPC health port: Envoy health-checks the cluster there, in
    # plaintext even when the cluster talks TLS (as the Helm chart's Envoy does).
    health_port: int | None = None


@dataclass
class SecurityStack:
    upstreams: Upstreams
    epps: dict[str, EppPorts]
    routes: dict[str, Route]
    envoy: ManagedProcess
    envoy_admin_port: int
    workdir: Path

    def url(self, route: str) -> str:
        return f"http://127.0.0.1:{self.routes[route].port}"

    def admin_url(self, epp: str) -> str:
        return f"http://127.0.0.1:{self.epps[epp].metrics}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin_port}"


def envoy_with_routes(routes: Sequence[Route], admin_port: int) -> dict[str, Any]:
    first, *rest = routes
    config = envoy_config(listen_port=first.port, epp_port=first.epp_port, admin_port=admin_port)
    main = config["static_resources"]["listeners"][0]
    main["name"] = first.name
    first.cluster = "epp"
    epp_cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "epp")
    if first.tls is not None:
        epp_cluster["transport_socket"] = first.tls
    for route in rest:  # copies of the main listener: before it is changed
        add_epp_listener(config, route.name, route.port, route.epp_port)
        route.cluster = route.name
        listener = _listener(config, route.name)
        listener["address"]["socket_address"]["address"] = "127.0.0.1"
        cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == route.name)
        if route.tls is not None:
            cluster["transport_socket"] = route.tls
        if route.health_port is not None:
            _health_checks(cluster, route.health_port, tls=route.tls is not None)
        if route.fail_open:
            _fail_open(_ext_proc(listener))
    if first.fail_open:
        _fail_open(_ext_proc(main))
    return config


def _health_checks(cluster: dict[str, Any], port: int, tls: bool) -> None:
    """gRPC health checks on the EPP's health port, the way
    manifests/helm/inferencepool/templates/envoy-config.yaml sets them up."""
    check: dict[str, Any] = {
        "timeout": "1s",
        "interval": "0.2s",
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
    }
    if tls:
        check["transport_socket_match_criteria"] = {"health": "plaintext"}
        cluster["transport_socket_matches"] = [
            {
                "name": "plaintext-health-checks",
                "match": {"health": "plaintext"},
                "transport_socket": {
                    "name": "envoy.transport_sockets.raw_buffer",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets"
                        ".raw_buffer.v3.RawBuffer"
                    },
                },
            }
        ]
    cluster["health_checks"] = [check]
    for endpoint in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
        endpoint["endpoint"]["health_check_config"] = {"port_value": port}


def _fail_open(ext_proc: dict[str, Any]) -> None:
    # Envoy fails open only outside FULL_DUPLEX_STREAMED request bodies.
    ext_proc["typed_config"]["failure_mode_allow"] = True
    ext_proc["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERED"


@contextlib.contextmanager
def security_stack(
    workdir: Path,
    epp_args: dict[str, Sequence[str]],
    routes: Sequence[tuple[str, str, dict[str, Any] | None, bool]],
    config_text: str = CONFIG,
    health_checked: Sequence[str] = (),
) -> Iterator[SecurityStack]:
    """Upstreams, one `epp serve` per entry of `epp_args` (name -> extra flags), and
    one Envoy with a listener per route (name, EPP name, TLS socket, FailOpen); the
    routes named in `health_checked` (not the first) get Envoy's health checks."""
    with contextlib.ExitStack() as cleanup:
        upstreams = Upstreams(3).start()
        cleanup.callback(upstreams.stop)
        endpoints = write_endpoints_file(
            workdir / "endpoints.yaml", [(u.name, u.address) for u in upstreams]
        )
        config = workdir / "config.yaml"
        config.write_text(config_text)
        epps: dict[str, EppPorts] = {}
        for name, args in epp_args.items():
            process, ports = start_epp_on_free_ports(
                endpoints, workdir / name, config_file=config, extra_args=list(args)
            )
            cleanup.callback(process.stop)
            epps[name] = ports
        # Envoy's ports drawn together, so no two of its listeners get the same
        # one (drawn one at a time, two once did, and Envoy refused the config).
        *listen_ports, admin_port = free_ports(len(routes) + 1)
        planned = [
            Route(
                name,
                epps[epp].grpc,
                port,
                tls,
                fail_open,
                health_port=epps[epp].health if name in health_checked else None,
            )
            for (name, epp, tls, fail_open), port in zip(routes, listen_ports, strict=True)
        ]
        envoy = start_envoy(envoy_with_routes(planned, admin_port), workdir / "envoy")
        cleanup.callback(envoy.stop)
        yield SecurityStack(
            upstreams, epps, {r.name: r for r in planned}, envoy, admin_port, workdir
        )
