"""The first response chunk's hooks: run at once, or deferred until the caller has
handed the chunk on (what the ext_proc stream does, so that a plugin's work there,
the predicted-TTFT producer's fit, does not delay the client's first token)."""

from __future__ import annotations

import asyncio

from epp.clock import VirtualClock
from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Decision, Director
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry
from tests.epp.extproc.sample_plugins import MODULE, Recorder, config


class Setup:
    def __init__(self) -> None:
        self.clock = VirtualClock(100.0)
        datastore = Datastore()
        datastore.replace_all([EndpointSpec("pod-a", "10.0.0.1:8000")])
        built = load_config(
            config(("recorder", f"{MODULE}:Recorder")),
            PluginRegistry.from_entry_points(),
            datastore=datastore,
            clock=self.clock,
        )
        self.director = Director(datastore, built, Telemetry(datastore), clock=self.clock)
        recorder = built.plugins["recorder"]
        assert isinstance(recorder, Recorder)
        self.recorder = recorder

    async def pick(self, request_id: str) -> Decision:
        request = parse_request(
            request_id=request_id,
            method="POST",
            path="/v1/completions",
            headers={},
            body=b'{"model": "m", "prompt": "hello"}',
        )
        return await self.director.pick_endpoint(request)


async def test_deferred_hooks_run_on_the_next_turn_with_the_chunks_own_time() -> None:
    setup = Setup()
    decision = await setup.pick("r1")
    setup.clock.advance(0.25)
    setup.director.first_chunk(decision, defer=True)
    assert decision.first_chunk_at == 100.25
    assert setup.recorder.first_chunks == []  # not yet: the chunk goes on first
    setup.clock.advance(1.0)  # however late the hooks run, the chunk came at 0.25 s
    await asyncio.sleep(0)
    assert setup.recorder.first_chunks == [("r1", 0.25)]
    setup.director.first_chunk(decision, defer=True)  # a later chunk: nothing
    await asyncio.sleep(0)
    assert setup.recorder.first_chunks == [("r1", 0.25)]


async def test_an_end_before_the_deferred_hooks_runs_them_first_and_once() -> None:
    setup = Setup()
    decision = await setup.pick("r2")
    setup.clock.advance(0.5)
    setup.director.first_chunk(decision, defer=True)
    # The only chunk was also the last: the end comes in the same turn.
    setup.director.finish(decision, ResponseInfo(completed=True))
    assert setup.recorder.events == [("first_chunk", "r2"), ("post_response", "r2")]
    await asyncio.sleep(0)  # the deferred call finds nothing left to do
    assert setup.recorder.events == [("first_chunk", "r2"), ("post_response", "r2")]
    assert setup.recorder.first_chunks == [("r2", 0.5)]


async def test_without_defer_the_hooks_run_at_once() -> None:
    setup = Setup()
    decision = await setup.pick("r3")
    setup.director.first_chunk(decision)
    assert setup.recorder.first_chunks == [("r3", 0.0)]
