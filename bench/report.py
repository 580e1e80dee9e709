"""The benchmark's outputs: results.json, report.md and PNG plots (matplotlib, Agg).

Plots: `ttft_cdf.png` (TTFT CDF per policy), `hit_rate.png` (measured hit rate per
policy with the bounds), `load_per_pod.png` (requests per pod per policy) for the
last rung of the ladder, and for a ladder of two or more rates `ladder.png` (hit
rate and TTFT p90 against the request rate).

With repeats (`--repeats N`), a figure is the mean over the repeats shown as
`mean ± half-width of its 95% confidence interval`, the TTFT CDF pools every
repeat's requests and the hit-rate bars carry the interval as error bars.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after use("Agg")
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from bench.lab.tenants import report_lines as tenants_report
from bench.provenance import commit_label, produced_by


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) + unit


def _ci(result: dict[str, Any], key: str, spec: str, unit: str = "") -> str:
    """The value, and ` ± ` its 95% confidence half-width when it has one (repeats)."""
    text = _fmt(result.get(key), spec)
    half = result.get(f"{key}_ci95")
    if half is None or text == "-":
        return text + (unit if text != "-" else "")
    return f"{text} ± {format(half, spec)}{unit}"


def _ms(result: dict[str, Any], key: str, spec: str = ".2f") -> str:
    """A time in seconds shown in milliseconds, with its 95% half-width if any."""
    value, half = result.get(key), result.get(f"{key}_ci95")
    text = _fmt(None if value is None else 1000 * value, spec)
    return text if half is None or text == "-" else f"{text} ± {format(1000 * half, spec)}"


def _lag(result: dict[str, Any]) -> str:
    keys = ("client_lag_p50_s", "client_lag_p99_s", "client_lag_max_s")
    return " / ".join(_ci(result, key, ".3f") for key in keys)


def _status(result: dict[str, Any]) -> str:
    if result["status"] == "failed":
        return f"**FAILED**: {result.get('failure')}"
    if result["status"] == "errors":
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(result.get("error_kinds", {}).items()))
        over = f" over {len(result['repeats'])} repeats" if result.get("repeats") else ""
        return f"errors ({kinds}{over})"
    return "ok"


def table(document: dict[str, Any], policies: dict[str, Any]) -> list[str]:
    oracle = document["oracle"]
    lines = [
        "| policy | hit rate | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s)"
        " | TPOT p50 (ms) | TPOT p90 (ms) | throughput (req/s)"
        " | output tok/s | requests | errors | shed (429/503) | max/mean load"
        " | sim lag max (s) | client lag p50 / p99 / max (s) | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in policies.items():
        lines.append(
            f"| {name} | {_ci(r, 'hit_rate', '.3f')} | {_ci(r, 'ttft_p50_s', '.3f')}"
            f" | {_ci(r, 'ttft_p90_s', '.3f')} | {_ci(r, 'ttft_p99_s', '.3f')}"
            f" | {_ms(r, 'tpot_p50_s')} | {_ms(r, 'tpot_p90_s')}"
            f" | {_ci(r, 'throughput_rps', '.2f')} | {_ci(r, 'output_tokens_per_s', ',.0f')}"
            f" | {_fmt(r['requests'], 'g')} | {_ci(r, 'errors', 'g')} | {_ci(r, 'shed', 'g')}"
            f" | {_ci(r, 'max_over_mean_load', '.2f')} | {_ci(r, 'sim_lag_max_s', '.3f')}"
            f" | {_lag(r)} | {_status(r)} |"
        )
    empty = " |" * 15
    lines.append(
        f"| *bound h\\* (one copy per prefix, infinite cache)* | {oracle['h_star']:.3f}{empty}"
    )
    lines.append(
        f"| *h_random (uniform random over {oracle['pods']} pods, infinite caches)*"
        f" | {oracle['h_random']:.3f}{empty}"
    )
    return lines


def _names(start: int, stop: int) -> str:
    return ", ".join(f"`sim-{i}`" for i in range(start, stop))


def pd_table(document: dict[str, Any], policies: dict[str, Any]) -> list[str]:
    """A prefill/decode fleet: per policy, which requests were disaggregated (from
    the responses) and what the pods counted (`/sim/state` `pd`)."""
    prefill_pods = document["setup"].get("prefill_pods") or 0
    if not prefill_pods:
        return []
    pods = document["setup"]["pods"]
    lines = [
        "## Prefill/decode",
        "",
        f"Prefill pods (llm-d.ai/role prefill): {_names(0, prefill_pods)}; decode pods:"
        f" {_names(prefill_pods, pods)}. *Disaggregated*: requests the"
        " EPP sent with `x-prefiller-host-port` (Envoy echoes it into the response),"
        " and *EPP*: what its own `epp_disagg_decision_total` counted as"
        " prefill-decode, the same requests unless a response was lost;"
        " *prefill legs*: what the pods' sidecars sent and the prefill pods served;"
        " *KV transfers*: blocks the decode pods pulled (mean simulated time);"
        " *fallbacks*: prefill legs that failed and were prefilled on the decode pod."
        " Policies without a P/D profile handler ignore the roles and serve every"
        " request whole, on any pod. The hit rate above counts both legs' lookups, and"
        " tokens pulled from a prefill pod are not hits; requests per pod count the"
        " prefill legs too.",
        "",
        "| policy | disaggregated | prefill legs sent / served | KV transfers (mean ms)"
        " | fallbacks | TTFT p50 / p90 (s) disaggregated | whole"
        " | TPOT p50 / p90 (ms) disaggregated | whole |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in policies.items():
        if r.get("pd_prefill_legs_served") is None:
            continue
        share = r.get("pd_disaggregated_share")
        shown = _ci(r, "pd_disaggregated", "g")
        if share is not None:
            shown += f" ({share:.0%})"
        if r.get("pd_epp_disaggregated") is not None:
            shown += f"; EPP {_ci(r, 'pd_epp_disaggregated', 'g')}"
        lines.append(
            f"| {name} | {shown}"
            f" | {_ci(r, 'pd_prefill_legs_sent', 'g')} / {_ci(r, 'pd_prefill_legs_served', 'g')}"
            f" | {_ci(r, 'pd_kv_transfers', 'g')} ({_ms(r, 'pd_kv_transfer_mean_s')})"
            f" | {_ci(r, 'pd_fallbacks', 'g')}"
            f" | {_ci(r, 'pd_ttft_p50_disaggregated_s', '.3f')}"
            f" / {_ci(r, 'pd_ttft_p90_disaggregated_s', '.3f')}"
            f" | {_ci(r, 'pd_ttft_p50_whole_s', '.3f')} / {_ci(r, 'pd_ttft_p90_whole_s', '.3f')}"
            f" | {_ms(r, 'pd_tpot_p50_disaggregated_s')}"
            f" / {_ms(r, 'pd_tpot_p90_disaggregated_s')}"
            f" | {_ms(r, 'pd_tpot_p50_whole_s')} / {_ms(r, 'pd_tpot_p90_whole_s')} |"
        )
    return [*lines, ""]


def ladder_table(document: dict[str, Any]) -> list[str]:
    names = list(document["ladder"][0]["policies"]) if document["ladder"] else []
    head = "| load | " + " | ".join(f"{n} hit / TTFT p90 (s) / errors" for n in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for rung in document["ladder"]:
        cells = []
        for name in names:
            r = rung["policies"][name]
            cell = (
                f"{_ci(r, 'hit_rate', '.3f')} / {_ci(r, 'ttft_p90_s', '.3f')}"
                f" / {_fmt(r['errors'], 'g')}"
            )
            if r["status"] == "failed":
                cell += " FAILED"
            cells.append(cell)
        lines.append(f"| {rung['label']} | " + " | ".join(cells) + " |")
    return lines


# The report warns when the client's lag p99 exceeds this share of the TTFT p50.
CLIENT_LAG_WARNING = 0.1


def _repeats_text(document: dict[str, Any], repeats: int) -> list[str]:
    if repeats <= 1:
        return []
    lines = [
        f"Every policy ran {repeats} times per load, each time on a fresh fleet, the order"
        " of the policies reversed every other repeat so that a drift of the machine falls"
        " on all of them alike. Figures are the mean over the repeats ± the half-width of"
        " its 95% confidence interval (Student's t with N - 1 degrees of freedom,"
        f" N = {repeats});"
        " each repeat's own figures are in results.json (`repeats`). Order:",
        "",
    ]
    for rung in document["ladder"]:
        orders = "; ".join(
            f"{i}: {', '.join(order)}" for i, order in enumerate(rung.get("policy_order", []), 1)
        )
        lines.append(f"- {rung['label']}: {orders}")
    return [*lines, ""]


def _roles(setup: dict[str, Any]) -> str:
    prefill = setup.get("prefill_pods") or 0
    if not prefill:
        return ""
    return f"; prefill/decode: {prefill} prefill, {setup['pods'] - prefill} decode"


def report_markdown(document: dict[str, Any], plots: Sequence[str]) -> str:
    setup = document["setup"]
    workload = document["workload"]
    oracle = document["oracle"]
    params = ", ".join(f"{k}={v}" for k, v in workload["params"].items())
    last = document["ladder"][-1]["label"] if document["ladder"] else ""
    repeats = setup.get("repeats") or 1
    commit = commit_label(document)
    lines = [
        f"# Routing benchmark: {workload['name']}",
        "",
        *produced_by(document),
        f"- workload: `{workload['name']}` ({params}): {workload['requests']} requests,"
        f" {workload['prompt_tokens']:,} prompt tokens",
        f"- fleet: {setup['pods']} simulated vLLM pods (`python -m sim`{_roles(setup)}), time scale"
        f" {setup['time_scale']:g} (wall seconds per simulated second), KV blocks of"
        f" {setup['block_size']} tokens, {setup['num_gpu_blocks'] or 'default'} blocks per pod,"
        f" tokenizer {Path(setup['tokenizer']).name}; every policy starts on a fresh fleet",
        "- EPP policies: client -> Envoy (manifests/envoy/envoy.yaml) -> EPP -> pod;"
        " peers: client -> router -> pod",
        f"- {document['machine']['cpus']} CPUs; the run took {document['wall_seconds']:.0f} s;"
        f" commit {commit}",
        "",
        "Times are simulated seconds. Hit rate = prefix-cache hit tokens / prompt tokens,"
        " from the pods' own counters. TTFT and end-to-end times are measured from each"
        " request's scheduled time (its arrival in the open-loop schedule; for a later"
        " turn, the previous answer's end plus think time; in closed loop, when the"
        " client slot became free), not from when the client got round to sending it;"
        " the client lag (sent - scheduled) shows how far the client itself fell behind."
        " TTFT percentiles are over successful requests; TPOT (time per output token) is"
        " each answer's (last token - first token) / (output tokens - 1), its percentiles"
        " over the successful requests of two tokens or more;"
        " errors are counted separately, requests the router answered 429/503 itself"
        " (flow control's bounds and TTL, admission) as shed, not errors; a policy is"
        " marked FAILED when its run did"
        f" not complete or more than {setup['max_error_rate']:.0%} of its requests failed.",
        "",
        *_repeats_text(document, repeats),
        f"## Results ({last})",
        "",
        *table(document, document["policies"]),
        "",
        f"Bounds for this request sequence ({oracle['requests']} requests, blocks of"
        f" {oracle['block_size']}): h* = {oracle['h_star']:.3f} is the hit rate if every"
        " request could reuse the longest block-aligned prefix it shares with any earlier"
        f" request; h_random = {oracle['h_random']:.3f} is the expected hit rate of uniformly"
        f" random routing over {oracle['pods']} pods with infinite caches (round-robin in"
        f" arrival order: {oracle['h_round_robin']:.3f}). Both ignore time and eviction.",
        "",
    ]
    warnings = []
    for rung in document["ladder"]:
        for name, r in rung["policies"].items():
            fraction = r.get("sim_lag_fraction")
            if fraction is not None and fraction > 0.02:
                warnings.append(
                    f"- {name} ({rung['label']}): the simulator fell {r['sim_lag_max_s']:.2f} s"
                    f" behind ({fraction:.1%} of the run): the machine could not keep up with"
                    " this time scale"
                )
            client_lag, ttft = r.get("client_lag_p99_s"), r.get("ttft_p50_s")
            if client_lag is not None and ttft and client_lag > CLIENT_LAG_WARNING * ttft:
                warnings.append(
                    f"- {name} ({rung['label']}): the client sent 1% of its requests"
                    f" {client_lag:.3f} s or more after their scheduled time (TTFT p50"
                    f" {ttft:.3f} s): its TTFTs include that much of the client's own"
                    " queueing; the machine could not keep up with this rate and time scale"
                )
    if warnings:
        lines += ["Warnings:", "", *warnings, ""]
    lines += pd_table(document, document["policies"])
    # The tenants workload: the lab's flow-control tables, from the same summary.
    lines += tenants_report(document["policies"])
    if len(document["ladder"]) > 1:
        lines += ["## Load ladder", "", *ladder_table(document), ""]
    load = document["policies"]
    if load:
        lines += ["## Requests per pod", ""]
        for name, r in load.items():
            per_pod = r.get("load_per_pod") or {}
            if per_pod:
                lines.append(f"- {name}: " + ", ".join(f"{p} {n}" for p, n in per_pod.items()))
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem}]({p})" for p in plots]
        lines.append("")
    return "\n".join(lines)


def _ttfts(out: Path, result: dict[str, Any]) -> list[float]:
    """The successful requests' TTFTs of a result, every repeat's pooled."""
    names = [r.get("records_file") for r in result.get("repeats") or [result]]
    values = []
    for name in names:
        if not name or not (out / name).is_file():
            continue
        with (out / name).open() as lines:
            for line in lines:
                record = json.loads(line)
                if record["ok"] and record["ttft_s"] is not None:
                    values.append(float(record["ttft_s"]))
    return sorted(values)


def plot_ttft_cdf(document: dict[str, Any], out: Path) -> str | None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for name, result in document["policies"].items():
        values = _ttfts(out, result)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=name)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (simulated seconds, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {document['workload']['name']} ({document['ladder'][-1]['label']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    return "ttft_cdf.png"


def plot_hit_rate(document: dict[str, Any], out: Path) -> str | None:
    policies = {n: r for n, r in document["policies"].items() if r.get("hit_rate") is not None}
    if not policies:
        return None
    oracle = document["oracle"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(policies)
    errors = [policies[n].get("hit_rate_ci95") for n in names]
    yerr = [e or 0.0 for e in errors] if any(e is not None for e in errors) else None
    ax.bar(names, [policies[n]["hit_rate"] for n in names], color="tab:blue", yerr=yerr, capsize=4)
    ax.axhline(oracle["h_star"], color="tab:green", linestyle="--", label="h* (bound)")
    ax.axhline(oracle["h_random"], color="tab:red", linestyle=":", label="h_random (expected)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_title("Measured hit rate (pods' counters) and bounds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    return "hit_rate.png"


def plot_load(document: dict[str, Any], out: Path) -> str | None:
    policies = {n: r for n, r in document["policies"].items() if r.get("load_per_pod")}
    if not policies:
        return None
    pods = sorted({p for r in policies.values() for p in r["load_per_pod"]}, key=_pod_order)
    fig, ax = plt.subplots(figsize=(max(7, len(pods) * 0.9), 4.5))
    width = 0.8 / len(policies)
    for i, (name, result) in enumerate(policies.items()):
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(pods))]
        ax.bar(xs, [result["load_per_pod"].get(p, 0) for p in pods], width, label=name)
    ax.set_xticks(range(len(pods)))
    ax.set_xticklabels(pods)
    ax.set_ylabel("requests served")
    ax.set_title("Requests per pod")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "load_per_pod.png", dpi=110)
    plt.close(fig)
    return "load_per_pod.png"


def _pod_order(name: str) -> tuple[str, int]:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


def plot_ladder(document: dict[str, Any], out: Path) -> str | None:
    rungs = [r for r in document["ladder"] if r["arrivals"].get("rate") is not None]
    if len(rungs) < 2:
        return None
    rates = [r["arrivals"]["rate"] for r in rungs]
    names = list(rungs[0]["policies"])
    oracle = document["oracle"]
    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        hits = [r["policies"][name].get("hit_rate") for r in rungs]
        p90 = [r["policies"][name].get("ttft_p90_s") for r in rungs]
        hit_ax.plot(rates, [math.nan if h is None else h for h in hits], marker="o", label=name)
        ttft_ax.plot(rates, [math.nan if t is None else t for t in p90], marker="o", label=name)
    hit_ax.axhline(oracle["h_star"], color="tab:green", linestyle="--", label="h*")
    hit_ax.axhline(oracle["h_random"], color="tab:red", linestyle=":", label="h_random")
    hit_ax.set_ylim(0, 1)
    hit_ax.set_xlabel("request rate (per simulated second)")
    hit_ax.set_ylabel("prefix-cache hit rate")
    hit_ax.set_title("Hit rate vs load")
    ttft_ax.set_yscale("log")
    ttft_ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ttft_ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ttft_ax.yaxis.set_minor_formatter(NullFormatter())
    ttft_ax.set_xlabel("request rate (per simulated second)")
    ttft_ax.set_ylabel("TTFT p90 (simulated seconds, log scale)")
    ttft_ax.set_title("TTFT p90 vs load")
    for ax in (hit_ax, ttft_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ladder.png", dpi=110)
    plt.close(fig)
    return "ladder.png"


def write_outputs(document: dict[str, Any], out: Path) -> list[str]:
    """results.json, the plots, then report.md (which shows them); returns the plots."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    plots = [
        p
        for p in (
            plot_ttft_cdf(document, out),
            plot_hit_rate(document, out),
            plot_load(document, out),
            plot_ladder(document, out),
        )
        if p is not None
    ]
    (out / "report.md").write_text(report_markdown(document, plots))
    return plots
