"""The EPP side of the lab: the real scheduling code, fed as production feeds it.

Built exactly as `epp serve` builds it (the config loader, the plugin registry's
entry points, the datastore, the director), on the lab's virtual clock. What the
lab does instead of the network:

- **Picks** go through `Director.pick_endpoint` with the request body a client
  would send, parsed by the EPP's own parser. A data producer that awaits (the
  precise scorer tokenizing in a worker thread) runs on a private asyncio loop
  until it is done; no virtual time passes meanwhile (the pick's time is the
  `route_s` delay).
- **Ends**: `Director.finish` with the usage the engine reports, when the response
  has ended at the client (in-flight counts and post-response plugins).
- **Metrics**: every pod is scraped every `metrics_interval_s`, each pod at its own
  phase of the interval; a scrape reads the pod's state at that moment and lands
  in the datastore `metrics_latency_s` later. The datastore is brought up to date
  only when a pick is about to read it, which is when it matters.
- **Roles**: each pod's role is its `llm-d.ai/role` label in the datastore, as an
  endpoints file or Kubernetes gives it, for the role filters of a P/D config; a
  disaggregated decision names the prefill pod in its `x-prefiller-host-port`
  request header (`prefill_pod_of`).
- **KV events**: a step's events are encoded as the engine publishes them
  (vLLM's msgpack), decoded by the EPP's own decoder and applied through the
  precise service's real ingestion, `kv_event_s` after the step ended. Only when
  the config has a precise prefix service.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.lab.loop import EventLoop
from bench.lab.pod import LabPod
from epp.config import load_config
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.director import Decision, Director
from epp.errors import EppError
from epp.kvindex.events import decode_batch
from epp.kvindex.service import PrecisePrefixService
from epp.requests import PREFILLER_HEADER, parse_request
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo, Usage
from epp.telemetry import Telemetry
from sim.kv_events import EventBatchEncoder, KVEvent

_HEADERS = {"content-type": "application/json"}
# The pods' role label (llm-d's, docs/disaggregation.md).
ROLE_LABEL = "llm-d.ai/role"


@dataclass(frozen=True)
class Delays:
    """How stale what the EPP sees is, and what the real stack adds to a request
    outside the engine, in virtual seconds. The defaults are measured on the real
    stack (`python -m bench.lab.calibrate`, docs/lab.md says which figure each one is)."""

    # Through Envoy and the EPP's pick: what that path adds over sending straight to
    # the pod (measured: round-robin 3.6, default 3.8, precise-prefix 5.1 ms + 9 us
    # per prompt token it tokenizes).
    route_s: float = 0.0038
    # ... plus, per prompt token the EPP tokenizes for the pick (text its tokenizer
    # has not seen: the precise prefix scorer), 9.3 us measured.
    route_per_token_s: float = 9.3e-6
    # Through a peer router's model: the transport of a gateway whose pick costs
    # nothing (round-robin through Envoy and the EPP: 3.6 ms measured), so that the
    # peers' algorithms are compared with ours as if they ran in the same gateway.
    # Their own routers' transport is measured where they really run (`bench run`).
    peer_route_s: float = 0.0036
    # In the pod before the engine takes the request (HTTP, parsing, chat template,
    # tokenizing), and the way back of the first and last token: 2.7 ms measured
    # straight to a simulated pod, less `response_s`; plus, per prompt token the
    # pod's prefix cache does not hold, the tokenizing of text the pod has not seen
    # (its tokenizer remembers the messages it tokenized): 9.2 us measured.
    pod_overhead_s: float = 0.0022
    pod_overhead_per_token_s: float = 9.2e-6
    # Engine first token / last token -> the client (and the EPP's end of stream).
    response_s: float = 0.0005
    # A step's KV events: published after the step, applied to the index
    # (measured: median 0.73 ms, mean 1.14 ms, `bench.lab.calibrate --parts staleness`).
    kv_event_s: float = 0.001
    # The metrics scrape period (GIE's --refresh-metrics-interval default) and
    # how long a scrape's answer takes to reach the datastore (measured: median
    # 2.3 ms, mean 2.6 ms, same run).
    metrics_interval_s: float = 0.05
    metrics_latency_s: float = 0.002

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"delay {name} must be a finite number >= 0, got {value}")
        if self.metrics_interval_s <= 0:
            raise ValueError("metrics_interval_s must be > 0")

    def to_json(self) -> dict[str, float]:
        return asdict(self)


class LabEpp:
    """One EPP process's scheduling side over the lab's pods."""

    def __init__(
        self,
        config_text: str,
        source: str,
        pods: Sequence[LabPod],
        loop: EventLoop,
        delays: Delays,
        seed: int,
        registry: PluginRegistry,
        tokenizer_dirs: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`tokenizer_dirs`: (model, directory) pairs, as `epp serve --tokenizer-dir`
        gives them (the pods' tokenizer for their model)."""
        self.loop = loop
        self.delays = delays
        self.pods = list(pods)
        self.datastore = Datastore()
        self.datastore.replace_all(
            EndpointSpec(p.name, p.address, labels={ROLE_LABEL: p.role} if p.role else {})
            for p in pods
        )
        self.endpoints = [self.datastore.get(p.name) for p in pods]
        self._by_name = {p.name: p for p in pods}
        self._by_address = {p.address: p for p in pods}
        telemetry = Telemetry(self.datastore)
        self.config = load_config(
            config_text,
            registry,
            source=source,
            datastore=self.datastore,
            clock=loop.clock,
            seed=seed,
            settings=ServerSettings(tokenizer_dirs=tuple(tokenizer_dirs)),
        )
        self.director = Director(self.datastore, self.config, telemetry, clock=loop.clock)
        self.precise = [
            s for s in self.config.services.values() if isinstance(s, PrecisePrefixService)
        ]
        self._aio = asyncio.new_event_loop()
        for service in self.precise:
            self._aio.run_until_complete(service.tokenizers.load())
        self._encoder = EventBatchEncoder()
        rng = random.Random(f"lab-scrape-phases:{seed}")
        self._phases = [rng.uniform(0.0, delays.metrics_interval_s) for _ in pods]
        self._scraped = [-1] * len(self.pods)
        self._block_size = pods[0].core.config.block_size if pods else 0
        self._num_blocks = pods[0].core.config.num_gpu_blocks if pods else 0
        self.picks = 0
        self.refusals: dict[str, int] = {}
        # Tokens the EPP's tokenizers produced for the last pick.
        self.last_tokens_encoded = 0

    def close(self) -> None:
        for service in self.precise:
            service.tokenizers.close()
        self._aio.close()

    # -- KV events -----------------------------------------------------------------------

    @property
    def wants_events(self) -> bool:
        return bool(self.precise)

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        payload = self._encoder.encode(self.loop.now(), events)
        endpoint = self.endpoints[pod.index]
        assert endpoint is not None

        def deliver() -> None:
            batch = decode_batch(payload)
            for service in self.precise:
                service.feed(endpoint, batch)

        self.loop.after(self.delays.kv_event_s, deliver)

    # -- metrics -------------------------------------------------------------------------

    def _refresh_metrics(self) -> None:
        """Every pod's metrics as of its latest scrape that has landed by now."""
        now = self.loop.now()
        interval = self.delays.metrics_interval_s
        latency = self.delays.metrics_latency_s
        for i, pod in enumerate(self.pods):
            k = math.floor((now - latency - self._phases[i]) / interval)
            if k < 0 or k == self._scraped[i]:
                continue
            self._scraped[i] = k
            taken = self._phases[i] + k * interval
            state = pod.state_at(taken)
            self.datastore.set_metrics(
                pod.name,
                EndpointMetrics(
                    waiting_requests=state.waiting,
                    running_requests=state.running,
                    kv_cache_usage=state.kv_usage,
                    block_size=self._block_size,
                    num_gpu_blocks=self._num_blocks,
                    updated_at=taken + latency,
                ),
            )

    # -- requests ------------------------------------------------------------------------

    def pick(self, request_id: str, path: str, body: bytes) -> Decision | None:
        """The EPP's decision for one request now, or None when it refused it (counted
        in `refusals` by the error's status)."""
        self._refresh_metrics()
        self.picks += 1
        before = self._tokens_encoded()
        try:
            request = parse_request(
                request_id=request_id, method="POST", path=path, headers=_HEADERS, body=body
            )
            return self._aio.run_until_complete(self.director.pick_endpoint(request))
        except EppError as error:
            key = f"{error.status} {type(error).__name__}"
            self.refusals[key] = self.refusals.get(key, 0) + 1
            return None
        finally:
            self.last_tokens_encoded = self._tokens_encoded() - before

    def _tokens_encoded(self) -> int:
        return sum(s.tokenizers.tokens_encoded() for s in self.precise)

    def first_chunk(self, decision: Decision) -> None:
        self.director.first_chunk(decision)

    def finish(self, decision: Decision, usage: Usage | None, completed: bool = True) -> None:
        self.director.finish(
            decision,
            ResponseInfo(
                completed=completed,
                status=200 if completed else None,
                usage=usage,
                duration_s=self.loop.now() - decision.picked_at,
            ),
        )

    def pod_of(self, decision: Decision) -> LabPod:
        return self._by_name[decision.endpoint.name]

    def prefill_pod_of(self, decision: Decision) -> LabPod | None:
        """The pod a disaggregated decision runs the prefill on (its
        `x-prefiller-host-port` header), or None: the request runs whole."""
        address = decision.result.request_headers.get(PREFILLER_HEADER)
        return None if address is None else self._by_address[address]

    def describe(self) -> dict[str, Any]:
        return {"picks": self.picks, "refusals": dict(self.refusals)}
