"""llm-d's precise pipeline: `token-producer`, `endpoint-notification-source` and
`precise-prefix-cache-producer` feeding `prefix-cache-scorer`. Their parameters
(llm-d's names) mapped onto the precise prefix service, the errors for what cannot
work here, the endpoint notifications, and the same scores as the composite
`precise-prefix-cache-scorer` on the same KV events (vLLM's own golden payloads)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml
from epp.plugins.endpoint_notification_source import EndpointNotifier
from epp.plugins.precise_prefix_cache_producer import PrecisePrefixCacheProducer, parse_bytes
from epp.plugins.token_producer import TOKENIZED_PROMPT, TokenProducer

from epp.config import InvalidConfig, SchedulingConfig, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.kvindex.blockkeys import HashContext
from epp.kvindex.events import decode_batch
from epp.kvindex.service import PrecisePrefixService
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import CycleState
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry
from epp.tokenization.service import PromptTokenization
from epp.tokenization.tokens import token_bytes
from tests.plugins.helpers import write_sim_endpoints
from tests.testdata import load_json, qwen_dir

MODEL = "hf-repo/model-name"


def pipeline(
    producer: dict[str, Any] | None = None,
    token_producer: dict[str, Any] | None = None,
    *,
    data_layer: bool = True,
) -> str:
    """llm-d's sample shape: token producer, notifications, the precise producer
    read by prefix-cache-scorer."""
    plugins: list[dict[str, Any]] = [
        {
            "type": "token-producer",
            "parameters": {"modelName": MODEL} if token_producer is None else token_producer,
        },
        {"type": "endpoint-notification-source"},
        {"type": "precise-prefix-cache-producer", "parameters": producer or {}},
        {
            "type": "prefix-cache-scorer",
            "parameters": {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"},
        },
        {"type": "max-score-picker", "parameters": {"seed": 1}},
    ]
    document: dict[str, Any] = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer"},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }
    if data_layer:
        document["dataLayer"] = {
            "sources": [
                {
                    "pluginRef": "endpoint-notification-source",
                    "extractors": [{"pluginRef": "precise-prefix-cache-producer"}],
                }
            ]
        }
    return yaml.safe_dump(document, sort_keys=False)


def composite(block_size: int) -> str:
    """The same profile with the composite `precise-prefix-cache-scorer`."""
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {
                    "type": "precise-prefix-cache-scorer",
                    "name": "prefix",
                    "parameters": {"blockSize": block_size, "tokenizers": []},
                },
                {"type": "max-score-picker", "parameters": {"seed": 1}},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": "prefix"}, {"pluginRef": "max-score-picker"}],
                }
            ],
        }
    )


def registry() -> PluginRegistry:
    return PluginRegistry.from_entry_points()


def pool(count: int = 3) -> Datastore:
    datastore = Datastore()
    datastore.replace_all(EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(count))
    return datastore


def completion(prompt: object, model: str = "m") -> InferenceRequest:
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={},
        body=msgspec.json.encode({"model": model, "prompt": prompt}),
    )


def precise(config: SchedulingConfig, name: str = "precise-prefix-cache-producer") -> Any:
    service = config.services[name]
    assert isinstance(service, PrecisePrefixService)
    return service


@contextlib.asynccontextmanager
async def running(*services: Any) -> AsyncIterator[None]:
    """The services running as the server runs them, for the block's duration."""
    tasks = [asyncio.create_task(s.run()) for s in services]
    await asyncio.sleep(0.05)  # each service starts its own tasks
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- parameters ---------------------------------------------------------------------


