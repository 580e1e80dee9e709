"""`python -m bench.gcpause`: full garbage collections timed with the indexes full,
each state in its own interpreter, as `epp serve` runs and without its freeze."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gcpause import main


def test_it_times_each_state_frozen_and_not(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    code = main(
        ["--pods", "2", "--blocks-per-pod", "600", "--precise-entries", "3200",
         "--repeats", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    written = json.loads(out.read_text())
    assert written["command"].startswith("python -m bench.gcpause --pods 2")
    results = {(r["state"], r["frozen"]): r for r in written["results"]}
    assert set(results) == {
        (state, frozen) for state in ("empty", "approximate", "precise") for frozen in (False, True)
    }
    for (state, frozen), result in results.items():
        assert result["pods"] == 2
        assert result["full_collection_ms"]["repeats"] == 2
        assert 0 < result["full_collection_ms"]["median"] <= result["full_collection_ms"]["max"]
        if frozen:
            # What the EPP built before serving is out of the collector's way.
            assert result["frozen_objects"] > 1_000
            assert result["tracked_objects"] < results[(state, False)]["tracked_objects"] / 4
        else:
            assert result["frozen_objects"] == 0
    # Every pod's LRU full; the precise index as asked.
    assert results[("approximate", True)]["entries"] == 2 * 600
    assert results[("precise", True)]["entries"] == 3200
    assert results[("empty", True)]["entries"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--states", "approximate,bogus"], "--states: expected some of"),
        (["--pods", "16,x"], "expected fleet sizes like 1,16,64"),
        (["--pods", "0"], "fleet sizes must be 1 or more"),
        (["--blocks-per-pod", "0"], "must be 1 or more"),
        (["--repeats", "0"], "must be 1 or more"),
        (["--variants", "thawed"], "--variants: expected unfrozen, frozen or both"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
