"""What a run of the tenants workload says about flow control (docs/flow-control.md,
"Measured"): per objective (priority), TTFT and what became of the requests; per
tenant, its throughput during the burst against its fair share; Jain's fairness
index between the tenants; the controller's peak queue.

One implementation for both runs of the workload: the lab's (bench/lab/run.py, on
virtual time) and `bench run`'s (bench/runner.py, through real Envoy and EPP) feed
the same records to `tenants_summary`, and their results (`tenants` in each
policy's result) make the same tables (`report_lines`, `python -m bench.lab.tenants`
on either's output directory). What differs is where two figures come from:

- **When the router let a request go** (the queue wait): in the lab, the instant the
  EPP's decision was made; through Envoy, when Envoy sent the request's first byte
  upstream (Envoy's own time and the pick included: a few milliseconds).
- **Requests that waited** and the queue: the lab's router counts every wait above 0
  and sees the controller itself (peak queue, timer wake-ups); `bench run` takes the
  EPP's own metrics (`waited`: dispatched after more than the queue-duration
  histogram's first bucket, 1 ms, per priority; the peak queue sampled from
  `epp_flow_control_queue_size` during the run). A figure the run cannot know is
  left out (None, "-" in the tables).

- **Served / shed / failed**: served, the response ended; shed, the router answered
  429 or 503 itself (flow control's bound or TTL, or the detector's admission with
  flow control off; bench/client.py `is_shed`); failed, anything else (an engine
  error, a refusal without a status). Both runs check that they add up to the
  requests sent.
- **Throughput during the burst**: the output tokens the engines produced for the
  tenant within the burst window, over the window's length (each served request's
  tokens spread evenly from its first token to its last: a response that spans the
  window's edge counts for the part inside); offered, the output tokens asked for
  by the tenant's requests sent in the window. Tokens rather than completed
  requests, since a response lasts seconds under load and the window is not much
  longer.
- **Fair share** (max-min): the window's total served throughput split so that no
  tenant gets more than it offered and the rest is shared equally (water-filling).
  With the bursty tenant offering five times its share, the steady tenant's fair
  share is what it offered, or half the total if that is less.
- **Jain's index** over the tenants' throughput each divided by its fair share:
  (Σx)² / (n Σx²), 1.0 when every tenant gets exactly its fair share, 1/n when one
  gets everything. `jain_raw` is the same over the raw throughputs.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.client import Record, is_shed
from bench.stats import ci95, percentile, pm
from bench.workloads import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, OBJECTIVE_MIX, TENANTS

Sent = tuple[Record, tuple[tuple[str, str], ...], float | None]
"""A request's record, its headers, and when the router answered it (None: never)."""


def fair_shares(demands: dict[str, float], total: float) -> dict[str, float]:
    """Max-min fair split of `total` among demands (water-filling)."""
    shares = dict.fromkeys(demands, 0.0)
    left = total
    open_ = sorted(demands, key=lambda k: (demands[k], k))
    while open_ and left > 1e-12:
        equal = left / len(open_)
        smallest = open_[0]
        if demands[smallest] <= equal:
            shares[smallest] = demands[smallest]
            left -= demands[smallest]
            open_.pop(0)
            continue
        for name in open_:
            shares[name] = equal
        left = 0.0
        break
    return shares


def jain(values: Sequence[float]) -> float | None:
    if not values:
        return None
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if square > 0 else None


def _tokens_within(record: Record, start: float, end: float) -> float:
    """The record's output tokens produced within [start, end), spread evenly from
    its first token to its last."""
    if not record.ok or record.ttft_s is None or record.e2e_s is None:
        return 0.0
    tokens = record.output_tokens or 0
    first = record.scheduled_s + record.ttft_s
    last = record.scheduled_s + record.e2e_s
    if last <= first:
        return float(tokens) if start <= first < end else 0.0
    inside = max(0.0, min(last, end) - max(first, start))
    return tokens * inside / (last - first)


