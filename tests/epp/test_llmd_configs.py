"""llm-d-router's sample configs load and run unchanged, with what each name means
there. Written here with the same plugins and parameters: `deploy/config/
epp-config.yaml` (a decode filter, the prefix-cache scorer with its approximate
producer, the max-score picker, under `apiVersion: llm-d.ai/...`),
`sim-epp-no-hit-lru.yaml` (the no-hit LRU scorer beside a precise prefix scorer)
and `epp-burst-prefix-cache-config.yaml` (bursts co-located by the burst producer,
read by the prefix-cache scorer); and the shipped configs modelled on llm-d's:
the optimized baseline and `pd-epp-config.yaml`'s prefill/decode disaggregation
(manifests/config/llm-d-pd.yaml)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from epp.cli import main as cli_main
from epp.config import load_config
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.director import Director
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import CycleState, PluginContext, PrefixMatchInfo, prefix_match_key
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


# llm-d's newer samples use two plugin types this EPP does not have (README,
# "Configs written for llm-d-router"): its precise producer, which keys blocks by
# its own hash of the engines' token ids, and its token producer, which asks a vLLM
# server to tokenize. The tests below stand in for them where the registry lacks
# them, with their parameters: the precise producer as a pool without KV events yet
# (a match info with no hit), the token producer as a no-op (this EPP's producers
# estimate tokens from the text). What is tested is everything else in the files.


class _ColdPrecisePrefixProducer:
    """`precise-prefix-cache-producer` before any KV event: nothing is cached."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        token_processor_config: dict[str, Any] = msgspec.field(default_factory=dict)

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.key = prefix_match_key(context.name)
        self.block_size = int(params.token_processor_config.get("blockSizeTokens", 16))

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        cycle.put(self.key, PrefixMatchInfo(4, self.block_size, {}))


class _VllmConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str


class _NoOpTokenProducer:
    """`token-producer`, taking its parameters and producing nothing."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        model_name: str
        vllm: _VllmConfig

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        pass

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        return None


def llm_d_registry() -> PluginRegistry:
    registry = PluginRegistry.from_entry_points()
    known = set(registry.known_types())
    for type_name, stand_in in (
        ("precise-prefix-cache-producer", _ColdPrecisePrefixProducer),
        ("token-producer", _NoOpTokenProducer),
    ):
        if type_name not in known:
            registry.register(type_name, stand_in)
    return registry


def llm_d_pool() -> Datastore:
    datastore = Datastore()
    datastore.replace_all(
        [
            EndpointSpec("decode-0", "10.0.0.1:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("decode-1", "10.0.0.2:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("plain", "10.0.0.3:8000"),
            EndpointSpec("prefill", "10.0.0.4:8000", labels={"llm-d.ai/role": "prefill"}),
        ]
    )
    return datastore


def completion(prompt: str) -> InferenceRequest:
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={},
        body=msgspec.json.encode({"model": "m", "prompt": prompt}),
    )


# The structure of llm-d-router's deploy/config/sim-epp-no-hit-lru.yaml: the same
# plugin types, names, parameters and profiles (its comments left out).
SIM_EPP_NO_HIT_LRU = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSizeTokens: 5
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
- type: no-hit-lru-scorer
  parameters:
    lruSize: 2048
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
  - pluginRef: no-hit-lru-scorer
    weight: 1
"""


def test_llm_d_no_hit_lru_sample_config_runs() -> None:
    datastore = llm_d_pool()
    config = load_config(SIM_EPP_NO_HIT_LRU, llm_d_registry(), datastore=datastore)
    director = Director(datastore, config, Telemetry(datastore))

    def pick(prompt: str) -> str:
        decision = asyncio.run(director.pick_endpoint(completion(prompt)))
        director.finish(decision, ResponseInfo(completed=True))
        return decision.endpoint.name

    # Nothing is cached anywhere, so every request is cold: the prefix scorer ties
    # and the no-hit LRU sends each to the decode target that had a cold request
    # longest ago. Never the prefill pod.
    picks = [pick(f"prompt {i} " * 10) for i in range(9)]
    assert set(picks[:3]) == {"decode-0", "decode-1", "plain"}
    assert picks[3:6] == picks[:3] == picks[6:]


# The structure of llm-d-router's deploy/config/epp-burst-prefix-cache-config.yaml:
# the same plugin types, names, parameters and profiles (its comments left out).
EPP_BURST_PREFIX_CACHE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: hf-repo/model-name
      vllm:
        url: http://<vllm-service>.<namespace>.svc.cluster.local:8000
  - type: single-profile-handler
  - type: decode-filter
  - type: burst-prefix-cache-producer
    parameters:
      windowDurationMs: 100
      maxPerReplica: -1
      minColocateBlocks: 0
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: burst-prefix-cache-producer
  - type: load-aware-scorer
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: decode-filter
      - pluginRef: prefix-cache-scorer
        weight: 2.0
      - pluginRef: load-aware-scorer
        weight: 1.0
      - pluginRef: max-score-picker
