"""`python -m bench.pick`: what precise prefix routing costs, in-process.

Five measurements (docs/performance.md, "Precise prefix routing"; (c) in
docs/routing.md):

- pick latency, (a): a chat request whose 2,000-token system prompt was seen before
  (two of the pods hold it) plus a new 200-token user message;
- pick latency, (b): an unseen 8,000-token completion prompt, next to the time
  tokenizing such a prompt takes by itself;
- KV-event ingestion: vLLM-format payloads (16-block BlockStored events with their
  tokens, and removals) decoded and applied, in blocks per second on one core;
- index memory per (block, pod) entry at 1,000,000 entries, filled through the
  ingestion (the index and the engine-hash maps; tracemalloc and RSS);
- (c) the picks of shipped configs side by side (`--configs`, default
  `weighted,default`: the weighted profile that was the default, and the
  default), every hook of a routed request included, on `--pods` endpoints or
  on several fleet sizes taking turns (`--config-pods 1,16,64`).

The pick is the director's `pick_endpoint` with the `precise-prefix-cache-scorer`
(speculative indexing on) and `max-score-picker`, over 16 endpoints whose index is
filled through the real ingestion path; tokenization uses the real Qwen2.5
tokenizer. Nothing here touches the network: it measures the EPP's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import shlex
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml
import zmq.asyncio

from bench.provenance import emit, provenance
from bench.stats import latency_ms
from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.kvindex.alignment import AlignmentChecker
from epp.kvindex.events import HASH_MASK, BlockStored, EventBatch, decode_batch
from epp.kvindex.index import PrefixIndex
from epp.kvindex.ingest import PreciseIndex, StreamIndex
from epp.kvindex.service import PrecisePrefixService
from epp.kvindex.subscriber import KVEventStream, SubscriberSettings
from epp.logs import LogOnce
from epp.memory import rss_bytes
from epp.requests import parse_request
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry
from epp.tokenization.tokenizer import PromptTokenizer
from epp.tokenization.tokens import token_bytes, token_ids
from sim.hashing import BlockHasher, to_event_hash

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT.parent / "shared" / "testdata" / "tokenizers" / "qwen2_5"
WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "be",
    "have",
    "do",
    "say",
    "get",
    "make",
    "go",
    "know",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "right",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "to",
    "of",
    "in",
    "for",
    "on",
    "with",
    "at",
    "by",
    "from",
    "up",
    "about",
    "into",
    "over",
    "after",
    "river",
    "mountain",
    "station",
    "ticket",
    "window",
    "garden",
    "kitchen",
]


_CONFIG = yaml.safe_dump(
    {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "type": "precise-prefix-cache-scorer",
                "name": "prefix",
                "parameters": {
                    "blockSize": 16,
                    "speculativeIndexing": True,
                    "tokenizers": [{"model": "*", "path": str(QWEN)}],
                },
            },
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


def _percentiles(samples: list[float]) -> dict[str, float]:
    """n, then p50/p90/p99/mean in ms of pick times in seconds (pick.json's shape)."""
    return {"n": len(samples), **latency_ms(samples)}


class Texts:
    """Random English-like text of an exact token count (for the Qwen tokenizer)."""

    def __init__(self, tokenizer: PromptTokenizer, seed: int = 1) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def make(self, tokens: int) -> str:
        words = " ".join(self.rng.choice(WORDS) for _ in range(int(tokens * 1.3) + 10))
        ids = token_ids(self.tokenizer.encode_now(words))[:tokens]
        return str(self.tokenizer._model.decode(ids))


def _engine_event(hasher: BlockHasher, tokens: list[int]) -> dict[str, Any]:
    """A BlockStored event as vLLM (>= 0.24) publishes it for a prompt's full blocks."""
    keys = [to_event_hash(d) for d in hasher.block_hashes(tokens)]
    size = hasher.block_size
    return {
        "type": "BlockStored",
        "block_hashes": keys,
        "parent_block_hash": None,
        "token_ids": tokens[: len(keys) * size],
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(keys),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def _payload(*events: dict[str, Any]) -> Any:
    return decode_batch(msgspec.msgpack.encode([time.time(), list(events), 0]))


def _fill(
    sinks: list[StreamIndex], hasher: BlockHasher, rng: random.Random, blocks_per_pod: int
) -> None:
    """Give every pod `blocks_per_pod` blocks of random prompts, through ingestion."""
    for sink in sinks:
        for _ in range(blocks_per_pod // 64):
            prompt = [rng.randrange(151_000) for _ in range(64 * 16)]
            sink.apply(_payload(_engine_event(hasher, prompt)))


@dataclass
class PickSetup:
    director: Director
    service: PrecisePrefixService
    tokenizer: PromptTokenizer
    texts: Texts
    system: str


async def _setup(pods: int) -> PickSetup:
    datastore = Datastore()
    datastore.replace_all(
        EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000", kv_events=f"tcp://10.0.0.{i + 1}:5557")
        for i in range(pods)
    )
    config = load_config(_CONFIG, PluginRegistry.from_entry_points(), datastore=datastore)
    service = config.services["prefix"]
    assert isinstance(service, PrecisePrefixService)
    await service.tokenizers.load()
    tokenizer = service.tokenizers.resolve("m").tokenizer
    assert tokenizer is not None
    director = Director(datastore, config, Telemetry(datastore))
    # The subscriber is not started: the pods' streams are fed by hand, through the
    # same ingestion path as live events.
    sinks = [service.precise.add_stream(e, 0) for e in datastore.all_endpoints()]
    hasher = BlockHasher("sha256", "0", 16)
    _fill(sinks, hasher, random.Random(7), 4096)  # 16 x 4096 blocks of other prompts
    texts = Texts(tokenizer)
    # A 2,000-token system prompt, cached on two pods (the rendered prefix).
    system = texts.make(2000)
    system_ids = token_ids(tokenizer.encode_now("<|im_start|>system\n" + system + "<|im_end|>\n"))
    for sink in sinks[3:5]:
        sink.apply(_payload(_engine_event(hasher, system_ids)))
    return PickSetup(director, service, tokenizer, texts, system)


async def _timed_pick(director: Director, request: Any) -> tuple[float, str]:
    started = time.perf_counter()
    decision = await director.pick_endpoint(request)
    elapsed = time.perf_counter() - started
    director.finish(decision, ResponseInfo(completed=True))
    return elapsed, decision.endpoint.name


async def measure_chat(setup: PickSetup, iterations: int, warmup: int) -> dict[str, Any]:
    """(a): the cached 2,000-token system prompt plus a new 200-token message."""
    samples: list[float] = []
    picked: dict[str, int] = {}
    for i in range(iterations + warmup):
        body = msgspec.json.encode(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": setup.system},
                    {"role": "user", "content": setup.texts.make(200)},
                ],
            }
        )
        request = parse_request(
            request_id=str(i), method="POST", path="/v1/chat/completions", headers={}, body=body
        )
        gc.collect(0)
        elapsed, name = await _timed_pick(setup.director, request)
        if i >= warmup:
            samples.append(elapsed)
            picked[name] = picked.get(name, 0) + 1
    return {**_percentiles(samples), "picked": picked}


async def measure_completion(setup: PickSetup, iterations: int) -> dict[str, Any]:
    """(b): unseen 8,000-token completion prompts.

    Each prompt is also tokenized by itself, by the tokenizer directly (so the EPP's
    caches never see it) and on the worker threads the pick uses; the pick's cost
    over tokenization is the difference, pair by pair, which keeps most of this
    machine's noise out of it. The second encoding of a text is a little cheaper (the
    tokenizer's own word cache), so the two take turns at going first. Then the same
    request is picked again, its tokens now cached: the EPP's own work for it."""
    encode = setup.tokenizer._model.encode_batch_fast
    executor = setup.service.tokenizers.executor
    loop = asyncio.get_running_loop()

    def tokenize(text: str) -> bytes:
        return token_bytes(encode([text], add_special_tokens=True)[0].ids)

    async def alone(text: str) -> float:
        started = time.perf_counter()
        await loop.run_in_executor(executor, tokenize, text)
        return time.perf_counter() - started

    unseen: list[float] = []
    tokenizing: list[float] = []
    over: list[float] = []
    known: list[float] = []
    warmup = 5
    for i in range(iterations + warmup):
        text = setup.texts.make(8000)
        body = msgspec.json.encode({"model": "m", "prompt": text})
        request = parse_request(
            request_id=f"b{i}", method="POST", path="/v1/completions", headers={}, body=body
        )
        gc.collect(0)
        if i % 2:
            tokenized = await alone(text)
            first, _ = await _timed_pick(setup.director, request)
        else:
            first, _ = await _timed_pick(setup.director, request)
            tokenized = await alone(text)
        again, _ = await _timed_pick(setup.director, request)
        if i >= warmup:
            unseen.append(first)
            tokenizing.append(tokenized)
            over.append(first - tokenized)
            known.append(again)
    return {
        "pick_unseen": _percentiles(unseen),
        "tokenize_alone": _percentiles(tokenizing),
        "pick_minus_tokenize": _percentiles(over),
        "pick_tokens_known": _percentiles(known),
    }


async def measure_pick(pods: int, iterations: int, warmup: int) -> dict[str, Any]:
    setup = await _setup(pods)
    try:
        return {
            "a_chat_2000_cached_plus_200_new": await measure_chat(setup, iterations, warmup),
            "b_completion_8000_unseen": await measure_completion(setup, max(20, iterations // 10)),
            "index_entries": setup.service.precise.index.stats.entries,
        }
    finally:
        setup.service.tokenizers.close()


def _ingest_payloads(
    hasher: BlockHasher, rng: random.Random, batches: int
) -> tuple[list[bytes], int]:
    """Engine-like batches: a 16-block BlockStored (256 tokens) per step, and a
    16-block BlockRemoved every other step."""
    payloads = []
    blocks = 0
    stored: list[list[int]] = []
    for step in range(batches):
        event = _engine_event(hasher, [rng.randrange(151_000) for _ in range(256)])
        events = [event]
        blocks += len(event["block_hashes"])
        stored.append(event["block_hashes"])
        if step % 2:
            gone = stored.pop(0)
            events.append(
                {"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU", "group_idx": 0}
            )
            blocks += len(gone)
        payloads.append(msgspec.msgpack.encode([time.time(), events, 0]))
    return payloads, blocks


async def measure_ingestion(batches: int) -> dict[str, Any]:
    """Blocks per second through a stream's whole per-message path (frames, seq,
    decode, apply, sampled alignment check), without the socket: what the event loop
    spends per message, on one core (process CPU time)."""
    rng = random.Random(3)
    payloads, blocks = _ingest_payloads(BlockHasher("sha256", "0", 16), rng, batches)
    out: dict[str, Any] = {"batches": batches, "blocks": blocks}
    for name, check in (("alignment_check_on", True), ("alignment_check_off", False)):
        precise = PreciseIndex(
            PrefixIndex(10_000_000, {"gpu": 1.0, "cpu": 0.8}),
            16,
            AlignmentChecker(16, clock=time.monotonic) if check else None,
            None,
        )
        datastore = Datastore()
        datastore.replace_all([EndpointSpec("pod", "10.0.0.1:8000")])
        sink = precise.add_stream(datastore.all_endpoints()[0], 0)
        stream = KVEventStream(
            zmq.asyncio.Context.instance(),
            sink,
            "tcp://127.0.0.1:1",
            None,
            SubscriberSettings(),
            LogOnce(logging.getLogger("bench")),
        )
        messages = [[b"", seq.to_bytes(8, "big"), p] for seq, p in enumerate(payloads)]
        gc.collect()
        started = time.process_time()
        for message in messages:
            await stream.handle(message)
        cpu = time.process_time() - started
        assert stream.status.gaps == 0
        assert sink.alignment.aligned is not False
        out[name] = {"cpu_s": cpu, "blocks_per_s": blocks / cpu, "batches_per_s": batches / cpu}
    return out


async def measure_configs(
    names: list[str], fleets: list[int], iterations: int
) -> dict[int, dict[str, Any]]:
    """(c) The pick of shipped configs (manifests/config/NAME.yaml) side by side, with
    every hook a routed request runs (pre-request, first chunk, end): chat requests
    with one of 16 system prompts of 2,000 words and a new 200-word message, over
    each fleet size in `fleets` (endpoints). Every config on every fleet picks each
    request in turn, the order reversed every other request, so a host whose speed
    moves (a shared machine's does, by half within minutes) slows them alike and
    their differences, the cost of more candidates included, are measured at one
    speed; the first 16 x 4 requests of each warm its prefix index. Returns, per
    fleet size, each config's pick latencies."""
    rng = random.Random(3)
    systems = [" ".join(rng.choice(WORDS) for _ in range(2000)) for _ in range(16)]
    # The requests' model gets the local tokenizer, as `epp serve --tokenizer-dir`
    # gives it (the shipped precise profiles fetch each model's from the Hub).
    local = (("m", str(QWEN)),) if (QWEN / "tokenizer.json").is_file() else ()
    directors: dict[tuple[int, str], Director] = {}
    for pods in fleets:
        for name in names:
            datastore = Datastore()
            datastore.replace_all(
                EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(pods)
            )
            text = (ROOT / "manifests" / "config" / f"{name}.yaml").read_text()
            config = load_config(
                text,
                PluginRegistry.from_entry_points(),
                datastore=datastore,
                settings=ServerSettings(tokenizer_dirs=local),
            )
            directors[pods, name] = Director(datastore, config, Telemetry(datastore))
    samples: dict[tuple[int, str], list[float]] = {key: [] for key in directors}
    turns = list(directors)
    warmup = 64
    for i in range(iterations + warmup):
        body = msgspec.json.encode(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": systems[i % 16]},
                    {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(200))},
                ],
            }
        )
        for key in turns if i % 2 == 0 else reversed(turns):
            director = directors[key]
            request = parse_request(
                request_id=str(i), method="POST", path="/v1/chat/completions", headers={}, body=body
            )
            gc.collect(0)
            started = time.perf_counter()
            decision = await director.pick_endpoint(request)
            elapsed = time.perf_counter() - started
            director.first_chunk(decision)
            director.finish(decision, ResponseInfo(completed=True))
            if i >= warmup:
                samples[key].append(elapsed)
    return {pods: {name: _percentiles(samples[pods, name]) for name in names} for pods in fleets}