def test_llm_d_parameters_map_onto_the_precise_service() -> None:
    config = load_config(
        pipeline(
            {
                "tokenProcessorConfig": {"blockSizeTokens": 32, "blockSize": 8, "hashSeed": "42"},
                "indexerConfig": {
                    "kvBlockIndexConfig": {
                        "inMemoryConfig": {"size": 12345, "podCacheSize": 4},
                        "enableMetrics": True,
                        "metricsLoggingInterval": 60_000_000_000,
                    },
                    "kvCacheBackendConfigs": [
                        {"name": "GPU", "weight": 1.0},
                        {"name": "cpu", "weight": 0.5},
                    ],
                },
                "kvEventsConfig": {
                    "topicFilter": "kv@",
                    "concurrency": 8,
                    "engineType": "sglang",
                    "discoverPods": True,
                    "podDiscoveryConfig": {
                        "podLabelSelector": "app=vllm",
                        "podNamespace": "ns",
                        "socketPort": 6000,
                        "replaySocketPort": 6001,
                    },
                },
                "speculativeIndexing": True,
                "speculativeTTL": "3s",
            }
        ),
        registry(),
    )
    service = precise(config)
    settings = service.subscriber.settings
    assert service.config.block_size == 32  # blockSizeTokens wins over blockSize
    assert service.precise.index.max_entries == 12345
    assert service.config.medium_weights == {"gpu": 1.0, "cpu": 0.5}
    assert (settings.topic, settings.port, settings.replay_port) == ("kv@", 6000, 6001)
    assert service.speculative is not None
    assert service.config.speculative_ttl == "3s"
    # Endpoints come from the notifications, tokens from the token producer.
    assert not service.subscriber.follow_datastore
    assert service.tokenizers.sources == []


def test_llm_d_defaults() -> None:
    config = load_config(pipeline(), registry())
    service = precise(config)
    settings = service.subscriber.settings
    assert service.config.block_size == 16
    assert (settings.topic, settings.port, settings.replay_port) == ("kv@", 5557, None)
    assert service.speculative is None
    assert service.config.medium_weights == {"gpu": 1.0, "cpu": 0.8}
    assert service.precise.index.max_entries == 2_000_000  # this EPP's bound
    # The deprecated blockSize is read when blockSizeTokens is not set.
    old = load_config(pipeline({"tokenProcessorConfig": {"blockSize": 64}}), registry())
    assert precise(old).config.block_size == 64
    # A memory budget: about 150 bytes per (block, pod) entry.
    sized = pipeline(
        {"indexerConfig": {"kvBlockIndexConfig": {"costAwareMemoryConfig": {"size": "15MB"}}}}
    )
    assert precise(load_config(sized, registry())).precise.index.max_entries == 100_000
    assert parse_bytes("2GiB") == 2**31
    assert parse_bytes("500 MiB") == 500 * 2**20


def test_the_token_producer_tokenizes_with_model_names_tokenizer() -> None:
    """modelName's tokenizer serves every request; `--tokenizer-dir` for modelName
    replaces it, for another model adds that model's own."""
    config = load_config(pipeline(), registry())
    tokenization = config.services["token-producer"]
    assert isinstance(tokenization, PromptTokenization)
    assert tokenization.describe() == {"*": "pending"}
    assert tokenization.registry.sources[-1].hugging_face == MODEL
    local = load_config(
        pipeline(),
        registry(),
        settings=ServerSettings(
            tokenizer_dirs=((MODEL, str(qwen_dir())), ("sim-model", str(qwen_dir())))
        ),
    )
    tokenization = local.services["token-producer"]
    assert isinstance(tokenization, PromptTokenization)
    assert {s.model: s.path for s in tokenization.registry.sources} == {
        "sim-model": str(qwen_dir()),
        "*": str(qwen_dir()),
    }
    # The estimate backend needs no tokenizer, and no service.
    estimate = load_config(pipeline(token_producer={"estimate": {}}), registry())
    assert "token-producer" not in estimate.services


async def test_estimate_tokens_match_no_engine_blocks() -> None:
    config = load_config(pipeline(token_producer={}), registry(), datastore=pool(1))
    producer = config.plugins["token-producer"]
    assert isinstance(producer, TokenProducer)
    cycle = CycleState()
    await producer.prepare(completion("abcdefgh"), cycle, [])
    tokenized = cycle.get(TOKENIZED_PROMPT)
    assert tokenized is not None
    assert tokenized.estimated
    assert tokenized.tokens == b"abcdefgh"  # 4 bytes a pseudo-token


