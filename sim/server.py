"""One simulated vLLM pod: the HTTP server in front of the engine (aiohttp).

Endpoints, as vLLM serves them:

- `POST /v1/completions`, `POST /v1/chat/completions`: streaming (SSE, `data: {...}`
  lines, `data: [DONE]`; a last usage-only chunk when `stream_options.include_usage`
  is set) or not (with `usage.prompt_tokens_details.cached_tokens` always given);
- `GET /v1/models`, `GET /health`, `GET /metrics` (vLLM's metric names);
- `POST /reset_prefix_cache` (vLLM's development endpoint): clears the prefix cache
  and publishes AllBlocksCleared, refused (400) while requests hold blocks;
- `POST /tokenize` (a completion body with `prompt`, or a chat body with `messages`)
  -> `{"count", "max_model_len", "tokens", "token_strs": null}`, and
  `POST /v1/chat/completions/render`, `POST /v1/completions/render` -> the prompt's
  token ids (`{"request_id", "token_ids", "model", ...}`; one such object per prompt,
  in a list, for completions), computed exactly as a generation request's would be.
  Routers that route on token ids ask a worker for them: vllm-router's
  `cache_aware` policy calls render, then tokenize, for each chat request. Neither
  touches the engine (no cache lookup, no counter).

Fault knobs and introspection for tests (not in vLLM):

- `POST /sim/restart`: an engine restart: in-flight requests fail, the cache is
  empty, counters restart at zero, KV-event seq starts again at 0 with an empty
  replay buffer (no event announces it: the seq going back is the signal);
- `POST /sim/drop-events` `{"count": n, "fromReplay": false}`: the next n event
  batches are not sent on the PUB socket (a seq gap; still replayable unless
  `fromReplay`);
- `POST /sim/metrics-delay` `{"seconds": s}`: `/metrics` answers s wall seconds late;
- `POST /sim/stall` `{"stalled": true}`: the engine stops stepping while the server
  answers everything (a hung engine behind a live API process): requests wait,
  `/metrics` shows the gauges of the moment it stopped (vLLM's move with the stats
  its engine sends at each step); `false` lets it go on;
- `GET /sim/state`: the engine's true state as JSON (cached block hashes as uint64 =
  the digests' last 8 bytes, the default KV-event form, and their XOR; free/used
  blocks; KV-event seq; counters).

Every response carries `x-sim-pod: <name>`, so tests and benchmarks can see which pod
served a request.

Prefill/decode disaggregation (docs/disaggregation.md), the engine's part as vLLM with
its NIXL connector does it (sim/engine.py), the sidecar's as llm-d's routing sidecar:

- A request whose `kv_transfer_params` has `do_remote_decode` is a prefill leg: it
  runs, and its non-streaming answer carries `kv_transfer_params` for the decode pod
  (`do_remote_prefill` true, `do_remote_decode` false, `remote_engine_id`,
  `remote_request_id`, `remote_block_ids`, `remote_host`, `remote_port`, and the
  simulator's own `remote_num_tokens`: the tokens whose KV those blocks hold).
- A request whose `kv_transfer_params` has `do_remote_prefill` is a decode leg: it
  waits for the transfer of the KV it does not cache, then decodes.
- The pod plays the decode pod's sidecar: a request carrying
  `x-prefiller-host-port: <host:port>` (set by the EPP) is first sent to that pod as
  a prefill leg (a copy with `kv_transfer_params` asking for a remote decode,
  `stream` false, no `stream_options`, `max_tokens` and `max_completion_tokens` 1),
  then run here with the `kv_transfer_params` the prefill pod returned. A malformed
  header is a 400. When the prefill leg fails (no connection, a timeout, a status
  other than 200, an answer without `kv_transfer_params`) the request is prefilled
  here instead: it is never lost; `sim:pd_prefill_fallbacks_total{reason}` counts
  it and a warning names it. Without the header the request is served whole.
- The pod's role (`--role`) is its `llm-d.ai/role` label where the simulator
  publishes labels (`python -m sim fleet`'s endpoints file, `python -m sim kubeapi`);
  the pod itself serves any leg whatever its role, as vLLM with `kv_both` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web

from sim.chat_template import ChatTemplateError
from sim.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    RemotePrefill,
    RequestState,
    TokenOutput,
)
from sim.hashing import to_event_hash
from sim.kv_events import EventBatchEncoder, EventFormat
from sim.latency import LatencyModel
from sim.metrics import FALLBACK_REASONS, Gauges, render
from sim.protocol import (
    ChoiceResult,
    GenerationRequest,
    RequestError,
    ResponseHeader,
    error_body,
    parse_chat,
    parse_completion,
)
from sim.publisher import KVEventPublisher, PublisherConfig, ReplayLayout
from sim.tokenizer import HFTokenizer, Tokenizer, answer_token_ids, load_tokenizer

log = logging.getLogger(__name__)

POD_HEADER = "x-sim-pod"
# llm-d's contract (docs/disaggregation.md): the EPP names the prefill pod in this
# header; the pod's role is this label.
PREFILLER_HEADER: Final = "x-prefiller-host-port"
ROLE_LABEL: Final = "llm-d.ai/role"
ROLES: Final = ("prefill", "decode", "prefill-decode")
# What the sidecar sends as the prefill leg's kv_transfer_params (llm-d's).
PREFILL_LEG_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class SimConfig:
    name: str = "sim-0"
    model: str = "sim-model"
    # Tokens generated when the request sets no max_tokens (finish_reason "stop").
    output_tokens: int = 8
    # A directory with tokenizer.json + tokenizer_config.json; None: built-in tokenizer.
    tokenizer: str | None = None
    # A Jinja file replacing the tokenizer's chat template.
    chat_template: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    # KV events: PUB port (None: no KV events, as vLLM without --kv-events-config)
    # and replay ROUTER port; 0 picks a free port.
    kv_events_port: int | None = None
    replay_port: int | None = None
    zmq_host: str = "127.0.0.1"
    kv_events_format: EventFormat = "map"
    kv_events_topic: str = ""
    int_block_hashes: bool = True
    replay_layout: ReplayLayout = "current"
    replay_buffer_steps: int = 10_000
    # The PUB socket's high-water mark (vLLM's KVEventsConfig.hwm): messages queued
    # for one slow subscriber beyond it are dropped, and it sees a seq gap.
    kv_events_hwm: int = 100_000
    # Wall seconds /metrics waits before answering (a slow scrape target).
    metrics_delay_s: float = 0.0
    # Prefill/decode disaggregation: the pod's `llm-d.ai/role` (None: no label), and
    # how long (wall seconds) the sidecar waits for a prefill leg before it prefills
    # the request itself.
    role: str | None = None
    prefill_timeout_s: float = 60.0
    # The step-time model, with the KV-transfer bandwidth and latency (sim/latency.py).
    latency: LatencyModel = field(default_factory=LatencyModel)

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.prefill_timeout_s > 0:
            raise ValueError("prefill_timeout_s must be > 0")


def parse_host_port(value: str) -> tuple[str, int]:
    """`x-prefiller-host-port`: `host:port` (`[v6]:port`); RequestError (400) if not."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RequestError(
            f"header {PREFILLER_HEADER} must be <host>:<port> with a port in 1..65535,"
            f" got {value!r}"
        )
    return host, int(port)


