"""`precise-prefix-cache-scorer` in a real EPP (in-process, real ports) following
simulated vLLM pods that tokenize with the real Qwen2.5 tokenizer and publish
vLLM-format KV events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.app import EppApp
from epp.cli import build_parser, serve_options
from epp.config import InvalidConfig, load_config
from epp.datastore import Endpoint
from epp.director import Decision
from epp.kvindex.service import PrecisePrefixService
from epp.requests import parse_request
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import PrefixMatchInfo, ResponseInfo, prefix_match_key
from sim.server import SimPod
from sim.tokenizer import HFTokenizer, load_tokenizer
from tests.epp.conftest import local_options
from tests.plugins.helpers import write_sim_endpoints
from tests.sim.conftest import pod_config
from tests.testdata import hub_cache, qwen_dir

SYSTEM = "You are the support assistant of a large bookshop. " * 60  # ~700 tokens


def config(**parameters: Any) -> str:
    params = {
        "blockSize": 16,  # no hash settings: the engines' seeds do not matter
        "tokenizers": [{"model": "*", "path": str(qwen_dir())}],
        "kvEventsConfig": {"replayTimeout": "500ms", "reconnectInterval": "50ms"},
        **parameters,
    }
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {"type": "precise-prefix-cache-scorer", "name": "prefix", "parameters": params},
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": "prefix"}, {"pluginRef": "max-score-picker"}],
                }
            ],
        }
    )


@pytest.fixture(scope="module")
def qwen_sim() -> HFTokenizer:
    tokenizer = load_tokenizer(qwen_dir())
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


class Fleet:
    def __init__(self, pods: dict[str, SimPod], app: EppApp) -> None:
        self.pods = pods
        self.app = app
        self.admin = f"http://127.0.0.1:{app.ports['metrics']}"

    @property
    def plugin(self) -> Any:
        return self.app.director.config.plugins["prefix"]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.pods[name].port}"

    async def send(
        self, name: str, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> None:
        """Serve a request on one pod directly (it caches its blocks)."""
        url = f"http://127.0.0.1:{self.pods[name].port}{path}"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 200, await response.text()

    async def route(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> Decision:
        """Route a request through the EPP's director, as the ext_proc stream does."""
        request = parse_request(
            request_id="t", method="POST", path=path, headers={}, body=msgspec.json.encode(body)
        )
        director = self.app.director
        decision = await director.pick_endpoint(request)
        director.finish(decision, ResponseInfo(completed=True))
        return decision

    def name_of(self, endpoint: Endpoint) -> str:
        by_address = {e.address: e.name for e in self.app.datastore.all_endpoints()}
        return by_address[endpoint.address]

    async def pick(
        self, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> tuple[str, dict[str, float]]:
        """The pod a request is routed to, and the prefix scores."""
        decision = await self.route(body, path)
        scores = decision.result.profiles["default"].scores["prefix"]
        return self.name_of(decision.endpoint), {self.name_of(e): s for e, s in scores.items()}

    async def debug(self) -> dict[str, dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.admin}/debug/endpoints") as response,
        ):
            return {e["name"]: e for e in await response.json()}

    async def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        async with aiohttp.ClientSession() as session, session.get(f"{self.admin}/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and (labels is None or sample.labels == labels):
                    return float(sample.value)
        return 0.0

    async def wait_blocks(self, name: str, at_least: int = 1, timeout_s: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            index = (await self.debug())[name].get("index", {})
            if index.get("blocks", 0) >= at_least:
                return
            assert asyncio.get_running_loop().time() < deadline, f"no blocks for {name}: {index}"
            await asyncio.sleep(0.02)

    async def wait_tokenizer(self, model: str, state: str, timeout_s: float = 20.0) -> str:
        """`model`'s tokenizer line in /debug/endpoints once it starts with `state`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            entry = next(iter((await self.debug()).values()))
            line: str = entry["index"]["tokenizers"].get(model, "")
            if line.startswith(state):
                return line
            assert asyncio.get_running_loop().time() < deadline, entry["index"]["tokenizers"]
            await asyncio.sleep(0.02)

    async def ready(self) -> None:
        """Tokenizers loaded and every stream connected."""
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            entries = await self.debug()
            states = [e["index"]["state"] for e in entries.values() if "index" in e]
            tokenizers = next(iter(entries.values()))["index"]["tokenizers"]
            # Per-model Hub tokenizers ("*": "per model ...") load on first use.
            if all(s == "live" for s in states) and all(
                t.startswith(("ready", "failed", "per model")) for t in tokenizers.values()
            ):
                return
            assert asyncio.get_running_loop().time() < deadline, entries
            await asyncio.sleep(0.02)


StartFleet = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def start_fleet(tmp_path: Path, qwen_sim: HFTokenizer) -> AsyncIterator[StartFleet]:
    started: list[SimPod] = []
    apps: list[EppApp] = []

    async def start(
        config_text: str,
        names: tuple[str, ...] = ("a", "b", "c"),
        serve: dict[str, Any] | None = None,
        **pod_options: Any,
    ) -> Fleet:
        """`serve`: other `epp serve` options; `pod_options`: each pod's, by name."""
        pods = {}
        for name in names:
            options = pod_options.get(name, {})
            pod = SimPod(pod_config(name=name, **options), tokenizer=qwen_sim)
            await pod.start("127.0.0.1", 0)
            started.append(pod)
            pods[name] = pod
        endpoints = write_sim_endpoints(tmp_path / f"endpoints-{len(apps)}.yaml", pods)
        app = EppApp(
            local_options(
                endpoints,
                config_text=config_text,
                debug_endpoints=True,
                shutdown_grace_s=0.2,
                **(serve or {}),
            )
        )
        await app.start()
        apps.append(app)
        fleet = Fleet(pods, app)
        await fleet.ready()
        return fleet

    yield start
    for app in apps:
        await app.stop()
    for pod in started:
        await pod.stop()


def chat(user: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        **extra,
    }


async def test_a_request_whose_prefix_is_cached_on_b_goes_to_b(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(config())
    await fleet.send("b", chat("Where is my order 1234?"))
    await fleet.wait_blocks("b", 40)
    for question in ("Do you sell maps?", "Opening hours on Sunday?", "Gift cards?"):
        picked, scores = await fleet.pick(chat(question))
        assert picked == "b", scores
        assert 0.9 < scores["b"] < 1.0  # the system prompt, not the new question
        assert scores["a"] == scores["c"] == 0.0
    # An unrelated prompt matches nowhere.
    _, scores = await fleet.pick(chat("hello", system="A different assistant altogether. " * 40))
    assert set(scores.values()) == {0.0}
    assert await fleet.metric("epp_precise_prefix_lookups_total", {"result": "hit"}) == 3


async def test_a_conversations_next_turn_continues_it_another_conversation_does_not(
    start_fleet: StartFleet,
) -> None:
    """The predicted-TTFT model's session rule reads `continues` from the precise
    match: a prompt that passes through the end of an earlier routed prompt."""
    fleet = await start_fleet(config())

    def continues(decision: Decision) -> bool:
        info = decision.cycle.get(prefix_match_key("prefix"))
        assert isinstance(info, PrefixMatchInfo)
        return info.continues

    question = "Which of your travel guides covers the coast of Portugal in winter? " * 3
    first = chat(question)
    routed = await fleet.route(first)
    assert not continues(routed)  # nothing routed before it
    pod = fleet.name_of(routed.endpoint)
    await fleet.send(pod, first)  # the engine serves it and caches its blocks
    await fleet.wait_blocks(pod, at_least=40)

    messages = [
        *first["messages"],
        {"role": "assistant", "content": "The winter edition of our Iberia guide does."},
        {"role": "user", "content": "Is it in stock in paperback?"},
    ]
    next_turn = await fleet.route({**first, "messages": messages})
    assert fleet.name_of(next_turn.endpoint) == pod
    assert continues(next_turn)

    # Another conversation over the same system prompt, held on the same pod: a
    # shared prefix, not a continuation.
    other = await fleet.route(chat("Do you ship signed first editions abroad? " * 3))
    assert fleet.name_of(other.endpoint) == pod
    assert not continues(other)


async def test_debug_endpoints_and_metrics_show_the_index(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(config())
    await fleet.send("a", chat("first"))
    await fleet.wait_blocks("a")
    entry = (await fleet.debug())["a"]["index"]
    for key in ("blocks", "lastSeq", "eventsApplied", "gaps", "replays"):
        assert key in entry, entry
    assert entry["blocks"] == len(fleet.pods["a"].engine.kv.pool.cached_hashes())
    assert entry["lastSeq"] >= 0
    assert entry["eventsApplied"] >= 1
    assert entry["gaps"] == 0
    assert entry["aligned"] is True
    assert entry["trusted"] is True
    assert entry["engineHashes"] == entry["blocks"]
    assert "tokenizationAgreement" in entry
    assert entry["state"] == "live"
    assert entry["tokenizers"] == {"*": "ready"}
    assert (
        await fleet.metric("epp_kv_index_blocks", {"endpoint": "a", "medium": "gpu"})
        == entry["blocks"]
    )
    assert await fleet.metric("epp_kv_index_entries") == entry["blocks"]
    assert await fleet.metric("epp_kv_index_max_entries") == 2_000_000
    assert await fleet.metric("epp_kv_events_applied_total", {"endpoint": "a"}) >= 1
    assert await fleet.metric("epp_kv_alignment_checked_blocks_total", {"endpoint": "a"}) > 0
    assert await fleet.metric("epp_kv_index_trusted", {"endpoint": "a"}) == 1


async def test_a_burst_of_siblings_sticks_together_before_any_event(
    start_fleet: StartFleet,
) -> None:
    fleet = await start_fleet(config(speculativeIndexing=True, speculativeTTL="300ms"))
    first, scores = await fleet.pick(chat("question one"))
    assert set(scores.values()) == {0.0}  # nobody has it: any pod
    # Nothing was sent anywhere, so no event exists: the speculative entries decide.
    for question in ("question two", "question three"):
        picked, scores = await fleet.pick(chat(question))
        assert picked == first, scores
        assert scores[first] > 0.9
    await asyncio.sleep(0.5)  # past 1.5 x TTL: forgotten
    _, scores = await fleet.pick(chat("question four"))
    assert set(scores.values()) == {0.0}
    assert await fleet.metric("epp_precise_prefix_speculative_records_total") == 4
    assert await fleet.metric("epp_precise_prefix_speculative_extensions_total") == 2


async def test_without_speculative_indexing_siblings_are_cold(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(config())
    await fleet.pick(chat("question one"))
    _, scores = await fleet.pick(chat("question two"))
    assert set(scores.values()) == {0.0}


async def test_pods_with_any_seed_or_algorithm_are_scored(start_fleet: StartFleet) -> None:
    """Pods hashing with other seeds and algorithms than each other (and than any
    setting of the scorer's) are all trusted and scored: the index hashes the
    token ids itself. (This used to be a misalignment.)"""
    fleet = await start_fleet(
        config(),
        b={"hash_seed": "vllm-none-hash"},
        c={"hash_seed": "1234567", "hash_algo": "sha256_cbor"},
    )
    await fleet.send("c", chat("hello"))
    await fleet.wait_blocks("c", 40)
    entry = (await fleet.debug())["c"]["index"]
    assert entry["aligned"] is True
    assert entry["trusted"] is True
    picked, scores = await fleet.pick(chat("hello again"))
    assert picked == "c"
    assert scores["c"] > 0.9
    await fleet.send("b", chat("hello"))
    await fleet.wait_blocks("b", 40)
    _, scores = await fleet.pick(chat("hello again"))
    assert scores["b"] == scores["c"] > 0.9
    assert await fleet.metric("epp_kv_alignment_failures_total", {"endpoint": "c"}) == 0


async def test_a_pod_with_another_block_size_is_not_trusted(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(config(), c={"block_size": 32})
    await fleet.send("c", chat("hello"))
    await fleet.send("b", chat("hello"))
    await fleet.wait_blocks("b")
    deadline = asyncio.get_running_loop().time() + 5
    while (await fleet.debug())["c"]["index"].get("trusted", True):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    entry = (await fleet.debug())["c"]["index"]
    assert entry["aligned"] is False
    assert entry["blocks"] == 0
    assert "set blockSize to the engine's --block-size" in entry["alignmentCause"]
    picked, scores = await fleet.pick(chat("hello again"))
    assert picked == "b"
    assert scores["c"] == 0.0
    assert await fleet.metric("epp_kv_alignment_failures_total", {"endpoint": "c"}) >= 1
    assert await fleet.metric("epp_kv_index_trusted", {"endpoint": "c"}) == 0
    rejected = {"endpoint": "c", "reason": "block_size_mismatch"}
    assert await fleet.metric("epp_kv_events_rejected_total", rejected) >= 1


async def test_picks_probe_the_tokenization_and_the_engine_confirms_it(
    start_fleet: StartFleet,
) -> None:
    """The EPP's tokenization (Qwen2.5's chat template and tokenizer) agrees with the
    engine's: the blocks a pick predicts show up in the chosen pod's events."""
    fleet = await start_fleet(config(alignmentSampleEvery=1), names=("a", "b"))
    for done, question in enumerate(("one", "two", "three"), start=1):
        body = chat(question)
        picked, _ = await fleet.pick(body)
        await fleet.send(picked, body)  # what the gateway does with the pick
        # Each probe settles before the next pick: the prompts share their probe
        # block (the chat template's opening), and a pick whose probe block is
        # already awaited on that pod adds no second expectation, so with events
        # late (a loaded host) three picks could settle as two.
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            probes = [e["index"]["tokenizationProbes"] for e in (await fleet.debug()).values()]
            if sum(p["confirmed"] for p in probes) == done:
                break
            assert asyncio.get_running_loop().time() < deadline, probes
            await asyncio.sleep(0.02)
    assert sum(p["missed"] for p in probes) == 0
    entries = await fleet.debug()
    assert {e["index"]["tokenizationAgreement"] for e in entries.values()} <= {True, None}
    metric = "epp_kv_tokenization_probes_total"
    confirmed = [
        await fleet.metric(metric, {"endpoint": n, "result": "confirmed"}) for n in ("a", "b")
    ]
    assert sum(confirmed) == 3


async def test_cache_salt_keeps_tenants_apart(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(config())
    await fleet.send("a", chat("q", cache_salt="tenant-1"))
    await fleet.wait_blocks("a")
    _, unsalted = await fleet.pick(chat("q2"))
    _, other = await fleet.pick(chat("q2", cache_salt="tenant-2"))
    picked, same = await fleet.pick(chat("q2", cache_salt="tenant-1"))
    assert unsalted["a"] == other["a"] == 0.0
    assert picked == "a"
    assert same["a"] > 0.9


async def test_token_id_prompts_need_no_tokenizer(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(config(tokenizers=[]), names=("a", "b"))
    prompt = list(range(1000, 1330))
    await fleet.send(
        "b", {"model": "sim-model", "prompt": prompt, "max_tokens": 1}, "/v1/completions"
    )
    await fleet.wait_blocks("b", 20)
    picked, scores = await fleet.pick(
        {"model": "sim-model", "prompt": [*prompt[:320], 7, 8, 9]}, "/v1/completions"
    )
    assert picked == "b"
    assert scores["b"] == 1.0
    # Text needs a tokenizer: no precise score, and the metric says why.
    _, scores = await fleet.pick(chat("text"))
    assert set(scores.values()) == {0.0}
    assert await fleet.metric("epp_precise_prefix_skipped_total", {"reason": "no_tokenizer"}) == 1


async def test_lora_requests_are_looked_up_without_the_adapter_path(
    start_fleet: StartFleet,
) -> None:
    """The adapter's name keys its blocks (as KV events name it): no path needed.
    The base model's blocks do not count for an adapter's request."""
    fleet = await start_fleet(
        config(loraAdapters=[{"name": "my-lora", "baseModel": "sim-model"}]), names=("a",)
    )
    await fleet.send("a", chat("hi"))  # the base model's blocks
    await fleet.wait_blocks("a", 40)
    _, scores = await fleet.pick({**chat("hi"), "model": "my-lora"})
    assert scores == {"a": 0.0}
    _, scores = await fleet.pick(chat("hi"))
    assert scores["a"] > 0.9
    assert await fleet.metric("epp_precise_prefix_lookups_total", {"result": "miss"}) == 1
    assert await fleet.metric("epp_precise_prefix_skipped_total") == 0


async def test_a_missing_tokenizer_falls_back_when_configured(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    fleet = await start_fleet(
        config(
            tokenizers=[{"model": "*", "path": str(tmp_path / "absent")}],
            onMissingTokenizer="fallback",
        ),
        names=("a",),
    )
    tokenizers = (await fleet.debug())["a"]["index"]["tokenizers"]
    assert tokenizers["*"].startswith("failed")
    _, scores = await fleet.pick(chat("hi"))
    assert scores == {"a": 0.0}
    assert (
        await fleet.metric("epp_precise_prefix_skipped_total", {"reason": "tokenizer_failed"}) == 1
    )


def test_a_missing_tokenizer_is_a_startup_error(tmp_path: Path) -> None:
    text = config(tokenizers=[{"model": "*", "path": str(tmp_path / "absent")}])
    with pytest.raises(InvalidConfig, match=r"tokenizer\.json does not exist"):
        load_config(text, PluginRegistry.from_entry_points())


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"hashAlgo": "md5"}, "hashAlgo"),
        ({"blockSize": 0}, "blockSize"),
        ({"mediumWeights": {"gpu": 2.0}}, "mediumWeights"),
        ({"tokenizers": [{"model": "*"}]}, "exactly one of path and huggingFace"),
        ({"tokenizers": [{"model": "m", "huggingFace": "*"}]}, "is for the model '\\*' entry"),
        (
            {"tokenizers": [{"model": "*", "huggingFace": "*", "revision": "v1"}]},
            "a revision names one repository's",
        ),
        ({"maxTokenizerModels": 0}, "maxTokenizerModels"),
        ({"kvEventsConfig": {"dpSize": 0}}, "dpSize"),
        ({"speculativeTTL": "soon"}, "speculativeTTL"),
        ({"kvEventsConfig": {"unknown": 1}}, "unknown"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load_config(config(**parameters), PluginRegistry.from_entry_points())


@pytest.mark.parametrize("name", ["precise-prefix.yaml", "predicted-ttft-precise.yaml"])
def test_the_shipped_precise_profiles_build_anywhere_without_io(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They name no directory: each model's tokenizer comes from the Hub when first
    asked for, so they build from any working directory, without the test data."""
    path = Path(__file__).resolve().parents[2] / "manifests" / "config" / name
    monkeypatch.chdir(tmp_path)
    loaded = load_config(path.read_text(), PluginRegistry.from_entry_points())
    service = loaded.services["prefix"]
    assert isinstance(service, PrecisePrefixService)
    assert service.tokenizers.describe() == {
        "*": "per model from the Hugging Face Hub (0 of at most 8 models)"
    }
    # With the benchmark's flag, the simulator's model gets the local tokenizer.
    local = load_config(
        path.read_text(),
        PluginRegistry.from_entry_points(),
        settings=ServerSettings(tokenizer_dirs=(("sim-model", str(qwen_dir())),)),
    )
    service = local.services["prefix"]
    assert isinstance(service, PrecisePrefixService)
    assert set(service.tokenizers.describe()) == {"sim-model", "*"}


async def test_each_models_hub_tokenizer_is_fetched_on_first_use(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    """`huggingFace: "*"`: the request's model is its Hub id (here from an offline
    cache laid out by the Hub's client), fetched when first named; until then, and
    for a model not in the cache, no precise score; past maxTokenizerModels, none
    either, and the metric says why."""
    hub_cache(tmp_path / "hub", "Org/Name")
    fleet = await start_fleet(
        config(
            tokenizers=[{"model": "*", "huggingFace": "*"}],
            tokenizersCacheDir=str(tmp_path / "hub"),
            huggingFaceOffline=True,
            maxTokenizerModels=2,
        ),
        names=("a", "b"),
        a={"model": "Org/Name"},
        b={"model": "Org/Name"},
    )
    body = {**chat("Where is my order?"), "model": "Org/Name"}
    _, scores = await fleet.pick(body)
    assert set(scores.values()) == {0.0}
    skipped = "epp_precise_prefix_skipped_total"
    assert await fleet.metric(skipped, {"reason": "tokenizer_loading"}) == 1
    await fleet.wait_tokenizer("Org/Name", "ready")
    await fleet.send("b", body)
    await fleet.wait_blocks("b", 40)
    picked, scores = await fleet.pick({**chat("Gift cards?"), "model": "Org/Name"})
    assert picked == "b"
    assert 0.9 < scores["b"] < 1.0
    # Not in the cache: failed, said in /debug/endpoints; the other model still works.
    await fleet.pick({**chat("hi"), "model": "Org/Absent"})
    failed = await fleet.wait_tokenizer("Org/Absent", "failed")
    assert "not in the cache (offline)" in failed
    # Two models named already: a third one is not fetched.
    _, scores = await fleet.pick({**chat("hi"), "model": "Org/Third"})
    assert set(scores.values()) == {0.0}
    assert await fleet.metric(skipped, {"reason": "tokenizer_model_limit"}) == 1
    tokenizers = (await fleet.debug())["a"]["index"]["tokenizers"]
    assert set(tokenizers) == {"*", "Org/Name", "Org/Absent"}
    assert tokenizers["*"].endswith("(2 of at most 2 models)")
    _, scores = await fleet.pick({**chat("Gift cards?"), "model": "Org/Name"})
    assert scores["b"] > 0.9


async def test_a_local_tokenizer_given_to_epp_serve_wins_over_the_config(
    start_fleet: StartFleet, tmp_path: Path
) -> None:
    """`epp serve --tokenizer-dir sim-model=DIR` (how the benchmark runs the shipped
    profiles): that model's entry in the file is not used, not even checked."""
    fleet = await start_fleet(
        config(
            tokenizers=[
                {"model": "sim-model", "path": str(tmp_path / "absent")},
                {"model": "*", "huggingFace": "*"},
            ]
        ),
        names=("a", "b"),
        serve={"tokenizer_dirs": (("sim-model", str(qwen_dir())),)},
    )
    assert (await fleet.debug())["a"]["index"]["tokenizers"] == {
        "sim-model": "ready",
        "*": "per model from the Hugging Face Hub (0 of at most 8 models)",
    }
    await fleet.send("b", chat("Where is my order?"))
    await fleet.wait_blocks("b", 40)
    picked, scores = await fleet.pick(chat("Gift cards?"))
    assert picked == "b"
    assert scores["b"] > 0.9


def test_the_tokenizer_dir_flag() -> None:
    parser = build_parser()
    flags = ["--tokenizer-dir", "org/m=/t/m", "--tokenizer-dir", "x=y=z"]
    args = parser.parse_args(["serve", "--endpoints-file", "e.yaml", *flags])
    assert serve_options(args).tokenizer_dirs == (("org/m", "/t/m"), ("x", "y=z"))
    assert serve_options(parser.parse_args(["serve", "--endpoints-file", "e"])).tokenizer_dirs == ()
    for bad in ("model", "=dir", "model="):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--endpoints-file", "e", "--tokenizer-dir", bad])


def test_the_engines_hash_settings_are_still_accepted_and_change_nothing() -> None:
    """llm-d's configs (and ours before the index had its own keys) set them."""
    compat = {"hashSeed": "42", "hashAlgo": "xxhash_cbor", "extraKeysFormat": "plain"}
    loaded = load_config(config(**compat), PluginRegistry.from_entry_points())
    plain = load_config(config(), PluginRegistry.from_entry_points())
    tokens = list(range(100, 164))
    services = [c.services["prefix"] for c in (loaded, plain)]
    keys = [s.keys.keys(tokens) for s in services if isinstance(s, PrecisePrefixService)]
    assert len(keys) == 2
    assert keys[0] == keys[1]
