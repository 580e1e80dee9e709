"""Config reload (`epp/reload.py`) in a running EPP: a changed `--config` file is
validated and swapped in for new requests while open streams finish on the config
that picked them; a bad file is refused with a log line and a metric, and the
running config keeps serving."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import grpc
import msgspec
import pytest

from epp import heap
from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.reload import BuiltConfig, ConfigRuntime, build_tracked
from epp.scheduling import (
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    ResponseInfo,
    SchedulingResult,
    ScoredEndpoint,
)
from epp.scheduling.registry import PluginRegistry
from epp.telemetry import Telemetry
from tests.epp.conftest import ENDPOINTS, Epp, StartEpp
from tests.epp.extproc import envoy_client as ec

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()
POD_A, POD_B = ENDPOINTS["pod-a"], ENDPOINTS["pod-b"]


class Pinned:
    """The service of `PinnedPicker`: runs while its config is in use, as a KV-event
    subscriber or a metrics scraper would."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        self.running.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.stopped.set()

    def describe_endpoint(self, endpoint: Endpoint) -> dict[str, object]:
        return {}

    def collector(self) -> None:
        return None


class PinnedPicker:
    """Picks the endpoint named in its parameters, records the requests that end
    through it, and has a service that runs while its config is in use."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True):
        endpoint: str

    Service = staticmethod(lambda params, context: Pinned())

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.endpoint = params.endpoint
        self.finished: list[str] = []
        assert isinstance(context.service, Pinned)
        self.running = context.service.running
        self.stopped = context.service.stopped

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        return [s.endpoint for s in scored if s.endpoint.name == self.endpoint]

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        self.finished.append(result.targets[0].name)


def pinned(endpoint: str) -> str:
    return f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: {__name__}:PinnedPicker
  name: pinned
  parameters: {{endpoint: {endpoint}}}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: pinned
"""


def replace(path: Path, text: str | bytes) -> None:
    """Write a new version the way editors and the kubelet do: a new file renamed
    over the old one (a new inode, so the change is seen at once)."""
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


async def start(start_epp: StartEpp, path: Path, text: str, **options: object) -> Epp:
    replace(path, text)
    return await start_epp(config_file=str(path), config_reload_interval_s=0.02, **options)


async def reloads(epp: Epp, result: str) -> float:
    return await epp.metric("epp_config_reloads_total", {"result": result})


async def wait_reloads(epp: Epp, result: str, count: int) -> None:
    assert await epp.wait_metric("epp_config_reloads_total", {"result": result}, count) == count


async def routed_to(epp: Epp) -> str:
    """Route one whole request; where it went."""
    stream = epp.stream()
    routed = await ec.route(stream, BODY)
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    return routed.destination


