"""The list + watch loop on its own (against the simulated API server, through the
official client), its backoff, and how API failures are put into words."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from epp.sources.kube.errors import Expired, KubeError, classify
from epp.sources.kube.reflector import Backoff, Collection, Reflector
from epp.sources.kube.source import load_client_configuration
from sim.kubeapi import FakeKubeApi
from tests.epp.sources.kube.conftest import FAST, LABELS


class Recorder:
    """A handler that fails on its first list, as a bug would."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    def replace(self, items: list[str]) -> None:
        self.lists.append(items)
        if len(self.lists) == 1:
            raise RuntimeError("a bug in the handler")

    def apply(self, event_type: str, item: str) -> None:
        self.events.append((event_type, item))


def name_of(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["name"])


async def test_an_unexpected_error_is_logged_and_the_reflector_starts_over(
    kube: FakeKubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put_pod("vllm-0", labels=LABELS, ip="10.0.0.1", ready=True)
    configuration = load_client_configuration(str(kube.kubeconfig(tmp_path / "kc")))
    api_client = k8s.ApiClient(configuration)
    collection = Collection(
        k8s.CoreV1Api(api_client).list_namespaced_pod,
        ("default",),
        {"label_selector": "app=vllm"},
        "pods",
        "",
        "default",
        configuration.host,
    )
    handler = Recorder()
    reasons: list[str] = []
    reflector: Reflector[str] = Reflector(
        collection, name_of, handler, FAST, on_list=reasons.append, rng=random.Random(1)
    )
    task = asyncio.create_task(reflector.run())
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while len(handler.lists) < 2 or kube.watchers("pods") < 1:
            assert asyncio.get_running_loop().time() < deadline, handler.lists
            await asyncio.sleep(0.01)
        assert "pods (app=vllm) in namespace 'default': unexpected error" in caplog.text
        assert reasons == ["initial", "error"]
        kube.put_pod("vllm-1", labels=LABELS, ip="10.0.0.2", ready=True)
        while handler.events != [("ADDED", "vllm-1")]:
            assert asyncio.get_running_loop().time() < deadline, handler.events
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        api_client.close()


def test_backoff_doubles_with_jitter_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(0.5, 4.0, random.Random(3))
    delays = [backoff.next_delay() for _ in range(6)]
    for delay, ceiling in zip(delays, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert ceiling / 2 <= delay <= ceiling
    backoff.reset()
    assert backoff.next_delay() <= 0.5


def status(code: int, message: str) -> ApiException:
    error = ApiException(status=code, reason="x")
    error.body = json.dumps({"kind": "Status", "code": code, "message": message})
    return error


@pytest.mark.parametrize(
    ("exc", "reason", "words"),
    [
        (status(403, "nope"), "forbidden", "lacks RBAC verb 'watch' on resource 'pods'"),
        (status(401, "bad token"), "unauthorized", "did not accept the credentials"),
        (status(404, "no such"), "not_found", "CustomResourceDefinition installed"),
        (status(410, "too old"), "expired", "resourceVersion expired: too old"),
        (status(500, "etcd down"), "server_error", "answered 500: etcd down"),
        (status(429, "slow down"), "server_error", "answered 429"),
        (status(418, "teapot"), "bad_response", "HTTP 418: teapot"),
        (ApiException(status=0, reason="SSLError: bad cert"), "unreachable", "SSLError"),
        (urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"), "timeout", "presumed"),
        (ConnectionRefusedError("refused"), "unreachable", "is unreachable"),
        (ValueError("not JSON"), "bad_response", "unreadable answer"),
    ],
)
def test_failures_are_put_in_words(exc: BaseException, reason: str, words: str) -> None:
    error = classify(
        exc,
        verb="watch",
        resource="pods",
        group="",
        namespace="llm",
        server="https://10.96.0.1:443",
    )
    assert isinstance(error, KubeError)
    assert error.reason == reason
    assert words in error.message
    assert "in namespace 'llm'" in error.message
    assert isinstance(error, Expired) == (reason == "expired")


def test_reflector_logs_are_quiet_on_repeats(caplog: pytest.LogCaptureFixture) -> None:
    # The same failure again and again is logged once; a different one is logged.
    caplog.set_level(logging.WARNING)
    reflector: Reflector[str] = Reflector(
        Collection(lambda: None, (), {}, "pods", "", "llm", "http://x"),
        name_of,
        Recorder(),
        FAST,
    )
    first = KubeError("unreachable", "cannot list pods: the API server is unreachable")
    for _ in range(5):
        reflector._failed("list", first)
    reflector._failed("list", KubeError("forbidden", "forbidden: cannot list pods"))
    assert caplog.text.count("is unreachable") == 1
    assert caplog.text.count("forbidden: cannot list pods") == 1
