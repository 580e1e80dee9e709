"""What the project promises about routing, checked in the lab on every change.

Small fleets and workloads in virtual time (8 pods, a few hundred requests, three
seeds, under a minute in all), at twice the fleet's no-hit capacity
(docs/lab.md#capacity), where routing decides whether the fleet keeps up. Each
assertion leaves the margin of the 95% confidence intervals over the seeds:
"A beats B" means A's mean plus its CI is below B's mean minus its CI.
Breaking a scorer makes these fail (docs/lab.md says which and how it was tried).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.lab.run import FleetSpec, LabOptions, run_lab
from bench.workloads import Words, WorkloadSpec, default_tokenizer_dir

SHAPE = {"system_len": 1024, "question_len": 128, "output_len": 64}
WORKLOADS = {
    "shared-prefix": {"groups": 16, "prompts_per_group": 16, **SHAPE},
    "hot-prefix": {"groups": 16, "requests": 384, "hot_share": 0.5, **SHAPE},
}


def lab(workload: str, tmp_path: Path) -> dict[str, Any]:
    return run_lab(
        LabOptions(
            workload=WorkloadSpec(workload, options=WORKLOADS[workload]),
            policies=("round-robin", "default"),
            fleet=FleetSpec(8),
            seeds=(0, 1, 2),
            load=2.0,
            rate=None,
            tokenizer=default_tokenizer_dir(),
            out=tmp_path / workload,
            command="tests/bench/lab/test_routing_quality.py",
        )
    )


def upper(result: dict[str, Any], key: str) -> float:
    return float(result[key] + (result[f"{key}_ci95"] or 0.0))


def lower(result: dict[str, Any], key: str) -> float:
    return float(result[key] - (result[f"{key}_ci95"] or 0.0))


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_default_profile_routes_to_the_cache_and_keeps_the_fleet_up(
    workload: str, tmp_path: Path, qwen_words: Words
) -> None:
    document = lab(workload, tmp_path)
    default = document["policies"]["default"]
    round_robin = document["policies"]["round-robin"]
    h_star = document["oracle"]["h_star"]
    assert default["errors"] == 0
    assert round_robin["errors"] == 0
    # It finds the shared prefixes: at least 0.9 of the best any router could, and
    # clearly more than round-robin. (Predicted-TTFT trades a hit for a shorter
    # wait when that is faster, so its hit rate moves more from seed to seed than a
    # weighted profile's: the bound is on the mean.)
    assert default["hit_rate"] >= 0.9 * h_star, (default["hit_rate"], h_star)
    assert lower(default, "hit_rate") > upper(round_robin, "hit_rate")
    # So the fleet keeps up where round-robin queues: lower TTFT, median and tail.
    assert upper(default, "ttft_p50_s") < lower(round_robin, "ttft_p50_s")
    assert upper(default, "ttft_p90_s") < lower(round_robin, "ttft_p90_s")
    # Without piling the hot prefix onto a few pods.
    assert default["max_over_mean_load"] <= 1.5, default["max_over_mean_load"]
