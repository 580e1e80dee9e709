"""Peer routers modelled in the lab from their published algorithms and defaults.

The real routers run in `python -m bench run` (sglang-router is the ground truth
there); in the lab they are models, named as `--policy`:

- `sglang-cache-aware`: SGLang's router, policy `cache_aware`, with the defaults
  the pinned sglang-router (0.3.2) runs with: cache_threshold 0.3,
  balance_abs_threshold 64, balance_rel_threshold 1.5. The load of a worker is the
  router's own count of its requests in flight. When the loads are imbalanced
  (max - min > abs threshold and max > rel threshold x min) the request goes to the
  least loaded worker; otherwise the request's text is matched against a prefix
  tree of the texts sent to each worker, and when the matched share of the text
  exceeds cache_threshold it goes to the worker holding the deepest match (the
  most recent one there), else to the least loaded. Either way its text joins the
  chosen worker's tree. The text of a chat request is its messages' contents
  joined by spaces. Model simplifications: the tree matches in steps of
  `CHAR_STEP` characters (a chained hash per step), and its eviction (a per-worker
  budget of 2^26 characters by default) is not modelled.
- `dynamo-kv`: NVIDIA Dynamo's KV router with its defaults (overlap credit 1.0,
  prefill load scale 1.0, temperature 0, active blocks and prefill tokens
  tracked, output blocks not). For each worker: `overlap`, the prompt's leading
  blocks it holds (from the engines' KV events); the prefill tokens the router
  has sent it that have not had their first token yet, plus this prompt's tokens
  less the overlap's; and the distinct prompt blocks of the requests it has in
  flight there, plus this prompt's blocks not among them. Cost = the prefill
  tokens in blocks + those blocks; the cheapest worker wins, ties at random.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from bench.lab.loop import EventLoop
from bench.lab.pod import LabPod
from epp.scheduling.types import Usage
from sim.hashing import BlockHasher
from sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

CHAR_STEP = 32


def routing_text(body: bytes) -> str:
    """What SGLang's router matches for a chat request: the messages' contents."""
    document = json.loads(body)
    parts = []
    for message in document.get("messages", ()):
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    if not parts and isinstance(document.get("prompt"), str):
        parts.append(document["prompt"])
    return " ".join(parts)


@dataclass
class _Flight:
    worker: int
    prefill_tokens: int
    blocks: list[bytes]
    prefilling: bool = True


class SglangCacheAware:
    """The model of SGLang's `cache_aware` policy (module docstring)."""

    def __init__(
        self,
        pods: Sequence[LabPod],
        seed: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.pods = list(pods)
        self.route_delay_s = 0.0
        self.ttft_predictions: list[tuple[float, float]] = []  # it predicts none
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.load = [0] * len(pods)
        # chained hash of the text up to a step -> {worker: when it was last inserted}
        self._tree: dict[int, dict[int, int]] = {}
        self._inserts = 0
        self.decisions = {"imbalanced": 0, "cache": 0, "min_load": 0}

    @property
    def wants_events(self) -> bool:
        return False

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        raise AssertionError("the cache-aware model reads no KV events")

    def _keys(self, text: str) -> list[int]:
        data = text.encode()
        keys = []
        previous = 0
        for start in range(0, len(data) - CHAR_STEP + 1, CHAR_STEP):
            previous = xxhash.xxh3_64_intdigest(data[start : start + CHAR_STEP], previous)
            keys.append(previous)
        return keys

    def _least_loaded(self) -> int:
        return min(range(len(self.load)), key=lambda i: (self.load[i], i))

    def route(self, request_id: str, body: bytes, prompt: Sequence[int]) -> tuple[LabPod, Any]:
        text = routing_text(body)
        keys = self._keys(text)
        high, low = max(self.load), min(self.load)
        if high - low > self.balance_abs and high > self.balance_rel * low:
            chosen = self._least_loaded()
            self.decisions["imbalanced"] += 1
        else:
            deepest: dict[int, int] | None = None
            matched = 0
            for key in keys:
                node = self._tree.get(key)
                if node is None:
                    break
                deepest, matched = node, matched + CHAR_STEP
            rate = matched / len(text) if text else 0.0
            if deepest is not None and rate > self.cache_threshold:
                chosen = max(deepest, key=lambda w: deepest[w])
                self.decisions["cache"] += 1
            else:
                chosen = self._least_loaded()
                self.decisions["min_load"] += 1
        self._inserts += 1
        for key in keys:
            self._tree.setdefault(key, {})[chosen] = self._inserts
        self.load[chosen] += 1
        return self.pods[chosen], chosen

    def prefill_pod(self, handle: Any) -> LabPod | None:
        """The peers' models do not disaggregate: every request runs whole."""
        return None

    def first_token(self, handle: Any) -> None:
        pass

    def end(self, handle: Any, usage: Usage | None, completed: bool) -> None:
        self.load[handle] -= 1

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"decisions": dict(self.decisions), "tree_nodes": len(self._tree)}