BAD_PRODUCER = [
    ({"tokenProcessorConfig": {"blockSizeTokens": -1}}, "blockSizeTokens must be greater than 0"),
    ({"tokenProcessorConfig": {"hashAlgorithm": "md5"}}, "hashAlgorithm"),
    (
        {"indexerConfig": {"tokenizersPoolConfig": {"modelName": "m"}}},
        "tokenizersPoolConfig is not supported; configure a token-producer",
    ),
    (
        {"indexerConfig": {"kvBlockIndexConfig": {"redisConfig": {"address": "redis:6379"}}}},
        "redisConfig: an index shared through Redis is not supported",
    ),
    (
        {"indexerConfig": {"kvBlockIndexConfig": {"costAwareMemoryConfig": {"size": "lots"}}}},
        "is not a size",
    ),
    (
        {"indexerConfig": {"kvBlockIndexConfig": {"inMemoryConfig": None}}},
        "no valid index configuration",
    ),
    (
        {"indexerConfig": {"kvCacheBackendConfigs": [{"name": "gpu", "weight": 2}]}},
        "kvCacheBackendConfigs: give each medium a weight in",
    ),
    ({"kvEventsConfig": {"zmqEndpoint": "tcp://0.0.0.0:5557"}}, "zmqEndpoint: one socket"),
    ({"kvEventsConfig": {"engineType": "trtllm"}}, "engineType"),
    ({"kvEventsConfig": {"podDiscoveryConfig": {"socketPort": 0}}}, "socketPort"),
    ({"kvEventsConfig": {"concurrency": 0}}, "concurrency"),
    ({"speculativeTTL": "soon"}, "speculativeTTL"),
    ({"kvEventsConfig": {"unknown": 1}}, "unknown"),
    ({"blockSize": 16}, "blockSize"),  # the composite's parameter, not the producer's
]


@pytest.mark.parametrize(("parameters", "message"), BAD_PRODUCER)
def test_bad_producer_parameters_are_config_errors(
    parameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidConfig, match=message) as caught:
        load_config(pipeline(parameters), registry())
    (error,) = caught.value.errors
    assert error.path[:2] == ("plugins", 2)  # the producer's entry


BAD_TOKEN_PRODUCER = [
    (
        {"modelName": MODEL, "udsTokenizerConfig": {"socketFile": "/tmp/tokenizer.sock"}},
        "udsTokenizerConfig: the tokenizer sidecar",
    ),
    ({"modelName": MODEL, "estimate": {}}, "only one of 'estimate', 'vllm'"),
    ({"vllm": {"url": "http://localhost:8000"}}, "'modelName' must be specified"),
    ({"modelName": MODEL, "vllm": {"timeout": "soon"}}, "timeout"),
    ({"modelName": MODEL, "backend": "vllm"}, "backend"),
    ({"modelName": MODEL, "tokenizerDir": "/nonexistent"}, "tokenizer.json does not exist"),
]


@pytest.mark.parametrize(("parameters", "message"), BAD_TOKEN_PRODUCER)
def test_bad_token_producer_parameters_are_config_errors(
    parameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidConfig, match=message) as caught:
        load_config(pipeline(token_producer=parameters), registry())
    (error,) = caught.value.errors
    assert error.path[:2] == ("plugins", 0)


def test_a_token_producer_after_its_reader_is_refused() -> None:
    """Data producers run in the file's order here: tokens must come first."""
    document = yaml.safe_load(pipeline())
    plugins = document["plugins"]
    plugins.append(plugins.pop(0))
    with pytest.raises(InvalidConfig, match="declare it before 'precise-prefix-cache-producer'"):
        load_config(yaml.safe_dump(document), registry())


def test_the_notification_source_takes_endpoint_extractors_only() -> None:
    document = yaml.safe_load(pipeline())
    document["plugins"].append({"type": "core-metrics-extractor"})
    document["dataLayer"]["sources"][0]["extractors"].append(
        {"pluginRef": "core-metrics-extractor"}
    )
    with pytest.raises(InvalidConfig, match="does not take endpoint events") as caught:
        load_config(yaml.safe_dump(document), registry())
    (error,) = caught.value.errors
    assert error.path[:2] == ("dataLayer", "sources")


# -- endpoint notifications ---------------------------------------------------------


def stored(tokens: Sequence[int], block_size: int, first_hash: int = 1000) -> bytes:
    """One vLLM (>= 0.24) batch storing every full block of `tokens`."""
    blocks = len(tokens) // block_size
    event = {
        "type": "BlockStored",
        "block_hashes": [first_hash + i for i in range(blocks)],
        "parent_block_hash": None,
        "token_ids": list(tokens[: blocks * block_size]),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * blocks,
    }
    return msgspec.msgpack.encode([1700000000.5, [event], 0])


