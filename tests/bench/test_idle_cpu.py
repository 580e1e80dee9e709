"""`python -m bench.idle_cpu`'s reading of a process's CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.idle_cpu import Window, cpu_seconds


def test_cpu_seconds_counts_work_and_not_sleep() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
            "time.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while cpu_seconds(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = cpu_seconds(child.pid)
        assert busy >= 0.3
        time.sleep(0.5)  # it sleeps now: no CPU
        assert cpu_seconds(child.pid) - busy < 0.05
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(os.getpid()) > 0


def test_a_window_is_cpu_over_wall_time() -> None:
    window = Window(wall_s=10.0, cpu_s=0.25, dispatch_passes=0, queued_at_end=0)
    assert window.cpu_percent == 2.5
    assert window.to_json()["cpu_percent"] == 2.5
    assert Window(0.0, 1.0, None, None).cpu_percent == 0.0