class DynamoKv:
    """The model of Dynamo's KV router cost (module docstring)."""

    def __init__(
        self, pods: Sequence[LabPod], loop: EventLoop, kv_event_s: float, seed: int
    ) -> None:
        self.pods = list(pods)
        self.route_delay_s = 0.0
        self.ttft_predictions: list[tuple[float, float]] = []  # it predicts none
        self.loop = loop
        self.kv_event_s = kv_event_s
        engine = pods[0].core.config
        self.block_size = engine.block_size
        self.hasher = BlockHasher(
            engine.hash_algo, engine.hash_seed, engine.block_size, engine.extra_keys_format
        )
        # block hash -> worker -> copies the worker holds
        self._held: dict[bytes, dict[int, int]] = {}
        self._rng = random.Random(f"dynamo-kv:{seed}")
        self.prefill_tokens = [0] * len(pods)
        # Per worker: prompt block -> requests in flight there that hold it.
        self.active: list[dict[bytes, int]] = [{} for _ in pods]

    @property
    def wants_events(self) -> bool:
        return True

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        batch = list(events)
        self.loop.after(self.kv_event_s, lambda: self._apply(pod.index, batch))

    def _apply(self, worker: int, events: list[KVEvent]) -> None:
        held = self._held
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    copies = held.setdefault(block_hash, {})
                    copies[worker] = copies.get(worker, 0) + 1
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    holders = held.get(block_hash)
                    if holders is None or worker not in holders:
                        continue
                    holders[worker] -= 1
                    if holders[worker] <= 0:
                        del holders[worker]
                        if not holders:
                            del held[block_hash]
            elif isinstance(event, AllBlocksCleared):
                for block_hash in [h for h, c in held.items() if worker in c]:
                    del held[block_hash][worker]
                    if not held[block_hash]:
                        del held[block_hash]

    def route(self, request_id: str, body: bytes, prompt: Sequence[int]) -> tuple[LabPod, Any]:
        hashes = self.hasher.block_hashes(prompt)
        size = self.block_size
        overlap = [0] * len(self.pods)
        candidates = set(range(len(self.pods)))
        for block_hash in hashes:
            copies = self._held.get(block_hash)
            if not copies:
                break
            candidates &= copies.keys()
            if not candidates:
                break
            for worker in candidates:
                overlap[worker] += 1
        costs = []
        # The prompt's blocks a worker's requests in flight do not hold, counted by a
        # set intersection when the prompt's hashes are distinct (chained hashes
        # always are): the same count, without a look-up per block and worker.
        distinct = set(hashes)
        counted = distinct if len(distinct) == len(hashes) else None
        for worker, active in enumerate(self.active):
            new_tokens = max(0, len(prompt) - overlap[worker] * size)
            prefill_blocks = (self.prefill_tokens[worker] + new_tokens) / size
            if counted is not None:
                new_blocks = len(hashes) - len(counted.intersection(active))
            else:
                new_blocks = sum(1 for h in hashes if h not in active)
            costs.append(prefill_blocks + len(active) + new_blocks)
        best = min(costs)
        chosen = self._rng.choice([w for w, c in enumerate(costs) if c == best])
        flight = _Flight(chosen, max(0, len(prompt) - overlap[chosen] * size), hashes)
        self.prefill_tokens[chosen] += flight.prefill_tokens
        active = self.active[chosen]
        for block_hash in hashes:
            active[block_hash] = active.get(block_hash, 0) + 1
        return self.pods[chosen], flight

    def prefill_pod(self, handle: Any) -> LabPod | None:
        """The peers' models do not disaggregate: every request runs whole."""
        return None

    def first_token(self, handle: Any) -> None:
        flight: _Flight = handle
        if flight.prefilling:
            flight.prefilling = False
            self.prefill_tokens[flight.worker] -= flight.prefill_tokens

    def end(self, handle: Any, usage: Usage | None, completed: bool) -> None:
        flight: _Flight = handle
        self.first_token(flight)
        active = self.active[flight.worker]
        for block_hash in flight.blocks:
            left = active[block_hash] - 1
            if left:
                active[block_hash] = left
            else:
                del active[block_hash]

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"indexed_blocks": len(self._held)}
