"""Precise prefix routing against real vLLM engines: client -> real Envoy ->
`epp serve` (precise-prefix-cache-scorer fed by vLLM's own KV events, with the
load scorers of manifests/config/precise-prefix.yaml) -> two vLLM CPU engines
serving a tiny random-weight Qwen2 model with the real Qwen2.5 tokenizer.

Everything runs twice, once per hashing mode (engines.MODES): vLLM's default hash,
and xxhash with a random seed per engine. The EPP's config has no hash settings in
either: its index keys blocks by the token ids the events carry.

The tests of one mode share one fleet and run in this file's order: the EPP is
started after the engines already cache a prefix each (replay on join), then
routing, the engines' counters and metrics, and last a restarted engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.provenance import portable_path
from bench.stack import ROOT
from tests.e2e_vllm.engines import (
    BLOCK_SIZE,
    MODEL_NAME,
    MODES,
    VllmFleet,
    VllmPod,
    engine_counters,
    ensure_model,
    first_block_hashes,
)
from tests.integration.conftest import Stack, running_stack
from tests.integration.faults import eventually

# Engines take minutes to start, twice in the last test.
pytestmark = pytest.mark.timeout(1800)

PODS = 2
SCORES_HEADER = "x-epp-scores"
SETTLE_S = 30.0
PRECISE_PROFILE = ROOT / "manifests" / "config" / "precise-prefix.yaml"
# How many shared-system-prompt groups the routing test warms at least, and at most
# (it goes on until each engine was chosen for two: first picks are ties between
# empty engines, broken at random).
GROUPS_MIN, GROUPS_MAX = 6, 16
FOLLOW_UPS = 3

TOPICS = (
    "train timetable", "river ferry", "mountain huts", "village bakery", "bicycle rental",
    "school library", "winter roads", "market stalls", "museum tours", "harbour tides",
    "bus depot", "ski lifts", "post office", "water mill", "night trains", "cheese dairy",
    "glacier walks", "bee keepers", "wine cellar", "old bridge",
)  # fmt: skip


def system_prompt(key: str) -> str:
    """About 900 tokens, distinct from its first words on (so no two groups share
    even block 0)."""
    topic = TOPICS[sum(key.encode()) % len(TOPICS)]
    rules = " ".join(
        f"Rule {i}: answer questions about the {topic} briefly, politely and exactly."
        for i in range(60)
    )
    return f"You are the assistant of group {key} for the {topic}. {rules}"


def chat_body(system: str, question: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
    }


def epp_config(model_dir: Path) -> str:
    """manifests/config/precise-prefix.yaml's profile for these engines, behind
    stale-metrics-filter (a killed engine's pod is dropped at its first refused
    scrape, not routed to until it is back: docs/vllm-e2e.md): blockSize 32
    (theirs), the tiny model's tokenizer by its served name, and no hash settings.
    Every pick is a tokenization probe (the manifest samples one in 32): the tier
    checks that the EPP tokenizes exactly as vLLM does."""
    config = yaml.safe_load(PRECISE_PROFILE.read_text())
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    scorer["parameters"].update(
        blockSize=BLOCK_SIZE,
        tokenizers=[{"model": MODEL_NAME, "path": str(model_dir)}],
        alignmentSampleEvery=1,
    )
    config["plugins"].insert(0, {"type": "stale-metrics-filter"})
    for profile in config["schedulingProfiles"]:
        profile["plugins"].insert(0, {"pluginRef": "stale-metrics-filter"})
    return yaml.safe_dump(config, sort_keys=False)


# -- the fleet, the EPP and Envoy, per mode ----------------------------------------------


@dataclass
class Tier:
    mode: str
    fleet: VllmFleet
    stack: Stack
    record: dict[str, Any]
    # Sent to one engine directly before the EPP started: engine name -> system prompt.
    joined: dict[str, str]
    # The routing test's groups: system prompt -> the engine that holds it.
    groups: dict[str, str] = field(default_factory=dict)
    # Seconds of the routed chats through Envoy (4 output tokens each; the metrics
    # test's long answers are recorded apart).
    latencies: list[float] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return list(self.fleet.pods)

    def pod(self, name: str) -> VllmPod:
        return self.fleet[name]

    def other(self, name: str) -> str:
        (other,) = (n for n in self.names if n != name)
        return other


def _post_direct(pod: VllmPod, body: dict[str, Any]) -> dict[str, Any]:
    """One request straight to an engine (no Envoy, no EPP), before the EPP exists."""
    request = urllib.request.Request(
        pod.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


@pytest.fixture(scope="module", params=list(MODES))
def tier(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    results: dict[str, Any],
) -> Iterator[Tier]:
    mode: str = request.param
    model_dir = ensure_model()
    workdir = tmp_path_factory.mktemp(f"vllm-{mode}")
    fleet = VllmFleet(workdir, PODS, mode)
    record: dict[str, Any] = results["modes"].setdefault(mode, {"checks": {}})
    record["engine_command"] = fleet["vllm-0"].portable_argv()
    record["model"] = portable_path(model_dir)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(fleet.stop)
        fleet.start()
        record["pod_start_seconds"] = {n: p.start_seconds for n, p in fleet.pods.items()}
        # Before any EPP: each engine caches a prefix of its own, and both one common
        # prompt, whose first block shows whether the engines hash alike.
        joined = {name: system_prompt(f"join-{mode}-{name}") for name in fleet.pods}
        for name, system in joined.items():
            _post_direct(fleet[name], chat_body(system, "Who are you?"))
        common = chat_body(system_prompt(f"common-{mode}"), "Hello?")
        for pod in fleet.pods.values():
            _post_direct(pod, common)
        hashes = [first_block_hashes(pod) for pod in fleet.pods.values()]
        shared = set(hashes[0]) & set(hashes[1])
        assert shared, "the common prompt's first block is in neither replay buffer"
        record["engine_hashes_agree"] = all(hashes[0][k] == hashes[1][k] for k in shared)
        endpoints = fleet.endpoints_file(workdir / "endpoints.yaml")
        config = epp_config(model_dir)
        record["epp_config"] = yaml.safe_load(config.replace(str(model_dir), "out/vllm-model"))
        stack = cleanup.enter_context(
            running_stack(
                workdir, endpoints_file=endpoints, config_text=config, epp_args=["--score-header"]
            )
        )
        tier = Tier(mode, fleet, stack, record, joined)
        yield tier
        if tier.latencies:
            record["latency_s"] = {
                "requests": len(tier.latencies),
                "p50": round(statistics.median(tier.latencies), 4),
                "max": round(max(tier.latencies), 4),
            }


# -- talking to it -------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    pod: str | None  # the EPP's pick, from x-epp-scores (through Envoy only)
    usage: dict[str, Any]
    seconds: float
    text: str = ""

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def picked(header: str | None) -> str | None:
    """The endpoint marked `*` in x-epp-scores (`vllm-0*=0.8333,vllm-1=0.5000`)."""
    for part in (header or "").split(","):
        name = part.split("=", 1)[0]
        if name.endswith("*"):
            return name[:-1]
    return None


async def chat(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float = 60.0
) -> Reply:
    started = time.monotonic()
    async with session.post(
        url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        text = await response.text()
        seconds = time.monotonic() - started
        usage: dict[str, Any] = {}
        if response.status == 200:
            usage = (await response.json(content_type=None))["usage"]
        return Reply(
            response.status, picked(response.headers.get(SCORES_HEADER)), usage, seconds, text
        )


async def via_envoy(
    session: aiohttp.ClientSession, tier: Tier, body: dict[str, Any], *, timed: bool = True
) -> Reply:
    # Generous: decoding on two shared cores, beside other work, can be slow.
    reply = await chat(session, tier.stack.url, body, timeout_s=120)
    assert reply.status == 200, reply.text[:500]
    if timed:
        tier.latencies.append(reply.seconds)
    return reply


async def explain(
    session: aiohttp.ClientSession, tier: Tier, body: dict[str, Any]
) -> dict[str, float]:
    """The precise scorer's score of each engine for `body`, now (nothing changes)."""
    query = {"path": "/v1/chat/completions", "headers": {}, "body": body}
    async with session.post(tier.stack.admin_url + "/debug/explain", json=query) as response:
        assert response.status == 200, await response.text()
        found = await response.json()
    return {c["name"]: float(c["scores"]["prefix"]) for c in found["candidates"]}


