"""The metrics source: scrapes every endpoint's model-server /metrics page and keeps
an `EndpointMetrics` snapshot per endpoint in the datastore.

What is read (DESIGN §5), per engine (GIE's engine configs, chosen per endpoint by
its `inference.networking.k8s.io/engine-type` label, else `llm-d.ai/engine-type`,
else the default engine, vLLM):

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
lines were read before costs a lookup (`ReadCache`). docs/performance.md has the
measured cost per endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import math
import re
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datastore import (
    CACHE_INFO,
    DEFAULT_STALENESS_S,
    KV_CACHE_USAGE,
    LORA,
    RUNNING,
    WAITING,
    Datastore,
    Endpoint,
    EndpointMetrics,
)
from epp.sources.http_fetch import FetchError, KeepAliveFetcher

log = logging.getLogger(__name__)

ENGINE_LABEL: Final = "inference.networking.k8s.io/engine-type"
# llm-d's newer name for the same label, read when the configured one is absent.
LLMD_ENGINE_LABEL: Final = "llm-d.ai/engine-type"
DEFAULT_ENGINE: Final = "vllm"

DEFAULT_INTERVAL_S: Final = 0.05  # GIE's --refresh-metrics-interval
DEFAULT_TIMEOUT_S: Final = 1.0  # GIE's per-poll timeout


# ---------------------------------------------------------------------------
# Metric specs and engines.

_SPEC: Final = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$", re.DOTALL)
_SPEC_LABEL: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*(?:"([^"]*)"|([^",}\s]+))\s*')


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A series selector: a metric name and labels the series must have."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MetricSpec:
        """`name`, `name{label=value}` or `name{label="value",...}`; ValueError if not."""
        match = _SPEC.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a metric spec like name or name{{label=value}}")
        labels: list[tuple[str, str]] = []
        block = (match.group(2) or "").strip()
        if block:
            for pair in block.split(","):
                found = _SPEC_LABEL.fullmatch(pair)
                if found is None:
                    raise ValueError(f"{text!r}: {pair.strip()!r} is not label=value")
                labels.append((found.group(1), found.group(2) or found.group(3) or ""))
        return cls(match.group(1), tuple(labels))

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Where an engine's /metrics page carries each fact. Each fact lists
    alternatives: the first one present on the page is used (vLLM renamed its KV
    usage gauge)."""

    name: str
    waiting: tuple[MetricSpec, ...] = ()
    running: tuple[MetricSpec, ...] = ()
    kv_usage: tuple[MetricSpec, ...] = ()
    lora: tuple[MetricSpec, ...] = ()
    # An info gauge whose labels carry the block size and block count...
    cache_info: tuple[MetricSpec, ...] = ()
    cache_block_size_label: str = "block_size"
    cache_num_blocks_label: str = "num_gpu_blocks"
    # ... or plain gauges holding them (TensorRT-LLM).
    cache_block_size: tuple[MetricSpec, ...] = ()
    cache_num_blocks: tuple[MetricSpec, ...] = ()
    custom: tuple[tuple[str, MetricSpec], ...] = ()

    def series_names(self) -> list[str]:
        specs = [
            *self.waiting,
            *self.running,
            *self.kv_usage,
            *self.lora,
            *self.cache_info,
            *self.cache_block_size,
            *self.cache_num_blocks,
            *(spec for _, spec in self.custom),
        ]
        return sorted({spec.name for spec in specs})


def _specs(*texts: str) -> tuple[MetricSpec, ...]:
    return tuple(MetricSpec.parse(t) for t in texts)


BUILTIN_ENGINES: Final[Mapping[str, EngineSpec]] = {
    "vllm": EngineSpec(
        "vllm",
        waiting=_specs("vllm:num_requests_waiting"),
        running=_specs("vllm:num_requests_running"),
        kv_usage=_specs("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora=_specs("vllm:lora_requests_info"),
        cache_info=_specs("vllm:cache_config_info"),
    ),
    "sglang": EngineSpec(
        "sglang",
        waiting=_specs("sglang:num_queue_reqs"),
        running=_specs("sglang:num_running_reqs"),
        kv_usage=_specs("sglang:token_usage"),
        cache_info=_specs("sglang:cache_config_info"),
        cache_block_size_label="page_size",
        cache_num_blocks_label="num_pages",
    ),
    "trtllm-serve": EngineSpec(
        "trtllm-serve",
        waiting=_specs("trtllm_num_requests_waiting"),
        running=_specs("trtllm_num_requests_running"),
        kv_usage=_specs("trtllm_kv_cache_utilization"),
        cache_block_size=_specs("trtllm_kv_cache_tokens_per_block"),
        cache_num_blocks=_specs("trtllm_kv_cache_max_blocks"),
    ),
    "triton-tensorrt-llm": EngineSpec(
        "triton-tensorrt-llm",
        waiting=_specs("nv_trt_llm_request_metrics{request_type=waiting}"),
        running=_specs("nv_trt_llm_request_metrics{request_type=scheduled}"),
        kv_usage=_specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"),
        cache_block_size=_specs(
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}"
        ),
        cache_num_blocks=_specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}"),
    ),
    "triton": EngineSpec(
        "triton",
        waiting=_specs("nv_inference_pending_request_count"),
        running=_specs("nv_inference_exec_count"),
    ),
}


