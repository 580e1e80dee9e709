"""`python -m sim fleet`: port layout, endpoints file, and a real fleet of processes."""

from __future__ import annotations

import os
import random
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

from bench.stack import (
    ProcessFailed,
    ephemeral_port_range,
    free_port_range,
    free_ports,
    start_sim_fleet,
)
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


def test_real_fleet(tmp_path: Path) -> None:
    base = free_port_range(6, random.Random())
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


def test_a_pod_that_cannot_start_ends_the_fleet_and_the_fleet_says_why(tmp_path: Path) -> None:
    base = free_port_range(3, random.Random())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base))  # sim-0's HTTP port
        taken.listen()
        done = subprocess.run(
            [
                sys.executable, "-m", "sim", "fleet", "--n", "1", "--base-port", str(base),
                "--endpoints-file", str(tmp_path / "e.yaml"), "--log-dir", str(tmp_path / "logs"),
            ],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert "fleet: sim-0 exited with code 1" in done.stdout
    # The pod's own reason, from its log, not only its exit code.
    assert "sim-0: " in done.stdout
    assert "address already in use" in done.stdout
    assert not (tmp_path / "e.yaml").exists()


def test_free_port_ranges_stay_below_the_ephemeral_ports() -> None:
    rng = random.Random(7)
    low = ephemeral_port_range()[0]
    for _ in range(20):
        base = free_port_range(30, rng)
        assert base >= 10_000
        assert base + 30 <= low
    ports = free_ports(50)
    assert len(set(ports)) == 50
    assert all(10_000 <= port < low for port in ports)


def test_a_fleet_start_that_loses_its_ports_starts_again_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken_base = free_port_range(3, random.Random())
    chosen: list[int] = []

    def first_taken_then_free(count: int, rng: random.Random) -> int:
        base = taken_base if not chosen else free_port_range(count, rng)
        chosen.append(base)
        return base

    monkeypatch.setattr("bench.stack.free_port_range", first_taken_then_free)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", taken_base))
        taken.listen()
        fleet, endpoints = start_sim_fleet(1, tmp_path, ["--time-scale", "0.01"])
    try:
        assert len(chosen) == 2
        address = yaml.safe_load(endpoints.read_text())["endpoints"][0]["address"]
        assert address == f"127.0.0.1:{chosen[1]}"
        with urllib.request.urlopen(f"http://{address}/health") as response:
            assert response.status == 200
    finally:
        fleet.stop()


def test_a_fleet_that_fails_for_another_reason_is_not_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts: list[int] = []

    def counted(count: int, rng: random.Random) -> int:
        starts.append(count)
        return free_port_range(count, rng)

    monkeypatch.setattr("bench.stack.free_port_range", counted)
    with pytest.raises(ProcessFailed, match="exited"):
        start_sim_fleet(1, tmp_path, ["--num-gpu-blocks", "-5"])
    assert starts == [3]


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


def test_no_room_below_the_ephemeral_ports_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("bench.stack.ephemeral_port_range", lambda: (10_020, 60_999))
    with pytest.raises(RuntimeError, match="no room for 30 ports"):
        free_port_range(30, random.Random())
    with pytest.raises(RuntimeError, match="ip_local_port_range"):
        free_ports(30)
    assert 10_000 <= free_port_range(5, random.Random()) <= 10_015