def tenants_summary(
    sent: Sequence[Sent],
    window: tuple[float, float] | None,
    router: dict[str, Any],
    output_len: int,
    waited: dict[str, int | None] | None = None,
) -> dict[str, Any]:
    """One run's flow-control figures (see the module docstring); `router` is the
    router's `describe()` (the controller's peak queue, when it has one; `bench
    run` gives the EPP's metrics in the same shape). `waited`: per objective, how
    many requests waited in the router, as the router counted them (None: counted
    here, every wait above 0; a None count: unknown)."""
    objectives = [name for name, _ in OBJECTIVE_MIX]
    by_objective: dict[str, Any] = {}
    for objective in objectives:
        mine = [(r, routed) for r, h, routed in sent if dict(h).get(OBJECTIVE_HEADER) == objective]
        ttfts = sorted(r.ttft_s for r, _ in mine if r.ok and r.ttft_s is not None)
        waits = sorted(routed - r.scheduled_s for r, routed in mine if r.ok and routed is not None)
        by_objective[objective] = {
            "sent": len(mine),
            "served": sum(1 for r, _ in mine if r.ok),
            "shed": sum(1 for r, _ in mine if is_shed(r)),
            "failed": sum(1 for r, _ in mine if not r.ok and not is_shed(r)),
            "ttft_p50_s": percentile(ttfts, 0.50),
            "ttft_p90_s": percentile(ttfts, 0.90),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "queue_wait_p90_s": percentile(waits, 0.90),
            "queue_wait_max_s": waits[-1] if waits else None,
            "waited": sum(1 for w in waits if w > 0) if waited is None else waited.get(objective),
        }
    by_tenant: dict[str, Any] = {}
    start, end = window if window is not None else (0.0, 0.0)
    length = end - start
    for tenant in TENANTS:
        theirs = [r for r, h, _ in sent if dict(h).get(FAIRNESS_ID_HEADER) == tenant]
        offered = output_len * sum(1 for r in theirs if start <= r.scheduled_s < end)
        served = sum(_tokens_within(r, start, end) for r in theirs)
        by_tenant[tenant] = {
            "sent": len(theirs),
            "served": sum(1 for r in theirs if r.ok),
            "shed": sum(1 for r in theirs if is_shed(r)),
            "offered_tokens_per_s_burst": offered / length if length > 0 else None,
            "served_tokens_per_s_burst": served / length if length > 0 else None,
        }
    jain_fair = jain_raw = jain_band = None
    if length > 0:
        total = sum(t["served_tokens_per_s_burst"] for t in by_tenant.values())
        shares = fair_shares(
            {k: t["offered_tokens_per_s_burst"] for k, t in by_tenant.items()}, total
        )
        for tenant, t in by_tenant.items():
            share = shares[tenant]
            t["fair_share_tokens_per_s_burst"] = share
            t["of_fair_share"] = t["served_tokens_per_s_burst"] / share if share else None
        ratios = [t["of_fair_share"] for t in by_tenant.values() if t["of_fair_share"] is not None]
        jain_fair = jain(ratios)
        jain_raw = jain([t["served_tokens_per_s_burst"] for t in by_tenant.values()])
        # The fairness strict priority bands promise: within each objective's band,
        # the max-min split of what that band was served between the tenants'
        # offers in it; a tenant's band share is the sum over bands.
        band_share = dict.fromkeys(by_tenant, 0.0)
        for objective in objectives:
            offered_in: dict[str, float] = {}
            served_in = 0.0
            for tenant in by_tenant:
                theirs = [
                    r
                    for r, h, _ in sent
                    if dict(h).get(FAIRNESS_ID_HEADER) == tenant
                    and dict(h).get(OBJECTIVE_HEADER) == objective
                ]
                offered_in[tenant] = output_len * sum(
                    1 for r in theirs if start <= r.scheduled_s < end
                )
                served_in += sum(_tokens_within(r, start, end) for r in theirs)
            for tenant, share in fair_shares(offered_in, served_in).items():
                band_share[tenant] += share / length
        for tenant, t in by_tenant.items():
            share = band_share[tenant]
            t["band_fair_share_tokens_per_s_burst"] = share
            t["of_band_fair_share"] = t["served_tokens_per_s_burst"] / share if share else None
        jain_band = jain(
            [t["of_band_fair_share"] for t in by_tenant.values() if t["of_band_fair_share"]]
        )
    records = [r for r, _, _ in sent]
    counts = [o["waited"] for o in by_objective.values()]
    out: dict[str, Any] = {
        "sent": len(records),
        "served": sum(1 for r in records if r.ok),
        "shed": sum(1 for r in records if is_shed(r)),
        "failed": sum(1 for r in records if not r.ok and not is_shed(r)),
        "waited": None if None in counts else sum(counts),
        "burst_window_s": [start, end] if window is not None else None,
        "jain_burst": jain_fair,
        "jain_raw_burst": jain_raw,
        "jain_band_burst": jain_band,
        "by_objective": by_objective,
        "by_tenant": by_tenant,
    }
    if out["served"] + out["shed"] + out["failed"] != out["sent"]:
        raise RuntimeError(f"accounting: served + shed + failed != sent: {out}")
    fc = router.get("flow_control")
    if fc is not None:
        out["flow_control"] = fc
        if fc.get("queued_at_end") or fc.get("picks_waiting_at_end"):
            raise RuntimeError(f"accounting: requests left in flow control at the end: {fc}")
    return out


