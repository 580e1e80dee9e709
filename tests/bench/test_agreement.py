"""`python -m bench agreement`: two real `epp serve` replicas behind one real Envoy,
following the same simulated pods' KV events, asked for the same prompts at the
same moments. With precise routing they must pick the same pods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.agreement import AgreementOptions, run_agreement


def test_two_replicas_pick_the_same_pods(tmp_path: Path) -> None:
    document = run_agreement(
        AgreementOptions(
            out_dir=tmp_path,
            pods=3,
            replicas=2,
            groups=8,
            requests=80,
            rate=15.0,
            system_len=256,
            probe_interval_s=0.1,
        )
    )
    assert document["requests"]["errors"] == 0
    # Envoy balanced its ext_proc streams over both replicas.
    first, second = document["requests_per_replica"]
    assert first + second >= 80
    assert min(first, second) >= 0.3 * (first + second)
    # Both indexes hold exactly what every engine caches, once the events are in.
    assert document["indexes_settled"]
    digests = document["digests"]
    for name, engine in digests["engines"].items():
        assert digests["replicas"][name] == [engine, engine]
    at_rest = document["at_rest"]
    assert at_rest["probes"] >= 6
    assert at_rest["prefix_score_agreement"] == 1.0
    assert at_rest["pick_agreement_untied"] == 1.0
    under_load = document["under_load"]
    assert under_load["probes"] >= 10
    assert under_load["pick_agreement"] >= 0.8, under_load
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["under_load"] == under_load
    assert "| under load |" in (tmp_path / "report.md").read_text()


def test_one_replica_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agreement", "--replicas", "1"]) == 2
    assert "--replicas >= 2" in capsys.readouterr().err
