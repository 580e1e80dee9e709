"""llm-d-router's sample configs load and run unchanged, with what each name means
there. Written here with the same plugins and parameters: `deploy/config/
epp-config.yaml` (a decode filter, the prefix-cache scorer with its approximate
producer, the max-score picker, under `apiVersion: llm-d.ai/...`),
`sim-epp-no-hit-lru.yaml` (the no-hit LRU scorer beside a precise prefix producer
without a token producer), `epp-burst-prefix-cache-config.yaml` (bursts co-located
by the burst producer, read by the prefix-cache scorer) and
`epp-precise-prefix-cache-config.yaml` (llm-d's precise pipeline: token producer,
endpoint notifications, precise producer); and the shipped configs modelled on
llm-d's: the optimized baseline, `pd-epp-config.yaml`'s prefill/decode
disaggregation (manifests/config/llm-d-pd.yaml) and the precise pipeline
(manifests/config/llm-d-precise-prefix.yaml)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from epp.cli import main as cli_main
from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.requests import InferenceRequest, parse_request
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


def llm_d_registry() -> PluginRegistry:
    return PluginRegistry.from_entry_points()


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


# llm-d-router's deploy/config/epp-precise-prefix-cache-config.yaml, as it is on
# llm-d-router's main branch: the same plugin types, names, parameters, data layer
# and profile (its comments left out).
EPP_PRECISE_PREFIX_CACHE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: hf-repo/model-name
      vllm:
        url: http://localhost:8000
  - type: endpoint-notification-source
  - type: metrics-data-source
  - type: core-metrics-extractor
  - type: single-profile-handler
  - type: decode-filter
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSize: 64
      indexerConfig:
        kvBlockIndexConfig:
          enableMetrics: true
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
  - type: kv-cache-utilization-scorer
  - type: queue-scorer
  - type: max-score-picker
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: precise-prefix-cache-producer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: decode-filter
      - pluginRef: prefix-cache-scorer
        weight: 2.0
      - pluginRef: kv-cache-utilization-scorer
        weight: 1.0
      - pluginRef: queue-scorer
        weight: 1.0
      - pluginRef: max-score-picker
"""
PRECISE_MANIFEST = (
    Path(__file__).resolve().parents[2] / "manifests/config/llm-d-precise-prefix.yaml"
)


