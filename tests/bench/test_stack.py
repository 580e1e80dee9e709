"""bench.stack: starting an EPP on ports another process may take first."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from bench import stack
from bench.stack import EppPorts, ProcessFailed, start_epp_on_free_ports, write_endpoints_file


def test_an_epp_whose_port_was_taken_is_started_again_on_other_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("pod-a", "127.0.0.1:1")])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # The first pick meets a port taken since it was found free.
        picks = iter([EppPorts(*stack.free_ports(2), taken), EppPorts.free()])
        monkeypatch.setattr(EppPorts, "free", classmethod(lambda cls: next(picks)))
        epp, ports = start_epp_on_free_ports(endpoints, tmp_path)
        try:
            assert ports.metrics != taken
            with urllib.request.urlopen(f"http://127.0.0.1:{ports.metrics}/readyz") as answer:
                assert answer.status == 200
        finally:
            epp.stop()


def test_an_epp_that_fails_for_another_reason_is_not_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    picked: list[EppPorts] = []
    real_free = EppPorts.free

    def counted(cls: type[EppPorts]) -> EppPorts:
        picked.append(real_free())
        return picked[-1]

    monkeypatch.setattr(EppPorts, "free", classmethod(counted))
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ProcessFailed, match=r"missing\.yaml"):
        start_epp_on_free_ports(missing, tmp_path)
    assert len(picked) == 1