# ---------------------------------------------------------------------------
# Reading the wanted series off a page.


class PageError(ValueError):
    """The page cannot be used at all (not a metrics page, or not this engine's)."""


class Sample:
    """One sample line: its value, and its labels, parsed only when asked for (the
    request counts of most engines need none)."""

    __slots__ = ("_cache", "_raw", "value")

    def __init__(
        self, raw_labels: bytes, value: float, cache: dict[bytes, dict[str, str]] | None = None
    ) -> None:
        self._raw = raw_labels
        self._cache = cache
        self.value = value

    @property
    def labels(self) -> Mapping[str, str]:
        cache = self._cache
        if cache is None:
            return _labels(self._raw)
        found = cache.get(self._raw)
        if found is None:
            if len(cache) >= LABEL_CACHE_SIZE:
                cache.clear()  # a crude bound; the same few label sets come back
            found = cache[self._raw] = _labels(self._raw)
        return found


# Label sets parsed before, by their text: info series (LoRA, cache config) carry
# the same labels scrape after scrape, and parsing them is most of a page's cost.
LABEL_CACHE_SIZE: Final = 4096
# Series read before, by the bytes of their sample lines (a pod's queue length or
# LoRA state takes the same few values again and again), per series name: a KV
# usage that is new on every page must not flush the others.
SERIES_CACHE_SIZE: Final = 1024
# Sample-line blocks longer than this are read, not cached.
MAX_CACHED_BLOCK_BYTES: Final = 2048


class SeriesRead:
    """A series read off a page: its samples, a note per line that could not be
    read, and the facts derived from it (`_Page.derive`), kept with it: a read
    shared by every page with the same lines is derived from once."""

    __slots__ = ("facts", "problems", "samples")

    def __init__(self, samples: Sequence[Sample], problems: Sequence[str]) -> None:
        self.samples = samples
        self.problems = problems
        self.facts: dict[tuple[str, str], tuple[object, Derived]] = {}


# What a fact gives: the `EndpointMetrics` fields, and why it is unknown (or None).
Derived = tuple[dict[str, object], str | None]

_NO_SERIES: Final = SeriesRead((), ())


class ReadCache:
    """What one page shares with the next, kept across pages (and endpoints: the
    same bytes read the same whoever sent them). Each table is bounded crudely:
    emptied when full, since the same few entries come back."""

    __slots__ = ("labels", "series")

    def __init__(self) -> None:
        self.labels: dict[bytes, dict[str, str]] = {}
        self.series: dict[str, dict[bytes, SeriesRead]] = {}


# One name="value" pair of a label set; the value's pattern is the "unrolled loop"
# form, which consumes runs of ordinary bytes at once.
_LABEL_PAIR: Final = re.compile(
    rb'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"\\]*(?:\\.[^"\\]*)*)"\s*,?'
)
_ESCAPE: Final = re.compile(rb"\\(.)")
_ESCAPES: Final = {b"n": b"\n", b"\\": b"\\", b'"': b'"'}


def _unescape(value: bytes) -> str:
    if b"\\" in value:
        value = _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), b"\\" + m.group(1)), value)
    return value.decode("utf-8", errors="replace")


def _labels(block: bytes) -> dict[str, str]:
    """The pairs of a label set (the text between `{` and `}`); labels that do not
    parse yield an empty set, which matches no spec that asks for labels."""
    labels: dict[str, str] = {}
    pos = 0
    size = len(block.rstrip())
    while pos < size:
        match = _LABEL_PAIR.match(block, pos)
        if match is None:
            return {}
        labels[match.group(1).decode("ascii")] = _unescape(match.group(2))
        pos = match.end()
    return labels


_METRIC_NAME: Final = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Sample names a family's lines may carry besides its own (histograms, summaries,
# counters).
_SUFFIXES: Final = (b"_bucket", b"_count", b"_sum", b"_total", b"_created", b"_gcount", b"_gsum")


def _family_of(name: bytes) -> bytes:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _first_sample(page: bytes, name: bytes) -> int:
    """Where the first sample line of exactly the series `name` starts; -1: none."""
    size = len(name)
    end = len(page)
    if page.startswith(name) and size < end and page[size] in _AFTER_NAME:
        return 0
    needle = b"\n" + name
    pos = page.find(needle)
    while pos >= 0:
        after = pos + 1 + size
        # The name must end here: `vllm:num_requests_waiting` is also the start
        # of other metric names.
        if after < end and page[after] in _AFTER_NAME:
            return pos + 1
        pos = page.find(needle, after)
    return -1


