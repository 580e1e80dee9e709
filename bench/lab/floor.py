"""The lowest TTFT any router could give each request of a lab workload: a bound
to read the policies' TTFTs against.

Each request is taken alone on an idle pod that holds the longest prefix any
earlier request left (h_star's rule, bench/bounds.py: an infinite cache, every
prefix everywhere it is needed). Its TTFT is then what the lab charges outside the
engine, through the cheapest router (the transport of a gateway whose pick costs
nothing, `Delays.peer_route_s`, or this EPP's own if less; no tokenizing), plus
the pod's overhead for the tokens it does not hold, plus its uncached prompt
prefilled in chunks of `max_num_batched_tokens` with nothing else in the steps,
plus the way back of the first token. Nothing queues, no decode shares a step,
nothing is evicted.

So no policy's percentile can be below the floor's (each request's TTFT is at
least its own floor), and what a policy's TTFT has above it is the price of its
placement: queueing, prefix misses and batch-mates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from bench.lab.epp import Delays
from bench.stats import percentile
from sim.engine import EngineConfig
from sim.latency import LatencyModel, StepChunk


@dataclass(frozen=True)
class TtftFloor:
    """Percentiles over the requests of their floor TTFT, in seconds."""

    p50_s: float
    p90_s: float
    p99_s: float
    mean_s: float

    def to_json(self) -> dict[str, float]:
        return {f"ttft_floor_{k}": v for k, v in asdict(self).items()}


def request_floor_s(
    prompt_tokens: int,
    hit_tokens: int,
    engine: EngineConfig,
    latency: LatencyModel,
    delays: Delays,
) -> float:
    """One request's floor TTFT (the module docstring), in seconds."""
    alone = prefill_alone_s(prompt_tokens, hit_tokens, engine, latency)
    return outside_engine_s(prompt_tokens - hit_tokens, delays) + alone


def outside_engine_s(uncached_tokens: int, delays: Delays) -> float:
    """The floor's time outside the engine, in seconds: the cheapest router's path,
    the pod's overhead for `uncached_tokens`, and the first token's way back."""
    seconds = min(delays.route_s, delays.peer_route_s)
    seconds += delays.pod_overhead_s + delays.pod_overhead_per_token_s * uncached_tokens
    return seconds + delays.response_s


def prefill_alone_s(
    prompt_tokens: int, hit_tokens: int, engine: EngineConfig, latency: LatencyModel
) -> float:
    """The engine's time for a prompt's tokens past `hit_tokens`, prefilled in chunks
    of `max_num_batched_tokens` with nothing else in the steps, in seconds."""
    if not 0 <= hit_tokens < prompt_tokens:
        raise ValueError("a request computes at least one prompt token: 0 <= hit < prompt")
    seconds = 0.0
    done = hit_tokens
    while done < prompt_tokens:
        chunk = min(engine.max_num_batched_tokens, prompt_tokens - done)
        seconds += latency.step_time([StepChunk(chunk, done)])
        done += chunk
    return seconds


def ttft_floor(
    requests: Iterable[tuple[int, int]],
    engine: EngineConfig,
    latency: LatencyModel,
    delays: Delays,
) -> TtftFloor | None:
    """The floor over (prompt tokens, hit tokens) pairs; None for no requests."""
    floors = [request_floor_s(p, h, engine, latency, delays) for p, h in requests]
    if not floors:
        return None
    floors.sort()
    p50, p90, p99 = (percentile(floors, q) or 0.0 for q in (0.5, 0.9, 0.99))
    return TtftFloor(p50, p90, p99, sum(floors) / len(floors))