def _mean(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    known = [float(v) for v in values if v is not None]
    if not known or len(known) < len(values):
        return None, None
    return statistics.fmean(known), ci95(known)


def over_seeds_tenants(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean over seeds (and its 95% CI half-width, `<key>_ci95`) of each figure."""
    out: dict[str, Any] = {}

    def put(target: dict[str, Any], key: str, values: Sequence[Any]) -> None:
        target[key], target[f"{key}_ci95"] = _mean(values)

    for key in (
        "sent",
        "served",
        "shed",
        "failed",
        "waited",
        "jain_burst",
        "jain_raw_burst",
        "jain_band_burst",
    ):
        put(out, key, [r[key] for r in runs])
    out["by_objective"] = {}
    for objective in runs[0]["by_objective"]:
        part: dict[str, Any] = {}
        for key in runs[0]["by_objective"][objective]:
            put(part, key, [r["by_objective"][objective][key] for r in runs])
        out["by_objective"][objective] = part
    out["by_tenant"] = {}
    for tenant in runs[0]["by_tenant"]:
        part = {}
        for key in runs[0]["by_tenant"][tenant]:
            put(part, key, [r["by_tenant"][tenant][key] for r in runs])
        out["by_tenant"][tenant] = part
    found = [r.get("flow_control") for r in runs]
    fcs = [fc for fc in found if fc is not None]
    if fcs and len(fcs) == len(found):
        # The largest peak over the runs, the sums of the counts; a figure a run
        # does not know (bench run has no timer count) stays None.
        def over(key: str, combine: Any) -> Any:
            values = [fc.get(key) for fc in fcs]
            return None if None in values else combine(values)

        out["flow_control"] = {
            "queue_peak_max": over("queue_peak", max),
            "queue_peak_bytes_max": over("queue_peak_bytes", max),
            "dispatch_passes": over("dispatch_passes", sum),
            "timer_wakeups": over("timer_wakeups", sum),
            "timer_wakeups_with_empty_queue": over("timer_wakeups_with_empty_queue", sum),
        }
        put(out["flow_control"], "queue_peak", [fc.get("queue_peak") for fc in fcs])
        put(out["flow_control"], "queue_peak_bytes", [fc.get("queue_peak_bytes") for fc in fcs])
    return out


# -- report ---------------------------------------------------------------------------------


def report_lines(policies: dict[str, Any], reference: dict[str, Any] | None = None) -> list[str]:
    """report.md's flow-control tables (mean ± 95% CI over seeds). `reference`: the
    same policies' results from an unloaded run, for each objective's TTFT p90
    ratio loaded / unloaded."""
    with_tenants = {name: r["tenants"] for name, r in policies.items() if "tenants" in r}
    if not with_tenants:
        return []
    lines = [
        "## Flow control: objectives, tenants, the queue",
        "",
        "Per objective (priority critical 10, standard 0, batch -1 where the config"
        " defines them): requests sent, served, shed (answered 429/503 by the EPP),"
        " TTFT of the served ones from their arrival (queue wait included), and the"
        " wait in the EPP's queue.",
        "",
        "| policy | objective | sent | served | shed | failed | TTFT p50 ms | TTFT p90 ms"
        + (" | unloaded TTFT p90 ms | p90 loaded / unloaded" if reference else "")
        + " | queue wait p90 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if reference else "") + "---:|",
    ]
    for name, t in with_tenants.items():
        for objective, o in t["by_objective"].items():
            extra = ""
            if reference is not None:
                base = reference.get(name, {}).get("tenants", {}).get("by_objective", {})
                base_p90 = base.get(objective, {}).get("ttft_p90_s")
                ratio = (
                    o["ttft_p90_s"] / base_p90
                    if base_p90 and o.get("ttft_p90_s") is not None
                    else None
                )
                extra = (
                    f" | {'-' if base_p90 is None else format(base_p90 * 1000, '.1f')}"
                    f" | {'-' if ratio is None else format(ratio, '.2f')}"
                )
            lines.append(
                f"| {name} | {objective} | {pm(o, 'sent', '.0f')} | {pm(o, 'served', '.0f')}"
                f" | {pm(o, 'shed', '.0f')} | {pm(o, 'failed', '.0f')}"
                f" | {pm(o, 'ttft_p50_s', '.1f', 1000)} | {pm(o, 'ttft_p90_s', '.1f', 1000)}"
                f"{extra} | {pm(o, 'queue_wait_p90_s', '.1f', 1000)} |"
            )
    lines += [
        "",
        "Per tenant, during the burst window: output tokens per second offered and"
        " served, the max-min fair share of what was served, and served / fair share;"
        " Jain's index over the tenants' served / fair share. Then the same against"
        " the fairness strict priority bands promise: in each objective's band, the"
        " max-min split of what that band was served between the tenants' offers in"
        " it, summed over the bands.",
        "",
        "| policy | tenant | offered tok/s | served tok/s | fair share tok/s | of fair share"
        " | Jain's index | per-band fair share tok/s | of per-band fair share"
        " | Jain's index (per band) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in with_tenants.items():
        for tenant, x in t["by_tenant"].items():
            lines.append(
                f"| {name} | {tenant} | {pm(x, 'offered_tokens_per_s_burst', '.0f')}"
                f" | {pm(x, 'served_tokens_per_s_burst', '.0f')}"
                f" | {pm(x, 'fair_share_tokens_per_s_burst', '.0f')}"
                f" | {pm(x, 'of_fair_share', '.3f')} | {pm(t, 'jain_burst', '.3f')}"
                f" | {pm(x, 'band_fair_share_tokens_per_s_burst', '.0f')}"
                f" | {pm(x, 'of_band_fair_share', '.3f')} | {pm(t, 'jain_band_burst', '.3f')} |"
            )
    lines += [
        "",
        "Every request, all seeds (or repeats): served + shed + failed = sent (checked;"
        " nothing is left in a queue at the end). The queue's peak is the largest over"
        " the seeds; timer wake-ups with an empty queue would be work done while idle"
        " (the lab only: through Envoy, `-`; the EPP's idle CPU is measured by"
        " `python -m bench.idle_cpu`).",
        "",
        "| policy | sent | served | shed | failed | requests that waited | peak queue"
        " | peak queue bytes | dispatch passes | timer wake-ups | ... with an empty queue |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in with_tenants.items():
        fc = t.get("flow_control") or {}
        keys = (
            "queue_peak_max",
            "queue_peak_bytes_max",
            "dispatch_passes",
            "timer_wakeups",
            "timer_wakeups_with_empty_queue",
        )
        tail = "".join(f" | {'-' if fc.get(k) is None else fc[k]}" for k in keys) + " |"
        lines.append(
            f"| {name} | {pm(t, 'sent', '.0f')} | {pm(t, 'served', '.1f')}"
            f" | {pm(t, 'shed', '.1f')} | {pm(t, 'failed', '.1f')} | {pm(t, 'waited', '.0f')}"
            + tail
        )
    return [*lines, ""]


def unloaded_reference(
    runs: Sequence[Mapping[str, Any]], policies: Sequence[str], reference_policy: str | None = None
) -> dict[str, Any]:
    """Each policy's unloaded TTFT p90 per objective, for `report_lines`: the mean over
    `runs` (unloaded runs' `policies`, each already a mean over its seeds or repeats)
    of that policy's p90, or of `reference_policy`'s for every policy (one reference
    for all: the same pool unloaded, whatever the config). A p90 of a few hundred
    requests moves by 10-20% between runs, so several runs make a steadier reference.
    """
    out: dict[str, Any] = {}
    for name in policies:
        source = reference_policy or name
        values: dict[str, list[float]] = {}
        for run in runs:
            by_objective = run.get(source, {}).get("tenants", {}).get("by_objective", {})
            for objective, o in by_objective.items():
                if o.get("ttft_p90_s") is not None:
                    values.setdefault(objective, []).append(o["ttft_p90_s"])
        out[name] = {
            "tenants": {
                "by_objective": {o: {"ttft_p90_s": sum(v) / len(v)} for o, v in values.items()}
            }
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.lab.tenants LOADED [UNLOADED ...]`: the flow-control tables of a
    tenants run, with each objective's TTFT p90 against its unloaded value (the mean
    over the unloaded runs given)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m bench.lab.tenants", description=main.__doc__)
    parser.add_argument(
        "loaded",
        type=Path,
        metavar="LOADED",
        help="a tenants run's --out (`python -m bench lab` or `python -m bench run`)",
    )
    parser.add_argument(
        "unloaded",
        type=Path,
        nargs="*",
        metavar="UNLOADED",
        help="the same workload at low load; several: each objective's unloaded p90 is"
        " the mean over them",
    )
    parser.add_argument(
        "--reference-policy",
        metavar="POLICY",
        help="take every policy's unloaded p90 from this policy's unloaded runs (e.g."
        " `default`: the pool unloaded with flow control off) instead of its own",
    )
    args = parser.parse_args(argv)

    def results(path: Path) -> dict[str, Any]:
        file = path / "results.json"
        if not file.is_file():
            parser.error(f"{file} not found: give the --out directory of a tenants run")
        data: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
        return data

    loaded = results(args.loaded)
    reference = None
    if args.unloaded:
        runs = [results(path)["policies"] for path in args.unloaded]
        if args.reference_policy and not any(args.reference_policy in run for run in runs):
            known = sorted({name for run in runs for name in run})
            parser.error(
                f"--reference-policy {args.reference_policy!r} is in none of the unloaded"
                f" runs (they have: {', '.join(known)})"
            )
        reference = unloaded_reference(runs, list(loaded["policies"]), args.reference_policy)
    elif args.reference_policy:
        parser.error("--reference-policy needs an UNLOADED run")
    print("\n".join(report_lines(loaded["policies"], reference)), end="")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
