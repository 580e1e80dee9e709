"""`python -m bench.lab.tenants`: the unloaded reference, from one run or the mean of
several, a policy's own or one policy's for all; bad arguments are clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.lab.tenants import main, unloaded_reference


def run(p90s: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A results.json's `policies`, with only what the reference reads."""
    return {
        name: {"tenants": {"by_objective": {o: {"ttft_p90_s": v} for o, v in by.items()}}}
        for name, by in p90s.items()
    }


def p90(reference: dict[str, Any], name: str, objective: str) -> float:
    value: float = reference[name]["tenants"]["by_objective"][objective]["ttft_p90_s"]
    return value


def test_the_reference_is_the_mean_over_unloaded_runs() -> None:
    first = run({"off": {"critical": 0.08}, "on": {"critical": 0.10, "batch": 0.4}})
    second = run({"off": {"critical": 0.10}, "on": {"critical": 0.12}})
    own = unloaded_reference([first, second], ["off", "on"])
    assert p90(own, "off", "critical") == pytest.approx(0.09)
    assert p90(own, "on", "critical") == pytest.approx(0.11)
    assert p90(own, "on", "batch") == pytest.approx(0.4)  # only the run that has it
    shared = unloaded_reference([first, second], ["off", "on"], reference_policy="off")
    assert p90(shared, "on", "critical") == pytest.approx(0.09)
    assert "batch" not in shared["on"]["tenants"]["by_objective"]


def write(path: Path, policies: dict[str, Any]) -> Path:
    path.mkdir()
    (path / "results.json").write_text(json.dumps({"policies": policies}), encoding="utf-8")
    return path


def loaded_policies() -> dict[str, Any]:
    """A loaded run as the summary needs it: one policy's tenants section."""
    objective = {
        "sent": 10, "served": 10, "shed": 0, "failed": 0,
        "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "queue_wait_p90_s": 0.01,
    }  # fmt: skip
    return {"on": {"tenants": {"by_objective": {"critical": objective}, "by_tenant": {}}}}


def test_the_command_sets_each_ratio_against_the_chosen_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = write(tmp_path / "loaded", loaded_policies())
    a = write(tmp_path / "a", run({"off": {"critical": 0.08}, "on": {"critical": 0.2}}))
    b = write(tmp_path / "b", run({"off": {"critical": 0.12}, "on": {"critical": 0.2}}))
    assert main([str(loaded), str(a), str(b)]) == 0
    assert "| on | critical | 10 | 10 | 0 | 0 | 100.0 | 200.0 | 200.0 | 1.00 |" in (
        capsys.readouterr().out
    )
    assert main([str(loaded), str(a), str(b), "--reference-policy", "off"]) == 0
    assert "| 200.0 | 100.0 | 2.00 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["missing"], "missing/results.json not found"),
        (["a", "--reference-policy", "nobody"], "'nobody' is in none of the unloaded runs"),
        (["--reference-policy", "off"], "--reference-policy needs an UNLOADED run"),
    ],
)
def test_bad_arguments_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    loaded = write(tmp_path / "loaded", loaded_policies())
    write(tmp_path / "a", run({"off": {"critical": 0.08}}))
    args = [str(tmp_path / x) if x in ("missing", "a") else x for x in extra]
    with pytest.raises(SystemExit) as exit_:
        main([str(loaded), *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
