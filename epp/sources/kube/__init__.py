"""The Kubernetes endpoint source: pods of an InferencePool (or a label selector),
by list + watch through the official `kubernetes` client.

This package's top level holds only the settings (`options.py`) and the object
model (`objects.py`); the source itself (`source.py`, `reflector.py`, `errors.py`)
imports the official client, which takes half a second, so it is imported where
it is used: `from epp.sources.kube.source import KubernetesEndpointSource`.
"""

from epp.sources.kube.objects import KvEventPorts, PoolSpec
from epp.sources.kube.options import KubeConfigError, KubeOptions, WatchSettings

__all__ = ["KubeConfigError", "KubeOptions", "KvEventPorts", "PoolSpec", "WatchSettings"]