async def test_endpoints_are_followed_as_the_notifications_say() -> None:
    """The source announces the pool's endpoints when it starts and each change
    after: the producer's subscriber joins them, and drops a leaving pod's streams
    and index entries at once."""
    datastore = pool(2)
    config = load_config(pipeline(), registry(), datastore=datastore)
    service = precise(config)
    notifier = config.services["endpoint-notification-source"]
    assert isinstance(notifier, EndpointNotifier)
    producer = config.plugins["precise-prefix-cache-producer"]
    assert isinstance(producer, PrecisePrefixCacheProducer)
    assert notifier.extractors == [producer]
    pod0, pod1 = datastore.all_endpoints()
    tokens = list(range(1, 65))
    service.feed(pod1, decode_batch(stored(tokens, 16)))
    async with running(notifier, service):
        assert set(service.subscriber.streams) == {pod0, pod1}
        assert service.subscriber.streams[pod1][0][0].address == "tcp://10.0.0.2:5557"
        datastore.replace_all([pod0.spec, EndpointSpec("pod-2", "10.0.0.3:8000")])
        await asyncio.sleep(0)
        assert {e.name for e in service.subscriber.streams} == {"pod-0", "pod-2"}
        found = service.lookup(token_bytes(tokens), HashContext(), [pod1])
        assert found.slots == {}  # its entries went with it
    # Without a dataLayer section each source is offered every extractor (GIE's
    # rule): the source still feeds the producer.
    implied = load_config(pipeline(data_layer=False), registry(), datastore=pool(2))
    notifier = implied.services["endpoint-notification-source"]
    assert isinstance(notifier, EndpointNotifier)
    assert len(notifier.extractors) == 1
    # Without any source, as in llm-d, nobody tells the producer of a pod.
    bare = yaml.safe_load(pipeline(data_layer=False))
    del bare["plugins"][1]
    alone = load_config(yaml.safe_dump(bare), registry(), datastore=pool(2))
    async with running(precise(alone)):
        assert precise(alone).subscriber.streams == {}


# -- the same scores as the composite --------------------------------------------------


def golden_batches() -> list[tuple[str, list[bytes]]]:
    """vLLM's own encodings (0.22.1 arrays, 0.33.0 maps) of its events for tokens
    1..48 in blocks of 16, cut into the steps an engine would publish: the first two
    blocks stored, the third, the first removed, all cleared."""
    out = []
    for vector in load_json("vllm/event_payloads.json")["vectors"]:
        if not vector["int_block_hashes"] or not any(
            v in vector["vllm"] for v in ("0.22.1", "0.33.0")
        ):
            continue
        ts, events, rank = msgspec.msgpack.decode(bytes.fromhex(vector["payload_hex"]))
        steps = [msgspec.msgpack.encode([ts, [event], rank]) for event in events]
        out.append((vector["vllm"], steps))
    assert len(out) == 2
    return out


def scores(director: Director, scorer: str, prompt: object) -> dict[str, float]:
    decision = asyncio.run(director.pick_endpoint(completion(prompt)))
    director.finish(decision, ResponseInfo(completed=True))
    found = decision.result.profiles["default"].scores[scorer]
    return {e.name: s for e, s in found.items()}


@pytest.mark.parametrize("step", range(4))
def test_the_pipeline_scores_as_the_composite_scorer_on_the_same_events(step: int) -> None:
    prompts = [
        list(range(1, 49)),  # the three blocks
        list(range(1, 33)) + [7] * 16,  # diverges at block 3
        list(range(1, 17)) + list(range(500, 532)),  # diverges at block 2
        list(range(1, 70)),  # the three blocks and a partial one
        list(range(900, 964)),  # nothing cached
    ]
    for version, steps in golden_batches():
        runs = []
        for text, scorer, service_name in (
            (pipeline({"tokenProcessorConfig": {"blockSizeTokens": 16}}), "prefix-cache-scorer",
             "precise-prefix-cache-producer"),
            (composite(16), "prefix", "prefix"),
        ):  # fmt: skip
            datastore = pool(3)
            config = load_config(text, registry(), datastore=datastore)
            service = precise(config, service_name)
            _, pod1, pod2 = datastore.all_endpoints()
            # pod-1 holds the blocks (through the golden steps); pod-2 the first one.
            for payload in steps[: step + 1]:
                service.feed(pod1, decode_batch(payload))
            service.feed(pod2, decode_batch(steps[0]))
            director = Director(datastore, config, Telemetry(datastore))
            runs.append([scores(director, scorer, p) for p in prompts])
        new, old = runs
        assert new == old, version
        if step == 1:  # all three blocks stored on pod-1
            assert new[0]["pod-1"] == 1.0
            assert new[1]["pod-1"] == pytest.approx(2 / 3)
            assert new[4] == {"pod-0": 0.0, "pod-1": 0.0, "pod-2": 0.0}


