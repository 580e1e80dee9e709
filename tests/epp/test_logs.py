"""Structured logs from a real `epp serve` process: JSON lines carrying the
request's x-request-id, and prompts only when --log-prompts says so."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from bench.stack import start_epp_on_free_ports, write_endpoints_file
from tests.epp.extproc import envoy_client as ec

PROMPT = "a prompt that must stay private"


async def run_one_request(tmp_path: Path, *extra_args: str) -> list[str]:
    """Route one request and one bad request through a real EPP process; its log."""
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("pod-a", "10.0.0.1:8000")])
    epp, ports = start_epp_on_free_ports(endpoints, tmp_path, extra_args=extra_args)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
            routed = await ec.route(ec.EnvoyStream(channel), body, request_id="req-42")
            assert routed.destination == "10.0.0.1:8000"
            bad = await ec.send_request(ec.EnvoyStream(channel), b"{", request_id="req-43")
            assert bad.status == 400
    finally:
        epp.stop()
    return epp.log_path.read_text().splitlines()


async def test_json_lines_carry_the_request_id(tmp_path: Path) -> None:
    lines = await run_one_request(tmp_path, "--log-format", "json", "-v", "3")
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    routed = [e for e in entries if e["msg"] == "routed"]
    assert len(routed) == 1
    assert routed[0]["request_id"] == "req-42"
    assert routed[0]["endpoint"] == "pod-a"
    rejected = [e for e in entries if e.get("request_id") == "req-43"]
    assert rejected
    assert rejected[0]["level"] == "info"
    assert "400" in rejected[0]["msg"]
    assert not any(PROMPT in line for line in lines)


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_prompts_appear_only_with_log_prompts(tmp_path: Path, log_format: str) -> None:
    lines = await run_one_request(tmp_path, "--log-format", log_format, "-v", "3", "--log-prompts")
    assert any(PROMPT in line and "req-42" in line for line in lines)


async def test_default_verbosity_logs_no_per_request_lines(tmp_path: Path) -> None:
    lines = await run_one_request(tmp_path)
    assert not any("routed" in line for line in lines)
    assert any("serving" in line for line in lines)
