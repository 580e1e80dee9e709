"""`bench run`'s data path (simulated pods, `epp serve` with the shipped flow-control
config, the bench's Envoy) carries a tenants request's objective and fairness id to
the EPP: a critical request of the steady tenant is counted by flow control in
priority band 10 under its tenant's flow, and Envoy says when it let it go."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from bench.client import Arrivals, drive
from bench.runner import MODEL, RunOptions, data_path, http_get, resolve_policy
from bench.workloads import (
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    Workload,
    WorkloadSpec,
    load_words,
    tenants,
)
from epp.sources.metrics import read_series


def _critical_steady(workload: Workload) -> Workload:
    """The first request of the workload that is the steady tenant's and critical."""
    wanted = {FAIRNESS_ID_HEADER: "steady", OBJECTIVE_HEADER: "critical"}
    session = next(s for s in workload.sessions if dict(s.turns[0].headers) == wanted)
    return dataclasses.replace(
        workload, sessions=(dataclasses.replace(session, id=0, arrival_s=0.0),)
    )


def test_a_critical_tenants_request_reaches_the_epp_with_its_headers(tmp_path: Path) -> None:
    words = load_words(None)
    workload = _critical_steady(tenants(words, requests=200, question_len=16, output_len=4))
    policy = resolve_policy("flow-control")
    options = RunOptions(
        out=tmp_path,
        workload=WorkloadSpec("tenants"),
        policies=[policy],
        ladder=[],
        pods=1,
        tokenizer=None,
        progress=False,
    )
    with data_path(policy, options, tmp_path) as path:
        records, _ = asyncio.run(
            drive(
                workload,
                path.url,
                Arrivals("trace"),
                model=MODEL,
                time_scale=1.0,
                seed=0,
                request_timeout_s=30.0,
            )
        )
        assert path.epp_metrics_url is not None
        page = http_get(path.epp_metrics_url)
    (record,) = records
    assert record.ok, record.error
    # Envoy's routed header: when it sent the request upstream, after the EPP.
    assert record.sent_s is not None
    assert record.routed_s is not None
    assert record.sent_s < record.routed_s < record.sent_s + (record.ttft_s or 0.0)
    counted = {
        (s.labels["outcome"], s.labels["priority"], s.labels["fairness_id"]): s.value
        for s in read_series(page, "epp_flow_control_requests_total").samples
    }
    # The objective gave it critical's priority (10 in the config), the fairness id
    # its flow: without the headers it would be priority 0, flow "default-flow".
    assert counted == {("dispatched", "10", "steady"): 1.0}