async def debug_endpoints(session: aiohttp.ClientSession, tier: Tier) -> dict[str, Any]:
    async with session.get(tier.stack.admin_url + "/debug/endpoints") as response:
        assert response.status == 200
        return {e["name"]: e for e in await response.json()}


async def counters(tier: Tier) -> dict[str, dict[str, float]]:
    return {
        name: await asyncio.to_thread(engine_counters, pod) for name, pod in tier.fleet.pods.items()
    }


def expected_score(reply: Reply) -> float:
    """The share of the prompt's full blocks the engine really served from its
    cache: what the precise score of the engine that served it must have been."""
    full = reply.prompt_tokens // BLOCK_SIZE
    return (reply.cached_tokens // BLOCK_SIZE) / full if full else 0.0


async def routed_check(
    session: aiohttp.ClientSession, tier: Tier, body: dict[str, Any], holder: str
) -> dict[str, Any]:
    """One request that must go to `holder`: the explain before it, the pick, the
    engines' counters around it. Returns what was seen; asserts every part."""
    scores = await explain(session, tier, body)
    before = await counters(tier)
    reply = await via_envoy(session, tier, body)
    after = await counters(tier)
    hits = {n: after[n]["hits"] - before[n]["hits"] for n in tier.names}
    seen = {
        "holder": holder,
        "picked": reply.pod,
        "scores": scores,
        "prompt_tokens": reply.prompt_tokens,
        "cached_tokens": reply.cached_tokens,
        "hit_deltas": hits,
        "seconds": round(reply.seconds, 4),
    }
    other = tier.other(holder)
    assert reply.pod == holder, seen
    # The precise score is the engine's own: the blocks it then served from cache.
    assert scores[holder] == pytest.approx(expected_score(reply)), seen
    assert scores[holder] > 0.8, seen
    assert scores[other] == 0.0, seen
    # The engines' own counters agree: all hits on the holder, none elsewhere.
    assert hits[holder] == reply.cached_tokens > 0, seen
    assert hits[other] == 0, seen
    return seen


async def wait_indexed(
    session: aiohttp.ClientSession, tier: Tier, name: str, blocks_at_least: int
) -> None:
    async def grown() -> bool:
        entry = (await debug_endpoints(session, tier))[name]
        return bool(entry["index"]["blocks"] >= blocks_at_least)

    await eventually(grown, f"{name}'s index reaches {blocks_at_least} blocks")


# -- 3. replay on join -----------------------------------------------------------------------


async def test_replay_brings_in_what_engines_cached_before_the_epp_started(tier: Tier) -> None:
    check: dict[str, Any] = {"passed": False}
    tier.record["checks"]["replay_on_join"] = check
    # The mode is what it says: engines agree on block hashes only with vLLM's
    # default (constant seed); with xxhash each drew its own seed.
    assert tier.record["engine_hashes_agree"] == (tier.mode == "default")
    async with aiohttp.ClientSession() as session:

        async def ready() -> dict[str, Any] | None:
            entries = await debug_endpoints(session, tier)
            ok = all(
                e["index"].get("state") == "live"
                and e["index"]["blocks"] > 0
                and e["index"]["tokenizers"] == {MODEL_NAME: "ready"}
                for e in entries.values()
            )
            return entries if ok else None

        entries = await eventually(ready, "both streams live, replayed, the tokenizer loaded")
        check["blocks_after_join"] = {n: e["index"]["blocks"] for n, e in entries.items()}
        check["replays"] = {n: e["index"]["replays"] for n, e in entries.items()}
        seen = []
        for name, system in tier.joined.items():
            body = chat_body(system, "And what do you know?")
            seen.append(await routed_check(session, tier, body, name))
        check["requests"] = seen
        check["right"] = sum(s["picked"] == s["holder"] for s in seen)
        check["total"] = len(seen)
    check["passed"] = True


# -- 1 and 2. routing follows the engines' caches; their counters agree ---------------------


async def test_requests_sharing_a_system_prompt_go_to_the_engine_that_holds_it(
    tier: Tier,
) -> None:
    check: dict[str, Any] = {"passed": False}
    tier.record["checks"]["routing"] = check
    warm: list[dict[str, Any]] = []
    follow: list[dict[str, Any]] = []
    check["warm"], check["follow_ups"] = warm, follow
    async with aiohttp.ClientSession() as session:
        g = 0
        while g < GROUPS_MAX:
            chosen = list(tier.groups.values())
            if g >= GROUPS_MIN and all(chosen.count(n) >= 2 for n in tier.names):
                break
            system = system_prompt(f"{tier.mode}-{g}")
            g += 1
            body = chat_body(system, "Question 0: when does the first one leave?")
            # Cold: nobody holds it.
            cold = await explain(session, tier, body)
            assert set(cold.values()) == {0.0}, cold
            blocks = {
                n: e["index"]["blocks"] for n, e in (await debug_endpoints(session, tier)).items()
            }
            reply = await via_envoy(session, tier, body)
            assert reply.pod in tier.names, reply
            tier.groups[system] = reply.pod
            warm.append({"picked": reply.pod, "prompt_tokens": reply.prompt_tokens})
            # The engine's own events (not the pick's speculative entry) are in.
            await wait_indexed(
                session, tier, reply.pod, blocks[reply.pod] + reply.prompt_tokens // BLOCK_SIZE
            )
            for k in range(1, FOLLOW_UPS + 1):
                # The last question is long enough to fill blocks of its own: the
                # holder's score is then a fraction, the engine's hits must match it.
                question = f"Question {k}: when does train number {k * 7} leave?"
                if k == FOLLOW_UPS:
                    question += " I also need the platform, the fare and the stops." * 8
                follow.append(
                    await routed_check(session, tier, chat_body(system, question), reply.pod)
                )
        chosen = list(tier.groups.values())
        check["groups"] = len(tier.groups)
        check["warm_picks"] = {n: chosen.count(n) for n in tier.names}
        check["right"] = sum(s["picked"] == s["holder"] for s in follow)
        check["total"] = len(follow)
        holder_scores = sorted({round(s["scores"][s["holder"]], 4) for s in follow})
        other_scores = sorted({round(s["scores"][tier.other(s["holder"])], 4) for s in follow})
        check["precise_scores"] = {"holder": holder_scores, "other": other_scores}
        entries = await debug_endpoints(session, tier)
        check["tokenization_probes"] = {
            n: e["index"].get("tokenizationProbes") for n, e in entries.items()
        }
        assert all(c >= 1 for c in check["warm_picks"].values()), check["warm_picks"]
        for name, entry in entries.items():
            assert entry["index"]["aligned"] is True, entry
            probes = entry["index"].get("tokenizationProbes") or {}
            assert probes.get("missed", 0) == 0, (name, probes)
        assert any((p or {}).get("confirmed", 0) > 0 for p in check["tokenization_probes"].values())
        hits_check: dict[str, Any] = {
            "passed": True,
            "requests": len(follow),
            "holder_hit_tokens": sum(s["hit_deltas"][s["holder"]] for s in follow),
            "other_hit_tokens": sum(s["hit_deltas"][tier.other(s["holder"])] for s in follow),
            "cached_tokens_reported": sum(s["cached_tokens"] for s in follow),
            "prompt_tokens": sum(s["prompt_tokens"] for s in follow),
            "engine_counters_after": await counters(tier),
        }
        tier.record["checks"]["hit_counters"] = hits_check
    check["passed"] = True


# -- 5. the metrics scraper reads real vLLM pages ---------------------------------------------


async def test_the_scraper_reads_the_engines_metrics(tier: Tier) -> None:
    check: dict[str, Any] = {"passed": False}
    tier.record["checks"]["metrics_scraper"] = check
    async with aiohttp.ClientSession() as session:
        entries = await debug_endpoints(session, tier)
        for name, entry in entries.items():
            metrics = entry["metrics"]
            assert metrics["stale"] is False, (name, metrics)
            # vLLM publishes vllm:lora_requests_info only with --enable-lora.
            assert set(metrics["missing"]) <= {"lora"}, (name, metrics)
            assert metrics["cacheInfo"]["blockSize"] == BLOCK_SIZE, (name, metrics)
            for key in ("waiting", "running", "kvCacheUsage"):
                assert isinstance(metrics[key], int | float), (name, key, metrics)
        check["idle"] = {n: e["metrics"] for n, e in entries.items()}
        # Long answers in parallel: the scraper must see them running.
        peak: dict[str, dict[str, float]] = {
            n: {"running": 0, "waiting": 0, "kvCacheUsage": 0.0} for n in tier.names
        }
        check["peak"] = peak
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                for name, entry in (await debug_endpoints(session, tier)).items():
                    for key in peak[name]:
                        value = entry["metrics"][key] or 0
                        peak[name][key] = max(peak[name][key], value)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        bodies = [
            {**chat_body(system_prompt(f"{tier.mode}-burst-{i}"), "Tell a long story."),
             "max_tokens": 48, "ignore_eos": True}
            for i in range(4)
        ]  # fmt: skip
        replies = await asyncio.gather(*(via_envoy(session, tier, b, timed=False) for b in bodies))
        done.set()
        await watcher
        check["burst"] = {
            "requests": len(replies),
            "seconds": [round(r.seconds, 3) for r in replies],
        }
        assert sum(p["running"] for p in peak.values()) >= 1, peak
        assert max(p["kvCacheUsage"] for p in peak.values()) > 0, peak
    check["passed"] = True


# -- 4. an engine killed and started again on the same ports -----------------------------------


@dataclass
class Outcome:
    started: float
    ended: float
    status: int | None
    pod: str | None


async def test_a_restarted_engine_is_forgotten_and_routed_to_again(tier: Tier) -> None:
    check: dict[str, Any] = {"passed": False}
    tier.record["checks"]["pod_restart"] = check
    victim = "vllm-1"
    survivor = tier.other(victim)
    assert tier.groups, "the routing test warmed no groups"
    async with aiohttp.ClientSession() as session:
        # A prefix only the victim's old engine has: the EPP must forget it.
        forgotten = system_prompt(f"{tier.mode}-forgotten")
        await chat(session, tier.pod(victim).url, chat_body(forgotten, "Remember me?"))
        probe = chat_body(forgotten, "Do you still?")

        async def victim_holds() -> bool:
            return (await explain(session, tier, probe))[victim] > 0.9

        await eventually(victim_holds, "the victim's own prefix indexed")
        before = (await debug_endpoints(session, tier))[victim]["index"]
        check["victim_blocks_before"] = before["blocks"]

        outcomes: list[Outcome] = []
        stop = asyncio.Event()
        prompts = list(tier.groups)

        async def one(n: int) -> None:
            body = chat_body(prompts[n % len(prompts)], f"Load {n}: what now?")
            started = time.monotonic()
            try:
                reply = await chat(session, tier.stack.url, body, timeout_s=30)
                outcomes.append(Outcome(started, time.monotonic(), reply.status, reply.pod))
            except (aiohttp.ClientError, TimeoutError):
                outcomes.append(Outcome(started, time.monotonic(), None, None))

        async def load() -> None:
            tasks = set()
            n = 0
            while not stop.is_set():
                task = asyncio.create_task(one(n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            if tasks:
                await asyncio.wait(tasks)

        loader = asyncio.create_task(load())
        await asyncio.sleep(3)
        killed = time.monotonic()
        tier.pod(victim).kill()
        await asyncio.sleep(1)
        # Blocking (minutes): in a thread, so the load goes on meanwhile.
        await asyncio.to_thread(tier.fleet.start, victim)
        healthy = time.monotonic()
        check["restart_seconds"] = tier.pod(victim).start_seconds[-1]

        last: list[dict[str, Any]] = []

        async def restart_seen() -> dict[str, Any] | None:
            entry = (await debug_endpoints(session, tier))[victim]
            last[:] = [entry["index"]]
            return entry if entry["index"]["restarts"] >= 1 else None

        try:
            entry = await eventually(restart_seen, "the EPP sees the new engine", timeout_s=60)
        finally:
            check["victim_index_last_seen"] = last[0] if last else None
        detected = time.monotonic()
        check["restart_detected_after_healthy_s"] = round(detected - healthy, 2)
        check["victim_index_after"] = {
            k: entry["index"].get(k)
            for k in ("blocks", "restarts", "disconnects", "replays", "state")
        }

        # The new engine is a candidate again once its metrics are fresh (the
        # profile's stale-metrics-filter dropped it while it refused them), and the
        # old engine's blocks are gone from the EPP: its own prefix scores 0.
        async def candidate_again() -> dict[str, float] | None:
            scores = await explain(session, tier, probe)
            return scores if victim in scores else None

        scores = await eventually(candidate_again, "the new engine is a candidate", timeout_s=60)
        assert scores[victim] == 0.0
        await asyncio.sleep(3)
        stop.set()
        await loader

        # Routing recovered: each group's next request goes where the engines' caches
        # say, and what the engine then reuses is what the EPP scored.
        after: list[dict[str, Any]] = []
        for system in prompts:
            body = chat_body(system, "After the restart: which platform?")
            scores = await explain(session, tier, body)
            reply = await via_envoy(session, tier, body)
            best = max(scores, key=lambda n: scores[n])
            after.append({"scores": scores, "picked": reply.pod, "cached": reply.cached_tokens})
            if scores[best] > 0:
                assert reply.pod == best, after[-1]
                assert scores[best] == pytest.approx(expected_score(reply)), after[-1]
        check["after"] = after
        # Groups whose engine died and that no request has brought back since are
        # cold (every score 0, any pick is right); the others must go to the holder.
        warm_after = [a for a in after if max(a["scores"].values()) > 0]
        check["right_after"] = sum(
            a["picked"] == max(a["scores"], key=lambda n: a["scores"][n]) for a in warm_after
        )
        check["total_after"] = len(warm_after)
        check["cold_after"] = len(after) - len(warm_after)
        # Traffic returns to the new engine: a prefix only it caches (sent to it
        # directly) draws the next request with that prefix.
        fresh = system_prompt(f"{tier.mode}-after-restart")
        await chat(session, tier.pod(victim).url, chat_body(fresh, "Are you new?"))
        fresh_body = chat_body(fresh, "Really new?")

        async def victim_holds_fresh() -> bool:
            return (await explain(session, tier, fresh_body))[victim] > 0.9

        await eventually(victim_holds_fresh, "the new engine's own prefix indexed")
        check["new_engine"] = await routed_check(session, tier, fresh_body, victim)

    failed = [o for o in outcomes if o.status != 200]
    check["load"] = {
        "requests": len(outcomes),
        "failed": len(failed),
        "failed_before_healthy": len([o for o in failed if o.started < healthy]),
        "window_s": round(healthy - killed, 1),
        "to_victim_after_healthy": len(
            [o for o in outcomes if o.started >= healthy and o.pod == victim]
        ),
        "to_survivor": len([o for o in outcomes if o.pod == survivor]),
    }
    # Only requests started in the restart window (kill to healthy again) failed.
    assert all(killed <= o.ended and o.started < healthy for o in failed), check["load"]
    check["passed"] = True
