"""The arithmetic of the lab's fidelity table and of its delay calibration."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.lab.calibrate import _fit, main, paired, read_histogram
from bench.lab.fidelity import Case, compare, markdown

CASE = Case("shared-prefix", {}, 10.0)


def test_a_line_through_two_medians() -> None:
    fixed, per_token = _fit({2048: 0.0230, 128: 0.0038})
    assert fixed == pytest.approx(0.00252)
    assert per_token == pytest.approx(1e-5)


def test_paired_differences_cancel_what_moves_both_paths_in_a_round() -> None:
    # A host whose speed drifts: each round slower than the last, by more than the
    # 0.2 ms one path pays over the other; the difference of the two medians
    # would carry the drift's noise, the per-round differences do not.
    drift = [0.001 * i for i in range(40)]
    reference = [0.004 + d for d in drift]
    values = [0.0042 + d + (0.00005 if i % 2 else -0.00005) for i, d in enumerate(drift)]
    found = paired(values, reference, random.Random(1))
    assert found["median_s"] == pytest.approx(0.0002)
    assert found["low_s"] <= found["median_s"] <= found["high_s"]
    assert found["high_s"] - found["low_s"] <= 0.0001 + 1e-12
    with pytest.raises(ValueError, match="equally long"):
        paired(values, reference[:-1], random.Random(1))
    with pytest.raises(ValueError, match="non-empty"):
        paired([], [], random.Random(1))


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ("round-robin,default", "direct and each other path once"),
        ("direct,default,default", "direct and each other path once"),
        ("direct,no-such-config", "unknown policy 'no-such-config'"),
    ],
)
def test_calibrate_refuses_bad_paths_before_starting_anything(
    paths: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calibration"
    with pytest.raises(SystemExit) as exit_info:
        main(["--parts", "paths", "--paths", paths, "--out", str(out)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_quantiles_from_the_buckets_of_an_epp_page() -> None:
    """Read off a page as the EPP serves it, summed over endpoints, the window's
    observations only; quantiles interpolated within a bucket, as Prometheus does."""
    registry = CollectorRegistry()
    lag = Histogram(
        "lag_seconds", "", ["endpoint"], buckets=(0.001, 0.002, 0.005), registry=registry
    )
    lag.labels("a").observe(0.0001)  # before the window
    before = read_histogram(generate_latest(registry).decode(), "lag_seconds")
    for _ in range(4):
        lag.labels("a").observe(0.0015)
    for _ in range(4):
        lag.labels("b").observe(0.0015)
    lag.labels("b").observe(0.004)
    lag.labels("b").observe(7.0)  # beyond the last bound
    window = read_histogram(generate_latest(registry).decode(), "lag_seconds").minus(before)
    assert window.count == 10
    assert window.total == pytest.approx(8 * 0.0015 + 0.004 + 7.0)
    # The 5th of 10 is the 5th of the 8 in (1 ms, 2 ms].
    assert window.quantile(0.5) == pytest.approx(0.001 + 0.001 * 5 / 8)
    assert window.quantile(0.9) == pytest.approx(0.005)  # the 9th: the top of (2, 5 ms]
    assert window.quantile(0.95) == 0.005  # in +Inf: the highest finite bound
    summary = window.summary()
    assert summary["count"] == 10
    assert summary["buckets"] == {"0.001": 0, "0.002": 8, "0.005": 9, "+Inf": 10}
    assert read_histogram("", "lag_seconds").quantile(0.5) is None


def real(hit: float, p50: float, p90: float) -> dict[str, float]:
    return {"hit_rate": hit, "ttft_p50_s": p50, "ttft_p90_s": p90, "sim_lag_max_s": 0.0}


def test_the_tolerances_of_the_fidelity_table() -> None:
    close = compare(CASE, "default", real(0.80, 0.020, 0.050), real(0.82, 0.024, 0.040), False)
    assert close["hit_rate_ok"]
    assert close["ttft_ok"]
    assert close["ttft_p50_s_ratio"] == pytest.approx(1.2)
    # Hit rate off by 0.04: too far for one of ours, close enough for a peer's model.
    assert not compare(CASE, "x", real(0.80, 0.02, 0.05), real(0.84, 0.02, 0.05), False)[
        "hit_rate_ok"
    ]
    assert compare(CASE, "x", real(0.80, 0.02, 0.05), real(0.84, 0.02, 0.05), True)["hit_rate_ok"]
    # One TTFT percentile 30% off fails the row's TTFT.
    far = compare(CASE, "x", real(0.8, 0.020, 0.050), real(0.8, 0.020, 0.035), False)
    assert not far["ttft_ok"]
    # A run without TTFTs cannot pass.
    missing = compare(CASE, "x", real(0.8, 0.02, 0.05), {"hit_rate": 0.8}, False)
    assert not missing["ttft_ok"]
    table = markdown(
        {
            "pods": 4,
            "command": "c",
            "commit": "0123456789abcdef",
            "dirty": False,
            "machine": {"cpus": 2},
            "rows": [close, far],
        }
    )
    assert "| shared-prefix (rate 10/s) | default | 0.800 | 0.820 | +0.020 | yes |" in table
    assert table.count("| NO |") == 1
