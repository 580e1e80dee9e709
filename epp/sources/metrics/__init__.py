"""The metrics source: scrapes every endpoint's model-server /metrics page and keeps
an `EndpointMetrics` snapshot per endpoint in the datastore.

What is read (docs/architecture.md, "Model-server metrics"), per engine (GIE's
engine configs, chosen per endpoint by its `inference.networking.k8s.io/engine-type`
label, else `llm-d.ai/engine-type`, else the default engine, vLLM):

- vllm: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`), LoRA from
  `vllm:lora_requests_info` (labels `running_lora_adapters`, `waiting_lora_adapters`,
  `max_lora`), cache info from `vllm:cache_config_info` (`block_size`, `num_gpu_blocks`);
- sglang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`,
  `sglang:cache_config_info` (`page_size`, `num_pages`); no LoRA;
- trtllm-serve, triton-tensorrt-llm, triton: GIE's names (`BUILTIN_ENGINES`).

Custom engines come from a `core-metrics-extractor`'s `engineConfigs` (GIE's shape:
metric specs like `name{label=value}`).

Reading a page. A vLLM page is tens of KB, mostly histogram buckets the EPP never
reads, and it is read 20 times a second per pod: a full Prometheus parser
(prometheus_client's takes milliseconds per page) would cost more than the rest of
the scrape. So `read_series` finds the sample lines of the few wanted series with
`bytes.find` (a sample line starts with its name at the beginning of a line;
comment lines start with `#`), and parses only those lines, labels and value, with
the text format's quoting and escapes. A test checks it against prometheus_client's
parser on real-shaped pages. Where a series appears several times (vLLM's data-parallel
engines each report one, `engine="0"`, `engine="1"`), request counts are summed and
KV usage is the maximum: the pod's queue is the sum of its engines', and its most
loaded engine is the one that fills up first. For LoRA the latest series wins (its
value is a timestamp), as in GIE.

Bad input never crashes and never becomes a silently wrong number:
- no answer within the timeout, a non-200 status, a page none of the engine's
  metrics are on (an HTML error page, garbage, the wrong engine): the scrape fails,
  the previous snapshot is kept with `error` set, and it turns stale once older
  than the staleness threshold (--metrics-staleness-threshold, 2 s);
- a refused connection (or no route to the host): the same, but stale at once
  (`unreachable`): nothing listens there, so the pod cannot serve requests either
  (a killed or restarting model server), and the 2 s of grace a slow answer gets
  would only send it requests that fail;
- a metric missing from the page, or NaN, infinite, negative (or a KV usage above
  1): that fact goes in the snapshot's `missing` with the reason, and plugins score
  it neutrally.
/debug/endpoints shows both (`metrics.error`, `metrics.missing`, `metrics.reason`).

Cost. All endpoints are scraped on one clock: each tick starts a scrape of every
endpoint whose previous one has ended, and each answer is handled in its
connection's read callback (no task, future or timer per scrape). A plain
`http://` scrape uses `KeepAliveFetcher` (one kept-alive connection per endpoint, a
minimal HTTP/1.1 reader); `https://` uses one shared aiohttp session. A page
identical to the previous one (an idle pod) is not read again, and a series whose
lines were read before costs a lookup (`ReadCache`); for vLLM and SGLang a
single pass over the page reads the common case (`SinglePassReader`).
docs/performance.md has the measured cost per endpoint.

The modules, each building on the ones before it:
- `specs`: metric specs and engine configs (`MetricSpec`, `EngineSpec`,
  `BUILTIN_ENGINES`); immutable values.
- `text_format`: finding a series' sample lines on a page and parsing them
  (`Sample`); keeps nothing.
- `facts`: what each load fact is, derived from samples; pure functions.
- `read_cache`: `ReadCache`, the one cache of what was read (label sets, the reads
  of series by their lines, the facts derived from each read), and `read_series`.
- `page`: the two page readers, `read_page` (any engine, with a reason for every
  missing fact) and `SinglePassReader` (the common case of vLLM and SGLang), both
  through one `ReadCache`.
- `extractor`: `MetricsExtractor`, an endpoint's engine and page -> its
  `EndpointMetrics`.
- `scraper`: `ScrapeSettings`, `MetricsScraper` and its Prometheus collector.
- `describe`: `describe_metrics`, the /debug/endpoints view of a snapshot.

Import from this package: it re-exports what other code uses.
"""

from __future__ import annotations

from epp.sources.metrics.describe import describe_metrics
from epp.sources.metrics.extractor import ENGINE_LABEL, LLMD_ENGINE_LABEL, MetricsExtractor
from epp.sources.metrics.facts import Derived
from epp.sources.metrics.page import PageError, SinglePassReader, read_page
from epp.sources.metrics.read_cache import (
    MAX_CACHED_BLOCK_BYTES,
    SERIES_CACHE_SIZE,
    ReadCache,
    SeriesRead,
    read_series,
)
from epp.sources.metrics.scraper import (
    RESULTS,
    MetricsScraper,
    ScrapeSettings,
)
from epp.sources.metrics.specs import BUILTIN_ENGINES, DEFAULT_ENGINE, EngineSpec, MetricSpec
from epp.sources.metrics.text_format import LABEL_CACHE_SIZE, Sample

__all__ = [
    "BUILTIN_ENGINES",
    "DEFAULT_ENGINE",
    "ENGINE_LABEL",
    "LABEL_CACHE_SIZE",
    "LLMD_ENGINE_LABEL",
    "MAX_CACHED_BLOCK_BYTES",
    "RESULTS",
    "SERIES_CACHE_SIZE",
    "Derived",
    "EngineSpec",
    "MetricSpec",
    "MetricsExtractor",
    "MetricsScraper",
    "PageError",
    "ReadCache",
    "Sample",
    "ScrapeSettings",
    "SeriesRead",
    "SinglePassReader",
    "describe_metrics",
    "read_page",
    "read_series",
]
