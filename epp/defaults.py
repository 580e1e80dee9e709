"""Server-wide defaults, each defined once.

A value here is what `epp serve` uses when its flag is not given. The same value
is the default of whatever carries the setting without the command line
(`ServeOptions`, `ServerSettings`, the config reloader, ...), so each of those
imports it from here: a flag and the object built without it cannot drift apart.

Durations are written as the flags write them (Go syntax, "50ms"): `text` is what
`epp serve --help` shows, `seconds` what the code uses.

This module imports nothing of the EPP but `epp.durations`, so any module may
import it without a cycle. Defaults of the config file (implied plugins, weights)
live with the config loader, in `epp.config.defaults`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from epp.durations import parse_duration


@dataclass(frozen=True, slots=True)
class DurationDefault:
    """A default duration, kept as the flag writes it."""

    text: str

    @property
    def seconds(self) -> float:
        return parse_duration(self.text)


# Network (GIE's ports).
BIND: Final = "0.0.0.0"
GRPC_PORT: Final = 9002  # ext_proc (and lean mode's access log)
GRPC_HEALTH_PORT: Final = 9003  # gRPC health checking
METRICS_PORT: Final = 9090  # admin HTTP: /metrics, /healthz, /readyz, /debug/*
# On SIGTERM, how long open streams may take to finish.
SHUTDOWN_GRACE: Final = DurationDefault("5s")

# ext_proc streams served at once (0: no limit).
MAX_CONCURRENT_STREAMS: Final = 0

# The --config file: how often it is checked for a new version (0: never), and
# how long a replaced config's background tasks may outlive it while requests
# still hold it.
CONFIG_RELOAD_INTERVAL: Final = DurationDefault("1s")
CONFIG_DRAIN_TIMEOUT: Final = DurationDefault("10m")

# Model-server metrics (GIE's flags): the scrape period, the age past which a
# snapshot is not trusted, and how long one scrape may take.
REFRESH_METRICS_INTERVAL: Final = DurationDefault("50ms")
METRICS_STALENESS_THRESHOLD: Final = DurationDefault("2s")
METRICS_SCRAPE_TIMEOUT: Final = DurationDefault("1s")

# A pod whose oldest request has waited this long for its first token, with no
# progress there for as long, is stalled (epp/stalls.py; 0: never).
STALL_THRESHOLD: Final = DurationDefault("30s")

# Kubernetes discovery: the namespace of the pool when $NAMESPACE is unset, and
# the server-side watch timeout (each watch ends after a time in [T, 2T)).
POOL_NAMESPACE: Final = "default"
KUBE_WATCH_TIMEOUT: Final = DurationDefault("60s")

# Logging: the format, and the verbosity (2: info).
LOG_FORMAT: Final = "text"
LOG_VERBOSITY: Final = 2
