"""TLS between a real Envoy and `epp serve --secure-serving`: Envoy's ext_proc
cluster with an UpstreamTlsContext, as GIE deploys it (a self-signed certificate,
accepted without verification), and verified against a CA (`--cert-path`); an
Envoy that trusts another CA, or speaks plaintext, gets no decision."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.epp.tls_support import SERVER_NAME, TestCa, write_cert_dir
from tests.integration.listeners import SecurityStack, security_stack, tls_transport_socket
from tests.integration.upstream import NAME_HEADER

BODY = {"model": "m", "prompt": "hello over TLS"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecurityStack]:
    workdir = tmp_path_factory.mktemp("tls")
    ca = TestCa()
    ca_file = workdir / "ca.crt"
    ca_file.write_bytes(ca.pem)
    other_ca_file = workdir / "other-ca.crt"
    other_ca_file.write_bytes(TestCa("an unrelated CA").pem)
    certs = write_cert_dir(workdir / "certs", ca.issue(SERVER_NAME))
    with security_stack(
        workdir,
        {
            "self-signed": ["--secure-serving"],
            "ca-signed": ["--secure-serving", "--cert-path", str(certs)],
        },
        [
            # name, EPP, Envoy's TLS to it, FailOpen
            ("gie-style", "self-signed", tls_transport_socket(), False),
            ("verified", "ca-signed", tls_transport_socket(ca_file, SERVER_NAME), False),
            ("wrong-ca", "ca-signed", tls_transport_socket(other_ca_file, SERVER_NAME), False),
            ("plaintext", "ca-signed", None, False),
            # The Helm chart's Envoy: TLS to the EPP, health checks in plaintext.
            ("chart-style", "self-signed", tls_transport_socket(), False),
        ],
        health_checked=["chart-style"],
    ) as running:
        yield running


async def post(stack: SecurityStack, route: str) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            stack.url(route), data=json.dumps(BODY), headers={"content-type": "application/json"}
        ) as response,
    ):
        return response.status, dict(response.headers), await response.read()


async def stat(stack: SecurityStack, route: str, name: str) -> int:
    """An Envoy counter of the route's ext_proc cluster (`ssl.handshake`, ...)."""
    full = f"cluster.{stack.routes[route].cluster}.{name}"
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{stack.envoy_admin_url}/stats", params={"filter": f"^{full}$"}) as r,
    ):
        text = await r.text()
    return int(text.split(":")[1]) if ":" in text else 0


async def routed(stack: SecurityStack, epp: str) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.admin_url(epp) + "/metrics") as response,
    ):
        text = await response.text()
    for line in text.splitlines():
        if line.startswith('epp_requests_total{outcome="routed"}'):
            return float(line.split()[-1])
    return 0.0


async def test_envoy_reaches_a_self_signed_epp_over_tls_as_gie_deploys_it(
    stack: SecurityStack,
) -> None:
    status, headers, _ = await post(stack, "gie-style")
    assert status == 200
    assert headers[NAME_HEADER] in {u.name for u in stack.upstreams}
    assert await routed(stack, "self-signed") >= 1
    # The stream really went over TLS.
    assert await stat(stack, "gie-style", "ssl.handshake") >= 1


async def test_envoy_verifies_the_epps_certificate_against_its_ca(stack: SecurityStack) -> None:
    status, headers, _ = await post(stack, "verified")
    assert status == 200
    assert headers[NAME_HEADER] in {u.name for u in stack.upstreams}
    assert await stat(stack, "verified", "ssl.handshake") >= 1


async def test_an_envoy_that_trusts_another_ca_gets_no_decision(stack: SecurityStack) -> None:
    before = await routed(stack, "ca-signed")
    status, _, _ = await post(stack, "wrong-ca")
    assert status == 500  # FailClose: no decision, no request
    assert await stat(stack, "wrong-ca", "ssl.fail_verify_error") >= 1
    assert await routed(stack, "ca-signed") == before


async def test_a_plaintext_envoy_gets_no_decision_from_a_tls_epp(stack: SecurityStack) -> None:
    before = await routed(stack, "ca-signed")
    status, _, _ = await post(stack, "plaintext")
    assert status == 500
    assert await routed(stack, "ca-signed") == before


def test_the_self_signed_certificate_is_made_at_start_up(stack: SecurityStack) -> None:
    log = Path(stack.workdir / "self-signed" / "epp.log").read_text()
    assert "ext_proc (TLS, certificate self-signed)" in log
    log = Path(stack.workdir / "ca-signed" / "epp.log").read_text()
    assert f"ext_proc (TLS, certificate {stack.workdir / 'certs'})" in log


async def test_health_checks_stay_plaintext_beside_a_tls_cluster(stack: SecurityStack) -> None:
    """What the Helm chart's standalone Envoy does with secureServing: the ext_proc
    streams over TLS, the gRPC health checks (port 9003, plaintext, like the
    kubelet's probes) through a transport socket match."""
    deadline = asyncio.get_running_loop().time() + 10
    while await stat(stack, "chart-style", "health_check.success") < 1:
        assert asyncio.get_running_loop().time() < deadline, "no successful health check"
        await asyncio.sleep(0.1)
    assert await stat(stack, "chart-style", "health_check.failure") == 0
    status, _, _ = await post(stack, "chart-style")
    assert status == 200
    assert await stat(stack, "chart-style", "ssl.handshake") >= 1
