"""The lab's report: report.md with a table of mean ± 95% CI per policy, and plots
(TTFT CDFs pooled over seeds, requests per pod over time, hit rate with its CI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.lab.breakdown import report_lines as breakdown_report
from bench.lab.run import PREDICTION_WARMUP
from bench.lab.tenants import report_lines as tenants_report
from bench.provenance import produced_by
from bench.stats import pm


def table(policies: dict[str, Any]) -> list[str]:
    lines = [
        "| policy | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT p50 ms"
        " | TPOT p90 ms | req/s | max/mean load | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in policies.items():
        lines.append(
            f"| {name} | {pm(r, 'hit_rate', '.3f')} | {pm(r, 'ttft_p50_s', '.1f', 1000)}"
            f" | {pm(r, 'ttft_p90_s', '.1f', 1000)} | {pm(r, 'ttft_p99_s', '.1f', 1000)}"
            f" | {pm(r, 'tpot_p50_s', '.2f', 1000)} | {pm(r, 'tpot_p90_s', '.2f', 1000)}"
            f" | {pm(r, 'throughput_rps', '.2f')} | {pm(r, 'max_over_mean_load', '.2f')}"
            f" | {pm(r, 'errors', '.1f')} |"
        )
    return lines


def pd_lines(document: dict[str, Any]) -> list[str]:
    """A P/D fleet: per policy, what its pods did (summed over seeds)."""
    setup = document["setup"]
    prefill_pods = setup.get("prefill_pods", 0)
    if not prefill_pods:
        return []
    lines = [
        f"Prefill/decode fleet: {prefill_pods} {setup.get('prefill_role', 'prefill')} pods,"
        f" {setup['pods'] - prefill_pods} decode pods. Per policy, over all seeds: requests"
        " the router disaggregated, prefill"
        " legs the prefill pods served, KV transfers the decode pods pulled (mean time), and"
        " prefill legs that failed (prefilled on the decode pod). The hit rate above counts"
        " both legs' prompt lookups; tokens pulled from a prefill pod are not hits.",
        "",
    ]
    for name, r in document["policies"].items():
        parts = [run.get("pd") for run in r["runs"]]
        pds = [p for p in parts if p]
        if not pds:
            continue
        transfers = sum(p["kv_transfers"] for p in pds)
        means = [p["kv_transfer_mean_s"] for p in pds if p["kv_transfer_mean_s"] is not None]
        mean = f"{1000 * sum(means) / len(means):.2f} ms" if means else "-"
        prefill_legs = sum(sum(p["prefill_legs_per_pod"].values()) for p in pds)
        lines.append(
            f"- {name}: {sum(p['disaggregated'] for p in pds)} disaggregated, {prefill_legs}"
            f" prefill legs served, {transfers} KV transfers (mean {mean}),"
            f" {sum(p['fallbacks'] for p in pds)} fallbacks"
        )
    return [*lines, ""]


def report_markdown(document: dict[str, Any], plots: list[str]) -> str:
    setup = document["setup"]
    workload = document["workload"]
    oracle = document.get("oracle")
    lines = [
        f"# Routing lab: {workload['name']}, {setup['pods']} pods, {setup['load_label']}",
        "",
        *produced_by(document),
        f"- {workload['requests']} requests, {setup['seeds']} seeds ({setup['seed_list']}),"
        f" every policy from a cold fleet on each seed; capacity (no cache hit) "
        f"{setup['capacity_rps']:.2f} req/s, offered {setup['rate_rps']:.2f} req/s"
        f" (load {setup['load']:.2f})",
        f"- delays (virtual s): {', '.join(f'{k} {v:g}' for k, v in setup['delays'].items())}",
        f"- EPP replicas behind Envoy: {setup.get('epp_replicas', 1)} (each with its own"
        " state; the peers' models are one router)",
        *(
            [
                f"- pod restarts: {setup['restarts']} per run, evenly spaced over the"
                " arrivals (bench/lab/pod.py); a restarted pod's requests in flight fail"
                " (counted as errors) and are sent again"
            ]
            if setup.get("restarts")
            else []
        ),
        f"- engine: blocks of {setup['engine']['block_size']} tokens,"
        f" {setup['engine']['num_gpu_blocks']} blocks per pod,"
        f" max_num_seqs {setup['engine']['max_num_seqs']},"
        f" max_num_batched_tokens {setup['engine']['max_num_batched_tokens']}",
        f"- commit {document['commit'][:12]}{' (dirty)' if document['dirty'] else ''};"
        f" {document['machine']['cpus']} CPUs; wall time {document['wall_seconds']:.0f} s",
        "",
        "Mean over seeds ± the 95% confidence half-width (Student t). Times are virtual"
        " seconds shown in ms; TTFT counts from each request's scheduled arrival to its"
        " first token at the client. Hit rate = prefix-cache hit tokens / prompt tokens,"
        " from the engines' own counters.",
        "",
        *table(document["policies"]),
        "",
        *pd_lines(document),
    ]
    if oracle:
        lines += [
            f"Bounds (first seed's requests, blocks of {oracle['block_size']}): h* ="
            f" {oracle['h_star']:.3f} (every request reuses the longest prefix any earlier"
            f" request left); h_random = {oracle['h_random']:.3f} (uniformly random routing,"
            " infinite caches).",
            "",
        ]
    if oracle and "ttft_floor_p90_s" in oracle:
        lines += [
            "TTFT floor (the same requests, each alone on an idle pod holding the longest"
            " prefix any earlier request left, through the cheapest router; bench/lab/floor.py):"
            f" p50 {oracle['ttft_floor_p50_s'] * 1e3:.1f} ms, p90"
            f" {oracle['ttft_floor_p90_s'] * 1e3:.1f} ms, p99"
            f" {oracle['ttft_floor_p99_s'] * 1e3:.1f} ms. No policy's TTFT percentile can be"
            " below it.",
            "",
        ]
    predicted = {
        name: r
        for name, r in document["policies"].items()
        if r.get("ttft_prediction_error_p50") is not None
    }
    if predicted:
        lines += [
            "TTFT predictions (pick to first response chunk, as the EPP observes it;"
            " mean over seeds of each run's median and p90 of |predicted - observed| /"
            " observed, and its median of predicted / observed - 1):",
            "",
            *[_prediction_line(name, r) for name, r in predicted.items()],
            "",
        ]
    lines += breakdown_report(document["policies"])
    lines += tenants_report(document["policies"])
    speed = ", ".join(
        f"{name} {r['wall_s']:.1f} s" for name, r in document["policies"].items() if r.get("wall_s")
    )
    lines += [f"Wall time per run (mean over seeds): {speed}.", ""]
    if plots:
        lines += ["## Plots", "", *[f"![{Path(p).stem}]({p})" for p in plots], ""]
    return "\n".join(lines)


def plot_ttft_cdf(document: dict[str, Any], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in document["policies"].items():
        values = sorted(v for run in r["runs"] for v in run["ttfts_s"])
        if not values:
            continue
        n = len(values)
        ax.plot([v * 1000 for v in values], [(i + 1) / n for i in range(n)], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, virtual time, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT, all seeds pooled")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    return "ttft_cdf.png"


def plot_hit_rate(document: dict[str, Any], out: Path) -> str:
    names = list(document["policies"])
    values = [document["policies"][n]["hit_rate"] or 0.0 for n in names]
    errors = [document["policies"][n].get("hit_rate_ci95") or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, values, yerr=errors, capsize=4)
    oracle = document.get("oracle")
    if oracle:
        ax.axhline(oracle["h_star"], color="black", linestyle="--", label="h*")
        ax.legend()
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate (mean ± 95% CI over seeds)")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    return "hit_rate.png"


def plot_load(document: dict[str, Any], out: Path) -> str:
    """Requests picked per pod per time bucket, first seed, one panel per policy."""
    policies = document["policies"]
    pods = document["setup"]["pods"]
    fig, axes = plt.subplots(len(policies), 1, figsize=(7, 2.2 * len(policies)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], policies.items(), strict=True):
        picks = r["runs"][0]["picks"]
        if not picks:
            continue
        end = max(t for t, _ in picks) or 1.0
        buckets = 40
        width = end / buckets
        counts = [[0] * buckets for _ in range(pods)]
        for t, pod in picks:
            counts[pod][min(int(t / width), buckets - 1)] += 1
        xs = [(i + 0.5) * width for i in range(buckets)]
        for pod in range(pods):
            ax.plot(xs, [c / width for c in counts[pod]], linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("req/s per pod", fontsize=8)
    axes[-1, 0].set_xlabel("virtual time (s)")
    fig.tight_layout()
    fig.savefig(out / "load_per_pod.png", dpi=110)
    plt.close(fig)
    return "load_per_pod.png"


def _prediction_line(name: str, result: dict[str, Any]) -> str:
    """A predicting policy's errors: over whole runs, after warm-up, and by tenth of
    each run (mean over seeds) where every run has them."""
    line = (
        f"- {name}: error p50 {pm(result, 'ttft_prediction_error_p50', '.1%')},"
        f" p90 {pm(result, 'ttft_prediction_error_p90', '.1%')};"
        f" bias p50 {pm(result, 'ttft_prediction_bias_p50', '+.1%')}"
    )
    if result.get("ttft_prediction_error_p50_warm") is not None:
        line += (
            f"; after each run's first {PREDICTION_WARMUP} predictions, error p50"
            f" {pm(result, 'ttft_prediction_error_p50_warm', '.1%')}"
        )
    tenths = [run.get("ttft_prediction_error_p50_by_tenth") for run in result.get("runs", ())]
    if tenths and all(t is not None for t in tenths):
        means = [sum(t[i] for t in tenths) / len(tenths) for i in range(10)]
        line += "; error p50 by tenth of the run: " + ", ".join(f"{m:.0%}" for m in means)
    return line


def plot_predictions(document: dict[str, Any], out: Path) -> str | None:
    """Predicted against observed TTFT (pick to first chunk), all seeds pooled, one
    panel per policy that predicts; None when no policy does."""
    predicted = {
        name: [pair for run in r["runs"] for pair in run.get("ttft_predictions", ())]
        for name, r in document["policies"].items()
    }
    predicted = {name: pairs for name, pairs in predicted.items() if pairs}
    if not predicted:
        return None
    fig, axes = plt.subplots(1, len(predicted), figsize=(4.5 * len(predicted), 4.2), squeeze=False)
    for ax, (name, pairs) in zip(axes[0], predicted.items(), strict=True):
        xs = [o * 1000 for _, o in pairs]
        ys = [p * 1000 for p, _ in pairs]
        ax.scatter(xs, ys, s=3, alpha=0.3)
        low = max(0.1, min(min(xs), min(ys)))
        high = max(max(xs), max(ys))
        ax.plot(
            [low, high], [low, high], color="black", linewidth=0.8, label="predicted = observed"
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("observed TTFT at the EPP (ms, virtual)")
        ax.set_ylabel("predicted at the pick (ms)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_predicted_vs_observed.png", dpi=110)
    plt.close(fig)
    return "ttft_predicted_vs_observed.png"


def plot_tenants(document: dict[str, Any], out: Path) -> str | None:
    """The tenants workload: TTFT p90 per objective and each tenant's share of its
    fair share during the burst, per policy (mean ± 95% CI over seeds)."""
    policies = {n: r["tenants"] for n, r in document["policies"].items() if "tenants" in r}
    if not policies:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(policies)
    objectives = list(next(iter(policies.values()))["by_objective"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        parts = [policies[name]["by_objective"][o] for o in objectives]
        xs = [j + i * width for j in range(len(objectives))]
        left.bar(
            xs,
            [(p["ttft_p90_s"] or 0.0) * 1000 for p in parts],
            width,
            yerr=[(p.get("ttft_p90_s_ci95") or 0.0) * 1000 for p in parts],
            capsize=3,
            label=name,
        )
        tenants = list(policies[name]["by_tenant"])
        shares = [policies[name]["by_tenant"][t] for t in tenants]
        right.bar(
            [j + i * width for j in range(len(tenants))],
            [s["of_fair_share"] or 0.0 for s in shares],
            width,
            yerr=[s.get("of_fair_share_ci95") or 0.0 for s in shares],
            capsize=3,
            label=name,
        )
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(objectives))], objectives)
    left.set_yscale("log")
    left.set_ylabel("TTFT p90 (ms, virtual)")
    left.set_title("TTFT p90 by objective")
    left.legend(fontsize=8)
    tenants = list(next(iter(policies.values()))["by_tenant"])
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(tenants))], tenants)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.axhspan(0.9, 1.1, color="grey", alpha=0.15)
    right.set_ylabel("served / fair share (output tokens)")
    right.set_title("During the burst")
    fig.tight_layout()
    fig.savefig(out / "flow_control.png", dpi=110)
    plt.close(fig)
    return "flow_control.png"


def write_outputs(document: dict[str, Any], out: Path) -> list[str]:
    import json

    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_ttft_cdf(document, out), plot_hit_rate(document, out), plot_load(document, out)]
    predictions = plot_predictions(document, out)
    if predictions is not None:
        plots.append(predictions)
    tenants = plot_tenants(document, out)
    if tenants is not None:
        plots.append(tenants)
    slim = {
        **document,
        "policies": {
            name: {**r, "runs": [_slim(run) for run in r["runs"]]}
            for name, r in document["policies"].items()
        },
    }
    (out / "results.json").write_text(json.dumps(slim, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(report_markdown(document, plots), encoding="utf-8")
    return plots


def _slim(run: dict[str, Any]) -> dict[str, Any]:
    """A run as results.json keeps it: without the raw TTFTs and picks (plots have them)."""
    return {k: v for k, v in run.items() if k not in ("ttfts_s", "picks", "ttft_predictions")}