def _sample_lines(page: bytes, name: bytes, line: int) -> list[bytes]:
    """The sample lines of exactly the series `name` from its first one, at `line`,
    each without the name (from its label set or value to the end of the line).

    The text format keeps all lines of a family together, so the others are among
    the lines right after the first, up to the next family: the rest of the page is
    not searched (a full search of a 40 KB page costs more than reading the few
    lines the EPP needs)."""
    size = len(name)
    end = len(page)
    lines: list[bytes] = []
    family: bytes | None = None
    while True:
        next_line = page.find(b"\n", line)
        stop = next_line if next_line >= 0 else end
        after = line + size
        if after < stop and page[after] in _AFTER_NAME and page.startswith(name, line):
            lines.append(page[after:stop])
        else:
            # Another sample of the same family (a histogram's _count between two
            # label sets' _bucket lines) may be skipped; anything else ends it.
            found = _METRIC_NAME.match(page, line)
            if found is None:
                break  # a comment: the next family's HELP or TYPE
            if family is None:
                family = _family_of(name)
            if _family_of(found.group()) != family:
                break
        if next_line < 0:
            break
        line = next_line + 1
    return lines


# Byte values that may follow a metric name on a sample line: `{`, space, tab.
_AFTER_NAME: Final = frozenset(b"{ \t")


def read_series(page: bytes, name: str, cache: ReadCache | None = None) -> SeriesRead:
    """The samples of the series `name` on a Prometheus text page, and a note per
    sample line that could not be read. `cache` keeps what was read across pages.

    What is cached is keyed by the block of lines from the series' first sample to
    the next comment line (the next family's HELP or TYPE): every line the reading
    could look at is in it, so the same block reads the same."""
    encoded = name.encode("ascii")
    start = _first_sample(page, encoded)
    if start < 0:
        return _NO_SERIES
    if cache is None:
        return _read_lines(_sample_lines(page, encoded, start), name, None)
    comment = page.find(b"\n#", start)
    stop = comment + 1 if comment >= 0 else len(page)
    if stop - start > MAX_CACHED_BLOCK_BYTES:
        return _read_lines(_sample_lines(page, encoded, start), name, cache.labels)
    block = page[start:stop]
    reads = cache.series.get(name)
    if reads is None:
        reads = cache.series[name] = {}
    found = reads.get(block)
    if found is None:
        if len(reads) >= SERIES_CACHE_SIZE:
            reads.clear()
        found = reads[block] = _read_lines(_sample_lines(block, encoded, 0), name, cache.labels)
    return found


def _read_lines(
    lines: list[bytes], name: str, label_cache: dict[bytes, dict[str, str]] | None
) -> SeriesRead:
    samples: list[Sample] = []
    problems: list[str] = []
    for line in lines:
        raw_labels = b""
        if line[:1] == b"{":
            # Label values may hold `}`, but the value and timestamp after the set
            # never do: the set ends at the line's last `}`.
            close = line.rfind(b"}")
            if close < 0:
                problems.append(f"{name}: unterminated label set")
                continue
            raw_labels = line[1:close]
            line = line[close + 1 :]
        fields = line.split(None, 1)
        if not fields:
            problems.append(f"{name}: a sample without a value")
            continue
        try:
            value = float(fields[0])
        except ValueError:
            problems.append(f"{name}: value {fields[0][:20]!r} is not a number")
            continue
        samples.append(Sample(raw_labels, value, label_cache))
    return SeriesRead(tuple(samples), tuple(problems))


def _matching(samples: Sequence[Sample], spec: MetricSpec) -> list[Sample]:
    if not spec.labels:
        return list(samples)
    return [s for s in samples if all(s.labels.get(k) == v for k, v in spec.labels)]


class _Page:
    """One page, each series read at most once."""

    def __init__(self, page: bytes, cache: ReadCache | None) -> None:
        self.page = page
        self.cache = cache
        self._series: dict[str, SeriesRead] = {}

    def series(self, name: str) -> SeriesRead:
        found = self._series.get(name)
        if found is None:
            found = self._series[name] = read_series(self.page, name, self.cache)
        return found

    def find(self, specs: Sequence[MetricSpec]) -> tuple[MetricSpec, list[Sample]] | str:
        """The first spec with matching samples and those samples, or why none."""
        notes: list[str] = []
        for spec in specs:
            series = self.series(spec.name)
            matching = _matching(series.samples, spec)
            if matching:
                return spec, matching
            notes.extend(series.problems)
        if notes:
            return "; ".join(notes)
        return f"{' or '.join(str(s) for s in specs)} not on the page"

    def derive(
        self,
        key: tuple[str, str],
        specs: tuple[MetricSpec, ...],
        compute: Callable[[MetricSpec, list[Sample]], Derived],
    ) -> tuple[bool, Derived]:
        """Whether a spec of `specs` has matching samples, and `compute` of the first
        that has (or why none has). When that is the first spec, the outcome
        depends on its series alone and is kept with it, under `key` (engine,
        fact): the same lines on the next page cost a lookup, not a derivation."""
        first = self.series(specs[0].name)
        memo = first.facts.get(key)
        if memo is not None and memo[0] is specs:
            return True, memo[1]
        found = self.find(specs)
        if isinstance(found, str):
            return False, ({}, found)
        spec, samples = found
        derived = compute(spec, samples)
        if spec is specs[0]:
            first.facts[key] = (specs, derived)
        return True, derived


_INF: Final = math.inf


