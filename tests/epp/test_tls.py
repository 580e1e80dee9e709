"""TLS on the ext_proc port (`--secure-serving`, `--cert-path`,
`--enable-cert-reload`): the certificate files, the self-signed certificate, and a
real EPP serving real gRPC over TLS."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec as keys
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp import tls
from epp.app import EppApp, ServeOptions, StartupError
from epp.cli import UsageError, build_parser, serve_options
from tests.epp.conftest import Epp, StartEpp, write_endpoints
from tests.epp.extproc import envoy_client as ec
from tests.epp.tls_support import (
    SERVER_NAME,
    TestCa,
    serial_of,
    served_certificate,
    write_cert_dir,
)

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


async def route_over_tls(epp: Epp, root_pem: bytes, server_name: str | None = None) -> ec.Routed:
    """One request over a TLS channel that trusts `root_pem` (and checks the
    server's name against `server_name`)."""
    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{epp.app.ports['grpc']}", grpc.ssl_channel_credentials(root_pem), options
    )
    try:
        stream = ec.EnvoyStream(channel)
        routed = await ec.route(stream, BODY)
        await ec.respond(stream, [b"{}"])
        assert await stream.close() == grpc.StatusCode.OK
        return routed
    finally:
        await channel.close()


# -- the certificate files -------------------------------------------------------------


def test_a_self_signed_certificate_names_this_host_and_matches_its_key() -> None:
    pair = tls.self_signed(["epp.example"])
    cert = pair.certificate()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"epp.example", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    now = datetime.datetime.now(datetime.UTC)
    assert cert.not_valid_before_utc < now < cert.not_valid_after_utc
    key = serialization.load_pem_private_key(pair.key_pem, password=None)
    assert key.public_key() == cert.public_key()
    # A fresh key every time: nothing is baked into the code.
    assert tls.self_signed().key_pem != pair.key_pem


def test_a_certificate_directory_loads(tmp_path: Path) -> None:
    issued = TestCa().issue(SERVER_NAME)
    pair = tls.load_pair(write_cert_dir(tmp_path, issued))
    assert (pair.cert_pem, pair.key_pem, pair.source) == (
        issued.cert_pem,
        issued.key_pem,
        str(tmp_path),
    )


@pytest.mark.parametrize(
    ("case", "mentions"),
    [
        ("no-dir", "cannot read"),
        ("no-key", "tls.key"),
        ("garbage-cert", "not a PEM certificate"),
        ("garbage-key", "not a PEM private key"),
        ("other-key", "is not the key of the certificate"),
        ("encrypted-key", "encrypted"),
    ],
)
def test_a_bad_certificate_directory_is_refused_with_the_reason(
    tmp_path: Path, case: str, mentions: str
) -> None:
    ca = TestCa()
    directory = write_cert_dir(tmp_path / "certs", ca.issue(SERVER_NAME))
    if case == "no-dir":
        directory = tmp_path / "missing"
    elif case == "no-key":
        (directory / "tls.key").unlink()
    elif case == "garbage-cert":
        (directory / "tls.crt").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n")
    elif case == "garbage-key":
        (directory / "tls.key").write_text("not a key")
    elif case == "other-key":
        (directory / "tls.key").write_bytes(ca.issue(SERVER_NAME).key_pem)
    elif case == "encrypted-key":
        key = keys.generate_private_key(keys.SECP256R1())
        (directory / "tls.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"secret"),
            )
        )
    with pytest.raises(tls.TlsError, match=mentions):
        tls.load_pair(directory)


