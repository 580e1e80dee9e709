"""The precise prefix service's Prometheus metrics: the index, the KV-event
streams, the alignment check and the lookups (docs/precise-prefix.md lists them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from epp.promutil import LATENCY_BUCKETS, BucketCounts, add_histogram

if TYPE_CHECKING:
    from epp.kvindex.service import PrecisePrefixService


class PrecisePrefixCollector(Collector):
    """The service's Prometheus metrics, read from its plain counters at scrape
    time: nothing on the ingestion or pick path touches a Prometheus object."""

    def __init__(self, service: PrecisePrefixService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        precise = service.precise
        index = precise.index
        yield _gauge(
            "epp_kv_index_entries",
            "Live (block, endpoint) entries in the prefix index.",
            index.stats.entries,
        )
        yield _gauge(
            "epp_kv_index_max_entries",
            "The prefix index's bound (maxIndexEntries).",
            index.max_entries,
        )
        yield _counter(
            "epp_kv_index_evicted_entries",
            "Entries evicted to stay within maxIndexEntries (events lost, or a bound too small).",
            index.stats.evicted_entries,
        )
        blocks = GaugeMetricFamily(
            "epp_kv_index_blocks", "Blocks each endpoint holds per medium, as its KV events say.",
            labels=["endpoint", "medium"],
        )  # fmt: skip
        families: dict[str, CounterMetricFamily] = {
            "events": CounterMetricFamily(
                "epp_kv_events_applied", "KV events applied to the index.", labels=["endpoint"]
            ),
            "batches": CounterMetricFamily(
                "epp_kv_event_batches", "KV-event batches received.", labels=["endpoint"]
            ),
            "blocks": CounterMetricFamily(
                "epp_kv_blocks_applied",
                "Blocks stored or removed by applied KV events.",
                labels=["endpoint", "op"],
            ),
            "gaps": CounterMetricFamily(
                "epp_kv_event_gaps", "Sequence gaps in a KV-event stream.", labels=["endpoint"]
            ),
            "replays": CounterMetricFamily(
                "epp_kv_event_replays",
                "Replay requests by outcome (requested, failed, partial: the buffer no longer"
                " reached back far enough).",
                labels=["endpoint", "result"],
            ),
            "tail_checks": CounterMetricFamily(
                "epp_kv_event_tail_checks",
                "Checks, after a stream went quiet, for batches lost at its end (checked),"
                " and those that found some (lost: recovered from the replay socket).",
                labels=["endpoint", "result"],
            ),
            "resets": CounterMetricFamily(
                "epp_kv_index_resets",
                "Times an endpoint's entries were cleared, by reason (restart, gap,"
                " all_blocks_cleared).",
                labels=["endpoint", "reason"],
            ),
            "rejected": CounterMetricFamily(
                "epp_kv_events_rejected",
                "KV-event messages or events rejected as malformed, by reason.",
                labels=["endpoint", "reason"],
            ),
            "ignored": CounterMetricFamily(
                "epp_kv_events_ignored",
                "Well-formed KV events skipped on purpose, by reason.",
                labels=["endpoint", "reason"],
            ),
            "alignment": CounterMetricFamily(
                "epp_kv_alignment_failures",
                "BlockStored events whose block size disagreed with the scorer's blockSize.",
                labels=["endpoint"],
            ),
            "unknown": CounterMetricFamily(
                "epp_kv_unknown_block_hashes",
                "Block hashes in KV events that the endpoint's stream never stored with"
                " tokens, by reason: unknown_removal (BlockRemoved: nothing removed),"
                " unknown_block (BlockStored without tokens: not indexed).",
                labels=["endpoint", "reason"],
            ),
            "probes": CounterMetricFamily(
                "epp_kv_tokenization_probes",
                "Picks whose predicted block was looked for in the pod's KV events, by"
                " result: confirmed, missed (expired with events flowing), inconclusive.",
                labels=["endpoint", "result"],
            ),
            "checked": CounterMetricFamily(
                "epp_kv_alignment_checked_blocks",
                "Blocks whose token ids the alignment self-check checked (count and range).",
                labels=["endpoint"],
            ),
        }
        trusted = GaugeMetricFamily(
            "epp_kv_index_trusted",
            "1 if the endpoint's precise prefix score is trusted, 0 if its events are cut"
            " in blocks of another size than blockSize.",
            labels=["endpoint"],
        )
        agreement = GaugeMetricFamily(
            "epp_kv_tokenization_agreement",
            "0 if the blocks predicted for the prompts sent to the endpoint never showed up"
            " in its KV events (the tokenizations likely differ), else 1.",
            labels=["endpoint"],
        )
        connected = GaugeMetricFamily(
            "epp_kv_event_stream_live",
            "1 if the endpoint's KV-event stream is connected (live or replaying).",
            labels=["endpoint"],
        )
        lag = HistogramMetricFamily(
            "epp_kv_event_lag_seconds",
            "Time from a live KV-event batch's timestamp (vLLM's KVEventBatch.ts, stamped"
            " by the engine on its host's wall clock when the step's events are taken) to"
            " the batch applied to the index, on this host's wall clock: transport, queueing"
            " and the EPP's event loop. Across hosts the clock skew between them adds in."
            " Replayed batches (history) and batches without a usable ts (0, NaN) are not"
            " observed; one stamped after this host's now (skew) is observed as 0 and"
            " counted in epp_kv_event_lag_negative_total.",
            labels=["endpoint"],
        )
        negative = CounterMetricFamily(
            "epp_kv_event_lag_negative",
            "Live KV-event batches stamped after this host's wall clock when applied"
            " (observed as 0 in epp_kv_event_lag_seconds): the engine host's clock is"
            " ahead of this one's by more than the true lag.",
            labels=["endpoint"],
        )
        negative_s = CounterMetricFamily(
            "epp_kv_event_lag_negative_seconds",
            "How far ahead of this host's wall clock those batches were stamped, summed"
            " (divided by epp_kv_event_lag_negative_total: the mean skew less the mean"
            " lag, a lower bound of the skew).",
            labels=["endpoint"],
        )
        for endpoint, streams in service.subscriber.streams.items():
            name = endpoint.name
            by_medium: dict[str, int] = {}
            sinks = precise.streams(endpoint)
            for sink in sinks:
                for medium, count in index.slot_blocks(sink.slot).items():
                    by_medium[medium] = by_medium.get(medium, 0) + count
            for medium, count in by_medium.items():
                blocks.add_metric([name, medium], count)
            families["events"].add_metric([name], sum(s.counters.events_applied for s in sinks))
            families["batches"].add_metric([name], sum(s.counters.batches for s in sinks))
            families["blocks"].add_metric(
                [name, "stored"], sum(s.counters.blocks_stored for s in sinks)
            )
            families["blocks"].add_metric(
                [name, "removed"], sum(s.counters.blocks_removed for s in sinks)
            )
            statuses = [stream.status for stream, _ in streams]
            families["gaps"].add_metric([name], sum(s.gaps for s in statuses))
            families["replays"].add_metric([name, "requested"], sum(s.replays for s in statuses))
            families["replays"].add_metric(
                [name, "failed"], sum(s.replay_failures for s in statuses)
            )
            families["replays"].add_metric(
                [name, "partial"], sum(s.partial_replays for s in statuses)
            )
            families["tail_checks"].add_metric(
                [name, "checked"], sum(s.tail_checks for s in statuses)
            )
            families["tail_checks"].add_metric([name, "lost"], sum(s.tail_losses for s in statuses))
            for label, key in (
                ("resets", "clears"),
                ("rejected", "rejected"),
                ("ignored", "ignored"),
                ("unknown", "unknown_hashes"),
            ):
                merged: dict[str, int] = {}
                for sink in sinks:
                    for reason, count in getattr(sink.counters, key).items():
                        merged[reason] = merged.get(reason, 0) + count
                for reason, count in merged.items():
                    families[label].add_metric([name, reason], count)
            families["alignment"].add_metric([name], sum(s.alignment.mismatches for s in sinks))
            families["checked"].add_metric([name], sum(s.alignment.checked_blocks for s in sinks))
            for result in ("confirmed", "missed", "inconclusive"):
                families["probes"].add_metric(
                    [name, result], sum(getattr(s.alignment, result) for s in sinks)
                )
            agreement.add_metric(
                [name], 0.0 if any(s.alignment.tokenization is False for s in sinks) else 1.0
            )
            trusted.add_metric([name], 1.0 if precise.trusted(endpoint) else 0.0)
            connected.add_metric(
                [name],
                1.0 if all(s.state.value in ("live", "replaying") for s in statuses) else 0.0,
            )
            add_histogram(
                lag, [name], BucketCounts.merged((s.lag for s in statuses), LATENCY_BUCKETS)
            )
            negative.add_metric([name], sum(s.lag_negative for s in statuses))
            negative_s.add_metric([name], sum(s.lag_negative_s for s in statuses))
        yield blocks
        yield from families.values()
        yield trusted
        yield agreement
        yield connected
        yield lag
        yield negative
        yield negative_s
        stats = service.stats
        lookups = CounterMetricFamily(
            "epp_precise_prefix_lookups",
            "Prompts looked up in the index: hit (some candidate holds at least its first"
            " block) or miss.",
            labels=["result"],
        )
        lookups.add_metric(["hit"], stats.hits)
        lookups.add_metric(["miss"], stats.lookups - stats.hits)
        yield lookups
        skipped = CounterMetricFamily(
            "epp_precise_prefix_skipped",
            "Requests scored without the index, by reason (no tokenizer, multimodal, ...).",
            labels=["reason"],
        )
        for reason, count in stats.skipped.items():
            skipped.add_metric([reason], count)
        yield skipped
        yield _counter(
            "epp_precise_prefix_request_blocks",
            "Full blocks of the prompts looked up.",
            stats.request_blocks,
        )
        yield _counter(
            "epp_precise_prefix_matched_blocks",
            "Prefix blocks the best candidate held, summed over lookups.",
            stats.matched_blocks,
        )
        yield _counter(
            "epp_precise_prefix_hashed_blocks",
            "Block keys computed for lookups (the walk stops at the first block no"
            " candidate holds).",
            service.keys.computed,
        )
        if service.speculative is not None:
            yield _counter(
                "epp_precise_prefix_speculative_extensions",
                "Lookups where a speculative anchor extended a pod's match.",
                stats.speculative_extensions,
            )
            yield _counter(
                "epp_precise_prefix_speculative_records",
                "Picks recorded as speculative index entries.",
                service.speculative.stats.recorded,
            )
            yield _gauge(
                "epp_precise_prefix_speculative_entries",
                "Live speculative entries (block keys and anchors).",
                service.speculative.stats.entries,
            )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family
