"""Where a result came from: the code it measured must be this checkout's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import provenance as provenance_module
from bench.provenance import MEASURED_PACKAGES, code_outside_checkout, provenance


def test_the_measured_packages_of_this_checkout_are_its_own() -> None:
    assert code_outside_checkout() == []
    assert "code_outside_checkout" not in provenance("python -m bench lab")


def test_code_imported_from_another_checkout_is_named_and_marks_the_run_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seen from a checkout at tmp_path, the packages this interpreter imports (from
    # the real checkout) lie outside it, as an editable install made elsewhere maps them.
    monkeypatch.setattr(provenance_module, "ROOT", tmp_path)
    assert code_outside_checkout() == list(MEASURED_PACKAGES)
    document = provenance("python -m bench lab")
    assert document["dirty"] is True
    assert document["code_outside_checkout"] == list(MEASURED_PACKAGES)


def test_a_package_that_is_not_installed_is_not_counted() -> None:
    assert code_outside_checkout(("no_such_package_here",)) == []


def test_without_git_and_with_nothing_from_elsewhere_dirty_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(provenance_module, "_git", lambda *args: None)
    document = provenance("python -m bench lab")
    assert document["dirty"] is None
    assert document["commit"] is None