# -- end to end: llm-d's sample in a real EPP, simulated vLLM pods over ZMQ -----------


async def test_llm_d_sample_routes_on_simulated_vllm_pods_kv_events(tmp_path: Path) -> None:
    """llm-d's sample config, unchanged, in an in-process `epp serve` (real ports)
    following two simulated vLLM pods that publish their KV events over ZMQ as llm-d
    deploys them (block size 64, topic `kv@<pod>@<model>`): the pod that served a
    system prompt gets the next request sharing it, with the producer's score."""
    from epp.app import EppApp
    from sim.server import SimPod
    from sim.tokenizer import load_tokenizer
    from tests.epp.conftest import local_options
    from tests.epp.test_llmd_configs import EPP_PRECISE_PREFIX_CACHE
    from tests.sim.conftest import pod_config

    engine_tokenizer = load_tokenizer(qwen_dir())
    pods: dict[str, SimPod] = {}
    app: EppApp | None = None
    try:
        for name in ("a", "b"):
            pod = SimPod(
                pod_config(name=name, block_size=64, kv_events_topic=f"kv@{name}@sim-model"),
                tokenizer=engine_tokenizer,
            )
            await pod.start("127.0.0.1", 0)
            pods[name] = pod
        endpoints = write_sim_endpoints(tmp_path / "endpoints.yaml", pods)
        app = EppApp(
            local_options(
                endpoints,
                config_text=EPP_PRECISE_PREFIX_CACHE,
                debug_endpoints=True,
                shutdown_grace_s=0.2,
                tokenizer_dirs=((MODEL, str(qwen_dir())),),
            )
        )
        await app.start()
        admin = f"http://127.0.0.1:{app.ports['metrics']}/debug/endpoints"

        async def debug() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session, session.get(admin) as response:
                return {e["name"]: e for e in await response.json()}

        async def until(check: Any, what: str) -> dict[str, Any]:
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                entries = await debug()
                if check(entries):
                    return entries
                assert asyncio.get_running_loop().time() < deadline, (what, entries)
                await asyncio.sleep(0.05)

        await until(
            lambda es: all(
                e.get("index", {}).get("state") == "live"
                and e.get("tokenProducer", {}).get("tokenizers") == {"*": "ready"}
                for e in es.values()
            ),
            "every stream live and the tokenizer ready",
        )
        system = "You answer questions about the bookshop's opening hours. " * 40
        body = {"model": "sim-model", "prompt": system + "When do you open?", "max_tokens": 1}
        url = f"http://127.0.0.1:{pods['b'].port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
        await until(lambda es: es["b"]["index"]["blocks"] >= 6, "b's blocks indexed")

        director = app.director
        by_address = {f"127.0.0.1:{pod.port}": name for name, pod in pods.items()}
        for question in ("Do you sell maps?", "Gift cards for birthdays? " * 8):
            decision = await director.pick_endpoint(completion(system + question, "sim-model"))
            director.finish(decision, ResponseInfo(completed=True))
            scored = decision.result.profiles["default"].scores["prefix-cache-scorer"]
            scores = {by_address[e.address]: s for e, s in scored.items()}
            assert by_address[decision.endpoint.address] == "b", scores
            assert scores["a"] == 0.0
            assert 0.5 < scores["b"] <= 1.0
        entries = await debug()
        assert entries["b"]["index"]["trusted"] is True
        assert "tokenizers" not in entries["b"]["index"]  # the token producer's
    finally:
        if app is not None:
            await app.stop()
        for pod in pods.values():
            await pod.stop()
