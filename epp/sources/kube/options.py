"""The Kubernetes endpoint source's settings: plain values, cheap to import.

The official client takes half a second to import; the command line, the
static-file EPP and `epp validate` need only this module, so they never pay it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from epp import defaults
from epp.sources.kube.objects import POOL_VERSIONS, V1_GROUP, KvEventPorts


class KubeConfigError(Exception):
    """No usable client configuration (no in-cluster service account, no kubeconfig)."""


@dataclass(frozen=True)
class WatchSettings:
    """How lists and watches are timed and retried (`reflector.py`)."""

    # The server ends each watch after timeoutSeconds, drawn from [T, 2T).
    watch_timeout_s: float = defaults.KUBE_WATCH_TIMEOUT.seconds
    # The read timeout on a watch: timeoutSeconds plus this. A silent connection
    # beyond it is dead.
    read_grace_s: float = 15.0
    connect_timeout_s: float = 5.0
    # The read timeout of a list.
    list_timeout_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    # A watch that ends cleanly sooner than this without any event is treated as an
    # error (backed off), so a server that closes watches at once is not hammered.
    min_watch_s: float = 1.0


@dataclass(frozen=True)
class KubeOptions:
    """The Kubernetes endpoint source's settings (from the command line)."""

    pool_name: str | None = None
    pool_namespace: str = defaults.POOL_NAMESPACE
    pool_group: str = V1_GROUP
    endpoint_selector: Mapping[str, str] | None = None
    endpoint_target_ports: tuple[int, ...] = ()
    kubeconfig: str | None = None
    kv_events: KvEventPorts = field(default_factory=KvEventPorts)
    watch: WatchSettings = field(default_factory=WatchSettings)

    def check(self) -> list[str]:
        """Problems with the combination of settings (empty: fine)."""
        problems: list[str] = []
        standalone = self.endpoint_selector is not None or bool(self.endpoint_target_ports)
        if self.pool_name and standalone:
            problems.append(
                "--pool-name and --endpoint-selector/--endpoint-target-ports are exclusive:"
                " the InferencePool gives the selector and ports"
            )
        elif not self.pool_name:
            if self.endpoint_selector is None:
                problems.append("standalone Kubernetes mode needs --endpoint-selector k=v,...")
            if not self.endpoint_target_ports:
                problems.append("standalone Kubernetes mode needs --endpoint-target-ports PORT")
        if self.kv_events.replay_port is not None and self.kv_events.port is None:
            problems.append("--kv-events-replay-port needs --kv-events-port")
        if self.pool_name and self.pool_group not in POOL_VERSIONS:
            problems.append(
                f"--pool-group {self.pool_group!r}: expected one of {', '.join(POOL_VERSIONS)}"
            )
        return problems

    def describe(self) -> str:
        if self.pool_name:
            return f"InferencePool {self.pool_namespace}/{self.pool_name} ({self.pool_group})"
        selector = ",".join(f"{k}={v}" for k, v in sorted((self.endpoint_selector or {}).items()))
        ports = ",".join(str(p) for p in self.endpoint_target_ports)
        return f"pods {selector} in namespace {self.pool_namespace!r}, ports {ports}"
