"""`python -m sim fleet`: port layout, endpoints file, and a real fleet of processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from sim.cli import fleet_main
from sim.fleet import _healthy, endpoints_document, plan_fleet

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_port_layout() -> None:
    pods = plan_fleet(3, 8001)
    assert [(p.name, p.http_port, p.kv_events_port, p.replay_port) for p in pods] == [
        ("sim-0", 8001, 8004, 8007),
        ("sim-1", 8002, 8005, 8008),
        ("sim-2", 8003, 8006, 8009),
    ]
    moved = plan_fleet(2, 8001, kv_events_base_port=5557, replay_base_port=6557)
    assert [(p.kv_events_port, p.replay_port) for p in moved] == [(5557, 6557), (5558, 6558)]
    with pytest.raises(ValueError, match="overlap"):
        plan_fleet(3, 8001, kv_events_base_port=8002)
    assert plan_fleet(1, 9000, kv_events=False)[0].kv_events_port is None


def test_endpoints_document() -> None:
    document = endpoints_document(plan_fleet(2, 8001), "0.0.0.0")
    assert document == {
        "endpoints": [
            {
                "name": "sim-0",
                "address": "127.0.0.1:8001",
                "kvEvents": "tcp://127.0.0.1:8003",
                "kvEventsReplay": "tcp://127.0.0.1:8005",
            },
            {
                "name": "sim-1",
                "address": "127.0.0.1:8002",
                "kvEvents": "tcp://127.0.0.1:8004",
                "kvEventsReplay": "tcp://127.0.0.1:8006",
            },
        ]
    }


def test_fleet_refuses_per_pod_options(tmp_path: Path) -> None:
    argv = ["--n", "2", "--base-port", "8001", "--endpoints-file", str(tmp_path / "e.yaml")]
    with pytest.raises(SystemExit):
        fleet_main([*argv, "--port", "9000"])
    with pytest.raises(SystemExit):
        fleet_main([*argv, "--no-such-option"])


def _free_range(count: int) -> int:
    """A base port whose `count` successors are all free right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count >= 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range")


def test_real_fleet(tmp_path: Path) -> None:
    base = _free_range(6)
    endpoints = tmp_path / "endpoints.yaml"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "sim", "fleet", "--n", "2", "--base-port", str(base),
            "--endpoints-file", str(endpoints), "--log-dir", str(tmp_path / "logs"),
            "--time-scale", "0.01", "--num-gpu-blocks", "200",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not endpoints.exists():
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "the fleet did not write its endpoints file"
            time.sleep(0.05)
        document = yaml.safe_load(endpoints.read_text())
        names = [e["name"] for e in document["endpoints"]]
        assert names == ["sim-0", "sim-1"]
        for i, entry in enumerate(document["endpoints"]):
            assert entry["address"] == f"127.0.0.1:{base + i}"
            assert entry["kvEvents"] == f"tcp://127.0.0.1:{base + 2 + i}"
            assert entry["kvEventsReplay"] == f"tcp://127.0.0.1:{base + 4 + i}"
            with urllib.request.urlopen(f"http://{entry['address']}/sim/state") as response:
                state = yaml.safe_load(response.read())
            assert state["name"] == entry["name"]
            assert state["kvEvents"]["endpoint"] == entry["kvEvents"]
            assert state["hashSeed"] == "0"  # PYTHONHASHSEED reaches every pod
            assert state["blocks"]["total"] == 200  # serve options reach every pod
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
    assert process.returncode == 0, output.decode()
    assert b"fleet: stopped" in output
    # Every pod process is gone: its port can be listened on again (SO_REUSEADDR
    # for the closed connections' TIME_WAIT; it does not allow a second listener).
    for port in range(base, base + 2):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_health_poll_that_gets_no_http_back_is_not_healthy_yet() -> None:
    # What a poll that connected to itself reads: its own request line. A pod still
    # starting must read as "not yet", not end the fleet.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def echo_request_line() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"GET /health HTTP/1.1\r\n\r\n")

        thread = threading.Thread(target=echo_request_line)
        thread.start()
        assert _healthy(f"http://127.0.0.1:{port}/health") is False
        thread.join(5)
