"""Where a result came from: the command, the code and the machine. Every result
file the benchmarks write carries it, so a figure in the docs can be traced to the
run, the commit it measured and what else the host was doing."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _cpus() -> int:
    """The CPUs this process may run on (fewer than the machine's when pinned)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 0


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def portable_path(path: Path) -> str:
    """`path` as a results file records it: relative to the checkout when it lies in
    it or in the shared test data beside it (`../shared`), else only its name, so
    that a results file names no directory of the machine it was made on (a
    checkout's parent may be any directory: /tmp, a home)."""
    # Not resolved: a symbolic link to the shared data stays the name it is used by.
    absolute = Path(os.path.normpath(path.absolute()))
    for base, prefix in ((ROOT, ""), (ROOT.parent / "shared", "../shared/")):
        if absolute.is_relative_to(base):
            return prefix + absolute.relative_to(base).as_posix()
    return absolute.name


# The packages whose code a result measures.
MEASURED_PACKAGES = ("epp", "epp.plugins", "sim", "bench")


def code_outside_checkout(packages: tuple[str, ...] = MEASURED_PACKAGES) -> list[str]:
    """Those of `packages` this interpreter imports from outside this checkout. An
    editable install made from another checkout maps the built-in plugins
    (`epp.plugins`, kept in plugins/) there through an import hook, whatever the
    working directory: a run from a second checkout then measures the first one's
    plugins, and this checkout's git status says nothing about them."""
    outside = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        locations = [] if spec is None else list(spec.submodule_search_locations or ())
        if any(not Path(location).resolve().is_relative_to(ROOT) for location in locations):
            outside.append(name)
    return outside


def provenance(command: str) -> dict[str, Any]:
    """`command`, the git commit (and whether tracked files other than committed
    results differed from it: a run that rewrites docs/results/ measured the same
    code; or whether code it measured was imported from outside the checkout, which
    `code_outside_checkout` then names), the time in UTC, and the machine: CPUs, CPU
    model, Python, the 1-minute load average when the run ended (above the CPU
    count, something else competed)."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/results")
    outside = code_outside_checkout()
    # None: git could not tell, and nothing came from elsewhere.
    dirty = True if outside else (bool(status) if status is not None else None)
    return {
        "command": command,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": dirty,
        **({"code_outside_checkout": outside} if outside else {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": _cpus(),
            "cpu_model": _cpu_model(),
            "python": platform.python_version(),
            "load_average_1m": round(os.getloadavg()[0], 2),
        },
    }


def emit(document: dict[str, Any], out: Path | None) -> None:
    """Print a finished result `document` (its `provenance` merged in) as JSON, and
    write it to `out` when given."""
    text = json.dumps(document, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def produced_by(document: dict[str, Any]) -> list[str]:
    """A report's opening lines after its title: the command that produced the
    result file `document` (a `provenance` dict merged in), in a shell block."""
    return ["Produced by:", "", "```sh", document["command"], "```", ""]


def commit_label(document: dict[str, Any]) -> str:
    """The result's commit for a report, marked when tracked files differed."""
    commit = document.get("commit") or "unknown"
    return commit + (" (with uncommitted changes)" if document.get("dirty") else "")