def fleet_sizes(text: str) -> list[int]:
    """`--config-pods`: comma-separated fleet sizes, each at least 1."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected fleet sizes like 1,16,64, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"fleet sizes must be 1 or more, got {text!r}")
    return list(dict.fromkeys(sizes))


def _rss_bytes() -> int:
    rss = rss_bytes()
    if rss is None:
        raise SystemExit("measuring RSS needs Linux's /proc")
    return rss


def fill_precise_index(
    entries: int, holders: int, pods: int
) -> tuple[PrefixIndex, list[StreamIndex]]:
    """A fresh precise index holding `entries` (block, pod) entries over `pods`
    endpoints, filled through the KV-event ingestion: 16-block BlockStored events
    with their tokens, each applied to `holders` pods' streams. Engine hashes are
    random ints created here, like the decoded events' are."""
    rng = random.Random(11)
    datastore = Datastore()
    datastore.replace_all(EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(pods))
    index = PrefixIndex(entries * 2, {"gpu": 1.0, "cpu": 0.8})
    precise = PreciseIndex(index, 16, None, None)
    streams = [precise.add_stream(e, 0) for e in datastore.all_endpoints()]
    per_event = 16
    for n in range(0, entries // holders, per_event):
        # As the decoder hands them over: an engine hash's low 60 bits.
        hashes = [rng.getrandbits(64) & HASH_MASK for _ in range(per_event)]
        tokens = [rng.getrandbits(17) for _ in range(per_event * 16)]
        batch = EventBatch(0.0, [BlockStored(hashes, None, tokens, 16, "gpu")])
        del hashes, tokens
        for h in range(holders):
            streams[(n // 1024 + h * 5) % pods].apply(batch)
        del batch
    return index, streams


def memory_worker(entries: int, holders: int, mode: str, pods: int = 16) -> dict[str, Any]:
    """Fill a fresh index with `entries` (block, pod) entries through the KV-event
    ingestion (16-block BlockStored events with their tokens, each applied to
    `holders` pods' streams), and measure what it costs: by tracemalloc (the bytes
    Python asked for) or by the growth of the resident set (what the process really
    holds, allocator rounding included). Everything the ingestion keeps counts: the
    index entries and each stream's engine-hash map. Engine hashes are random ints
    created inside the measurement, like the decoded events' are.

    With tracemalloc, the maps are then dropped and what that frees is reported
    (`map_bytes_per_entry`, per map entry): what one map shared by the pods would
    save is that figure times the entries it would not need (holders - 1 of every
    `holders`)."""
    gc.collect()
    if mode == "tracemalloc":
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else _rss_bytes()
    index, streams = fill_precise_index(entries, holders, pods)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else _rss_bytes()
    map_entries = sum(len(s.engine_keys) for s in streams)
    out = {
        "entries": index.stats.entries,
        "keys": index.physical_keys(),
        "map_entries": map_entries,
        "bytes": after - before,
        "bytes_per_entry": (after - before) / index.stats.entries,
    }
    if mode == "tracemalloc":
        for stream in streams:
            stream.engine_keys = {}
        gc.collect()
        freed = after - tracemalloc.get_traced_memory()[0]
        out["map_bytes_per_entry"] = freed / max(1, map_entries)
        tracemalloc.stop()
    return out


def measure_memory(entries: int) -> dict[str, Any]:
    """Each measurement in a fresh interpreter, so that memory freed by earlier work
    does not hide the index's."""
    out: dict[str, Any] = {}
    for holders in (1, 2):
        for mode in ("tracemalloc", "rss"):
            done = subprocess.run(
                [sys.executable, "-m", "bench.pick", "--memory-worker",
                 f"{entries},{holders},{mode}"],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )  # fmt: skip
            out[f"{holders}_pod_per_block_{mode}"] = json.loads(done.stdout)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pick",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=1000, help="picks for (a); (b) does 1/10")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--ingest-batches", type=int, default=20_000)
    parser.add_argument("--memory-entries", type=int, default=1_000_000)
    parser.add_argument(
        "--configs",
        default="weighted,default",
        help="shipped configs whose picks (c) compares, comma-separated ('' to skip)",
    )
    parser.add_argument(
        "--config-pods",
        type=fleet_sizes,
        default=None,
        metavar="N[,N...]",
        help="fleet sizes (c) measures, every config on every size taking turns request by"
        " request (their costs then compare at one host speed); the results go under"
        " 'configs_by_pods'. Default: --pods alone, under 'configs'",
    )
    parser.add_argument(
        "--only-configs", action="store_true", help="measure (c) alone, not the precise parts"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker is not None:
        entries, holders, mode = args.memory_worker.split(",")
        print(json.dumps(memory_worker(int(entries), int(holders), mode)))
        return 0
    if not (QWEN / "tokenizer.json").is_file():
        print(f"needs the Qwen2.5 tokenizer in {QWEN}", file=sys.stderr)
        return 2
    command = "python -m bench.pick " + shlex.join(sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {"pods": args.pods}
    configs = [c for c in args.configs.split(",") if c]
    missing = [c for c in configs if not (ROOT / "manifests" / "config" / f"{c}.yaml").is_file()]
    if missing:
        print(f"no such config in manifests/config/: {', '.join(missing)}", file=sys.stderr)
        return 2
    if not args.only_configs:
        results["pick"] = asyncio.run(measure_pick(args.pods, args.iterations, args.warmup))
        results["ingestion"] = asyncio.run(measure_ingestion(args.ingest_batches))
        results["memory"] = measure_memory(args.memory_entries)
    if configs and args.config_pods is not None:
        measured = asyncio.run(measure_configs(configs, args.config_pods, args.iterations))
        results["configs_by_pods"] = {str(pods): picks for pods, picks in measured.items()}
    elif configs:
        measured = asyncio.run(measure_configs(configs, [args.pods], args.iterations))
        results["configs"] = measured[args.pods]
    results.update(provenance(command))
    emit(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
