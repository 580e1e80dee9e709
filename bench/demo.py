"""`make demo` / `python -m bench demo`: Envoy + EPP + simulated pods, requests routed.

Starts N simulated vLLM pods, `epp serve` with the example config, and Envoy in
front; sends a few OpenAI requests through Envoy and shows where each landed and
why (`/debug/explain`). Everything it starts is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from bench.stack import (
    ROOT,
    EppPorts,
    envoy_config,
    free_port,
    start_envoy,
    start_epp,
    start_sim,
    write_endpoints_file,
)

DEMO_CONFIG = ROOT / "manifests" / "config" / "round-robin.yaml"


def _request(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(out: Path, pods: int, keep_running: bool = False) -> int:
    # SIGTERM stops the demo as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as cleanup:
            print(f"starting {pods} simulated pods, the EPP and Envoy (logs in {out}/)")
            fleet = []
            for i in range(pods):
                port = free_port()
                pod = start_sim(port, out, f"sim-{i}")
                cleanup.callback(pod.stop)
                fleet.append((f"sim-{i}", f"127.0.0.1:{port}"))
            endpoints = write_endpoints_file(out / "endpoints.yaml", fleet)
            ports = EppPorts.free()
            epp = start_epp(endpoints, out, ports, DEMO_CONFIG, ["--debug-endpoints", "-v", "3"])
            cleanup.callback(epp.stop)
            listen = free_port()
            envoy = start_envoy(
                envoy_config(listen_port=listen, epp_port=ports.grpc, admin_port=free_port()), out
            )
            cleanup.callback(envoy.stop)
            url = f"http://127.0.0.1:{listen}"
            admin = f"http://127.0.0.1:{ports.metrics}"
            print(f"Envoy on {url}, EPP admin on {admin}, config {DEMO_CONFIG.relative_to(ROOT)}\n")

            body = {"model": "sim-model", "prompt": "The capital of France is", "max_tokens": 4}
            for i in range(2 * pods):
                status, headers, _ = _request(url + "/v1/completions", body)
                print(
                    f"  POST /v1/completions #{i + 1}: {status},"
                    f" served by {headers.get('x-sim-pod')}"
                )
            chat = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "Hello!"}],
                "stream": True,
            }
            status, headers, payload = _request(url + "/v1/chat/completions", chat)
            events = payload.count(b"data: ")
            print(
                f"  POST /v1/chat/completions (stream): {status}, served by"
                f" {headers.get('x-sim-pod')}, {events} SSE events passed through"
            )
            status, _, payload = _request(url + "/v1/completions", {"prompt": "no model"})
            print(f"  POST /v1/completions without a model: {status} {payload.decode()}")

            _, _, payload = _request(
                admin + "/debug/explain", {"path": "/v1/completions", "body": body}
            )
            print("\nWhat the EPP would decide for the next request (/debug/explain):")
            print("  " + json.dumps(json.loads(payload), indent=2).replace("\n", "\n  "))
            if keep_running:
                print(
                    f"\nTry it:  curl -s {url}/v1/completions"
                    " -H 'content-type: application/json' \\"
                )
                print(f"           -d '{json.dumps(body)}'")
                print("Running until Ctrl-C.")
                while True:
                    time.sleep(3600)
            print("\n(`python -m bench demo --keep-running` keeps the stack up to try it by hand)")
    except KeyboardInterrupt:
        print("\nstopped")
    print("all processes stopped")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(Path("out/demo"), 3))
