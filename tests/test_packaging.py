"""What a wheel of the project installs: only `epp` goes into site-packages, the
built-in plugins inside it as `epp.plugins` (from the top-level plugins/ folder),
registered under their type names; no generic top-level name (`plugins`, `sim`,
`bench`) that another distribution could also install."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_only_epp_is_installed(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    (metadata,) = [t for t in tops if t.endswith(".dist-info")]
    assert tops == {"epp", metadata}


def test_the_plugins_folder_installs_as_epp_plugins(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in sorted((ROOT / "plugins").glob("*.py")):
        assert f"epp/plugins/{module.name}" in names
    # Every package of the tree is in it, generated protobuf code included.
    for init in (ROOT / "epp").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names


def test_every_built_in_plugin_is_registered_from_epp_plugins(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    targets = dict(parser["epp.plugins"])
    assert targets["max-score-picker"] == "epp.plugins.max_score_picker:MaxScorePicker"
    assert all(t.startswith("epp.plugins.") for t in targets.values())
    modules = {t.split(":")[0].rsplit(".", 1)[1] for t in targets.values()}
    assert modules <= {p.stem for p in (ROOT / "plugins").glob("*.py")}