_json = msgspec.json.Encoder()


def _tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{'*' if port == 0 else port}"


class SimPod:
    def __init__(self, config: SimConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer: Tokenizer = tokenizer or load_tokenizer(
            config.tokenizer, config.chat_template
        )
        self.publisher: KVEventPublisher | None = None
        if config.kv_events_port is not None:
            self.publisher = KVEventPublisher(
                PublisherConfig(
                    endpoint=_tcp(config.zmq_host, config.kv_events_port),
                    replay_endpoint=(
                        None
                        if config.replay_port is None
                        else _tcp(config.zmq_host, config.replay_port)
                    ),
                    topic=config.kv_events_topic,
                    buffer_steps=config.replay_buffer_steps,
                    hwm=config.kv_events_hwm,
                    replay_layout=config.replay_layout,
                ),
                EventBatchEncoder(config.kv_events_format, config.int_block_hashes),
            )
        self.engine = Engine(
            config.engine, answer_token_ids(self.tokenizer), config.latency, sink=self.publisher
        )
        # Unique per process, as vLLM's engine ids are.
        self.engine.engine_id = f"{config.name}-{uuid.uuid4().hex[:12]}"
        self.metrics_delay_s = config.metrics_delay_s
        # /metrics while the engine is stalled (/sim/stall): the gauges when it stopped.
        self.stalled_gauges: Gauges | None = None
        # The sidecar: prefill legs sent, and the requests prefilled here instead, by
        # why (`sim.metrics.FALLBACK_REASONS`).
        self.prefill_legs_sent = 0
        self.fallbacks: Counter[str] = Counter()
        self._http: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        # Every response names the pod, aiohttp's own (unknown route, 405) included.
        self.app.on_response_prepare.append(self._name_response)
        routes = self.app.router
        routes.add_post("/v1/completions", self.completions)
        routes.add_post("/v1/chat/completions", self.chat_completions)
        routes.add_get("/v1/models", self.models)
        routes.add_get("/health", self.health)
        routes.add_get("/metrics", self.metrics)
        routes.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        routes.add_post("/tokenize", self.tokenize)
        routes.add_post("/v1/chat/completions/render", self.render_chat)
        routes.add_post("/v1/completions/render", self.render_completion)
        routes.add_post("/sim/restart", self.sim_restart)
        routes.add_post("/sim/drop-events", self.sim_drop_events)
        routes.add_post("/sim/metrics-delay", self.sim_metrics_delay)
        routes.add_post("/sim/stall", self.sim_stall)
        routes.add_get("/sim/state", self.sim_state)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        if self.publisher is not None:
            await self.publisher.start()
        self.engine.start()
        self._http = aiohttp.ClientSession()
        # handler_cancellation: a client that goes away cancels its handler, which
        # aborts its engine request (vLLM aborts on disconnect too). A short
        # shutdown_timeout: stopping a pod does not wait for long generations.
        self.runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        await self.engine.stop()
        if self.publisher is not None:
            await self.publisher.close()

    @property
    def port(self) -> int:
        """The HTTP port actually bound (useful with port 0)."""
        assert self.runner is not None, "not started"
        return int(self.runner.addresses[0][1])

    @property
    def kv_events_endpoint(self) -> str | None:
        return None if self.publisher is None else self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.publisher is None else self.publisher.replay_bound_endpoint

    # -- helpers -----------------------------------------------------------------

    async def _name_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.setdefault(POD_HEADER, self.config.name)

    def _headers(self) -> dict[str, str]:
        return {POD_HEADER: self.config.name}

    def _json_response(self, body: Any, status: int = 200) -> web.Response:
        return web.Response(
            body=_json.encode(body),
            status=status,
            content_type="application/json",
            headers=self._headers(),
        )

    def _error(self, error: RequestError) -> web.Response:
        return self._json_response(error.body(), error.status)

    # -- simple endpoints ----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(headers=self._headers())

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        return self._json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_delay_s > 0:
            await asyncio.sleep(self.metrics_delay_s)
        engine = self.engine
        # A stalled engine reports nothing new: vLLM's gauges move with the stats
        # its engine sends at each step.
        gauges = self.stalled_gauges if engine.stalled and self.stalled_gauges else self._gauges()
        text = render(
            self.config.model, engine.stats, gauges, self.config.role, dict(self.fallbacks)
        )
        return web.Response(
            text=text, content_type="text/plain", charset="utf-8", headers=self._headers()
        )

    def _gauges(self) -> Gauges:
        engine = self.engine
        return Gauges(
            running=len(engine.running),
            waiting=engine.num_waiting,
            kv_cache_usage=engine.kv.pool.usage(),
            block_size=engine.config.block_size,
            num_gpu_blocks=engine.config.num_gpu_blocks,
            hash_algo=engine.config.hash_algo,
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not await self.engine.reset_prefix_cache():
            used = self.engine.kv.pool.num_used_blocks
            return self._error(
                RequestError(f"Failed to reset prefix cache: {used} blocks are still in use.")
            )
        return web.Response(headers=self._headers())

    # -- tokenization (for routers that route on token ids) -------------------------

    async def _token_ids(self, request: web.Request, chat: bool | None) -> list[list[int]]:
        """The prompt token ids of a request body, as generation would compute them.
        `chat` None: a chat body when it has `messages` (what /tokenize accepts)."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise RequestError(f"JSON decode error: {exc}") from exc
        if chat is None:
            chat = isinstance(body, dict) and "messages" in body
        # Generation-only fields are not the tokenizer's business.
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        parsed = parse_chat(body) if chat else parse_completion(body)
        if parsed.model is not None and parsed.model != self.config.model:
            raise RequestError(
                f"The model `{parsed.model}` does not exist.",
                status=404,
                error_type="NotFoundError",
                param="model",
            )
        if isinstance(self.tokenizer, HFTokenizer):
            return await asyncio.to_thread(self._prompt_ids, parsed)
        return self._prompt_ids(parsed)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            prompts = await self._token_ids(request, None)
        except RequestError as error:
            return self._error(error)
        tokens = [t for ids in prompts for t in ids]
        return self._json_response(
            {
                "count": len(tokens),
                "max_model_len": self.engine.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    def _rendered(self, ids: list[int]) -> dict[str, Any]:
        return {
            "request_id": uuid.uuid4().hex,
            "token_ids": ids,
            "model": self.config.model,
            "sampling_params": {},
            "stream": False,
        }

    async def render_chat(self, request: web.Request) -> web.Response:
        try:
            (ids,) = await self._token_ids(request, True)
        except RequestError as error:
            return self._error(error)
        return self._json_response(self._rendered(ids))

    async def render_completion(self, request: web.Request) -> web.Response:
        try:
            prompts = await self._token_ids(request, False)
        except RequestError as error:
            return self._error(error)
        return self._json_response([self._rendered(ids) for ids in prompts])

    # -- fault knobs and state -------------------------------------------------------

    async def _knob_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise RequestError(f"invalid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    async def sim_restart(self, request: web.Request) -> web.Response:
        self.engine.restart()
        if self.publisher is not None:
            self.publisher.restart()
        log.info("%s: engine restarted", self.config.name)
        return self._json_response({"restarted": True, "restarts": self.engine.restarts})

    async def sim_drop_events(self, request: web.Request) -> web.Response:
        try:
            body = await self._knob_body(request)
            count = body.get("count", 1)
            from_replay = body.get("fromReplay", False)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise RequestError("'count' must be an integer >= 0")
            if not isinstance(from_replay, bool):
                raise RequestError("'fromReplay' must be a boolean")
            if self.publisher is None:
                raise RequestError("this pod publishes no KV events (no --kv-events-port)")
        except RequestError as error:
            return self._error(error)
        self.publisher.drop_next(count, from_replay)
        return self._json_response(
            {"pendingDrops": self.publisher.pending_drops, "nextSeq": self.publisher.next_seq}
        )

    async def sim_metrics_delay(self, request: web.Request) -> web.Response:
        try:
            body = await self._knob_body(request)
            seconds = body.get("seconds", 0.0)
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
                raise RequestError("'seconds' must be a number >= 0")
        except RequestError as error:
            return self._error(error)
        self.metrics_delay_s = float(seconds)
        return self._json_response({"metricsDelaySeconds": self.metrics_delay_s})

    async def sim_stall(self, request: web.Request) -> web.Response:
        """{"stalled": true}: the engine stops stepping while the server answers
        everything else (/metrics, /health, new requests, which wait): a hung engine
        behind a live API process. {"stalled": false}: it goes on."""
        try:
            body = await self._knob_body(request)
            stalled = body.get("stalled")
            if not isinstance(stalled, bool):
                raise RequestError("'stalled' must be true or false")
        except RequestError as error:
            return self._error(error)
        if stalled and not self.engine.stalled:
            self.stalled_gauges = self._gauges()
        self.engine.stall(stalled)
        return self._json_response({"stalled": self.engine.stalled})

    def state(self) -> dict[str, Any]:
        engine, pool = self.engine, self.engine.kv.pool
        publisher = self.publisher
        stats = engine.stats
        cached = sorted(to_event_hash(h) for h in pool.cached_hashes())
        return {
            "name": self.config.name,
            "model": self.config.model,
            "blockSize": engine.config.block_size,
            "hashAlgo": engine.config.hash_algo,
            "hashSeed": engine.config.hash_seed,
            "extraKeysFormat": engine.config.extra_keys_format,
            "timeScale": engine.config.time_scale,
            "restarts": engine.restarts,
            "blocks": {
                "total": pool.num_gpu_blocks,
                "usable": pool.num_usable_blocks,
                "free": pool.num_free_blocks,
                "used": pool.num_used_blocks,
                "cached": pool.num_cached_blocks,
            },
            "kvCacheUsage": pool.usage(),
            "cachedBlockHashes": cached,
            # Their XOR (16 hex digits), as the EPP's /debug/endpoints `index.digest`.
            "cachedBlocksDigest": f"{functools.reduce(operator.xor, cached, 0):016x}",
            "requests": {
                "waiting": engine.num_waiting,
                "running": len(engine.running),
                "waitingForRemoteKvs": len(engine.receiving),
            },
            "role": self.config.role,
            "pd": {
                "engineId": engine.engine_id,
                "prefillLegsServed": stats.prefill_legs,
                "decodeLegsServed": stats.decode_legs,
                "kvTransfers": stats.nixl_xfer_time.count,
                "kvTransferSeconds": stats.nixl_xfer_time.total,
                "kvTransferBytes": stats.nixl_bytes_transferred.total,
                "externalPrefixCacheHits": stats.external_prefix_cache_hits,
                "prefillLegsSent": self.prefill_legs_sent,
                "fallbacks": {reason: self.fallbacks[reason] for reason in FALLBACK_REASONS},
            },
            "kvEvents": None
            if publisher is None
            else {
                "endpoint": publisher.endpoint,
                "replayEndpoint": publisher.replay_bound_endpoint,
                "format": self.config.kv_events_format,
                "intBlockHashes": self.config.int_block_hashes,
                "lastSeq": publisher.last_seq,
                "nextSeq": publisher.next_seq,
                "published": publisher.stats.published,
                "dropped": publisher.stats.dropped,
                "pendingDrops": publisher.pending_drops,
                "replayBuffered": publisher.buffered,
                "replayRequests": publisher.stats.replay_requests,
            },
            "counters": {
                "requests": stats.requests_received,
                "promptTokens": stats.prompt_tokens,
                "generationTokens": stats.generation_tokens,
                "prefixCacheQueries": stats.prefix_cache_queries,
                "prefixCacheHits": stats.prefix_cache_hits,
                "preemptions": stats.preemptions,
                "steps": stats.steps,
                "busySeconds": stats.busy_s,
                "lagSeconds": stats.lag_s,
                "aborted": stats.aborted,
                "finished": dict(stats.finished),
            },
        }

    async def sim_state(self, request: web.Request) -> web.Response:
        return self._json_response(self.state())

    # -- generation ----------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat)

    async def _serve(
        self, request: web.Request, parse: Callable[[Any], GenerationRequest]
    ) -> web.StreamResponse:
        prefiller = request.headers.get(PREFILLER_HEADER)
        if prefiller is None:
            return await self._generate(request, parse)
        return await self._sidecar(request, parse, prefiller)

    # -- the decode pod's sidecar (module docstring) ------------------------------------

    async def _sidecar(
        self, request: web.Request, parse: Callable[[Any], GenerationRequest], prefiller: str
    ) -> web.StreamResponse:
        try:
            host, port = parse_host_port(prefiller)
        except RequestError as error:
            return self._error(error)
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
        if not isinstance(body, dict):
            # Not a request the engine would take: it answers with the error.
            return await self._generate(request, parse)
        leg = {k: v for k, v in body.items() if k != "stream_options"}
        leg["kv_transfer_params"] = dict(PREFILL_LEG_PARAMS)
        leg["stream"] = False
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}{request.path}"
        params = await self._prefill_leg(url, leg)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        return await self._generate(request, parse, body)

    async def _prefill_leg(self, url: str, leg: dict[str, Any]) -> dict[str, Any] | None:
        """POST the prefill leg; the `kv_transfer_params` it returned, or None (the
        failure counted and logged) to prefill here."""
        assert self._http is not None, "not started"
        self.prefill_legs_sent += 1
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s)
        headers = {"content-type": "application/json", "x-request-id": str(uuid.uuid4())}
        reason: str
        detail: str
        try:
            async with self._http.post(
                url, data=_json.encode(leg), headers=headers, timeout=timeout
            ) as response:
                raw = await response.read()
                if response.status != 200:
                    reason, detail = "status", f"status {response.status}"
                else:
                    try:
                        answer = msgspec.json.decode(raw)
                    except msgspec.DecodeError:
                        answer = None
                    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    if isinstance(params, dict) and params.get("do_remote_prefill") is True:
                        return params
                    reason, detail = "body", "no kv_transfer_params in its answer"
        except TimeoutError:
            reason, detail = "timeout", f"no answer in {self.config.prefill_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            reason, detail = "connect", f"{type(exc).__name__}: {exc}"
        self.fallbacks[reason] += 1
        log.warning(
            "%s: prefill leg to %s failed (%s); prefilling here", self.config.name, url, detail
        )
        return None

    def _prompt_ids(self, parsed: GenerationRequest) -> list[list[int]]:
        tokenizer = self.tokenizer
        if parsed.chat:
            template = tokenizer.chat_template
            if template is None:
                raise RequestError(
                    "this model's tokenizer has no chat template; pass --chat-template"
                )
            try:
                text = template.render(
                    parsed.messages,
                    add_generation_prompt=parsed.add_generation_prompt,
                    continue_final_message=parsed.continue_final_message,
                    tools=parsed.tools,
                    documents=parsed.documents,
                    template_kwargs=parsed.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise RequestError(str(exc)) from exc
            return [tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)]
        return [
            p if isinstance(p, list) else tokenizer.encode(p, parsed.add_special_tokens)
            for p in parsed.prompts
        ]

    def _output_budget(self, parsed: GenerationRequest, prompt_len: int) -> tuple[int, str]:
        """How many tokens to generate and the finish reason when they are done."""
        max_len = self.engine.max_model_len
        if prompt_len >= max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, your"
                f" request has {prompt_len} input tokens. Please reduce the length of the"
                " input messages.",
                param="messages" if parsed.chat else "prompt",
            )
        room = max_len - prompt_len
        if parsed.max_tokens is not None:
            if parsed.max_tokens > room:
                raise RequestError(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {parsed.max_tokens}."
                    f" This model's maximum context length is {max_len} tokens and your request"
                    f" has {prompt_len} input tokens ({parsed.max_tokens} > {max_len} -"
                    f" {prompt_len}).",
                    param="max_tokens",
                )
            return parsed.max_tokens, "length"
        if self.config.output_tokens <= room:
            return self.config.output_tokens, "stop"
        return room, "length"

    async def _generate(
        self,
        request: web.Request,
        parse: Callable[[Any], GenerationRequest],
        body: Any = None,
    ) -> web.StreamResponse:
        """Serve a generation request; `body`: its decoded body, when the sidecar
        changed it (None: the request's own)."""
        try:
            if body is None:
                raw = await request.read()
                try:
                    body = msgspec.json.decode(raw)
                except msgspec.DecodeError as exc:
                    raise RequestError(f"JSON decode error: {exc}") from exc
            parsed = parse(body)
            if parsed.model is not None and parsed.model != self.config.model:
                raise RequestError(
                    f"The model `{parsed.model}` does not exist.",
                    status=404,
                    error_type="NotFoundError",
                    param="model",
                )
            # A real tokenizer on a long prompt takes milliseconds: off the event
            # loop, so the engine's steps keep their timing.
            if isinstance(self.tokenizer, HFTokenizer):
                prompts = await asyncio.to_thread(self._prompt_ids, parsed)
            else:
                prompts = self._prompt_ids(parsed)
            budgets = [self._output_budget(parsed, len(ids)) for ids in prompts]
        except RequestError as error:
            return self._error(error)

        outputs: asyncio.Queue[TokenOutput] = asyncio.Queue()
        choices = [ChoiceResult(index=i, prompt_tokens=len(ids)) for i, ids in enumerate(prompts)]
        transfer = parsed.kv_transfer_params
        remote = None
        if transfer is not None and transfer.do_remote_prefill:
            remote = RemotePrefill(transfer.remote_engine_id, transfer.remote_block_ids)
        remote_decode = transfer is not None and transfer.do_remote_decode
        engine_requests = [
            self.engine.add_request(
                ids,
                n,
                reason,
                outputs,
                parsed.cache_salt,
                i,
                parsed.stream,
                remote_decode=remote_decode,
                remote=remote,
            )
            for i, (ids, (n, reason)) in enumerate(zip(prompts, budgets, strict=True))
        ]
        header = ResponseHeader(
            id=("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex,
            model=parsed.model or self.config.model,
            chat=parsed.chat,
        )
        try:
            if parsed.stream:
                return await self._stream(
                    request, parsed, header, choices, engine_requests, outputs
                )
            response = await self._complete(header, choices, engine_requests, outputs)
            if remote_decode and response.status == 200:
                return self._prefill_answer(request, response, engine_requests[0])
            return response
        finally:
            for engine_request in engine_requests:
                if engine_request.state in (
                    RequestState.WAITING,
                    RequestState.WAITING_FOR_REMOTE_KVS,
                    RequestState.RUNNING,
                ):
                    self.engine.abort(engine_request)

    def _prefill_answer(
        self, request: web.Request, response: web.Response, leg: EngineRequest
    ) -> web.Response:
        """A prefill leg's answer with the `kv_transfer_params` the decode pod needs
        (null when it did not end on its length, as vLLM's)."""
        assert isinstance(response.body, bytes)
        body = msgspec.json.decode(response.body)
        params: dict[str, Any] | None = None
        if leg.kv_block_ids is not None:
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            host, port = (sockname[0], sockname[1]) if sockname else (None, None)
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine.engine_id,
                "remote_request_id": leg.request_id,
                "remote_block_ids": list(leg.kv_block_ids),
                "remote_host": host,
                "remote_port": port,
                "remote_num_tokens": len(leg.kv_block_ids) * self.engine.config.block_size,
            }
        body["kv_transfer_params"] = params
        return self._json_response(body)

    def _record(
        self, choices: list[ChoiceResult], requests: list[EngineRequest], out: TokenOutput
    ) -> str:
        """Add output tokens to their choice; returns their text."""
        choice = choices[out.choice_index]
        choice.token_ids.extend(out.token_ids)
        choice.cached_tokens = requests[out.choice_index].num_cached_tokens or 0
        text = self.tokenizer.decode(out.token_ids)
        choice.text += text
        choice.finish_reason = out.finish_reason
        return text

    async def _complete(
        self,
        header: ResponseHeader,
        choices: list[ChoiceResult],
        requests: list[EngineRequest],
        outputs: asyncio.Queue[TokenOutput],
    ) -> web.Response:
        remaining = len(choices)
        while remaining:
            out = await outputs.get()
            if out.error is not None:
                return self._json_response(
                    error_body(out.error, 500, "InternalServerError"), status=500
                )
            self._record(choices, requests, out)
            if out.finish_reason is not None:
                remaining -= 1
        return self._json_response(header.completion(choices))

    async def _stream(
        self,
        request: web.Request,
        parsed: GenerationRequest,
        header: ResponseHeader,
        choices: list[ChoiceResult],
        requests: list[EngineRequest],
        outputs: asyncio.Queue[TokenOutput],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            | self._headers()
        )
        await response.prepare(request)
        usage_each = parsed.continuous_usage_stats and parsed.include_usage

        def event(chunk: dict[str, Any]) -> bytes:
            if usage_each:
                chunk["usage"] = header.usage_chunk(choices)["usage"]
            return b"data: " + _json.encode(chunk) + b"\n\n"

        remaining = len(choices)
        started: set[int] = set()
        while remaining:
            # One event per token, as vLLM sends them; tokens that queued up while
            # this handler waited go out in one write (cheaper, same events).
            batch = [await outputs.get()]
            while not outputs.empty():
                batch.append(outputs.get_nowait())
            data = bytearray()
            for out in batch:
                if out.error is not None:
                    # The engine went away mid-stream: the stream just ends, without
                    # [DONE], as when a vLLM process dies.
                    with contextlib.suppress(ConnectionError):
                        await response.write(bytes(data))
                        await response.write_eof()
                    return response
                text = self._record(choices, requests, out)
                if parsed.chat and out.choice_index not in started:
                    started.add(out.choice_index)
                    data += event(header.role_chunk(out.choice_index))
                data += event(header.chunk(out.choice_index, text, out.finish_reason))
                if out.finish_reason is not None:
                    remaining -= 1
            await response.write(bytes(data))
        if parsed.include_usage:
            await response.write(b"data: " + _json.encode(header.usage_chunk(choices)) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
