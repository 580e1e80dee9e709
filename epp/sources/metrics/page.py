"""Reading a page for an engine: the `EndpointMetrics` fields it gives, and for
every fact it does not give, why.

Two readers, which read the same (a test checks it on many page variants), through
one `ReadCache`:
- `read_page` reads any engine's page: a fact's alternative metric names (vLLM
  renamed its KV usage gauge), label selectors, custom metrics, the cache
  configuration from plain gauges. It says why each missing fact is missing, and
  raises `PageError` for a page that is not the engine's.
- `SinglePassReader` reads the common case of an engine whose facts each come from
  one plain metric name (vLLM's, SGLang's) in one pass, at a fraction of
  `read_page`'s cost, and declines (None) every other page, which `read_page`
  then reads.

Both derive each fact through `epp.sources.metrics.facts` and keep what it gave in
the cache's one fact table for (engine name, fact), by the lines of the fact's
first metric: a fact derived by one reader is a lookup for the other.

Contract: `read_page` keeps nothing but what it adds to the cache it is given. A
`SinglePassReader` is built for one engine and one cache; after that it writes
only that cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epp.datastore import CACHE_INFO, LORA
from epp.sources.metrics.facts import (
    GAUGE_FACTS,
    Derivation,
    Derived,
    derive_lora,
    labelled_cache_info,
)
from epp.sources.metrics.read_cache import (
    MAX_CACHED_BLOCK_BYTES,
    ReadCache,
    SeriesRead,
    read_series,
    remember,
)
from epp.sources.metrics.specs import EngineSpec, MetricSpec
from epp.sources.metrics.text_format import AFTER_NAME, Sample, read_sample_lines, sample_lines


class PageError(ValueError):
    """The page cannot be used at all (not a metrics page, or not this engine's)."""


def _matching(samples: Sequence[Sample], spec: MetricSpec) -> list[Sample]:
    if not spec.labels:
        return list(samples)
    return [s for s in samples if all(s.labels.get(k) == v for k, v in spec.labels)]


class _PageSeries:
    """The series of one page, as `read_page` reads them: each read at most once,
    through the cache when there is one."""

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
        compute: Derivation,
    ) -> tuple[bool, Derived]:
        """Whether a spec of `specs` has matching samples, and `compute` of the first
        that has (or why none has). When that is the first spec, the outcome
        depends on its lines alone and is kept in the cache's fact table for `key`
        (engine, fact), by those lines: the same lines on the next page cost a
        lookup, not a derivation, here and in `SinglePassReader`."""
        first = self.series(specs[0].name)
        known: dict[bytes, Derived] | None = None
        if self.cache is not None and first.block is not None:
            known = self.cache.fact_table(key, specs)
            derived = known.get(first.block)
            if derived is not None:
                return True, derived
        found = self.find(specs)
        if isinstance(found, str):
            return False, ({}, found)
        spec, samples = found
        derived = compute(spec, samples)
        if spec is specs[0] and known is not None and first.block is not None:
            remember(known, first.block, derived)
        return True, derived


def read_page(page: bytes, engine: EngineSpec, cache: ReadCache | None = None) -> dict[str, object]:
    """The `EndpointMetrics` fields a page gives for `engine` (including `missing`).

    Raises `PageError` when none of the engine's request or KV metrics is on it."""
    reader = _PageSeries(page, cache)
    values: dict[str, object] = {}
    missing: dict[str, str] = {}
    on_page = False  # whether any request or KV series of the engine is on the page
    name = engine.name
    for fact, field_name, attr, compute in GAUGE_FACTS:
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
        _, (fields, problem) = reader.derive((name, LORA), engine.lora, derive_lora)
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


def _cache_info(
    reader: _PageSeries, engine: EngineSpec, values: dict[str, object], missing: dict[str, str]
) -> None:
    if engine.cache_info:
        labelled = labelled_cache_info(engine)
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


class _SinglePassFact:
    """One fact as a `SinglePassReader` reads it: the bytes its metric's sample
    lines start with, how to derive it, and its table in the cache's fact cache
    (the one `read_page` uses too)."""

    __slots__ = (
        "absent",
        "apply",
        "compute",
        "encoded",
        "fact",
        "known",
        "name",
        "needle",
        "size",
        "spec",
    )

    def __init__(
        self,
        engine: EngineSpec,
        fact: str,
        specs: tuple[MetricSpec, ...],
        compute: Derivation,
        apply: str | None,
        cache: ReadCache,
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
        # What the fact gave, by the block of its metric's lines; kept here to save
        # a lookup per fact and page.
        self.known = cache.fact_table((engine.name, fact), specs)


class SinglePassReader:
    """`read_page` for an engine whose facts are each read off one plain metric
    name (vLLM's and SGLang's), in one pass with no layers: per fact, two
    `bytes.find` calls, a slice and a lookup of what those lines gave before, in
    the fact cache `read_page` uses too.

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
        self.facts: list[_SinglePassFact] = []
        self.constant_missing: dict[str, str] = {}
        for fact, field_name, attr, compute in GAUGE_FACTS:
            specs: tuple[MetricSpec, ...] = getattr(engine, field_name)
            self.facts.append(_SinglePassFact(engine, fact, specs, compute, attr, cache))
        if engine.lora:
            self.facts.append(_SinglePassFact(engine, LORA, engine.lora, derive_lora, None, cache))
        else:
            self.constant_missing[LORA] = f"the {engine.name} engine reports no LoRA metric"
        if engine.cache_info:
            labelled = labelled_cache_info(engine)
            self.facts.append(
                _SinglePassFact(engine, CACHE_INFO, engine.cache_info, labelled, None, cache)
            )
        else:
            self.constant_missing[CACHE_INFO] = (
                f"the {engine.name} engine reports no cache configuration"
            )

    @staticmethod
    def suits(engine: EngineSpec) -> bool:
        """Whether each of the engine's facts has a first metric without labels, with
        no custom metrics and no cache configuration from plain gauges."""
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
        """What `read_page` gives for this page, or None: left to `read_page`."""
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
            if after >= end or page[after] not in AFTER_NAME:
                return None
            stop = page.find(b"\n#", after)
            stop = stop + 1 if stop >= 0 else end
            if stop - at > MAX_CACHED_BLOCK_BYTES:
                return None  # a page without comment lines: not remembered
            block = page[at + 1 : stop]
            derived = fact.known.get(block)
            if derived is None:
                lines = sample_lines(block, fact.encoded, 0)
                samples, _ = read_sample_lines(lines, fact.name, self.cache.labels)
                if not samples:
                    return None
                # As `_PageSeries.derive` does: the first spec has no labels, so
                # all the samples match it.
                derived = fact.compute(fact.spec, list(samples))
                remember(fact.known, block, derived)
            if index < len(GAUGE_FACTS):
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
