"""`python -m bench demo` stops everything it started when it gets a real SIGINT or
SIGTERM in the middle of a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (children of children too): pid -> command line."""
    found: dict[int, str] = {}
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    found[child] = (
                        Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    )
                except OSError:
                    continue
                stack.append(child)
    return found


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_demo_and_everything_it_started(
    tmp_path: Path, signum: signal.Signals
) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "bench", "demo", "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # A shell starts background jobs with SIGINT ignored, and a child inherits
        # that (Python then installs no KeyboardInterrupt handler): the demo is
        # started as from a terminal, whatever ran this test.
        preexec_fn=_sigint_default,
    )
    try:
        # Wait for the whole data path (pods, EPP, Envoy) to be up and the run going.
        deadline = time.monotonic() + 60
        started: dict[int, str] = {}
        while time.monotonic() < deadline:
            started = descendants(demo.pid)
            requests = list(tmp_path.glob("runs/*/*/sims/*.log"))
            if any("envoy" in c for c in started.values()) and requests:
                break
            assert demo.poll() is None, demo.communicate()[0]
            time.sleep(0.1)
        else:
            pytest.fail(f"the demo's data path did not come up: {started}")
        time.sleep(1.0)  # requests in flight
        started = descendants(demo.pid)
        assert sum("sim serve" in c for c in started.values()) == 4, started
        demo.send_signal(signum)
        output, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, output.decode()
    assert "stopped" in output.decode()
    left = {pid: cmd for pid, cmd in started.items() if alive(pid)}
    assert not left, f"still running after the demo exited: {left}"
