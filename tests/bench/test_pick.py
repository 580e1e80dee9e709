"""`python -m bench.pick --only-configs`: shipped configs' picks side by side, on one
fleet size or on several taking turns (`--config-pods`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import pick
from tests.testdata import qwen_dir


def test_configs_on_several_fleet_sizes_are_measured_in_one_run(tmp_path: Path) -> None:
    qwen_dir()  # the chat requests' prompts are made with the real tokenizer's words
    out = tmp_path / "picks.json"
    code = pick.main(
        [
            "--only-configs",
            "--configs",
            "default,round-robin",
            "--config-pods",
            "1,8",
            "--iterations",
            "20",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert "configs" not in results
    by_pods = results["configs_by_pods"]
    assert sorted(by_pods) == ["1", "8"]
    for picks in by_pods.values():
        assert sorted(picks) == ["default", "round-robin"]
        for stats in picks.values():
            assert stats["n"] == 20
            assert 0.0 < stats["p50_ms"] <= stats["p99_ms"]
    assert results["command"].startswith("python -m bench.pick --only-configs")


@pytest.mark.parametrize(
    ("value", "message"),
    [("0,4", "must be 1 or more"), ("x", "expected fleet sizes like 1,16,64"), ("", "1 or more")],
)
def test_bad_fleet_sizes_are_refused_with_what_to_give(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        pick.main(["--only-configs", "--config-pods", value])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