async def test_a_new_config_serves_new_requests_while_open_streams_keep_theirs(
    start_epp: StartEpp, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    epp = await start(start_epp, path, pinned("pod-a"))
    old: PinnedPicker = epp.plugin("pinned")
    await asyncio.wait_for(old.running.wait(), 5)
    open_stream = epp.stream()
    assert (await ec.route(open_stream, BODY)).destination == POD_A

    replace(path, pinned("pod-b"))
    await wait_reloads(epp, "applied", 1)
    new: PinnedPicker = epp.plugin("pinned")
    assert new is not old
    await asyncio.wait_for(new.running.wait(), 5)
    assert await routed_to(epp) == POD_B
    assert new.finished == ["pod-b"]
    # The open stream holds the old config: its tasks still run.
    assert await epp.metric("epp_configs_draining") == 1
    assert not old.stopped.is_set()

    # The open stream was not dropped: its response goes through, and its end is
    # handled by the config that picked it.
    assert await ec.respond(open_stream, [b'{"usage": null}']) == b'{"usage": null}'
    assert await open_stream.close() == grpc.StatusCode.OK
    assert old.finished == ["pod-a"]
    await asyncio.wait_for(old.stopped.wait(), 5)
    assert await epp.wait_metric("epp_configs_draining", None, 0) == 0
    assert await epp.metric("epp_config_last_reload_successful") == 1
    assert new.finished == ["pod-b"]


async def test_an_invalid_new_file_is_rejected_and_the_old_config_keeps_serving(
    start_epp: StartEpp, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epp.reload")
    path = tmp_path / "config.yaml"
    epp = await start(start_epp, path, pinned("pod-a"))
    running: PinnedPicker = epp.plugin("pinned")

    replace(path, pinned("pod-b").replace("endpoint: pod-b", "endpoint: pod-b, extra: 1"))
    await wait_reloads(epp, "rejected", 1)
    assert await epp.metric("epp_config_last_reload_successful") == 0
    assert "line 6: plugins[0].parameters" in caplog.text
    assert "the running config keeps serving" in caplog.text
    assert epp.plugin("pinned") is running
    assert await routed_to(epp) == POD_A
    assert not running.stopped.is_set()

    # Not even readable as text: rejected too.
    replace(path, b"\xff\xfe not utf-8")
    await wait_reloads(epp, "rejected", 2)
    assert "cannot read the file" in caplog.text
    assert await routed_to(epp) == POD_A

    # Fixed: applied.
    replace(path, pinned("pod-c"))
    await wait_reloads(epp, "applied", 1)
    assert await epp.metric("epp_config_last_reload_successful") == 1
    assert await routed_to(epp) == ENDPOINTS["pod-c"]
    assert await reloads(epp, "rejected") == 2


async def test_a_configmap_volume_update_is_applied(start_epp: StartEpp, tmp_path: Path) -> None:
    # The kubelet's layout: config.yaml -> ..data/config.yaml, ..data -> a
    # timestamped directory; an update writes a new directory and swaps ..data.
    volume = tmp_path / "volume"
    volume.mkdir()
    first = volume / "..2026_01_01_00_00_00.1"
    first.mkdir()
    (first / "config.yaml").write_text(pinned("pod-a"), encoding="utf-8")
    (volume / "..data").symlink_to(first.name)
    (volume / "config.yaml").symlink_to("..data/config.yaml")
    epp = await start_epp(config_file=str(volume / "config.yaml"), config_reload_interval_s=0.02)
    assert await routed_to(epp) == POD_A

    second = volume / "..2026_01_01_00_01_00.2"
    second.mkdir()
    (second / "config.yaml").write_text(pinned("pod-b"), encoding="utf-8")
    (volume / "..data_tmp").symlink_to(second.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    await wait_reloads(epp, "applied", 1)
    assert await routed_to(epp) == POD_B


async def test_the_same_content_is_not_rebuilt(start_epp: StartEpp, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    epp = await start(start_epp, path, pinned("pod-a"))
    running = epp.plugin("pinned")
    replace(path, pinned("pod-a"))
    await wait_reloads(epp, "unchanged", 1)
    assert epp.plugin("pinned") is running
    assert await reloads(epp, "applied") == 0


async def test_a_request_that_never_ends_cannot_hold_the_old_config_forever(
    start_epp: StartEpp, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    epp = await start(start_epp, path, pinned("pod-a"), config_drain_timeout_s=0.2)
    old: PinnedPicker = epp.plugin("pinned")
    stuck = epp.stream()
    assert (await ec.route(stuck, BODY)).destination == POD_A

    replace(path, pinned("pod-b"))
    await wait_reloads(epp, "applied", 1)
    # The drain timeout stops the old config's services ...
    await asyncio.wait_for(old.stopped.wait(), 5)
    assert await epp.wait_metric("epp_configs_draining", None, 0) == 0
    # ... but the request itself still ends normally, on its own config.
    await ec.respond(stuck, [b"{}"])
    assert await stuck.close() == grpc.StatusCode.OK
    assert old.finished == ["pod-a"]


async def test_many_streams_across_a_reload_all_complete(
    start_epp: StartEpp, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    epp = await start(start_epp, path, pinned("pod-a"))

    async def one(i: int) -> str:
        await asyncio.sleep(i * 0.002)
        return await routed_to(epp)

    tasks = [asyncio.create_task(one(i)) for i in range(60)]
    await asyncio.sleep(0.03)
    replace(path, pinned("pod-b"))
    destinations = await asyncio.gather(*tasks)
    await wait_reloads(epp, "applied", 1)
    # Every request was routed by one config or the other, none failed.
    assert set(destinations) <= {POD_A, POD_B}
    assert await routed_to(epp) == POD_B
    assert await epp.metric("epp_requests_total", {"outcome": "internal_error"}) == 0


async def test_a_retired_config_is_collected_though_epp_serve_froze_it() -> None:
    """`epp serve` freezes what it built at start-up (epp.heap), and the collector
    never frees a cycle holding a frozen object: a config retired by a reload (its
    services and the tasks running them refer to each other) must still go."""
    datastore = Datastore()
    datastore.replace_all(EndpointSpec(f"pod-{i}", f"127.0.0.1:{i + 1}") for i in range(3))
    text = (Path(__file__).parents[2] / "manifests" / "config" / "default.yaml").read_text()
    registry = PluginRegistry.from_entry_points()

    def build() -> BuiltConfig:
        return build_tracked(
            datastore,
            lambda metrics: load_config(text, registry, datastore=datastore, metrics=metrics),
        )

    first = build()
    telemetry = Telemetry(datastore)
    director = Director(datastore, first.config, telemetry)
    runtime = ConfigRuntime(director, datastore, telemetry, first)
    runtime.start()
    services = [weakref.ref(s) for s in first.config.services.values()]
    assert services
    del first
    await asyncio.sleep(0.05)  # the services running
    heap.freeze()
    try:
        runtime.swap(build())
        await asyncio.wait_for(asyncio.gather(*runtime._draining.values()), 5)
        await asyncio.sleep(0)  # the collection comes on a later turn of the loop
        assert [ref() for ref in services] == [None] * len(services)
        assert gc.get_freeze_count() > 0  # what is alive is frozen again
    finally:
        gc.unfreeze()
        await runtime.stop()
