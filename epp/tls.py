"""TLS for the ext_proc gRPC server (`--secure-serving`), in GIE's terms.

- `--secure-serving`: the ext_proc port (and the access-log service beside it, lean
  mode) speaks TLS. GIE's EPP does this by default; this one serves plaintext
  unless told, because every Envoy configuration it ships (manifests/envoy/, the
  Helm chart's standalone Envoy unless `secureServing.enabled`) talks plaintext to
  it. The gRPC health port stays plaintext (the kubelet's gRPC probes cannot speak
  TLS), and so does the admin HTTP port.
- `--cert-path DIR`: the certificate and key, `DIR/tls.crt` and `DIR/tls.key` (PEM,
  the layout of a Kubernetes `kubernetes.io/tls` Secret mounted as a volume).
  Without it a self-signed certificate is made at start-up, in memory only, as GIE
  does: the connection is encrypted but the proxy cannot authenticate the EPP
  (Envoy's UpstreamTlsContext without a validation context accepts it).
- `--enable-cert-reload`: the files under `--cert-path` are watched; a renewed pair
  (cert-manager, a rotated Secret) serves new connections without a restart.
  Connections already open keep the certificate they were made with. A pair that
  does not load is logged and the previous one stays in use.

Everything about the files is checked before a port is opened (`load_pair`), so a
wrong path or a key that does not match its certificate stops the start with a
message that says which.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"
# The self-signed certificate's lifetime. It lives as long as the process, so this
# only needs to outlast any pod.
SELF_SIGNED_DAYS: Final = 365


class TlsError(Exception):
    """The certificate or key cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class CertificatePair:
    cert_pem: bytes  # the certificate, then any intermediates
    key_pem: bytes
    source: str  # where it came from, for log lines ("self-signed", a directory)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])

    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def self_signed(hosts: Sequence[str] = ()) -> CertificatePair:
    """A new self-signed certificate for `hosts` (DNS names or IP addresses; the
    machine's host name, `localhost` and 127.0.0.1 are always added).

    ECDSA P-256: made in a millisecond (an RSA-4096 key takes about a second of
    CPU at every start) and accepted by Envoy's and gRPC's TLS alike."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[str] = list(dict.fromkeys([*hosts, socket.gethostname(), "localhost"]))
    alt: list[x509.GeneralName] = []
    for name in [*names, "127.0.0.1"]:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "envoy-epp"),
            x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64]),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # A little in the past: a peer whose clock is slightly behind must not see a
        # certificate from the future.
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return CertificatePair(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        "self-signed",
    )


def load_pair(cert_dir: str | Path) -> CertificatePair:
    """`cert_dir/tls.crt` and `cert_dir/tls.key`, checked: both PEM, the key
    unencrypted and matching the certificate. Raises `TlsError`."""
    directory = Path(cert_dir)
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    try:
        cert_pem = cert_path.read_bytes()
        key_pem = key_path.read_bytes()
    except OSError as exc:
        raise TlsError(
            f"--cert-path {directory}: cannot read {exc.filename}: {exc.strerror}"
            f" (the directory must hold {CERT_FILE} and {KEY_FILE})"
        ) from None
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as exc:
        raise TlsError(f"{cert_path}: not a PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise TlsError(f"{key_path}: the key is encrypted; give it unencrypted") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TlsError(f"{key_path}: not a PEM private key ({exc})") from None
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    leaf = (
        certs[0]
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    if public != leaf:
        raise TlsError(f"{key_path} is not the key of the certificate in {cert_path}")
    return CertificatePair(cert_pem, key_pem, str(directory))


def _signature(cert_dir: Path) -> tuple[tuple[int, int, int], ...] | None:
    """What changes when either file is replaced (a Secret update swaps a symlink,
    which changes the inode as well as the time)."""
    try:
        stats = [os.stat(cert_dir / name) for name in (CERT_FILE, KEY_FILE)]
    except OSError:
        return None
    return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)


class ReloadingCertificate:
    """Server credentials that pick up a renewed pair from `cert_dir` at the next
    TLS handshake (gRPC asks at each one; a `stat` of two files is all it costs
    when nothing changed)."""

    def __init__(self, cert_dir: str | Path, initial: CertificatePair) -> None:
        self.cert_dir = Path(cert_dir)
        self.current = initial
        self._seen = _signature(self.cert_dir)
        self.reloads = 0
        self.failures = 0

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self.current), self._fetch, require_client_authentication=False
        )

    @staticmethod
    def _configuration(pair: CertificatePair) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(pair.key_pem, pair.cert_pem)])

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before a handshake: a new configuration, or None to keep
        the current one. Never raises (gRPC would fail the handshake)."""
        try:
            signature = _signature(self.cert_dir)
            if signature is None or signature == self._seen:
                return None
            self._seen = signature
            try:
                pair = load_pair(self.cert_dir)
            except TlsError as exc:
                self.failures += 1
                log.error("TLS certificate reload failed, the previous one stays: %s", exc)
                return None
            self.current = pair
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.cert_dir)
            return self._configuration(pair)
        except Exception:
            log.exception("TLS certificate reload failed, the previous one stays")
            return None
