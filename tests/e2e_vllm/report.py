"""report.md of a real-vLLM tier run, from its results.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHECKS = (
    ("routing", "1. shared system prompts go to the engine that holds them"),
    ("hit_counters", "2. the engines' prefix-cache hit counters agree"),
    ("replay_on_join", "3. replay on join: the EPP learns what engines cached before it"),
    ("pod_restart", "4. an engine killed and restarted on the same ports"),
    ("metrics_scraper", "5. the metrics scraper reads the engines' /metrics"),
)


def _passed(check: dict[str, Any] | None) -> str:
    if check is None:
        return "not run"
    return "passed" if check.get("passed") else "FAILED"


def _mode(name: str, mode: dict[str, Any]) -> list[str]:
    checks = mode.get("checks", {})
    lines = [f"## Mode `{name}`", ""]
    lines.append("Engine command (each pod, its own ports):")
    lines += ["", "```", " ".join(mode.get("engine_command", [])), "```", ""]
    lines.append(f"- engine start (s, to /health 200): {mode.get('pod_start_seconds')}")
    lines.append(
        f"- the two engines hash the same prompt's first block alike: "
        f"{mode.get('engine_hashes_agree')}"
    )
    latency = mode.get("latency_s")
    if latency:
        lines.append(
            f"- latency of the routed chats through Envoy (4 output tokens): p50"
            f" {latency['p50']} s, max {latency['max']} s ({latency['requests']} requests)"
        )
    lines += ["", "| check | result | figures |", "|---|---|---|"]
    for key, title in CHECKS:
        check = checks.get(key)
        lines.append(f"| {title} | {_passed(check)} | {_figures(key, check)} |")
    return [*lines, ""]


def _probes(per_pod: dict[str, Any]) -> str:
    """The EPP's tokenization probes (every pick one), summed over the engines."""
    total = {"confirmed": 0, "missed": 0}
    for probes in per_pod.values():
        for key in total:
            total[key] += int((probes or {}).get(key, 0))
    return f"{total['confirmed']} confirmed, {total['missed']} missed"


def _figures(key: str, check: dict[str, Any] | None) -> str:
    if not check:
        return ""
    if key == "routing":
        scores = check.get("precise_scores", {})
        return (
            f"{check.get('right')}/{check.get('total')} follow-ups to the holder; "
            f"{check.get('groups')} groups, first picks {check.get('warm_picks')}; "
            f"precise scores holder {scores.get('holder')}, other {scores.get('other')}; "
            f"tokenization probes {_probes(check.get('tokenization_probes') or {})}"
        )
    if key == "hit_counters":
        return (
            f"holder +{check.get('holder_hit_tokens'):.0f} hit tokens "
            f"(= {check.get('cached_tokens_reported')} cached tokens reported), "
            f"other +{check.get('other_hit_tokens'):.0f}, over {check.get('requests')} requests"
        )
    if key == "replay_on_join":
        return (
            f"{check.get('right')}/{check.get('total')} to the holder; blocks replayed "
            f"{check.get('blocks_after_join')}"
        )
    if key == "pod_restart":
        load = check.get("load", {})
        return (
            f"restart {check.get('restart_seconds')} s; window {load.get('window_s')} s: "
            f"{load.get('failed')}/{load.get('requests')} failed, all inside it;"
            " new engine "
            f"seen {check.get('restart_detected_after_healthy_s')} s after healthy; "
            f"after: {check.get('right_after')}/{check.get('total_after')} to the holder"
            f" ({check.get('cold_after')} groups cold),"
            f" the new engine's own prefix to it: "
            f"{(check.get('new_engine') or {}).get('picked') == 'vllm-1'}"
        )
    if key == "metrics_scraper":
        peak = check.get("peak", {})
        return "peaks seen " + "; ".join(
            f"{n}: running {p['running']:.0f}, kv {p['kvCacheUsage']:.5f}" for n, p in peak.items()
        )
    return ""


def write_report(results: dict[str, Any], path: Path) -> None:
    provenance = results.get("provenance", {})
    vllm = results.get("vllm", {})
    lines = [
        "# Precise prefix routing against real vLLM engines",
        "",
        "Written by the real-vLLM tier (`make e2e-vllm`, docs/vllm-e2e.md) from",
        "results.json beside this file.",
        "",
        f"- vLLM: {vllm.get('package')} {vllm.get('version')}, two engines, CPU backend",
        f"- command: `{provenance.get('command')}`",
        f"- commit: {provenance.get('commit')} (dirty: {provenance.get('dirty')}),"
        f" {provenance.get('created')}",
        f"- machine: {provenance.get('machine')}",
        f"- the whole tier: {results.get('tier_seconds')} s",
        "",
    ]
    for name, mode in results.get("modes", {}).items():
        lines += _mode(name, mode)
    path.write_text("\n".join(lines))
