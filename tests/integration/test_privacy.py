"""Prompts never leave the EPP: not in its logs (at the highest verbosity), not on
/metrics, not in /debug/endpoints, /debug/explain or /debug/memory output, unless --log-prompts
is given; /debug/* do not exist without --debug-endpoints; and every metric label
value comes from a bounded set (the config, the pool, fixed vocabularies), never
from a request.

Real processes: `epp serve` behind a real Envoy, varied requests (models, salts,
paths, headers, errors, streaming) carrying a distinctive prompt string."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.listeners import SecurityStack, security_stack

PROMPT_MARKER = "Kx7-confidential-prompt"
MODEL_MARKER = "Kx7-model"
MAX_BODY = 64 * 1024
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: prefix-cache-scorer
  parameters: {autoTune: false}
- type: active-request-scorer
- type: session-affinity-scorer
- type: max-score-picker
inferenceObjectives:
- {name: interactive, priority: 5}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - {pluginRef: prefix-cache-scorer, weight: 2}
  - {pluginRef: active-request-scorer, weight: 1}
  - {pluginRef: session-affinity-scorer, weight: 1}
  - pluginRef: max-score-picker
"""
COMMON = ["--max-body-bytes", str(MAX_BODY), "--debug-endpoints"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecurityStack]:
    with security_stack(
        tmp_path_factory.mktemp("privacy"),
        {
            # The highest verbosity there is: library loggers at debug too (-v 5+).
            "verbose": [*COMMON, "-v", "10"],
            # ... and tracing its memory: /debug/memory names source lines, never data.
            "verbose-json": [*COMMON, "-v", "10", "--log-format", "json", "--trace-memory", "4"],
            "log-prompts": [*COMMON, "-v", "3", "--log-prompts"],
            "no-debug": ["-v", "10"],
        },
        [
            ("verbose", "verbose", None, False),
            ("verbose-json", "verbose-json", None, False),
            ("log-prompts", "log-prompts", None, False),
        ],
        config_text=CONFIG,
    ) as running:
        yield running


def varied_requests(round_: int) -> list[tuple[str, str, dict[str, str], bytes]]:
    """(method, path, headers, body): every API, errors, control headers, fresh
    request-derived values (models, salts, ids, sessions) each round."""
    tag = f"{round_}-{uuid.uuid4().hex[:8]}"
    model = f"{MODEL_MARKER}-{tag}"
    prompt = f"{PROMPT_MARKER} {tag}: summarise the attached contract."
    salt = f"tenant-{tag}"

    def body(document: Any) -> bytes:
        return json.dumps(document).encode()

    headers = {
        "content-type": "application/json",
        "x-request-id": f"req-{tag}",
        "x-session-id": f"session-{tag}",
        "x-gateway-inference-fairness-id": f"fair-{tag}",
    }
    return [
        ("POST", "/v1/completions", headers, body({"model": model, "prompt": prompt})),
        (
            "POST",
            "/v1/chat/completions",
            {**headers, "x-gateway-inference-objective": "interactive"},
            body(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "cache_salt": salt,
                    "stream": True,
                    "max_tokens": 2,
                }
            ),
        ),
        (
            "POST",
            "/v1/responses",
            {**headers, "x-gateway-model-name-rewrite": f"{model}-rewritten"},
            body({"model": model, "input": prompt, "instructions": prompt}),
        ),
        ("POST", "/v1/embeddings", headers, body({"model": model, "input": [prompt, prompt]})),
        ("GET", f"/v1/models?q={tag}", {"x-request-id": f"get-{tag}"}, b""),
        ("POST", f"/custom/{tag}", headers, body({"model": model, "prompt": prompt})),
        # Refused: bad JSON, a missing model, over the body limit, nowhere to go.
        ("POST", "/v1/completions", headers, f'{{"model": "{model}", "prompt": "{prompt}'.encode()),
        ("POST", "/v1/completions", headers, body({"prompt": prompt})),
        (
            "POST",
            "/v1/completions",
            headers,
            body({"model": model, "prompt": prompt + " " + "x" * MAX_BODY}),
        ),
        (
            "POST",
            "/v1/completions",
            {**headers, "test-epp-endpoint-selection": "192.0.2.7:1"},
            body({"model": model, "prompt": prompt}),
        ),
    ]


async def send_all(stack: SecurityStack, route: str, round_: int) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as session:
        for method, path, headers, data in varied_requests(round_):
            async with session.request(
                method, stack.url(route) + path, headers=headers, data=data
            ) as response:
                await response.read()
                statuses.append(response.status)
    return statuses