def _bad_value(value: float, spec: MetricSpec, upper: float | None = None) -> str | None:
    if math.isnan(value):
        return f"{spec} is NaN"
    if math.isinf(value):
        return f"{spec} is infinite"
    if value < 0:
        return f"{spec} is negative ({value:g})"
    if upper is not None and value > upper:
        return f"{spec} is {value:g}, above {upper:g}"
    return None


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    text = labels.get(name, "").strip()
    if not text.isdigit():
        return None
    return int(text)


def _adapters(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def _request_count(spec: MetricSpec, samples: list[Sample]) -> Derived:
    return _gauge(spec, samples, None)


def _kv_usage(spec: MetricSpec, samples: list[Sample]) -> Derived:
    return _gauge(spec, samples, 1.0)


def _gauge(spec: MetricSpec, samples: list[Sample], upper: float | None) -> Derived:
    """Request counts are summed over the series (data-parallel engines), KV usage
    is the highest."""
    total = 0.0
    highest = 0.0
    for sample in samples:
        value = sample.value
        # The usual values (finite, >= 0, at most 1 for KV usage) pass with one
        # comparison chain; anything else gets its reason.
        if not ((0.0 <= value <= 1.0) if upper else (0.0 <= value < _INF)):
            problem = _bad_value(value, spec, upper) or f"{spec} is {value}"
            return {}, problem + (" (expected a fraction in [0, 1])" if upper else "")
        total += value
        highest = max(highest, value)
    return {"": highest if upper else round(total)}, None


def _lora(spec: MetricSpec, samples: list[Sample]) -> Derived:
    # The gauge's value is when the series was set: the latest one is current.
    latest = max(samples, key=lambda s: s.value if not math.isnan(s.value) else -1.0)
    max_lora = _int_label(latest.labels, "max_lora")
    if max_lora is None:
        return {}, f"{spec} has no integer max_lora label"
    return {
        "running_adapters": _adapters(latest.labels.get("running_lora_adapters", "")),
        "waiting_adapters": _adapters(latest.labels.get("waiting_lora_adapters", "")),
        "max_adapters": max_lora,
    }, None


_GAUGES: Final = (
    (WAITING, "waiting", "waiting_requests", _request_count),
    (RUNNING, "running", "running_requests", _request_count),
    (KV_CACHE_USAGE, "kv_usage", "kv_cache_usage", _kv_usage),
)


def read_page(page: bytes, engine: EngineSpec, cache: ReadCache | None = None) -> dict[str, object]:
    """The `EndpointMetrics` fields a page gives for `engine` (including `missing`).

    Raises `PageError` when none of the engine's request or KV metrics is on it."""
    reader = _Page(page, cache)
    values: dict[str, object] = {}
    missing: dict[str, str] = {}
    on_page = False  # whether any request or KV series of the engine is on the page
    name = engine.name
    for fact, field_name, attr, compute in _GAUGES:
        specs: tuple[MetricSpec, ...] = getattr(engine, field_name)
        if not specs:
            missing[fact] = f"the {name} engine config has no metric for it"
            continue
        found, (fields, problem) = reader.derive((name, fact), specs, compute)
        on_page = on_page or found
        if problem is not None:
            missing[fact] = problem
        else:
            values[attr] = fields[""]

    if not on_page:
        wanted = ", ".join(str(s) for s in (*engine.waiting, *engine.running, *engine.kv_usage))
        details = "; ".join(sorted(set(missing.values())))
        raise PageError(
            f"none of the {name} engine's metrics ({wanted}) is on the page"
            f" ({details}): is this a {name} server, with the right engine-type label?"
        )

    if not engine.lora:
        missing[LORA] = f"the {name} engine reports no LoRA metric"
    else:
        _, (fields, problem) = reader.derive((name, LORA), engine.lora, _lora)
        if problem is not None:
            missing[LORA] = problem
        else:
            values.update(fields)

    _cache_info(reader, engine, values, missing)

    custom: dict[str, float] = {}
    for key, spec in engine.custom:
        series = reader.find((spec,))
        if isinstance(series, str):
            missing[f"custom:{key}"] = series
            continue
        value = series[1][0].value
        if not math.isfinite(value):
            missing[f"custom:{key}"] = f"{spec} is {value}"
            continue
        custom[key] = value
    if custom:
        values["custom"] = custom
    values["missing"] = missing
    return values


def _labelled_cache_info(engine: EngineSpec) -> Callable[[MetricSpec, list[Sample]], Derived]:
    """The cache configuration from an info gauge's labels (vLLM, SGLang)."""

    def labelled(spec: MetricSpec, samples: list[Sample]) -> Derived:
        labels = samples[0].labels
        block_size = _int_label(labels, engine.cache_block_size_label)
        num_blocks = _int_label(labels, engine.cache_num_blocks_label)
        if not block_size or not num_blocks:
            return {}, (
                f"{spec} has no positive integer {engine.cache_block_size_label}"
                f" and {engine.cache_num_blocks_label} labels"
            )
        return {"block_size": block_size, "num_gpu_blocks": num_blocks}, None

    return labelled


def _cache_info(
    reader: _Page, engine: EngineSpec, values: dict[str, object], missing: dict[str, str]
) -> None:
    if engine.cache_info:
        labelled = _labelled_cache_info(engine)
        _, (fields, problem) = reader.derive((engine.name, CACHE_INFO), engine.cache_info, labelled)
        if problem is not None:
            missing[CACHE_INFO] = problem
        else:
            values.update(fields)
        return
    if engine.cache_block_size and engine.cache_num_blocks:
        sizes = reader.find(engine.cache_block_size)
        counts = reader.find(engine.cache_num_blocks)
        if isinstance(sizes, str) or isinstance(counts, str):
            missing[CACHE_INFO] = sizes if isinstance(sizes, str) else str(counts)
            return
        size_value, count_value = sizes[1][0].value, counts[1][0].value
        if (
            not (math.isfinite(size_value) and math.isfinite(count_value))
            or min(size_value, count_value) < 1
        ):
            missing[CACHE_INFO] = "block size or block count is not a positive number"
            return
        values["block_size"] = int(size_value)
        values["num_gpu_blocks"] = int(count_value)
        return
    missing[CACHE_INFO] = f"the {engine.name} engine reports no cache configuration"


class _PlainFact:
    """One fact of a `FastReader`: read off its metric's sample lines, and what they
    gave kept by those lines."""

    __slots__ = (
        "absent",
        "apply",
        "compute",
        "encoded",
        "fact",
        "memo",
        "name",
        "needle",
        "size",
        "spec",
    )

    def __init__(
        self,
        fact: str,
        specs: tuple[MetricSpec, ...],
        compute: Callable[[MetricSpec, list[Sample]], Derived],
        apply: str | None,
    ) -> None:
        spec = specs[0]
        self.fact = fact
        self.spec = spec
        # Why the fact is unknown when its metric is not on the page (read_page's
        # words); None: it has other metrics to try, which read_page does.
        self.absent = f"{spec} not on the page" if len(specs) == 1 else None
        self.name = spec.name
        self.encoded = spec.name.encode("ascii")
        self.needle = b"\n" + self.encoded
        self.size = len(self.needle)
        self.compute = compute
        self.apply = apply  # the field a gauge sets; None: the fields are merged
        self.memo: dict[bytes, Derived] = {}


class FastReader:
    """`read_page` for an engine whose facts are each read off one plain metric
    name (vLLM's and SGLang's), in one pass with no layers: per fact, two
    `bytes.find` calls, a slice and a lookup of what those lines gave before.

    Only the common case is read here: each fact's first metric is on the page
    (not as the page's first line, and followed by a comment line within
    `MAX_CACHED_BLOCK_BYTES`) with at least one readable sample, or absent
    when it is the fact's only metric (a pod without LoRA), and at least one
    request or KV fact is there. Anything else (an older vLLM's other KV name,
    unreadable lines, a page that is not this engine's) returns None, and
    `read_page` reads the page, with its reasons. A test checks that both read the
    same."""

    def __init__(self, engine: EngineSpec, cache: ReadCache) -> None:
        self.cache = cache
        self.facts: list[_PlainFact] = []
        self.constant_missing: dict[str, str] = {}
        for fact, field_name, attr, compute in _GAUGES:
            specs: tuple[MetricSpec, ...] = getattr(engine, field_name)
            self.facts.append(_PlainFact(fact, specs, compute, attr))
        if engine.lora:
            self.facts.append(_PlainFact(LORA, engine.lora, _lora, None))
        else:
            self.constant_missing[LORA] = f"the {engine.name} engine reports no LoRA metric"
        if engine.cache_info:
            self.facts.append(
                _PlainFact(CACHE_INFO, engine.cache_info, _labelled_cache_info(engine), None)
            )
        else:
            self.constant_missing[CACHE_INFO] = (
                f"the {engine.name} engine reports no cache configuration"
            )

    @staticmethod
    def suits(engine: EngineSpec) -> bool:
        firsts = [
            specs[0] if specs else None
            for specs in (engine.waiting, engine.running, engine.kv_usage)
        ]
        firsts += [engine.lora[0]] if engine.lora else []
        firsts += [engine.cache_info[0]] if engine.cache_info else []
        return (
            all(spec is not None and not spec.labels for spec in firsts)
            and not engine.custom
            and not (engine.cache_block_size or engine.cache_num_blocks)
        )

    def read(self, page: bytes) -> dict[str, object] | None:
        values: dict[str, object] = {}
        missing = dict(self.constant_missing)
        end = len(page)
        on_page = False  # whether a request or KV fact (the first three) was read
        for index, fact in enumerate(self.facts):
            at = page.find(fact.needle)
            if at < 0:
                if fact.absent is None or page.startswith(fact.encoded):
                    return None
                missing[fact.fact] = fact.absent
                continue
            after = at + fact.size
            if after >= end or page[after] not in _AFTER_NAME:
                return None
            stop = page.find(b"\n#", after)
            stop = stop + 1 if stop >= 0 else end
            if stop - at > MAX_CACHED_BLOCK_BYTES:
                return None  # a page without comment lines: not remembered
            block = page[at + 1 : stop]
            derived = fact.memo.get(block)
            if derived is None:
                lines = _sample_lines(block, fact.encoded, 0)
                samples = _read_lines(lines, fact.name, self.cache.labels).samples
                if not samples:
                    return None
                derived = fact.compute(fact.spec, list(samples))
                if len(fact.memo) >= SERIES_CACHE_SIZE:
                    fact.memo.clear()
                fact.memo[block] = derived
            if index < len(_GAUGES):
                on_page = True
            fields, problem = derived
            if problem is not None:
                missing[fact.fact] = problem
            elif fact.apply is not None:
                values[fact.apply] = fields[""]
            else:
                values.update(fields)
        if not on_page:
            return None  # read_page says why the page is not this engine's
        values["missing"] = missing
        return values


# ---------------------------------------------------------------------------
# The extractor: which engine an endpoint runs, and its page -> a snapshot.


class MetricsExtractor:
    """Turns an endpoint's /metrics page into its `EndpointMetrics` (GIE's
    `core-metrics-extractor`; the plugin of that type is this class with GIE's
    parameters)."""

    def __init__(
        self,
        engines: Mapping[str, EngineSpec] | None = None,
        default_engine: str = DEFAULT_ENGINE,
        engine_label_key: str = ENGINE_LABEL,
    ) -> None:
        merged = dict(BUILTIN_ENGINES)
        merged.update(engines or {})
        if default_engine not in merged:
            raise ValueError(
                f"defaultEngine {default_engine!r} is not an engine config"
                f" (known: {', '.join(sorted(merged))})"
            )
        self.engines: Mapping[str, EngineSpec] = merged
        self.default_engine = default_engine
        self.engine_label_key = engine_label_key
        self._cache = ReadCache()
        self._fast: dict[str, FastReader | None] = {}

    def engine_for(self, endpoint: Endpoint) -> EngineSpec:
        """The endpoint's engine, from its engine-type label; PageError if the label
        names an engine nobody configured (scraping it could only mislead)."""
        labels = endpoint.labels
        name = labels.get(self.engine_label_key) or labels.get(LLMD_ENGINE_LABEL)
        if not name:
            return self.engines[self.default_engine]
        engine = self.engines.get(name)
        if engine is None:
            raise PageError(
                f"engine type {name!r} (endpoint label) has no engine config"
                f" (known: {', '.join(sorted(self.engines))})"
            )
        return engine

    def extract(
        self,
        data: bytes,
        endpoint: Endpoint,
        *,
        now: float = 0.0,
        staleness_s: float = DEFAULT_STALENESS_S,
    ) -> EndpointMetrics:
        """The snapshot for a page scraped at `now`; PageError if unusable."""
        engine = self.engine_for(endpoint)
        if engine.name in self._fast:
            fast = self._fast[engine.name]
        else:
            fast = self._fast[engine.name] = (
                FastReader(engine, self._cache) if FastReader.suits(engine) else None
            )
        values = fast.read(data) if fast is not None else None
        if values is None:
            values = read_page(data, engine, self._cache)
        return EndpointMetrics(updated_at=now, staleness_s=staleness_s, **values)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The scraper.


@dataclass(frozen=True)
class ScrapeSettings:
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    staleness_s: float = DEFAULT_STALENESS_S
    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True
    ca_cert_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    # "fast": plain http:// through KeepAliveFetcher; "aiohttp": everything
    # through the shared aiohttp session (https always is).
    http_client: str = "fast"
    max_page_bytes: int = 16 * 1024 * 1024


@dataclass(eq=False)
class _Target:
    endpoint: Endpoint
    url: str
    fetcher: KeepAliveFetcher | None = None  # plain http://; else `task`
    task: asyncio.Task[None] | None = None  # the aiohttp scrape in progress
    started_at: float | None = None  # loop time of the scrape in progress
    last_page: bytes | None = None
    failing: bool = False
    last_error: str | None = None


RESULTS: Final = ("ok", "unchanged", "timeout", "connect_error", "http_error", "bad_page")


class MetricsScraper:
    """Keeps every endpoint's `metrics` snapshot fresh. Built without I/O; `run()`
    scrapes until cancelled, following the endpoint set as it changes.

    One clock for all endpoints: every `interval_s` (on multiples of it on the
    loop's clock) each endpoint whose previous scrape has ended gets a new one, so
    the answers come back together and are read in a few wakeups of the event loop
    (spreading the scrapes over the period cost about 40% more CPU per scrape:
    one wakeup and context switch each). A scrape still waiting for its answer is
    not doubled; once `timeout_s` has passed it is dropped as a timeout."""

    def __init__(
        self,
        datastore: Datastore,
        extractor: MetricsExtractor,
        settings: ScrapeSettings,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.datastore = datastore
        self.extractor = extractor
        self.settings = settings
        self._targets: dict[Endpoint, _Target] = {}
        self._session: aiohttp.ClientSession | None = None
        # Built at the first https:// scrape (it reads certificate files).
        self._ssl: ssl.SSLContext | None = None
        self._running = False
        # Scrapes by result, exposed as a counter at exposition time: a
        # prometheus_client Counter's lock and checks were a tenth of a scrape's CPU.
        self.results = dict.fromkeys(RESULTS, 0)
        registry = registry if registry is not None else CollectorRegistry()
        registry.register(_ScraperCollector(self))

    def url_for(self, endpoint: Endpoint) -> str:
        if endpoint.spec.metrics_url:
            return endpoint.spec.metrics_url
        s = self.settings
        return f"{s.scheme}://{endpoint.address}{s.path}"

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.interval_s
        self._running = True
        self.datastore.add_listener(self._membership)
        try:
            for endpoint in self.datastore.all_endpoints():
                self._start(endpoint)
            next_at = (math.floor(loop.time() / interval) + 1) * interval
            while True:
                await asyncio.sleep(next_at - loop.time())
                self._tick(loop)
                next_at += interval
                now = loop.time()
                if next_at <= now:
                    # The tick overran its period (a busy loop): go on at the next
                    # one, without a burst of catch-up scrapes.
                    next_at = (math.floor(now / interval) + 1) * interval
        finally:
            self._running = False
            self.datastore.remove_listener(self._membership)
            targets = list(self._targets.values())
            self._targets.clear()
            tasks = [t.task for t in targets if t.task is not None]
            for target in targets:
                self._stop(target)
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._session is not None:
                await self._session.close()
                self._session = None

    def _ssl_context(self) -> ssl.SSLContext:
        s = self.settings
        if s.insecure_skip_verify and not s.ca_cert_path:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=s.ca_cert_path)
        if s.client_cert_path:
            context.load_cert_chain(s.client_cert_path, s.client_key_path)
        return context

    def _membership(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        if not self._running:
            return
        for endpoint in removed:
            target = self._targets.pop(endpoint, None)
            if target is not None:
                self._stop(target)
        for endpoint in added:
            self._start(endpoint)

    def _start(self, endpoint: Endpoint) -> None:
        if endpoint in self._targets:
            return
        url = self.url_for(endpoint)
        target = _Target(endpoint, url)
        if self.settings.http_client == "fast" and urlsplit(url).scheme == "http":
            target.fetcher = KeepAliveFetcher(
                url,
                lambda status, page: self._answered(target, status, page),
                lambda exc: self._errored(target, exc),
                self.settings.max_page_bytes,
            )
        self._targets[endpoint] = target

    @staticmethod
    def _stop(target: _Target) -> None:
        target.started_at = None
        if target.task is not None:
            target.task.cancel()
            target.task = None
        if target.fetcher is not None:
            target.fetcher.abort()

    # -- scraping ----------------------------------------------------------------

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        timeout = self.settings.timeout_s
        for target in tuple(self._targets.values()):
            if target.started_at is not None:
                if now - target.started_at < timeout:
                    continue  # still waiting for its answer
                self._expire(target)
            self._begin(target, now)
        if timeout < self.settings.interval_s:
            # A timeout shorter than the period is noticed before the next tick.
            loop.call_at(now + timeout, self._expire_overdue, now)

    def _begin(self, target: _Target, now: float) -> None:
        target.started_at = now
        try:
            if target.fetcher is not None:
                target.fetcher.request()
            else:
                target.task = asyncio.get_running_loop().create_task(
                    self._scrape_with_aiohttp(target), name=f"metrics:{target.endpoint.name}"
                )
        except Exception:
            # A bug must not silently end this endpoint's scraping.
            target.started_at = None
            log.exception("metrics scrape of %s failed to start", target.endpoint.name)

    def _expire_overdue(self, started_at: float) -> None:
        # The scrapes of that tick, and no later ones: `_begin` stored this same
        # float, so equality is exact.
        for target in tuple(self._targets.values()):
            if target.started_at == started_at:
                self._expire(target)

    def _expire(self, target: _Target) -> None:
        self._stop(target)
        self._failed(target, "timeout", f"no answer within {self.settings.timeout_s:g}s")

    async def _scrape_with_aiohttp(self, target: _Target) -> None:
        try:
            status, page = await self._fetch_with_aiohttp(target)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if target.task is asyncio.current_task():
                target.task = None
                self._errored(target, exc)
            return
        if target.task is asyncio.current_task():
            target.task = None
            self._answered(target, status, page)

    async def _fetch_with_aiohttp(self, target: _Target) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
            )
        ssl_context: ssl.SSLContext | bool = False
        if target.url.startswith("https:"):
            if self._ssl is None:
                self._ssl = self._ssl_context()
            ssl_context = self._ssl
        async with self._session.get(
            target.url, ssl=ssl_context, allow_redirects=False
        ) as response:
            limit = self.settings.max_page_bytes
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > limit:
                    raise FetchError(f"the page is over {limit} bytes")
                chunks.append(chunk)
            return response.status, b"".join(chunks)

    def _errored(self, target: _Target, exc: Exception) -> None:
        """A scrape ended without an answer; never raises."""
        target.started_at = None
        try:
            if isinstance(exc, FetchError):
                self._failed(target, "bad_page", str(exc))
            elif isinstance(exc, (OSError, aiohttp.ClientError)):
                self._failed(
                    target,
                    "connect_error",
                    f"{type(exc).__name__}: {exc}",
                    unreachable=_refused(exc),
                )
            else:
                raise exc
        except Exception:
            log.exception("metrics scrape of %s failed unexpectedly", target.endpoint.name)

    def _answered(self, target: _Target, status: int, page: bytes) -> None:
        """A scrape's answer; never raises for bad input."""
        target.started_at = None
        try:
            self._read(target, status, page)
        except Exception:
            # A bug must not break the connection's callbacks or the scraping.
            log.exception("metrics scrape of %s failed unexpectedly", target.endpoint.name)

    def _read(self, target: _Target, status: int, page: bytes) -> None:
        endpoint = target.endpoint
        now = time.monotonic()
        if status != 200:
            self._failed(target, "http_error", f"HTTP {status} from {target.url}")
            return
        if page == target.last_page and not target.failing:
            # The same page as last time (an idle pod): same facts, fresh time.
            self._store(target, dataclasses.replace(endpoint.metrics, updated_at=now))
            self.results["unchanged"] += 1
            return
        try:
            snapshot = self.extractor.extract(
                page, endpoint, now=now, staleness_s=self.settings.staleness_s
            )
        except PageError as exc:
            target.last_page = None
            self._failed(target, "bad_page", str(exc))
            return
        target.last_page = page
        self._store(target, snapshot)
        self.results["ok"] += 1
        if target.failing:
            target.failing = False
            target.last_error = None
            log.info("metrics of %s are back (%s)", endpoint.name, target.url)

    def _store(self, target: _Target, snapshot: EndpointMetrics) -> None:
        endpoint = target.endpoint
        # A removed endpoint, or one replaced by a new spec under the same name,
        # must not receive this scrape.
        if self._targets.get(endpoint) is target and self.datastore.get(endpoint.name) is endpoint:
            self.datastore.set_metrics(endpoint.name, snapshot)

    def _failed(
        self, target: _Target, result: str, message: str, unreachable: bool = False
    ) -> None:
        self.results[result] += 1
        endpoint = target.endpoint
        previous = endpoint.metrics
        # Keep the last good values (and their time: they turn stale by age, or at
        # once if the server is gone), and say what went wrong.
        self._store(
            target,
            dataclasses.replace(
                previous,
                error=message,
                staleness_s=self.settings.staleness_s,
                unreachable=unreachable,
            ),
        )
        if not target.failing or message != target.last_error:
            # Once per change of trouble, not 20 times a second.
            log.warning("metrics of %s (%s): %s", endpoint.name, target.url, message)
        target.failing = True
        target.last_error = message


_UNREACHABLE_ERRNOS: Final = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


def _refused(exc: BaseException) -> bool:
    """Whether a failed scrape says nothing listens at the address (as opposed to a
    slow or broken answer, which may still come right)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        exc = exc.os_error
    return isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS
    )


class _ScraperCollector(Collector):
    """`epp_metrics_scrapes_total` and `epp_metrics_stale_endpoints`, computed at
    exposition time."""

    def __init__(self, scraper: MetricsScraper) -> None:
        self.scraper = scraper
        self.datastore = scraper.datastore

    def collect(self) -> Iterator[Metric]:
        scrapes = CounterMetricFamily(
            "epp_metrics_scrapes",
            "Scrapes of model-server /metrics pages, by result: ok, unchanged (the same"
            " page as before, not parsed again), timeout, connect_error, http_error,"
            " bad_page (none of the engine's metrics on it).",
            labels=["result"],
        )
        for result, count in self.scraper.results.items():
            scrapes.add_metric([result], count)
        yield scrapes
        now = time.monotonic()
        family = GaugeMetricFamily(
            "epp_metrics_stale_endpoints",
            "Endpoints whose model-server metrics are older than the staleness threshold"
            " (plugins score them neutrally; /debug/endpoints says why).",
        )
        family.add_metric(
            [], sum(1 for e in self.datastore.all_endpoints() if e.metrics.stale(now))
        )
        yield family


def describe_metrics(metrics: EndpointMetrics, now: float | None = None) -> dict[str, object]:
    """The `metrics` object of /debug/endpoints."""
    now = time.monotonic() if now is None else now
    age = metrics.age(now)
    stale = metrics.stale(now)
    reason: str | None = None
    if metrics.updated_at == 0.0:
        reason = "never scraped" + (f": {metrics.error}" if metrics.error else "")
    elif metrics.unreachable:
        reason = f"unreachable: {metrics.error} (last good scrape {age:.1f}s ago)"
    elif stale:
        reason = f"stale: last good scrape {age:.1f}s ago (threshold {metrics.staleness_s:g}s)"
        if metrics.error:
            reason += f"; last error: {metrics.error}"
    elif metrics.missing:
        reason = "; ".join(f"{fact}: {why}" for fact, why in metrics.missing.items())
    return {
        "waiting": metrics.waiting_requests,
        "running": metrics.running_requests,
        "kvCacheUsage": metrics.kv_cache_usage,
        "stale": stale,
        "ageSeconds": None if math.isinf(age) else round(age, 3),
        "error": metrics.error,
        "unreachable": metrics.unreachable,
        "missing": dict(metrics.missing),
        "reason": reason,
        "lora": {
            "running": sorted(metrics.running_adapters),
            "waiting": sorted(metrics.waiting_adapters),
            "max": metrics.max_adapters,
        },
        "cacheInfo": {"blockSize": metrics.block_size, "numGpuBlocks": metrics.num_gpu_blocks},
    }
