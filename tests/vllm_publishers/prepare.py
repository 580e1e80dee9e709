"""Sets up what the tests against vLLM's own code need, idempotently:

- `.venv-vllm-code/`: a venv with what vLLM's scheduler-side modules import
  (requirements.txt here: torch's CPU build, msgspec, pyzmq, cbor2, xxhash, ...);
- `out/vllm-wheels/`: the released vLLM wheels from PyPI (`pip download --no-deps`);
- `out/vllm-src/<version>/`: only their Python sources (and METADATA), extracted.
  The compiled CUDA extensions are not extracted and never imported.

    python -m tests.vllm_publishers.prepare [--versions 0.22.1 0.33.0]

vLLM's code is downloaded here, at test time; none of it is kept in the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm-code"
VENV_PYTHON = VENV / "bin" / "python"
WHEELS = ROOT / "out" / "vllm-wheels"
SOURCES = ROOT / "out" / "vllm-src"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
# 0.22.1: the last array-encoded events before the map encoding (0.24) and random
# NONE_HASH for every algorithm; 0.32.0 and 0.33.0: map-encoded events, and the
# fixed "vllm-none-hash" seed for sha256 (random for xxhash) since 0.29.
VERSIONS = ("0.22.1", "0.32.0", "0.33.0")


def source_dir(version: str) -> Path:
    return SOURCES / version


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def ensure_venv(python: str) -> None:
    stamp = VENV / ".installed"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    if not VENV_PYTHON.exists():
        run(python, "-m", "venv", str(VENV))
    run(
        str(VENV_PYTHON),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "-r",
        str(REQUIREMENTS),
    )
    stamp.write_text(digest)


def wheel_path(version: str) -> Path | None:
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    return found[0] if found else None


def ensure_wheel(version: str) -> Path:
    path = wheel_path(version)
    if path is None:
        WHEELS.mkdir(parents=True, exist_ok=True)
        # --only-binary: the released wheel (a few hundred MB), never an sdist build.
        run(
            str(VENV_PYTHON),
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(WHEELS),
            f"vllm=={version}",
        )
        path = wheel_path(version)
    if path is None:
        raise SystemExit(f"vllm=={version}: no wheel downloaded")
    return path


def ensure_sources(version: str) -> None:
    target = source_dir(version)
    stamp = target / ".extracted"
    wheel = ensure_wheel(version)
    if stamp.exists() and stamp.read_text() == wheel.name:
        return
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith((".py", ".dist-info/METADATA")):
                archive.extract(name, target)
    stamp.write_text(wheel.name)
    print(f"vLLM {version}: sources in {target.relative_to(ROOT)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), metavar="VERSION")
    parser.add_argument("--python", default="python3", help="the interpreter the venv is made from")
    args = parser.parse_args(argv)
    ensure_venv(args.python)
    for version in args.versions:
        ensure_sources(version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