@pytest.mark.parametrize("source", ["sample", "manifest"])
def test_llm_d_precise_sample_config_validates(
    source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`epp validate` takes llm-d's sample and the shipped copy as they are, with
    no tokenizer at hand and no network (building does no I/O)."""
    path = PRECISE_MANIFEST
    if source == "sample":
        path = tmp_path / "epp-precise-prefix-cache-config.yaml"
        path.write_text(EPP_PRECISE_PREFIX_CACHE)
    assert cli_main(["validate", str(path)]) == 0
    assert "profiles: default (1 filters, 3 scorers, picker max-score-picker)" in (
        capsys.readouterr().out
    )


def engine_blocks(token_ids: Sequence[int], block_size: int) -> bytes:
    """What a vLLM engine (>= 0.24, map-encoded) publishes once it cached a prompt
    of `token_ids`: one BlockStored batch for its full blocks, hashed as vLLM
    hashes them (the simulator's engine-faithful hasher)."""
    from tests.plugins.engine_events import stored_payload

    return stored_payload(token_ids, block_size=block_size)


async def test_llm_d_precise_sample_config_routes_to_the_pod_holding_the_prefix() -> None:
    """The sample, built unchanged (its modelName's tokenizer given as
    `epp serve --tokenizer-dir hf-repo/model-name=DIR` would), with the services
    running as the server runs them: the pod whose KV events hold a prompt's
    prefix gets the follow-up prompt, with the precise producer's score."""
    from epp.kvindex.events import decode_batch
    from epp.kvindex.service import PrecisePrefixService
    from epp.scheduling.interfaces import ServerSettings
    from epp.tokenization.service import PromptTokenization
    from sim.tokenizer import load_tokenizer
    from tests.testdata import qwen_dir

    # llm-d's pool, each engine's KV-event socket named in the endpoints file (an
    # in-process address: the test opens no network socket; the events come by `feed`).
    datastore = Datastore()
    datastore.replace_all(
        dataclasses.replace(spec, kv_events=f"inproc://kv-events-{spec.name}")
        for spec in (e.spec for e in llm_d_pool().all_endpoints())
    )
    config = load_config(
        EPP_PRECISE_PREFIX_CACHE,
        llm_d_registry(),
        datastore=datastore,
        settings=ServerSettings(tokenizer_dirs=(("hf-repo/model-name", str(qwen_dir())),)),
    )
    tokenization = config.services["token-producer"]
    precise = config.services["precise-prefix-cache-producer"]
    notifier = config.services["endpoint-notification-source"]
    assert isinstance(tokenization, PromptTokenization)
    assert isinstance(precise, PrecisePrefixService)
    assert precise.config.block_size == 64
    director = Director(datastore, config, Telemetry(datastore))
    endpoints = {e.name: e for e in datastore.all_endpoints()}

    tasks = [asyncio.create_task(s.run()) for s in (tokenization, notifier, precise)]
    try:
        for _ in range(200):
            if tokenization.describe() == {"*": "ready"}:
                break
            await asyncio.sleep(0.05)
        assert tokenization.describe() == {"*": "ready"}
        # Told of the pool by the notification source: following every pod.
        assert set(precise.subscriber.streams) == set(endpoints.values())

        system = "You answer questions about the bookshop's opening hours. " * 40
        # decode-1's engine served the system prompt and says so in its KV events
        # (the engine's own tokenizer: the simulator's, not the EPP's).
        engine = load_tokenizer(qwen_dir())
        cached = engine.encode(system + "When do you open on Sunday?")
        precise.feed(endpoints["decode-1"], decode_batch(engine_blocks(cached, 64)))
        # The prefill pod holds it too: the decode filter keeps it out anyway.
        precise.feed(endpoints["prefill"], decode_batch(engine_blocks(cached, 64)))

        # The follow-up shares the system prompt, not the question's blocks.
        request = completion(system + "Do you sell gift cards for birthdays? " * 8)
        decision = await director.pick_endpoint(request)
        director.finish(decision, ResponseInfo(completed=True))
        assert decision.endpoint.name == "decode-1"
        prefix = {
            e.name: s for e, s in decision.result.profiles["default"].scores[
                "prefix-cache-scorer"
            ].items()
        }  # fmt: skip
        assert set(prefix) == {"decode-0", "decode-1", "plain"}
        assert prefix["decode-0"] == prefix["plain"] == 0.0
        assert 0.5 < prefix["decode-1"] < 1.0  # the system prompt, not the question
        # A prompt nobody holds: no precise hit, and never the prefill pod.
        cold = await director.pick_endpoint(completion("An unrelated question. " * 60))
        director.finish(cold, ResponseInfo(completed=True))
        assert cold.endpoint.name != "prefill"
        scores = cold.result.profiles["default"].scores["prefix-cache-scorer"]
        assert set(scores.values()) == {0.0}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_llm_d_precise_manifest_builds_anywhere_without_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """manifests/config/llm-d-precise-prefix.yaml names a Hub model for its token
    producer: it builds from any directory, fetching nothing; with the benchmark's
    `--tokenizer-dir sim-model=DIR`, the simulator's model gets that tokenizer."""
    from epp.scheduling.interfaces import ServerSettings
    from epp.tokenization.service import PromptTokenization
    from tests.testdata import qwen_dir

    monkeypatch.chdir(tmp_path)
    text = PRECISE_MANIFEST.read_text()
    config = load_config(text, llm_d_registry())
    tokenization = config.services["token-producer"]
    assert isinstance(tokenization, PromptTokenization)
    assert tokenization.describe() == {"*": "pending"}
    local = load_config(
        text,
        llm_d_registry(),
        settings=ServerSettings(tokenizer_dirs=(("sim-model", str(qwen_dir())),)),
    )
    tokenization = local.services["token-producer"]
    assert isinstance(tokenization, PromptTokenization)
    assert set(tokenization.describe()) == {"sim-model", "*"}
