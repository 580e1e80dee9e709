"""The simulator stands alone: it never imports the EPP (and the EPP never imports it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _imported_after(module: str) -> set[str]:
    code = (
        f"import sys, {module}\nprint('\\n'.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


def test_sim_does_not_import_epp() -> None:
    assert "epp" not in _imported_after("sim.cli")


def test_epp_does_not_import_sim() -> None:
    assert "sim" not in _imported_after("epp.cli")