"""


def test_llm_d_burst_prefix_cache_sample_config_runs() -> None:
    datastore = llm_d_pool()
    config = load_config(EPP_BURST_PREFIX_CACHE, llm_d_registry(), datastore=datastore)
    director = Director(datastore, config, Telemetry(datastore))

    async def burst(prompts: list[str]) -> list[str]:
        """Requests arriving together: one batch window (100 ms, on the wall clock)."""
        decisions = await asyncio.gather(*(director.pick_endpoint(completion(p)) for p in prompts))
        for decision in decisions:
            director.finish(decision, ResponseInfo(completed=True))
        return [d.endpoint.name for d in decisions]

    # The samples of one rollout group: one prompt, one endpoint.
    group = "solve: " + "a long shared problem statement " * 20
    (target,) = set(asyncio.run(burst([group] * 8)))
    assert target != "prefill"
    # Two groups in one window: each kept whole, on two endpoints.
    one, two = "first " * 80, "second " * 80
    picks = asyncio.run(burst([one, two] * 4))
    assert len(set(picks[0::2])) == len(set(picks[1::2])) == 1
    assert picks[0] != picks[1]
    assert "prefill" not in picks


def test_llm_d_optimized_baseline_manifest_sticks_and_balances() -> None:
    """manifests/config/llm-d-optimized-baseline.yaml: a shared prefix stays on the
    endpoint that holds it; cold requests go where the fewest tokens are in flight."""
    path = Path(__file__).resolve().parents[2] / "manifests/config/llm-d-optimized-baseline.yaml"
    # Seeded, so that the 1% exploration draw is the same on every run.
    text = path.read_text().replace(
        "explorationProbability: 0.01", "explorationProbability: 0.01\n    seed: 1"
    )
    datastore = Datastore()
    datastore.replace_all([EndpointSpec(f"pod-{i}", f"10.0.0.{i}:8000") for i in range(3)])
    config = load_config(text, PluginRegistry.from_entry_points(), datastore=datastore)
    director = Director(datastore, config, Telemetry(datastore))

    def start(prompt: str) -> str:
        """Route a request and leave it in flight."""
        return asyncio.run(director.pick_endpoint(completion(prompt))).endpoint.name

    system = "system: " + "follow these rules " * 1500  # about 7000 tokens
    warm = {start(system + f"question {i} " * 30) for i in range(12)}
    assert len(warm) == 1
    # The warm endpoint holds 12 requests' tokens: unrelated prompts go elsewhere,
    # then to the endpoint with fewer tokens in flight.
    cold = [start(f"unrelated {i} " * 400) for i in range(2)]
    assert warm.isdisjoint(cold)
    assert len(set(cold)) == 2


PD_CONFIG = Path(__file__).resolve().parents[2] / "manifests/config/llm-d-pd.yaml"


def test_llm_d_pd_manifest_validates(capsys: pytest.CaptureFixture[str]) -> None:
    """manifests/config/llm-d-pd.yaml, modelled on llm-d-router's
    deploy/config/pd-epp-config.yaml, passes `epp validate`."""
    assert cli_main(["validate", str(PD_CONFIG)]) == 0
    assert "profiles: prefill" in capsys.readouterr().out


def test_llm_d_pd_manifest_disaggregates_long_uncached_prompts_only() -> None:
    """Decode pod first, always; a prefill pod and `x-prefiller-host-port` only when
    the decode pod would prefill at least nonCachedTokens (16) itself."""
    datastore = Datastore()
    datastore.replace_all(
        [
            EndpointSpec("decode-0", "10.0.0.1:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("decode-1", "10.0.0.2:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("prefill-0", "10.0.1.1:8000", labels={"llm-d.ai/role": "prefill"}),
            EndpointSpec("prefill-1", "10.0.1.2:8000", labels={"llm-d.ai/role": "prefill"}),
        ]
    )
    config = load_config(
        PD_CONFIG.read_text(), PluginRegistry.from_entry_points(), datastore=datastore
    )
    director = Director(datastore, config, Telemetry(datastore))
    prefill_pods = {"10.0.1.1:8000", "10.0.1.2:8000"}

    def pick(prompt: str) -> tuple[str, dict[str, str]]:
        decision = asyncio.run(director.pick_endpoint(completion(prompt)))
        director.finish(decision, ResponseInfo(completed=True))
        return decision.endpoint.name, dict(decision.result.request_headers)

    long_prompt = "an uncached document to summarise " * 60  # about 500 tokens
    explained = asyncio.run(director.explain(completion(long_prompt)))
    note = explained["notes"]["disagg-profile-handler"]
    assert note["decision"] is True
    assert note["facts"]["uncachedTokens"] >= 16
    assert explained["requestHeaders"]["x-prefiller-host-port"] in prefill_pods

    decode, headers = pick(long_prompt)
    assert decode.startswith("decode-")
    assert set(headers) == {"x-prefiller-host-port"}
    assert headers["x-prefiller-host-port"] in prefill_pods
    # The same prompt again: its decode pod holds it now, so it prefills nothing.
    again, headers = pick(long_prompt)
    assert (again, headers) == (decode, {})
    # A short prompt is not worth a transfer either.
    short, headers = pick("hello")
    assert short.startswith("decode-")
    assert headers == {}
    explained = asyncio.run(director.explain(completion("hello")))
    assert explained["notes"]["disagg-profile-handler"]["decision"] is False
    assert "requestHeaders" not in explained
