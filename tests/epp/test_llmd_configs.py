"""llm-d-router's sample config (its `deploy/config/epp-config.yaml`: a decode
filter, the prefix-cache scorer with its approximate producer, the max-score
picker, under `apiVersion: llm-d.ai/...`) loads and runs unchanged, with what
each name means there. Written here with the same plugins and parameters."""

from __future__ import annotations

import asyncio

import pytest

from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry

EPP_CONFIG = """\
apiVersion: {api}
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: decode-filter
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""


@pytest.mark.parametrize("api", ["llm-d.ai/v1alpha1", "llm-d.ai/v1"])
def test_llm_d_sample_config_runs(api: str) -> None:
    datastore = Datastore()
    datastore.replace_all(
        [
            EndpointSpec("decode-0", "10.0.0.1:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("decode-1", "10.0.0.2:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("plain", "10.0.0.3:8000"),
            EndpointSpec("prefill", "10.0.0.4:8000", labels={"llm-d.ai/role": "prefill"}),
        ]
    )
    config = load_config(
        EPP_CONFIG.format(api=api), PluginRegistry.from_entry_points(), datastore=datastore
    )
    director = Director(datastore, config, Telemetry(datastore))

    def pick(prompt: str) -> str:
        request = parse_request(
            request_id="r",
            method="POST",
            path="/v1/completions",
            headers={},
            body=b'{"model": "m", "prompt": "%s"}' % prompt.encode(),
        )
        decision = asyncio.run(director.pick_endpoint(request))
        director.finish(decision, ResponseInfo(completed=True))
        return decision.endpoint.name

    # Unrelated prompts spread over the decode targets (ties broken at random); the
    # prefill pod is never one of them, an unlabelled pod is (it serves whole
    # requests).
    spread = {pick(f"prompt {i} " * 30) for i in range(40)}
    assert spread == {"decode-0", "decode-1", "plain"}
    # The approximate prefix index learnt the first pick: a shared long prefix stays.
    shared = {pick("shared system prompt " * 40 + f"question {i}") for i in range(12)}
    assert len(shared) == 1