async def fetch(url: str, method: str = "GET", payload: Any = None) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=payload) as response,
    ):
        return response.status, await response.text()


def epp_log(stack: SecurityStack, epp: str) -> str:
    return Path(stack.workdir / epp / "epp.log").read_text(errors="replace")


def series(metrics_text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
    }


@pytest.mark.parametrize("epp", ["verbose", "verbose-json"])
async def test_prompts_reach_no_log_metric_or_debug_output(stack: SecurityStack, epp: str) -> None:
    statuses = await send_all(stack, epp, 1)
    # Every kind of outcome happened: routed, 400, 413 and 429.
    assert {200, 400, 413, 429} <= set(statuses), statuses

    admin = stack.admin_url(epp)
    _, endpoints = await fetch(f"{admin}/debug/endpoints")
    explain_ok = await fetch(
        f"{admin}/debug/explain",
        "POST",
        {"path": "/v1/completions", "body": {"model": "m", "prompt": PROMPT_MARKER}},
    )
    explain_bad = await fetch(
        f"{admin}/debug/explain",
        "POST",
        {"path": "/v1/chat/completions", "body": {"model": "m", "messages": PROMPT_MARKER}},
    )
    explain_raw = await fetch(
        f"{admin}/debug/explain",
        "POST",
        {"path": "/v1/completions", "body": f'{{"model": "m", "prompt": "{PROMPT_MARKER}'},
    )
    assert explain_ok[0] == 200
    assert explain_bad[0] == explain_raw[0] == 400
    _, metrics = await fetch(f"{admin}/metrics")
    memory_status, memory = await fetch(f"{admin}/debug/memory?sites=500")
    assert memory_status == 200
    if epp == "verbose-json":
        assert '"site"' in memory  # traced: the lines are there to look at
    log = epp_log(stack, epp)
    # The log really is at its most verbose: per-request lines and debug lines.
    assert "routed" in log
    assert "DEBUG" in log or '"level": "debug"' in log

    for where, text in {
        "log": log,
        "/metrics": metrics,
        "/debug/endpoints": endpoints,
        "/debug/explain": explain_ok[1],
        "/debug/explain (bad request)": explain_bad[1],
        "/debug/explain (bad JSON)": explain_raw[1],
        "/debug/memory": memory,
    }.items():
        assert PROMPT_MARKER not in text, f"the prompt leaked into {where}"
    assert MODEL_MARKER not in metrics, "a request's model became a metric label"


async def test_metric_labels_come_from_a_bounded_set(stack: SecurityStack) -> None:
    """The same traffic with fresh request-derived values (models, salts, request
    and session ids, paths) adds no series: no label value comes from a request."""
    admin = stack.admin_url("verbose")
    await send_all(stack, "verbose", 2)
    _, first = await fetch(f"{admin}/metrics")
    await send_all(stack, "verbose", 3)
    _, second = await fetch(f"{admin}/metrics")
    assert series(second) == series(first)
    values = {value for _, labels in series(second) for _, value in labels}
    sent = {
        value
        for round_ in (2, 3)
        for _, path, headers, _ in varied_requests(round_)
        for value in (path, *headers.values())
    }
    assert not values & sent
    assert not [v for v in values if MODEL_MARKER in v or PROMPT_MARKER in v or "req-" in v]


async def test_log_prompts_is_the_only_way_prompts_reach_the_log(stack: SecurityStack) -> None:
    statuses = await send_all(stack, "log-prompts", 4)
    assert 200 in statuses
    assert PROMPT_MARKER in epp_log(stack, "log-prompts")
    # ... and even then, never on /metrics or in /debug output.
    _, metrics = await fetch(f"{stack.admin_url('log-prompts')}/metrics")
    assert PROMPT_MARKER not in metrics


async def test_debug_endpoints_are_off_by_default(stack: SecurityStack) -> None:
    admin = stack.admin_url("no-debug")
    assert (await fetch(f"{admin}/debug/endpoints"))[0] == 404
    explain = {"path": "/v1/completions", "body": {"model": "m", "prompt": "x"}}
    assert (await fetch(f"{admin}/debug/explain", "POST", explain))[0] == 404
    assert (await fetch(f"{admin}/debug/explain"))[0] == 404
    assert (await fetch(f"{admin}/debug/memory"))[0] == 404
    # The rest of the admin port is there.
    assert (await fetch(f"{admin}/metrics"))[0] == 200
    assert (await fetch(f"{admin}/healthz"))[0] == 200