def test_a_bad_certificate_stops_the_start_before_any_port_opens(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    write_endpoints(endpoints, {"a": "10.0.0.1:8000"})
    with pytest.raises(StartupError, match="cannot read"):
        EppApp(
            ServeOptions(
                endpoints_file=str(endpoints), secure_serving=True, cert_path=str(tmp_path / "x")
            )
        )


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--cert-path", "/certs"], "--cert-path is only read with --secure-serving"),
        (["--secure-serving", "--enable-cert-reload"], "--enable-cert-reload needs --cert-path"),
        (["--secure-serving=false", "--cert-path", "/certs"], "only read with --secure-serving"),
    ],
)
def test_tls_flags_that_would_silently_do_nothing_are_refused(
    flags: list[str], problem: str
) -> None:
    args = build_parser().parse_args(["serve", "--endpoints-file", "e.yaml", *flags])
    with pytest.raises(UsageError, match=problem):
        serve_options(args)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], False),
        (["--secure-serving"], True),
        (["--secure-serving=true"], True),
        (["--secure-serving=false"], False),
        (["--secure-serving", "false"], False),
    ],
)
def test_secure_serving_takes_gies_boolean_forms(flags: list[str], expected: bool) -> None:
    args = build_parser().parse_args(["serve", "--endpoints-file", "e.yaml", *flags])
    assert serve_options(args).secure_serving is expected


# -- a real EPP over TLS ------------------------------------------------------------------


async def test_self_signed_tls_serves_ext_proc_and_plaintext_is_refused(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(secure_serving=True)
    port = epp.app.ports["grpc"]
    served = await asyncio.to_thread(served_certificate, port)
    # The client trusts exactly the certificate served, and checks its name.
    routed = await route_over_tls(epp, served, "localhost")
    assert routed.destination in epp.addresses
    assert routed.body == BODY
    # A plaintext client gets nowhere.
    plain = epp.stream()  # the fixture's channel is plaintext
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await ec.route(plain, BODY)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    # The health port stays plaintext: the kubelet's gRPC probes cannot do TLS.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.app.ports['health']}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check  # type: ignore[no-untyped-call]
        answer = await check(health_pb2.HealthCheckRequest(service="liveness"))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert await epp.wait_in_flight(0) == 0


async def test_a_certificate_from_cert_path_is_served_and_verified(
    start_epp: StartEpp, tmp_path: Path
) -> None:
    ca = TestCa()
    certs = write_cert_dir(tmp_path / "certs", ca.issue(SERVER_NAME))
    epp = await start_epp(secure_serving=True, cert_path=str(certs))
    routed = await route_over_tls(epp, ca.pem, SERVER_NAME)
    assert routed.destination in epp.addresses
    # A client that trusts another CA refuses the EPP's certificate.
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await route_over_tls(epp, TestCa("another CA").pem, SERVER_NAME)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    # And one that expects another name, too.
    with pytest.raises(grpc.aio.AioRpcError):
        await route_over_tls(epp, ca.pem, "someone-else.example")


async def test_a_renewed_certificate_is_served_without_a_restart(
    start_epp: StartEpp, tmp_path: Path
) -> None:
    ca = TestCa()
    certs = write_cert_dir(tmp_path / "certs", ca.issue(SERVER_NAME))
    epp = await start_epp(secure_serving=True, cert_path=str(certs), enable_cert_reload=True)
    port = epp.app.ports["grpc"]
    first = serial_of(await asyncio.to_thread(served_certificate, port))
    await route_over_tls(epp, ca.pem, SERVER_NAME)

    # cert-manager renews the Secret: both files are replaced.
    renewed = ca.issue(SERVER_NAME)
    write_cert_dir(certs, renewed)
    os.utime(certs / "tls.crt", ns=(1, 1))  # a new signature even within one clock tick
    assert serial_of(await asyncio.to_thread(served_certificate, port)) == serial_of(
        renewed.cert_pem
    )
    assert serial_of(renewed.cert_pem) != first
    await route_over_tls(epp, ca.pem, SERVER_NAME)
    assert epp.app.cert_reloader is not None
    assert epp.app.cert_reloader.reloads == 1

    # A broken renewal is refused; the last good certificate stays in use.
    (certs / "tls.key").write_text("half-written")
    assert serial_of(await asyncio.to_thread(served_certificate, port)) == serial_of(
        renewed.cert_pem
    )
    await route_over_tls(epp, ca.pem, SERVER_NAME)
    assert epp.app.cert_reloader.failures == 1
