"""`endpoint-notification-source`: tells its extractors when an endpoint joins the
pool and when it leaves (llm-d's data source of the same name).

A data source (`dataLayer.sources[].pluginRef`) that takes endpoint extractors:
plugins with `endpoint_event(event, endpoint)`, such as
`precise-prefix-cache-producer`, which subscribes to a joining pod's KV events and
drops a leaving pod's. Other extractors are refused (a `core-metrics-extractor`
reads /metrics pages: it belongs to `metrics-data-source`). No parameters.

Its work is a small service, run by the server while the config is in use: at
start every endpoint already in the pool is announced as added, then each change
the datastore reports (the endpoints file, Kubernetes) as it happens, the removed
endpoints of a change before the added ones. An extractor that fails is logged
and the others still hear of the change. Building starts nothing, so `epp validate`
and a config being replaced by a reload send no notifications.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from epp.datastore import Datastore, Endpoint
from epp.scheduling import NoParameters, PluginContext, ServiceContext

log = logging.getLogger(__name__)


class EndpointEvent(enum.Enum):
    """What happened to an endpoint (llm-d's EndpointEvent types)."""

    ADD_OR_UPDATE = "add-or-update"
    DELETE = "delete"


@runtime_checkable
class EndpointExtractor(Protocol):
    """A plugin that wants to hear of endpoints joining and leaving the pool. Called
    on the event loop, synchronously, as the datastore changes: it must be quick
    and must not block."""

    def endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None: ...


class EndpointNotifier:
    """Delivers the datastore's endpoint changes to extractors while it runs."""

    def __init__(self, datastore: Datastore, name: str) -> None:
        self.datastore = datastore
        self.name = name
        self.extractors: list[EndpointExtractor] = []

    async def run(self) -> None:
        self._changed(list(self.datastore.all_endpoints()), [])
        self.datastore.add_listener(self._changed)
        try:
            await asyncio.Event().wait()
        finally:
            self.datastore.remove_listener(self._changed)

    def _changed(self, added: Iterable[Endpoint], removed: Iterable[Endpoint]) -> None:
        for event, endpoints in (
            (EndpointEvent.DELETE, removed),
            (EndpointEvent.ADD_OR_UPDATE, added),
        ):
            for endpoint in endpoints:
                for extractor in self.extractors:
                    try:
                        extractor.endpoint_event(event, endpoint)
                    except Exception:
                        log.exception(
                            "%s: an extractor failed on %s %s",
                            self.name,
                            event.value,
                            endpoint.name,
                        )

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, Any]:
        return {}

    def collector(self) -> None:
        return None


def endpoint_notifier(params: NoParameters, context: ServiceContext) -> EndpointNotifier:
    return EndpointNotifier(context.datastore, context.name)


class EndpointNotificationSource:
    Parameters = NoParameters
    # Built by the framework, run by the server while the config is in use.
    Service = staticmethod(endpoint_notifier)

    def __init__(self, params: NoParameters, context: PluginContext) -> None:
        assert isinstance(context.service, EndpointNotifier)
        self.notifier: EndpointNotifier = context.service

    def add_extractor(self, extractor: object) -> None:
        if not isinstance(extractor, EndpointExtractor):
            raise ValueError(
                f"{type(extractor).__name__} does not take endpoint events:"
                " endpoint-notification-source takes endpoint extractors"
                " (precise-prefix-cache-producer)"
            )
        if extractor not in self.notifier.extractors:
            self.notifier.extractors.append(extractor)
