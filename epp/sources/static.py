"""The static endpoint source: `--endpoints-file FILE`, re-read when it changes.

    endpoints:
    - name: sim-0                                # unique
      address: 127.0.0.1:8001                    # IP:port, where Envoy sends traffic
      metricsUrl: http://127.0.0.1:8001/metrics  # optional (this is the default)
      kvEvents: tcp://127.0.0.1:5557             # optional: the engine's KV-event PUB socket
      kvEventsReplay: tcp://127.0.0.1:5558       # optional: its replay ROUTER socket
      labels: {}                                 # optional

A file that is invalid at start-up stops the EPP with every error listed; a file
that becomes invalid later is logged and ignored, and the last good set stays.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from pathlib import Path

import msgspec
import yaml

from epp.datastore import Datastore, EndpointSpec

log = logging.getLogger(__name__)


class InvalidEndpointsFile(Exception):
    def __init__(self, path: str, errors: list[str]) -> None:
        self.path = path
        self.errors = errors
        listing = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{path}: invalid endpoints file:\n{listing}")


class _Entry(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    name: str
    address: str
    metrics_url: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    labels: dict[str, str] = {}


class _File(msgspec.Struct, forbid_unknown_fields=True):
    endpoints: list[_Entry]


def _address_error(address: str) -> str | None:
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return "must be IP:port"
    # An IPv6 address goes in brackets ([::1]:8000), an IPv4 one does not: that is the
    # form Envoy parses, and without brackets "::1:8000" would read as an address.
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        if ":" in host or "[" in host or "]" in host:
            return "must be IP:port, with an IPv6 address in brackets: [::1]:8000"
        # Envoy's original-destination cluster connects to the header's value as is:
        # it does not resolve names.
        return "must be an IP address and port, not a host name"
    if bracketed != (ip.version == 6):
        return "must be IP:port, with an IPv6 address (and only an IPv6 one) in brackets"
    return None


def parse_endpoints(text: str, source: str) -> list[EndpointSpec]:
    """The endpoints of an endpoints file, or `InvalidEndpointsFile` with every error."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidEndpointsFile(source, [f"not valid YAML: {exc}"]) from None
    try:
        parsed = msgspec.convert(document, _File)
    except msgspec.ValidationError as exc:
        raise InvalidEndpointsFile(source, [str(exc).replace("`$", "`endpoints file")]) from None
    errors: list[str] = []
    names: set[str] = set()
    addresses: dict[str, str] = {}
    specs = []
    for i, entry in enumerate(parsed.endpoints):
        where = f"endpoints[{i}]"
        if not entry.name:
            errors.append(f"{where}.name: must not be empty")
        elif entry.name in names:
            errors.append(f"{where}.name: duplicate name {entry.name!r}")
        names.add(entry.name)
        problem = _address_error(entry.address)
        if problem:
            errors.append(f"{where}.address: {entry.address!r} {problem}")
        elif entry.address in addresses:
            errors.append(
                f"{where}.address: {entry.address} is also the address of"
                f" {addresses[entry.address]!r}"
            )
        addresses.setdefault(entry.address, entry.name)
        for key, value in (
            ("kvEvents", entry.kv_events),
            ("kvEventsReplay", entry.kv_events_replay),
        ):
            if value is not None and "://" not in value:
                errors.append(f"{where}.{key}: {value!r} must be a ZMQ address like tcp://IP:port")
        specs.append(
            EndpointSpec(
                name=entry.name,
                address=entry.address,
                metrics_url=entry.metrics_url,
                kv_events=entry.kv_events,
                kv_events_replay=entry.kv_events_replay,
                labels=dict(entry.labels),
            )
        )
    if errors:
        raise InvalidEndpointsFile(source, errors)
    return specs


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class StaticEndpointSource:
    def __init__(
        self, path: str | Path, datastore: Datastore, poll_interval_s: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.datastore = datastore
        self.poll_interval_s = poll_interval_s
        self._signature: tuple[int, int, int] | None = None

    def _read(self) -> list[EndpointSpec]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidEndpointsFile(str(self.path), [f"cannot read the file: {exc}"]) from None
        return parse_endpoints(text, str(self.path))

    def not_ready_reason(self) -> str | None:
        return None if self.datastore.synced else f"{self.path} has not been loaded"

    def load(self) -> None:
        """Read the file now and apply it; raises `InvalidEndpointsFile`."""
        self._signature = _signature(self.path)
        specs = self._read()
        self.datastore.replace_all(specs)
        log.info("loaded %d endpoints from %s", len(specs), self.path)

    async def run(self) -> None:
        """Re-read the file whenever it changes (polled: it works on every
        filesystem, Kubernetes ConfigMap volumes included)."""
        while True:
            await asyncio.sleep(self.poll_interval_s)
            signature = _signature(self.path)
            if signature is None or signature == self._signature:
                continue
            self._signature = signature
            try:
                specs = await asyncio.to_thread(self._read)
            except InvalidEndpointsFile as exc:
                # Reported once per version of the file.
                log.error(
                    "%s; keeping the previous %d endpoints",
                    exc,
                    len(self.datastore.all_endpoints()),
                )
                continue
            self.datastore.replace_all(specs)
            log.info("reloaded %d endpoints from %s", len(specs), self.path)
