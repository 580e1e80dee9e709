"""The EPP against vLLM's own KV-event publisher and block hashing (not the
simulator's re-implementation): the driver (`publish.py`) runs vLLM's code from
released wheels in a venv of its own.

Opt-in and never in the way of a plain `pytest`: everything here is skipped unless
the tests are asked for (EPP_VLLM_PUBLISHERS=1, or this folder named on the command
line) and `python -m tests.vllm_publishers.prepare` has set up the venv and the
extracted wheels. With EPP_VLLM_PUBLISHERS_OUT=<dir>, the session writes
results.json and report.md there."""

from __future__ import annotations

import json
import os
import platform
import select
import subprocess
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_publishers.prepare import ROOT, VENV_PYTHON, VERSIONS, source_dir

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "publish.py"
# vLLM's import chain (torch, transformers, ...) takes half a minute on a cold cache.
DRIVER_START_TIMEOUT_S = 240.0
DRIVER_CALL_TIMEOUT_S = 60.0


def _asked_for(config: pytest.Config) -> bool:
    if os.environ.get("EPP_VLLM_PUBLISHERS") == "1":
        return True
    here = str(HERE.relative_to(ROOT))
    return any(str(arg).split("::")[0].rstrip("/").endswith(here) for arg in config.args)


def available_versions() -> list[str]:
    return [v for v in VERSIONS if (source_dir(v) / "vllm" / "__init__.py").is_file()]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    reason = None
    if not _asked_for(config):
        reason = (
            "opt-in (minutes, needs vLLM wheels): EPP_VLLM_PUBLISHERS=1 pytest"
            " tests/vllm_publishers, after python -m tests.vllm_publishers.prepare"
        )
    elif not VENV_PYTHON.exists():
        reason = "no .venv-vllm-code: run python -m tests.vllm_publishers.prepare first"
    for item in mine:
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        callspec = getattr(item, "callspec", None)
        version = callspec.params.get("version") if callspec else None
        if version is not None and version not in available_versions():
            item.add_marker(
                pytest.mark.skip(
                    reason=f"vLLM {version} not extracted: python -m"
                    f" tests.vllm_publishers.prepare --versions {version}"
                )
            )


# -- the driver: vLLM's code in its own venv ----------------------------------------------


class DriverError(RuntimeError):
    pass


@dataclass
class Driver:
    """One publish.py process for one vLLM version; engines are created in it."""

    version: str
    process: subprocess.Popen[str]
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, version: str, log_dir: Path) -> Driver:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env["PYTHONPATH"] = str(source_dir(version))
        # vLLM is only asked to hash and publish: no device probing noise.
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        log_dir.mkdir(parents=True, exist_ok=True)
        stderr = (log_dir / f"driver-{version}.log").open("w")
        process = subprocess.Popen(
            [str(VENV_PYTHON), str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        stderr.close()
        driver = cls(version, process)
        driver.info = driver._read(DRIVER_START_TIMEOUT_S)
        if driver.info.get("vllm") != version:
            raise DriverError(f"driver runs vLLM {driver.info.get('vllm')}, not {version}")
        return driver

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            raise DriverError(f"vLLM {self.version} driver: no answer in {timeout_s}s")
        line = self.process.stdout.readline()
        if not line:
            raise DriverError(
                f"vLLM {self.version} driver exited ({self.process.poll()});"
                f" see out/vllm-publishers/driver-{self.version}.log"
            )
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise DriverError(f"vLLM {self.version}: {reply.get('traceback') or reply}")
        return reply

    def call(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read(DRIVER_CALL_TIMEOUT_S)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write('{"op": "quit"}\n')
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


class Drivers:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: dict[str, Driver] = {}
        self.failed: dict[str, str] = {}

    def get(self, version: str) -> Driver:
        if version in self.failed:
            pytest.fail(f"vLLM {version} driver did not start: {self.failed[version]}")
        if version not in self.running:
            try:
                self.running[version] = Driver.start(version, self.log_dir)
            except DriverError as exc:
                self.failed[version] = str(exc)
                raise
        return self.running[version]

    def stop(self) -> None:
        for driver in self.running.values():
            driver.stop()


@pytest.fixture(scope="session")
def drivers() -> Iterator[Drivers]:
    running = Drivers(ROOT / "out" / "vllm-publishers")
    yield running
    running.stop()


# -- results: what ran against which vLLM ------------------------------------------------


@dataclass
class Results:
    rows: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


RESULTS = Results()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A test's facts (version, algorithm, counts); its outcome is added after it ran."""
    row: dict[str, Any] = {"test": request.node.originalname}
    request.node.user_properties.append(("vllm_publishers", row))
    return row


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    rows: list[dict[str, Any]] = [
        value
        for name, value in item.user_properties
        if name == "vllm_publishers" and isinstance(value, dict)
    ]
    if not rows:
        return
    row = rows[0]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        row["outcome"] = report.outcome
        row["duration_s"] = round(report.duration, 3)
        if report.failed:
            row["error"] = str(report.longrepr).splitlines()[-1][:500]
        if row not in RESULTS.rows:
            RESULTS.rows.append(row)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("EPP_VLLM_PUBLISHERS_OUT")
    if not out or not RESULTS.rows:
        return
    from tests.vllm_publishers.report import write_results

    write_results(
        Path(out) if Path(out).is_absolute() else ROOT / out,
        RESULTS.rows,
        wall_s=time.monotonic() - RESULTS.started,
        python=platform.python_version(),
    )
