"""`precise-prefix-cache-producer`: which endpoints really hold the longest prefix
of the prompt, as the engines report it in their KV events (llm-d's producer of
the same name), for `prefix-cache-scorer` with `prefixMatchInfoProducerName`.

The split form of `precise-prefix-cache-scorer` (llm-d's deprecated composite,
which stays as it is): the same precise prefix service (epp/kvindex/service.py:
index, KV-event subscriber, speculative entries, alignment self-check), built by
the framework from this plugin's parameters and run by the server; this plugin
only reads it. Four parts:

- **DataProducer** (`prepare`): reads the prompt's token ids that a `token-producer`
  declared before it left (`TOKENIZED_PROMPT`), walks them over the index for the
  candidates and leaves the same `PrefixMatchInfo` the composite leaves, under this
  plugin's name. No tokens (no token producer, a prompt it could not tokenize): no
  match info, and the scorer gives every endpoint 0, as in llm-d.
- **PreRequest**: with `speculativeIndexing`, the chosen endpoint is recorded as
  holding the prompt for `speculativeTTL`; one pick in 32 is a tokenization probe.
- **Endpoint extractor** (`endpoint_event`), for an `endpoint-notification-source`
  (the `dataLayer` section names it as that source's extractor): a joining endpoint's
  KV events are subscribed to (`discoverPods`), a leaving one's streams stop and its
  index entries go. Without such a source it follows no endpoint (as in llm-d; a
  warning says so at the first request).
- **DataExtractor** (`extract`): the same, as the data layer's generic contract.

llm-d's parameters, and what each does here (docs/precise-prefix.md, "llm-d's
precise pipeline", has the table): `tokenProcessorConfig.blockSizeTokens` (or the
deprecated `blockSize`; 16) is the index's block size, which here must be the
engines' `--block-size` (the self-check reports a pod whose events are cut
otherwise, and scores it 0); `hashSeed` and `hashAlgorithm` only choose how llm-d
computes its own block keys, which need not match the engine's: accepted and
unused (this index has keys of its own). `indexerConfig.kvBlockIndexConfig`:
`inMemoryConfig.size` bounds the index, `costAwareMemoryConfig.size` too (as bytes,
about 150 per entry); `redisConfig` (a shared index) is refused;
`kvCacheBackendConfigs` are the media weights; `tokenizersPoolConfig` is refused as
llm-d refuses it. `kvEventsConfig`: `topicFilter` ("kv@"), `discoverPods` (true),
`podDiscoveryConfig.socketPort` (5557) and `replaySocketPort`, `engineType`
(vllm, sglang: both read alike); `zmqEndpoint` (one socket for every pod, which
this subscriber cannot tell apart) is refused; `concurrency`,
`podLabelSelector` and `podNamespace` are accepted and unused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec

from epp.datastore import Endpoint
from epp.durations import Duration
from epp.kvindex.blockkeys import HashContext
from epp.kvindex.service import (
    KVEventsConfig,
    PrecisePrefixConfig,
    PrecisePrefixService,
    PromptMatch,
)
from epp.requests import InferenceRequest
from epp.scheduling import (
    CycleState,
    PluginContext,
    SchedulingResult,
    ServiceContext,
    StateKey,
    explain_note,
    prefix_match_key,
)

from .endpoint_notification_source import EndpointEvent
from .precise_prefix_cache_scorer import match_info
from .token_producer import TOKENIZED_PROMPT, TokenProducer

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE_TOKENS: Final = 16
# What one (block, endpoint) entry costs here, engine-hash map included
# (docs/performance.md): turns costAwareMemoryConfig's bytes into entries.
BYTES_PER_INDEX_ENTRY: Final = 150

_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class TokenProcessorConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    block_size: int = 0  # deprecated in llm-d: blockSizeTokens wins when set
    block_size_tokens: int = 0  # 0: not set (16)
    hash_seed: str = ""  # accepted, unused: this index's keys are its own
    hash_algorithm: Literal["", "cbor-fnv", "xxh64"] = ""  # accepted, unused


class InMemoryIndexConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    size: Annotated[int, msgspec.Meta(ge=1)] | None = None  # None: this EPP's bound
    pod_cache_size: Annotated[int, msgspec.Meta(ge=1)] = 10  # accepted, unused


class RedisIndexConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    address: str = ""


class CostAwareMemoryIndexConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    size: str = "2GiB"


class KVBlockIndexConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    in_memory_config: InMemoryIndexConfig | None = msgspec.field(
        default_factory=InMemoryIndexConfig
    )
    redis_config: RedisIndexConfig | None = None
    cost_aware_memory_config: CostAwareMemoryIndexConfig | None = None
    # Accepted, unused: the index's metrics are always on /metrics here.
    enable_metrics: bool = False
    metrics_logging_interval: Annotated[int, msgspec.Meta(ge=0)] = 0  # Go nanoseconds


class KVCacheBackendConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    name: str
    weight: float


class IndexerConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    kv_block_index_config: KVBlockIndexConfig = msgspec.field(default_factory=KVBlockIndexConfig)
    kv_cache_backend_configs: list[KVCacheBackendConfig] | None = None
    # Deprecated in llm-d, and refused by its producer: see `precise_config`.
    tokenizers_pool_config: dict[str, Any] | None = None


class PodDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    pod_label_selector: str = "llm-d.ai/inference-serving=true"  # accepted, unused
    pod_namespace: str = ""  # accepted, unused
    socket_port: _Port = 5557
    replay_socket_port: Annotated[int, msgspec.Meta(le=65535)] = 0  # <= 0: no replay


class LlmdKVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    zmq_endpoint: str = ""
    topic_filter: str = "kv@"
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 4  # accepted, unused
    engine_type: Literal["", "vllm", "sglang"] = ""
    discover_pods: bool = True
    pod_discovery_config: PodDiscoveryConfig = msgspec.field(default_factory=PodDiscoveryConfig)


class PrecisePrefixCacheProducerParameters(
    msgspec.Struct, forbid_unknown_fields=True, rename="camel"
):
    token_processor_config: TokenProcessorConfig = msgspec.field(
        default_factory=TokenProcessorConfig
    )
    indexer_config: IndexerConfig = msgspec.field(default_factory=IndexerConfig)
    kv_events_config: LlmdKVEventsConfig = msgspec.field(default_factory=LlmdKVEventsConfig)
    speculative_indexing: bool = False
    speculative_ttl: Duration = msgspec.field(default="2s", name="speculativeTTL")


_UNITS: Final = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """ "2GiB", "500MiB", "1GB", "1024": bytes (the forms llm-d's size takes)."""
    found = _SIZE.match(text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (say 2GiB, 500MiB, 1GB)")
    return int(float(found.group(1)) * _UNITS[unit])


def block_size_tokens(config: TokenProcessorConfig) -> int:
    """llm-d's rule: blockSizeTokens, else the deprecated blockSize, else 16."""
    size = config.block_size_tokens
    if size == 0:
        size = config.block_size or DEFAULT_BLOCK_SIZE_TOKENS
    if size <= 0:
        raise ValueError(
            f"tokenProcessorConfig: blockSizeTokens must be greater than 0, got {size}"
        )
    return size


def max_index_entries(config: KVBlockIndexConfig) -> int | None:
    """The index's bound from llm-d's index settings (its precedence: cost-aware
    memory, then Redis, then in-memory); None: this EPP's default."""
    if config.cost_aware_memory_config is not None:
        size = parse_bytes(config.cost_aware_memory_config.size)
        return max(1, size // BYTES_PER_INDEX_ENTRY)
    if config.redis_config is not None:
        raise ValueError(
            "indexerConfig.kvBlockIndexConfig.redisConfig: an index shared through Redis is"
            " not supported: remove it. Each EPP replica here builds the same index from every"
            " engine's KV events (active-active replicas agree; docs/reliability.md)"
        )
    if config.in_memory_config is None:
        raise ValueError("indexerConfig.kvBlockIndexConfig: no valid index configuration provided")
    return config.in_memory_config.size


def precise_config(params: PrecisePrefixCacheProducerParameters) -> PrecisePrefixConfig:
    """llm-d's parameters as the precise prefix service's settings. Raises
    ValueError for what cannot work here, saying what to do."""
    indexer = params.indexer_config
    if indexer.tokenizers_pool_config is not None:
        # llm-d's own message: this producer reads tokens, it tokenizes nothing.
        raise ValueError(
            "indexerConfig.tokenizersPoolConfig is not supported; configure a token-producer"
            " plugin instead"
        )
    events = params.kv_events_config
    if events.zmq_endpoint:
        raise ValueError(
            "kvEventsConfig.zmqEndpoint: one socket that every engine publishes to is not"
            " supported: remove it. Each pod's events are read from its own socket"
            " (discoverPods, podDiscoveryConfig.socketPort, or the endpoints file's kvEvents)"
        )
    discovery = events.pod_discovery_config
    weights: dict[str, float] | None = None
    if indexer.kv_cache_backend_configs is not None:
        weights = {b.name.lower(): b.weight for b in indexer.kv_cache_backend_configs}
        if not weights or any(not 0 < w <= 1 for w in weights.values()):
            raise ValueError(
                "indexerConfig.kvCacheBackendConfigs: give each medium a weight in (0, 1]"
                " (a block held only in a medium without a weight is not indexed)"
            )
    bound = max_index_entries(indexer.kv_block_index_config)
    config = PrecisePrefixConfig(
        block_size=block_size_tokens(params.token_processor_config),
        kv_events_config=KVEventsConfig(
            topic_filter=events.topic_filter,
            concurrency=events.concurrency,
            # For endpoints without `kvEvents` in the endpoints file: the pod's ports.
            socket_port=discovery.socket_port,
            replay_port=discovery.replay_socket_port if discovery.replay_socket_port > 0 else None,
        ),
        speculative_indexing=params.speculative_indexing,
        speculative_ttl=params.speculative_ttl,
    )
    if weights is not None:
        config = msgspec.structs.replace(config, medium_weights=weights)
    if bound is not None:
        config = msgspec.structs.replace(config, max_index_entries=bound)
    return config


def precise_prefix_service(
    params: PrecisePrefixCacheProducerParameters, context: ServiceContext
) -> PrecisePrefixService:
    return PrecisePrefixService(
        precise_config(params),
        context.datastore,
        name=context.name,
        clock=context.clock,
        # Endpoints come from an endpoint-notification-source, tokens from a
        # token-producer: the service follows and tokenizes nothing by itself.
        follow_datastore=False,
        external_tokens=True,
    )


class PrecisePrefixCacheProducer:
    Parameters = PrecisePrefixCacheProducerParameters
    # Built by the framework from the parameters, run by the server.
    Service = staticmethod(precise_prefix_service)
    # A token-producer must run before it (plugins/token_producer.py checks).
    reads_tokenized_prompt: Final = True

    def __init__(
        self, params: PrecisePrefixCacheProducerParameters, context: PluginContext
    ) -> None:
        self.name = context.name
        assert isinstance(context.service, PrecisePrefixService)
        self.service: PrecisePrefixService = context.service
        self.discover_pods = params.kv_events_config.discover_pods
        self._match: StateKey[PromptMatch] = StateKey(f"precise-prefix-match:{context.name}")
        self._info_key = prefix_match_key(context.name)
        self._told_of_endpoints = False
        self._warned_unfed = False
        if not any(isinstance(p, TokenProducer) for p in context.plugins.values()):
            log.warning(
                "%s: no token-producer is declared before it, so no prompt is tokenized and"
                " every precise score is 0 (llm-d adds a tokenizer-free estimate producer"
                " here, whose tokens match no engine's blocks either): declare a"
                " token-producer with modelName before it",
                self.name,
            )
        if not self.discover_pods:
            log.warning(
                "%s: kvEventsConfig.discoverPods is false: no pod's KV events are read and"
                " every precise score is 0",
                self.name,
            )

    # -- DataProducer -------------------------------------------------------------------

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        if endpoints and not self._told_of_endpoints and not self._warned_unfed:
            self._warned_unfed = True
            log.warning(
                "%s: no endpoint-notification-source has told it of any endpoint, so it"
                " follows no pod's KV events: name it as that source's extractor in"
                " dataLayer.sources (as llm-d's sample config does)",
                self.name,
            )
        tokenized = cycle.get(TOKENIZED_PROMPT)
        if tokenized is None:
            return
        # LoRA adapters: keyed as their base model's requests (no adapter list here).
        context = HashContext(cache_salt=request.cache_salt)
        found = self.service.lookup(tokenized.tokens, context, endpoints)
        explain_note(
            cycle,
            self.name,
            {
                "promptBlocks": found.prompt_blocks,
                "consideredBlocks": found.considered_blocks,
                "truncated": found.considered_blocks < found.prompt_blocks,
                "estimatedTokens": tokenized.estimated,
            },
        )
        cycle.put(self._match, found)
        cycle.put(self._info_key, match_info(found, self.service))

    # -- PreRequest -----------------------------------------------------------------------

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        found = cycle.get(self._match)
        if found is not None:
            self.service.record_pick(found, result.kv_holders)

    # -- endpoint notifications --------------------------------------------------------

    def endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        self._told_of_endpoints = True
        if not self.discover_pods:
            return  # llm-d: no per-pod subscribers without pod discovery
        if event is EndpointEvent.DELETE:
            self.service.endpoints_changed((), (endpoint,))
        else:
            self.service.endpoints_changed((endpoint,), ())

    def extract(self, data: Any, endpoint: Endpoint) -> None:
        if isinstance(data, EndpointEvent):
            self.endpoint_event(data, endpoint)
