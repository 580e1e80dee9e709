"""results.json and report.md of a run against vLLM's own publisher code
(EPP_VLLM_PUBLISHERS_OUT=<dir>), summed per vLLM version and hash algorithm."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench.provenance import provenance

COMMAND = "EPP_VLLM_PUBLISHERS=1 pytest tests/vllm_publishers"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {"outcomes": Counter(), "vllm_events": Counter(), "epp": Counter()}
    )
    for row in rows:
        cell = cells[(row.get("version", "?"), row.get("algo", "?"))]
        cell["outcomes"][row.get("outcome", "?")] += 1
        cell["vllm_events"].update(row.get("vllm_events", {}))
        cell["epp"].update(row.get("epp", {}))
    return [
        {
            "version": version,
            "algo": algo,
            "passed": cell["outcomes"]["passed"],
            "failed": cell["outcomes"]["failed"],
            "skipped": cell["outcomes"]["skipped"],
            "vllm_events": dict(cell["vllm_events"]),
            "epp": dict(cell["epp"]),
        }
        for (version, algo), cell in sorted(cells.items())
    ]


def unseeded_none_hashes(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Per version and algorithm: whether two unseeded engines drew the same
    NONE_HASH (vLLM >= 0.29 derives it from a fixed seed for sha256) or not."""
    seen: dict[tuple[str, str], set[bool]] = defaultdict(set)
    for row in rows:
        engines = row.get("engines", {})
        if row.get("seed") != "default" or len(engines) < 2:
            continue
        hashes = {e["none_hash"] for e in engines.values()}
        seen[(row.get("version", "?"), row.get("algo", "?"))].add(len(hashes) == 1)
    return {
        key: "the same (fixed seed)"
        if same == {True}
        else "different (random)"
        if same == {False}
        else "mixed"
        for key, same in seen.items()
    }


def write_results(out: Path, rows: list[dict[str, Any]], wall_s: float, python: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = summarize(rows)
    document = {
        "what": "the EPP's precise prefix index (no hash settings) fed by vLLM's own"
        " KV-cache manager, block hashing and ZmqEventPublisher, from the released wheels",
        "provenance": provenance(COMMAND),
        "python_of_the_tests": python,
        "wall_s": round(wall_s, 1),
        "summary": table,
        "tests": rows,
    }
    (out / "results.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    lines = [
        "# The EPP against vLLM's own KV-event publisher code",
        "",
        f"`{COMMAND}` (after `python -m tests.vllm_publishers.prepare`), {len(rows)} tests"
        f" in {wall_s:.0f} s. Each vLLM version's scheduler-side code (KVCacheManager,"
        " BlockPool, the block hashing with an unseeded engine's NONE_HASH,"
        " ZmqEventPublisher) runs from its released wheel; the EPP subscribes over TCP"
        " with no hash settings. Events and blocks are summed over the tests of a row"
        " (vLLM: events published; EPP: blocks stored and removed as the index applied"
        " them).",
        "",
        "| vLLM | algorithm | passed | failed | BlockStored | BlockRemoved"
        " | AllBlocksCleared | EPP batches | EPP blocks stored | EPP blocks removed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell in table:
        events, epp = cell["vllm_events"], cell["epp"]
        lines.append(
            f"| {cell['version']} | {cell['algo']} | {cell['passed']} | {cell['failed']}"
            f" | {events.get('BlockStored', 0)} | {events.get('BlockRemoved', 0)}"
            f" | {events.get('AllBlocksCleared', 0)} | {epp.get('batches', 0)}"
            f" | {epp.get('blocks_stored', 0)} | {epp.get('blocks_removed', 0)} |"
        )
    seeds = unseeded_none_hashes(rows)
    if seeds:
        lines += [
            "",
            "NONE_HASH of two engines started with PYTHONHASHSEED unset (seed `default`),"
            " as vLLM's `init_none_hash` drew it: the EPP scores them alike either way.",
            "",
            "| vLLM | algorithm | the two engines' NONE_HASH |",
            "|---|---|---|",
        ]
        lines += [f"| {v} | {a} | {what} |" for (v, a), what in sorted(seeds.items())]
    failed = [row for row in rows if row.get("outcome") == "failed"]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [
            f"- {r.get('test')} [{r.get('version')}, {r.get('algo')}, seed {r.get('seed')}]:"
            f" {r.get('error', '')}"
            for r in failed
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
