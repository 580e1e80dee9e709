"""`python -m bench run --prefill-pods N`: a prefill/decode fleet through real Envoy
and the real EPP (llm-d-pd.yaml), what the results say about the disaggregated
requests (from the responses and from the pods' own counters), and TPOT."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from bench.__main__ import main
from bench.client import Arrivals, Record, RunTiming, drive, tpot
from bench.runner import PodCounters, RunOptions, pd_summary, summarize
from bench.workloads import Session, Turn, Workload, WorkloadSpec

# A short rag run on one prefill and one decode pod: 12 requests over 3 documents
# of 256 tokens, so every prompt leaves the decode pod far more than llm-d-pd's
# nonCachedTokens (16) to prefill and the decider disaggregates it.
RAG = [
    "--workload", "rag", "--pods", "2", "--requests", "12", "--documents", "3",
    "--document-len", "256", "--question-len", "24", "--output-len", "8",
    "--concurrency", "2", "--no-progress",
]  # fmt: skip


def _records(out: Path, result: dict[str, Any]) -> list[dict[str, Any]]:
    lines = (out / result["records_file"]).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_pd_fleet_with_llm_d_pd_disaggregates_through_envoy_and_the_epp(
    tmp_path: Path,
) -> None:
    policies = ["--policy", "llm-d-pd", "--policy", "round-robin"]
    code = main(["run", *RAG, "--prefill-pods", "1", *policies, "--out", str(tmp_path)])
    assert code == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["setup"]["prefill_pods"] == 1
    assert document["setup"]["sim_args"][-2:] == ["--prefill-pods", "1"]
    # The EPP read the roles from the fleet's endpoints file.
    endpoints = yaml.safe_load(
        (tmp_path / "runs" / "concurrency-2" / "llm-d-pd" / "endpoints.yaml").read_text()
    )["endpoints"]
    assert [e["labels"] for e in endpoints] == [
        {"llm-d.ai/role": "prefill"},
        {"llm-d.ai/role": "decode"},
    ]

    pd = document["policies"]["llm-d-pd"]
    # Every request served, by the decode pod.
    assert (pd["requests"], pd["ok_requests"], pd["errors"], pd["status"]) == (12, 12, 0, "ok")
    assert pd["pods_in_headers"] == {"sim-1": 12}
    # The pods' own counters: the prefill pod served a prefill leg per request the
    # decode pod's sidecar sent, the decode pod pulled the KV cache for each, and no
    # prefill leg fell back to the decode pod.
    assert pd["pd_prefill_pods"] == ["sim-0"]
    legs = pd["pd_prefill_legs_per_pod"]
    assert legs["sim-0"] > 0
    assert legs["sim-1"] == 0
    assert pd["pd_prefill_legs_served"] == legs["sim-0"] == pd["pd_prefill_legs_sent"]
    assert pd["pd_decode_legs_served"] == pd["pd_prefill_legs_sent"]
    assert pd["pd_kv_transfers"] > 0
    assert pd["pd_kv_transfer_mean_s"] > 0
    assert pd["pd_kv_transfer_bytes"] > 0
    assert pd["pd_fallbacks"] == 0
    # Which requests: each response named its prefill pod, and they are exactly the
    # legs the pods counted.
    records = _records(tmp_path, pd)
    split = [r for r in records if r["prefill_pod"] is not None]
    assert {r["prefill_pod"] for r in split} == {"sim-0"}
    assert pd["pd_disaggregated"] == len(split) == pd["pd_prefill_legs_served"]
    assert pd["pd_disaggregated_share"] == len(split) / 12
    assert pd["pd_ttft_p50_disaggregated_s"] > 0
    # The EPP's own count of its decisions says the same: one per request, each
    # with a prefill leg.
    assert (pd["pd_epp_decided"], pd["pd_epp_disaggregated"]) == (12, len(split))
    # TPOT beside TTFT: 8 tokens an answer, so 7 gaps each.
    assert 0 < pd["tpot_p50_s"] <= pd["tpot_p90_s"]
    for r in records:
        assert r["tpot_s"] == pytest.approx((r["last_token_s"] - r["ttft_s"]) / 7)
        assert r["ttft_s"] <= r["last_token_s"] <= r["e2e_s"]

    # An aggregated policy ignores the roles: both pods serve whole requests.
    rr = document["policies"]["round-robin"]
    assert (rr["ok_requests"], rr["errors"]) == (12, 0)
    assert rr["pods_in_headers"] == {"sim-0": 6, "sim-1": 6}
    assert (rr["pd_disaggregated"], rr["pd_prefill_legs_served"], rr["pd_kv_transfers"]) == (
        0,
        0,
        0,
    )
    assert rr["tpot_p50_s"] > 0

    report = (tmp_path / "report.md").read_text()
    assert "| TPOT p50 (ms) | TPOT p90 (ms) |" in report
    assert "## Prefill/decode" in report
    shown = f"| llm-d-pd | {len(split)} ({len(split) / 12:.0%}); EPP {len(split)} |"
    assert shown in report
    # An EPP config without a P/D handler counts no decisions: nothing to show.
    assert "pd_epp_decided" not in rr


def test_a_trace_replays_on_a_pd_fleet(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 50, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]},
        {"timestamp": 100, "input_length": 900, "output_length": 4, "hash_ids": [1, 2, 4]},
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    fleet = ["--pods", "2", "--prefill-pods", "1", "--policy", "llm-d-pd", "--no-progress"]
    code = main(["run", "--workload", "trace", "--trace", str(trace), *fleet, "--out", str(out)])
    assert code == 0
    result = json.loads((out / "results.json").read_text())["policies"]["llm-d-pd"]
    assert (result["ok_requests"], result["errors"]) == (3, 0)
    assert result["pd_disaggregated"] == result["pd_prefill_legs_served"] > 0
    assert result["pd_fallbacks"] == 0


@pytest.mark.parametrize(
    ("pods", "prefill", "message"),
    [
        ("2", "-1", "--prefill-pods must be 0 (no roles) or more, not -1"),
        ("2", "2", "--prefill-pods must be fewer than --pods (2)"),
        ("3", "5", "--prefill-pods must be fewer than --pods (3)"),
    ],
)
def test_bad_prefill_pods_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pods: str, prefill: str, message: str
) -> None:
    args = ["run", "--pods", pods, "--prefill-pods", prefill, "--concurrency", "1"]
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert not (tmp_path / "results.json").exists()


def test_run_options_refuse_a_fleet_without_a_decode_pod() -> None:
    spec = WorkloadSpec("rag")
    with pytest.raises(ValueError, match="fewer than --pods"):
        RunOptions(Path("out"), spec, [], [], pods=4, prefill_pods=4)
    with pytest.raises(ValueError, match="0 \\(no roles\\) or more"):
        RunOptions(Path("out"), spec, [], [], pods=4, prefill_pods=-2)
    options = RunOptions(Path("out"), spec, [], [], pods=4, prefill_pods=1)
    assert options.fleet_args()[-2:] == ["--prefill-pods", "1"]
    assert "--prefill-pods" not in RunOptions(Path("out"), spec, [], [], pods=4).fleet_args()


# -- TPOT ----------------------------------------------------------------------------------


def test_tpot_of_a_hand_made_record() -> None:
    # First token 0.25 s after its schedule, the fifth and last at 0.65 s: four gaps
    # of 0.1 s.
    record = Record(0, 0, 0, 0.0, 0.0, ok=True, ttft_s=0.25, e2e_s=0.7, output_tokens=5)
    record.last_token_s = 0.65
    assert record.tpot_s == pytest.approx(0.1)
    assert record.to_json()["tpot_s"] == pytest.approx(0.1)
    # One token: no gap to time; no last token or no usage: unknown.
    assert tpot(0.25, 0.25, 1) is None
    assert tpot(0.25, None, 5) is None
    assert tpot(0.25, 0.65, None) is None
    assert tpot(None, 0.65, 5) is None


def test_tpot_percentiles_are_over_the_successful_requests_with_two_tokens() -> None:
    def made(ttft: float, last: float, tokens: int, ok: bool = True) -> Record:
        record = Record(0, 0, 0, 0.0, 0.0, ok=ok, ttft_s=ttft, e2e_s=last, output_tokens=tokens)
        record.last_token_s = last
        return record

    records = [
        made(0.1, 0.1 + 9 * 0.010, 10),  # 10 ms
        made(0.2, 0.2 + 4 * 0.020, 5),  # 20 ms
        made(0.3, 0.3 + 2 * 0.040, 3),  # 40 ms
        made(0.1, 0.1, 1),  # one token: no TPOT
        made(0.1, 0.1 + 9 * 1.0, 10, ok=False),  # failed: left out
    ]
    result = summarize(records, RunTiming(0.0, 2.0), {}, 1.0, max_error_rate=1.0)
    assert result["tpot_p50_s"] == pytest.approx(0.020)
    assert result["tpot_p90_s"] == pytest.approx(0.020 + 0.8 * 0.020)
    assert result["tpot_p99_s"] == pytest.approx(0.020 + 0.98 * 0.020)
    # No pod with a role: no P/D keys.
    assert not [k for k in result if k.startswith("pd_")]


GAP = 0.03  # wall seconds between the fake server's tokens


async def _tokens(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(
        headers={
            "content-type": "text/event-stream",
            "x-sim-pod": "fake-1",
            "x-bench-prefiller": "127.0.0.1:1",
        }
    )
    await response.prepare(request)
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    await response.write(role)
    for i in range(4):
        if i:
            await asyncio.sleep(GAP)
        text = json.dumps({"choices": [{"delta": {"content": f" t{i}"}}]}).encode()
        await response.write(b"data: " + text + b"\n\n")
    await asyncio.sleep(GAP)  # the usage chunk and [DONE] come later: not a token
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}'
    await response.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


@asynccontextmanager
async def _server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _tokens)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_client_times_the_last_token_not_the_end_of_the_stream() -> None:
    session = Session(0, -1, (Turn((("user", "hi"),), 4),))
    async with _server() as url:
        records, _ = await drive(
            Workload("test", {}, (session,)),
            url,
            Arrivals("closed", concurrency=1),
            model="m",
            time_scale=0.5,
            seed=0,
            request_timeout_s=30.0,
        )
    (record,) = records
    assert record.ok
    assert record.output_tokens == 4
    assert record.prefill_pod == "127.0.0.1:1"
    assert record.ttft_s is not None
    assert record.last_token_s is not None
    assert record.e2e_s is not None
    # Three gaps of GAP wall seconds, in simulated seconds (time scale 0.5: x2); the
    # end of the stream is a gap later still.
    assert record.last_token_s - record.ttft_s == pytest.approx(3 * GAP / 0.5, rel=0.5)
    assert record.tpot_s == pytest.approx(GAP / 0.5, rel=0.5)
    assert record.e2e_s - record.last_token_s >= 0.8 * GAP / 0.5


def test_pd_counters_subtract_and_sum() -> None:
    before = PodCounters(role="decode", prefill_legs_sent=2, fallbacks=(("connect", 1),))
    after = PodCounters(
        role="decode",
        prefill_legs_sent=5,
        decode_legs_served=3,
        kv_transfers=3,
        kv_transfer_s=0.03,
        kv_transfer_bytes=3e6,
        fallbacks=(("connect", 1), ("timeout", 2)),
    )
    delta = after.minus(before)
    assert (delta.role, delta.prefill_legs_sent, delta.fallbacks) == (
        "decode",
        3,
        (("connect", 0), ("timeout", 2)),
    )
    prefill = PodCounters(role="prefill", prefill_legs_served=3, requests=3)
    sent = Record(0, 0, 0, 0.0, 0.0, ok=True, ttft_s=0.2, prefill_pod="sim-0")
    whole = Record(1, 0, 0, 0.0, 0.0, ok=True, ttft_s=0.1)
    summary = pd_summary([sent, whole], {"sim-0": prefill, "sim-1": delta})
    assert summary["pd_prefill_pods"] == ["sim-0"]
    assert (summary["pd_disaggregated"], summary["pd_disaggregated_share"]) == (1, 0.5)
    assert summary["pd_kv_transfer_mean_s"] == pytest.approx(0.01)
    assert (summary["pd_fallbacks"], summary["pd_fallbacks_by_reason"]) == (
        2,
        {"connect": 0, "timeout": 2},
    )
    assert (summary["pd_ttft_p50_disaggregated_s"], summary["pd_ttft_p50_whole_s"]) == (0.2, 0.1)
    assert pd_summary([sent], {"sim-0": PodCounters()}) == {}
