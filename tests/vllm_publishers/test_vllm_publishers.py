"""The EPP's precise prefix index fed by vLLM's own code: the events of real vLLM
KV-cache managers (block hashes from vLLM's hashing with an unseeded engine's
NONE_HASH, BlockStored / BlockRemoved / AllBlocksCleared from vLLM's BlockPool)
published by vLLM's ZmqEventPublisher, read by the EPP's subscriber over TCP. The
service has no hash settings (only blockSize): whatever seed and algorithm each
engine drew, the pod holding a prompt's blocks scores 1.

Opt-in, see conftest.py. Parametrized over the vLLM versions x the hash
algorithms x the seed: "default" is what an engine does with PYTHONHASHSEED
unset (a random NONE_HASH before vLLM 0.29; since then the fixed
"vllm-none-hash" for sha256 and sha256_cbor, random for the xxhash ones),
"random" a random PYTHONHASHSEED of the engine's own."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from bench.stack import free_ports
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.kvindex.blockkeys import HashContext
from epp.kvindex.service import PrecisePrefixConfig, PrecisePrefixService
from epp.tokenization.tokens import token_bytes
from tests.vllm_publishers.conftest import Driver, Drivers
from tests.vllm_publishers.prepare import VERSIONS

BS = 16
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SEEDS = ("default", "random")
# Unique engine ids across the session (one driver process hosts them all).
_engine_ids = itertools.count()

pytestmark = pytest.mark.timeout(300)


def prompt(rng: random.Random, blocks: int, extra: int = 0) -> list[int]:
    """Token ids as a real vocabulary's (Qwen2.5's size): random, so two prompts
    share no block unless built to."""
    return [rng.randrange(1, 151_000) for _ in range(blocks * BS + extra)]


@dataclass
class Pod:
    name: str
    engine: dict[str, Any]  # the driver's description: id, seed, NONE_HASH, ...
    endpoint: Endpoint
    batches: int = 0  # batches the engine published
    events: Counter[str] = field(default_factory=Counter)
    published: list[int | str] = field(default_factory=list)  # BlockStored hashes, in order


class Fleet:
    """vLLM engines in the driver, each a pod of one EPP precise-prefix service that
    follows their ZMQ sockets (kvEvents, kvEventsReplay) as `epp serve` does."""

    def __init__(self, driver: Driver, record: dict[str, Any]) -> None:
        self.driver = driver
        self.record = record
        self.pods: dict[str, Pod] = {}
        self.service: PrecisePrefixService | None = None
        self._task: asyncio.Task[None] | None = None

    async def call(self, **command: Any) -> dict[str, Any]:
        # The driver answers in milliseconds, but off the loop all the same: the
        # subscriber keeps reading meanwhile.
        return await asyncio.to_thread(self.driver.call, **command)

    async def start(self, engines: dict[str, dict[str, Any]], follow: bool = True) -> None:
        """Creates the engines and the service; `follow=False` leaves the service
        stopped (`follow()` starts it) for engines that publish before it joins."""
        ports = free_ports(2 * len(engines))
        specs: list[EndpointSpec] = []
        described: dict[str, dict[str, Any]] = {}
        for i, (name, options) in enumerate(engines.items()):
            pub, replay = ports[2 * i], ports[2 * i + 1]
            described[name] = await self.call(
                op="engine", id=f"e{next(_engine_ids)}-{name}", pub=pub, replay=replay, **options
            )
            specs.append(
                EndpointSpec(
                    name,
                    f"127.0.0.1:{8000 + i}",
                    kv_events=f"tcp://127.0.0.1:{pub}",
                    kv_events_replay=f"tcp://127.0.0.1:{replay}",
                )
            )
        datastore = Datastore()
        datastore.replace_all(specs)
        # The scorer's parameters as a config file gives them: no hash settings.
        config = msgspec.convert(
            {
                "blockSize": BS,
                "kvEventsConfig": {"replayTimeout": "500ms", "reconnectInterval": "50ms"},
            },
            PrecisePrefixConfig,
        )
        self.service = PrecisePrefixService(config, datastore)
        for name, engine in described.items():
            endpoint = datastore.get(name)
            assert endpoint is not None
            self.pods[name] = Pod(name, engine, endpoint)
        if follow:
            self.follow()
        self.record["engines"] = {
            name: {k: engine[k] for k in ("pythonhashseed", "none_hash", "int_hashes")}
            for name, engine in described.items()
        }

    def follow(self) -> None:
        self._task = asyncio.create_task(self.svc.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for pod in self.pods.values():
            with contextlib.suppress(Exception):
                await self.call(op="close", engine=pod.engine["id"])

    @property
    def svc(self) -> PrecisePrefixService:
        assert self.service is not None
        return self.service

    async def step(
        self, name: str, op: str = "request", wait: bool = True, **command: Any
    ) -> dict[str, Any]:
        """One engine step (a request admitted, or a cache reset), its events
        published by vLLM, then (`wait`) waits until the EPP applied them."""
        pod = self.pods[name]
        reply = await self.call(op=op, engine=pod.engine["id"], **command)
        for event in reply["events"]:
            pod.events[event["type"]] += 1
            if event["type"] == "BlockStored":
                pod.published.extend(event["block_hashes"])
        pod.batches = reply["batches"]
        if wait:
            await self.applied(pod)
        return reply

    async def applied(self, pod: Pod, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            streams = self.svc.subscriber.streams.get(pod.endpoint, [])
            last = streams[0][0].status.last_seq if streams else None
            if last is not None and last >= pod.batches - 1:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{pod.name}: the EPP applied batch {last}, vLLM published"
                    f" {pod.batches} (seq 0..{pod.batches - 1})"
                )
            await asyncio.sleep(0.01)

    def score(self, name: str, tokens: list[int], **context: Any) -> float:
        endpoints = [pod.endpoint for pod in self.pods.values()]
        found = self.svc.lookup(token_bytes(tokens), HashContext(**context), endpoints)
        return found.score(self.pods[name].endpoint)

    def scores(self, tokens: list[int], **context: Any) -> dict[str, float]:
        return {name: self.score(name, tokens, **context) for name in self.pods}

    def assert_clean(self) -> None:
        """Every event vLLM published was applied: none rejected, ignored or naming
        a hash the stream did not know, and every pod trusted."""
        precise = self.svc.precise
        totals: Counter[str] = Counter()
        for pod in self.pods.values():
            for stream in precise.streams(pod.endpoint):
                counters = stream.counters
                assert not counters.rejected, (pod.name, counters.rejected)
                assert not counters.ignored, (pod.name, counters.ignored)
                assert not counters.unknown_hashes, (pod.name, counters.unknown_hashes)
                assert stream.alignment.aligned is not False, pod.name
                totals["batches"] += counters.batches
                totals["events_applied"] += counters.events_applied
                totals["blocks_stored"] += counters.blocks_stored
                totals["blocks_removed"] += counters.blocks_removed
                totals["clears"] += sum(counters.clears.values())
            assert precise.trusted(pod.endpoint), pod.name
        self.record["epp"] = dict(totals)
        self.record["vllm_events"] = dict(sum((p.events for p in self.pods.values()), Counter()))


@pytest.fixture
async def fleet(
    drivers: Drivers, record: dict[str, Any], request: pytest.FixtureRequest
) -> AsyncIterator[Fleet]:
    params = request.node.callspec.params
    record.update({k: params[k] for k in ("version", "algo", "seed", "int_hashes") if k in params})
    driver = await asyncio.to_thread(drivers.get, params["version"])
    running = Fleet(driver, record)
    yield running
    await running.stop()


def engine(algo: str, seed: str, int_hashes: bool = True, **options: Any) -> dict[str, Any]:
    return {"algo": algo, "seed": seed, "int_hashes": int_hashes, **options}


versions = pytest.mark.parametrize("version", VERSIONS)
algos = pytest.mark.parametrize("algo", ALGOS)
seeds = pytest.mark.parametrize("seed", SEEDS)


@versions
@algos
@seeds
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
async def test_the_holding_pod_scores_one(
    fleet: Fleet, version: str, algo: str, seed: str, int_hashes: bool
) -> None:
    rng = random.Random(f"{version}-{algo}-{seed}-{int_hashes}")
    tokens = prompt(rng, 6)
    await fleet.start({"a": engine(algo, seed, int_hashes), "b": engine(algo, seed, int_hashes)})
    # Two requests, as a conversation grows: the first caches blocks 0-1; the second
    # hits them in vLLM's prefix cache and stores blocks 2-5 in an event whose
    # parent is block 1's engine hash.
    first = await fleet.step("a", id="r1", tokens=tokens[: 2 * BS + 5])
    second = await fleet.step("a", id="r2", tokens=tokens)
    assert second["cached_tokens"] == 2 * BS  # vLLM's own prefix-cache hit
    stored = [e for e in second["events"] if e["type"] == "BlockStored"]
    assert stored
    assert stored[0]["parent_block_hash"] == first["events"][0]["block_hashes"][-1]
    assert all(isinstance(h, int if int_hashes else str) for h in fleet.pods["a"].published)
    await fleet.step("b", id="r3", tokens=prompt(rng, 4))  # something else on b

    assert fleet.scores(tokens) == {"a": 1.0, "b": 0.0}
    assert fleet.score("a", tokens[: 3 * BS] + prompt(rng, 3)) == 0.5  # diverges at block 3
    assert fleet.score("a", tokens[: 4 * BS]) == 1.0
    assert fleet.score("a", prompt(rng, 6)) == 0.0
    fleet.assert_clean()
    fleet.record["blocks"] = len(fleet.pods["a"].published)


@versions
@algos
@seeds
async def test_removed_blocks_and_a_cleared_cache_score_nothing(
    fleet: Fleet, version: str, algo: str, seed: str
) -> None:
    rng = random.Random(f"{version}-{algo}-{seed}-removal")
    tokens, other = prompt(rng, 6), prompt(rng, 5)
    # A small cache (9 usable blocks): the second prompt makes vLLM's own LRU
    # evict the first one's tail blocks (freed tail first), as BlockRemoved.
    await fleet.start({"a": engine(algo, seed, num_blocks=10), "b": engine(algo, seed)})
    await fleet.step("a", id="r1", tokens=tokens)
    await fleet.step("b", id="r1", tokens=tokens)
    held = list(fleet.pods["a"].published)
    assert fleet.scores(tokens) == {"a": 1.0, "b": 1.0}

    reply = await fleet.step("a", id="r2", tokens=other)
    removed = [h for e in reply["events"] if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed, "vLLM evicted nothing: the cache was not full"
    first_removed = min(held.index(h) for h in removed)
    assert fleet.score("a", tokens) == first_removed / 6
    assert fleet.score("a", other) == 1.0
    assert fleet.score("b", tokens) == 1.0  # another pod's blocks stay

    reply = await fleet.step("a", op="reset")
    assert [e["type"] for e in reply["events"]] == ["AllBlocksCleared"]
    assert fleet.score("a", tokens) == fleet.score("a", other) == 0.0
    assert fleet.score("b", tokens) == 1.0
    # Stored again after the clear: indexed again.
    await fleet.step("a", id="r3", tokens=tokens)
    assert fleet.score("a", tokens) == 1.0
    fleet.assert_clean()
    fleet.record["blocks_removed_by_vllm"] = len(removed)


@versions
@algos
@seeds
async def test_salted_and_lora_blocks_are_credited_to_their_own_requests_only(
    fleet: Fleet, version: str, algo: str, seed: str
) -> None:
    rng = random.Random(f"{version}-{algo}-{seed}-extras")
    tokens = prompt(rng, 4, extra=7)
    await fleet.start(
        {"salted": engine(algo, seed), "plain": engine(algo, seed), "lora": engine(algo, seed)}
    )
    salted = await fleet.step("salted", id="r1", tokens=tokens, cache_salt="tenant-1")
    await fleet.step("plain", id="r1", tokens=tokens)
    lora = await fleet.step("lora", id="r1", tokens=tokens, lora={"name": "adapter-x", "id": 7})
    # What vLLM hashed into the blocks, as its events say.
    fleet.record["extra_keys"] = {
        "salted": salted["events"][0].get("extra_keys"),
        "lora": lora["events"][0].get("extra_keys"),
    }
    none = {"salted": 0.0, "plain": 0.0, "lora": 0.0}
    assert fleet.scores(tokens, cache_salt="tenant-1") == none | {"salted": 1.0}
    assert fleet.scores(tokens, cache_salt="tenant-2") == none
    assert fleet.scores(tokens) == none | {"plain": 1.0}
    assert fleet.scores(tokens, lora_name="adapter-x") == none | {"lora": 1.0}
    assert fleet.scores(tokens, lora_name="adapter-y") == none
    assert fleet.scores(tokens, lora_name="adapter-x", cache_salt="tenant-1") == none
    fleet.assert_clean()


@versions
@algos
async def test_engines_with_different_random_seeds_both_score_one(
    fleet: Fleet, version: str, algo: str
) -> None:
    rng = random.Random(f"{version}-{algo}-two-seeds")
    tokens = prompt(rng, 6)
    await fleet.start({"a": engine(algo, "random"), "b": engine(algo, "random")})
    assert fleet.pods["a"].engine["none_hash"] != fleet.pods["b"].engine["none_hash"]
    await fleet.step("a", id="r1", tokens=tokens)
    await fleet.step("b", id="r1", tokens=tokens)
    # Same tokens, unrelated engine hashes...
    assert not set(fleet.pods["a"].published) & set(fleet.pods["b"].published)
    # ...and the same own keys: one index entry a block, both pods score 1.
    assert fleet.scores(tokens) == {"a": 1.0, "b": 1.0}
    assert fleet.svc.precise.index.physical_keys() == 6
    fleet.assert_clean()


@versions
@algos
async def test_an_epp_joining_late_reads_the_engines_replay_buffer(
    fleet: Fleet, version: str, algo: str
) -> None:
    """The engine published before the EPP subscribed (its PUB socket dropped the
    batches): the EPP reads them from vLLM's replay socket (whose reply layout
    changed between versions) on connecting."""
    rng = random.Random(f"{version}-{algo}-late")
    tokens = prompt(rng, 6)
    await fleet.start({"a": engine(algo, "random"), "b": engine(algo, "random")}, follow=False)
    await fleet.step("a", id="r1", tokens=tokens[: 3 * BS], wait=False)
    await fleet.step("a", id="r2", tokens=tokens, wait=False)
    fleet.follow()
    await fleet.applied(fleet.pods["a"])
    assert fleet.scores(tokens) == {"a": 1.0, "b": 0.0}
    status = fleet.svc.subscriber.streams[fleet.pods["a"].endpoint][0][0].status
    assert status.replays >= 1
    fleet.record["replays"] = status.replays
    fleet.assert_clean()
