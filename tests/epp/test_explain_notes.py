"""Plugins' notes for /debug/explain are kept on an explained pick only: a routed
request's pick builds none (nobody reads them), an explained one shows them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import EXPLAIN_NOTES, CycleState, explain_note, explaining
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import UNEXPLAINED, ResponseInfo
from epp.telemetry import Telemetry

CONFIG = Path(__file__).resolve().parents[2] / "manifests" / "config" / "predicted-ttft.yaml"


def test_a_routed_pick_keeps_no_notes_and_an_explained_one_does() -> None:
    datastore = Datastore()
    datastore.replace_all(EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(3))
    config = load_config(
        CONFIG.read_text(), PluginRegistry.from_entry_points(), datastore=datastore
    )
    director = Director(datastore, config, Telemetry(datastore))
    body = b'{"model": "m", "prompt": "a prompt that no pod has seen yet"}'

    def request() -> InferenceRequest:
        return parse_request(
            request_id="r", method="POST", path="/v1/completions", headers={}, body=body
        )

    decision = asyncio.run(director.pick_endpoint(request()))
    assert decision.cycle.get(EXPLAIN_NOTES) is None
    director.finish(decision, ResponseInfo(completed=True))
    explained = asyncio.run(director.explain(request()))
    notes = explained["notes"]["predicted-ttft-scorer"]
    assert set(notes) == {"pod-0", "pod-1", "pod-2"}
    assert notes["pod-0"]["predictedTtftMs"] > 0


def test_explain_note_is_a_no_op_on_an_unexplained_cycle() -> None:
    cycle = CycleState()
    assert explaining(cycle)
    explain_note(cycle, "p", {"a": 1})
    assert cycle.get(EXPLAIN_NOTES) == {"p": {"a": 1}}
    quiet = CycleState()
    quiet.put(UNEXPLAINED, True)
    assert not explaining(quiet)
    explain_note(quiet, "p", {"a": 1})
    assert quiet.get(EXPLAIN_NOTES) is None
