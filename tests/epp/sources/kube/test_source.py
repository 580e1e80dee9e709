"""The Kubernetes endpoint source against a simulated API server (real HTTP list
and watch), through the official client: pods and their readiness, the
InferencePool and its changes, and every failure the source must survive."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from epp.config import load_config
from epp.datastore import Endpoint
from epp.director import Director
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.sources.kube import KubeConfigError, KubeOptions
from epp.sources.kube.objects import V1ALPHA2_GROUP, KvEventPorts
from epp.sources.kube.source import load_client_configuration
from epp.telemetry import Telemetry
from sim.kubeapi import POOLS_V1, POOLS_V1ALPHA2, FakeKubeApi
from tests.epp.sources.kube.conftest import LABELS, TOKEN, StartSource

PD_CONFIG = (Path(__file__).resolve().parents[4] / "manifests/config/llm-d-pd.yaml").read_text()


def add_pods(kube: FakeKubeApi, n: int, ready: bool = True, prefix: str = "vllm") -> None:
    for i in range(n):
        kube.put_pod(
            f"{prefix}-{i}", labels={**LABELS, "zone": "a"}, ip=f"10.0.0.{i + 1}", ready=ready
        )


def watch_requests(kube: FakeKubeApi, plural: str) -> list[dict[str, str]]:
    return [r.query for r in kube.requests if r.watch and r.path.endswith("/" + plural)]


def list_requests(kube: FakeKubeApi, plural: str) -> list[dict[str, str]]:
    return [r.query for r in kube.requests if not r.watch and r.path.endswith("/" + plural)]


# ---------------------------------------------------------------------------
# Pods


async def test_pods_of_the_pool_become_endpoints(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 3)
    kube.put_pod("other", labels={"app": "web"}, ip="10.0.1.1", ready=True)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    assert run.endpoints() == {
        "vllm-0": ("10.0.0.1:8000", True),
        "vllm-1": ("10.0.0.2:8000", True),
        "vllm-2": ("10.0.0.3:8000", True),
    }
    # Labels are copied from the pod.
    endpoint = run.datastore.get("vllm-0")
    assert endpoint is not None
    assert endpoint.labels == {"app": "vllm", "zone": "a"}
    assert run.source.not_ready_reason() is None
    assert run.status_calls == 1  # synced


async def test_pods_appear_disappear_and_flap_readiness(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.ready() == {"vllm-0"})

    kube.put_pod("vllm-1", labels=LABELS, ip="10.0.0.2", ready=False)
    await run.until(lambda: "vllm-1" in run.endpoints())
    assert run.ready() == {"vllm-0"}  # known, not routable yet
    kube.update_pod("vllm-1", ready=True)
    await run.until(lambda: run.ready() == {"vllm-0", "vllm-1"})

    # A readiness flap keeps the endpoint object (its metrics, in-flight count,
    # prefix-index state); only its readiness changes.
    before = run.datastore.get("vllm-0")
    kube.update_pod("vllm-0", ready=False)
    await run.until(lambda: run.ready() == {"vllm-1"})
    kube.update_pod("vllm-0", ready=True)
    await run.until(lambda: run.ready() == {"vllm-0", "vllm-1"})
    assert run.datastore.get("vllm-0") is before

    kube.delete_pod("vllm-1")
    await run.until(lambda: set(run.endpoints()) == {"vllm-0"})
    # A pod that stops matching the selector leaves too.
    kube.update_pod("vllm-0", labels={"app": "other"})
    await run.until(lambda: run.endpoints() == {})
    assert run.datastore.synced  # an empty pool is still a known pool
    assert run.metric("epp_kubernetes_watch_events_total", resource="pods", type="DELETED") == 2


async def test_terminating_pods_leave_and_pods_without_ip_are_skipped(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 2)
    kube.put_pod("pending", labels=LABELS, ip=None, ready=False)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    assert set(run.endpoints()) == {"vllm-0", "vllm-1"}

    # Still Ready, but being deleted: it will not serve again.
    kube.update_pod("vllm-0", terminating=True)
    await run.until(lambda: set(run.endpoints()) == {"vllm-1"})
    kube.update_pod("pending", ip="10.0.0.9", ready=True)
    await run.until(lambda: run.ready() == {"vllm-1", "pending"})
    assert run.endpoints()["pending"] == ("10.0.0.9:8000", True)


async def test_several_target_ports_give_ranks_with_their_kv_event_ports(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000, 8001])
    run = await start_source(pool_name="pool", kv_events=KvEventPorts(port=5557, replay_port=5600))
    await run.until(lambda: run.datastore.synced)
    ranks: dict[str, Endpoint] = {e.name: e for e in run.datastore.all_endpoints()}
    sockets = {n: (e.address, e.spec.kv_events, e.spec.kv_events_replay) for n, e in ranks.items()}
    assert sockets == {
        "vllm-0-rank-0": ("10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600"),
        "vllm-0-rank-1": ("10.0.0.1:8001", "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601"),
    }


async def test_pods_with_odd_ports_are_reported_and_keep_what_is_usable(
    kube: FakeKubeApi, start_source: StartSource, caplog: pytest.LogCaptureFixture
) -> None:
    annotation = "inference.networking.k8s.io/active-ports"
    kube.put_pod("good", labels=LABELS, ip="10.0.0.1", ready=True, container_ports=[8000, 8001])
    # Names a port the pool does not target: that part is ignored.
    kube.put_pod(
        "extra", labels=LABELS, ip="10.0.0.2", ready=True, annotations={annotation: "8001,9999"}
    )
    # Names only ports the pool does not target: no endpoint at all.
    kube.put_pod("none", labels=LABELS, ip="10.0.0.3", ready=True, annotations={annotation: "9999"})
    # Not a list of ports: ignored, every target port is served.
    kube.put_pod("garbled", labels=LABELS, ip="10.0.0.4", ready=True, annotations={annotation: "x"})
    # Declares other container ports than the pool targets: routed, with a warning.
    kube.put_pod("undeclared", labels=LABELS, ip="10.0.0.5", ready=True, container_ports=[7000])
    kube.put_pool("pool", selector=LABELS, ports=[8000, 8001])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    assert sorted(run.ready()) == [
        "extra-rank-1",
        "garbled-rank-0",
        "garbled-rank-1",
        "good-rank-0",
        "good-rank-1",
        "undeclared-rank-0",
        "undeclared-rank-1",
    ]
    # At most three pods are named one by one; the rest are counted.
    assert "names port(s) 9999 that the pool does not target (8000, 8001); ignored" in caplog.text
    assert "1 more pods have port problems like these" in caplog.text
    caplog.clear()
    kube.update_pod("undeclared", ready=False)  # same problem: not logged again
    await run.until(lambda: "undeclared-rank-0" not in run.ready())
    assert "undeclared" not in caplog.text
    kube.update_pod("none", annotations={annotation: "8000"})  # fixed
    await run.until(lambda: "none-rank-0" in run.ready())
    assert "pod none" not in caplog.text
    kube.update_pod("good", container_ports=[8000])
    await run.until(lambda: "pod good: target port(s) 8001 not among" in caplog.text)
    assert run.ready() >= {"good-rank-0", "good-rank-1"}  # still routed
    assert run.metric("epp_kubernetes_pods", state="ready") == 4
    assert run.metric("epp_kubernetes_pods", state="not_ready") == 1


async def test_rapid_readiness_flaps_end_in_the_last_state_with_the_same_endpoint(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 2)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.ready() == {"vllm-0", "vllm-1"})
    endpoint = run.datastore.get("vllm-0")
    assert endpoint is not None
    run.datastore.acquire(endpoint)  # a request in flight there
    changes: list[tuple[int, int]] = []
    run.datastore.add_listener(lambda added, removed: changes.append((len(added), len(removed))))
    # 41 changes in a burst, faster than the source applies them one by one.
    for i in range(41):
        kube.update_pod("vllm-0", ready=i % 2 == 1)
    await run.until(
        lambda: (
            run.metric("epp_kubernetes_watch_events_total", resource="pods", type="MODIFIED") == 41
        )
    )
    await run.until(lambda: run.ready() == {"vllm-1"})  # the last change: not Ready
    assert run.datastore.get("vllm-0") is endpoint
    assert endpoint.in_flight == 1  # nothing was lost with the flaps
    assert changes == []  # the membership never changed, only readiness
    kube.update_pod("vllm-0", ready=True)
    await run.until(lambda: run.ready() == {"vllm-0", "vllm-1"})


async def test_standalone_selector_and_ports(kube: FakeKubeApi, start_source: StartSource) -> None:
    add_pods(kube, 2)
    run = await start_source(endpoint_selector=LABELS, endpoint_target_ports=(8000,))
    await run.until(lambda: run.ready() == {"vllm-0", "vllm-1"})
    # No InferencePool is ever asked for.
    assert not [r for r in kube.requests if "inferencepools" in r.path]


# ---------------------------------------------------------------------------
# The InferencePool


async def test_a_selector_change_retargets_without_emptying_the_pool(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 2)
    for i in range(3):
        kube.put_pod(f"sglang-{i}", labels={"app": "sglang"}, ip=f"10.0.2.{i + 1}", ready=True)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    sizes: list[int] = []
    run.datastore.add_listener(lambda a, r: sizes.append(len(run.datastore.ready_endpoints())))

    kube.put_pool("pool", selector={"app": "sglang"}, ports=[8000])
    await run.until(lambda: run.ready() == {"sglang-0", "sglang-1", "sglang-2"})
    assert 0 not in sizes  # the old pods served until the new list replaced them
    assert run.metric("epp_kubernetes_lists_total", resource="pods", reason="selector") == 1
    assert list_requests(kube, "pods")[-1]["labelSelector"] == "app=sglang"
    # The new watch follows the new selector.
    kube.update_pod("sglang-0", ready=False)
    await run.until(lambda: run.ready() == {"sglang-1", "sglang-2"})
    kube.delete_pod("vllm-0")  # no longer of the pool: nothing changes
    kube.update_pod("sglang-0", ready=True)
    await run.until(lambda: run.ready() == {"sglang-0", "sglang-1", "sglang-2"})


async def test_a_port_change_rebuilds_the_endpoints_without_a_relist(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 2)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    lists = len(list_requests(kube, "pods"))

    kube.put_pool("pool", selector=LABELS, ports=[9000, 9001])
    await run.until(lambda: len(run.endpoints()) == 4)
    assert run.endpoints()["vllm-1-rank-1"] == ("10.0.0.2:9001", True)
    assert len(list_requests(kube, "pods")) == lists


async def test_v1alpha2_pool(kube: FakeKubeApi, start_source: StartSource) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000], kind=POOLS_V1ALPHA2)
    run = await start_source(pool_name="pool", pool_group=V1ALPHA2_GROUP)
    await run.until(lambda: run.ready() == {"vllm-0"})
    assert list_requests(kube, "inferencepools")[0]["fieldSelector"] == "metadata.name=pool"
    assert any("/inference.networking.x-k8s.io/v1alpha2/" in r.path for r in kube.requests)


async def test_a_deleted_pool_empties_the_datastore_until_it_comes_back(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 2)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)

    kube.delete(POOLS_V1, "default", "pool")
    await run.until(lambda: not run.datastore.synced)
    assert run.endpoints() == {}
    reason = run.source.not_ready_reason()
    assert reason is not None
    assert "default/pool was deleted" in reason
    assert run.status_calls == 2  # synced, then not

    kube.put_pool("pool", selector=LABELS, ports=[8000])
    await run.until(lambda: run.ready() == {"vllm-0", "vllm-1"})
    assert run.source.not_ready_reason() is None


async def test_a_missing_pool_is_waited_for(kube: FakeKubeApi, start_source: StartSource) -> None:
    add_pods(kube, 1)
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.source.statuses()["inferencepools"].synced)
    reason = run.source.not_ready_reason()
    assert reason is not None
    assert "InferencePool default/pool not found" in reason
    assert not run.datastore.synced
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    await run.until(lambda: run.ready() == {"vllm-0"})


async def test_an_invalid_pool_edit_keeps_the_last_valid_spec(
    kube: FakeKubeApi, start_source: StartSource, caplog: pytest.LogCaptureFixture
) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    bad = kube.get(POOLS_V1, "default", "pool")
    assert bad is not None
    bad["spec"]["targetPorts"] = []
    kube.write(POOLS_V1, bad)
    await run.until(lambda: "is invalid" in caplog.text)
    assert "no target port" in caplog.text
    assert run.ready() == {"vllm-0"}


# ---------------------------------------------------------------------------
# The watch protocol


async def test_watches_ask_for_bookmarks_with_a_timeout_and_resume_from_the_last_rv(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    listed_rv = int(kube.rv)
    # The watch starts right after the list that synced the source.
    await run.until(lambda: len(watch_requests(kube, "pods")) == 1, what="the pod watch")
    (first,) = watch_requests(kube, "pods")
    assert first["allowWatchBookmarks"] == "true"
    assert first["labelSelector"] == "app=vllm"
    assert first["resourceVersion"] == str(listed_rv)
    assert 1 <= int(first["timeoutSeconds"]) < 2  # [T, 2T) with T = 1 s

    # Pods change (the global rv moves on); the pool's quiet watch learns the new rv
    # from bookmarks, and its next watch (after the server ends this one) starts there.
    add_pods(kube, 3, prefix="more")
    await run.until(lambda: len(watch_requests(kube, "inferencepools")) >= 2, timeout_s=5)
    resumed = watch_requests(kube, "inferencepools")[-1]
    assert int(resumed["resourceVersion"]) >= listed_rv + 3
    # No list was needed for any of it.
    assert len(list_requests(kube, "pods")) == 1
    assert len(list_requests(kube, "inferencepools")) == 1


async def test_a_dropped_watch_resumes_from_the_last_rv_without_a_relist(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 2)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    kube.update_pod("vllm-0", ready=False)
    await run.until(lambda: run.ready() == {"vllm-1"})
    seen_rv = kube.rv
    watches = len(watch_requests(kube, "pods"))

    kube.drop_watches()
    kube.update_pod("vllm-1", ready=False)  # while nobody watches
    await run.until(lambda: run.ready() == set())
    resumed = watch_requests(kube, "pods")[watches]
    assert resumed["resourceVersion"] == str(seen_rv)
    assert len(list_requests(kube, "pods")) == 1
    assert (
        run.metric(
            "epp_kubernetes_errors_total", resource="pods", operation="watch", reason="unreachable"
        )
        >= 1
    )


async def test_410_gone_relists(
    kube: FakeKubeApi, start_source: StartSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epp.sources.kube")
    add_pods(kube, 3)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)

    # The watch breaks, a pod goes while nobody watches, and the server forgets
    # the history: resuming from the old rv gets 410 Gone, and only a fresh list
    # can show the deletion.
    kube.drop_watches()
    kube.delete_pod("vllm-1")
    kube.compact()
    await run.until(lambda: set(run.endpoints()) == {"vllm-0", "vllm-2"})
    assert run.metric("epp_kubernetes_lists_total", resource="pods", reason="expired") == 1
    assert "too old resource version" in caplog.text
    assert len(list_requests(kube, "pods")) == 2
    # Watching goes on from the new list.
    kube.update_pod("vllm-2", ready=False)
    await run.until(lambda: run.ready() == {"vllm-0"})


async def test_a_dead_watch_is_noticed_by_the_read_timeout(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    add_pods(kube, 1)
    run = await start_source(endpoint_selector=LABELS, endpoint_target_ports=(8000,))
    await run.until(lambda: run.datastore.synced)
    # The next watch gets its headers and then silence, without the server ever
    # ending it (a dead path): only the client's read timeout can notice.
    kube.stall_watches()
    kube.drop_watches()
    kube.update_pod("vllm-0", ready=False)

    def timed_out() -> bool:
        return (
            run.metric(
                "epp_kubernetes_errors_total", resource="pods", operation="watch", reason="timeout"
            )
            >= 1
        )

    # timeoutSeconds (1-2 s) + read grace (0.5 s).
    await run.until(timed_out, timeout_s=6, what="a read timeout")
    kube.stall_watches(False)
    await run.until(lambda: run.ready() == set())


# ---------------------------------------------------------------------------
# Failures


async def test_unreachable_api_at_start_is_retried_and_reported(
    tmp_path: Path, start_source: StartSource
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = FakeKubeApi(token=TOKEN)
    api.port = port  # the kubeconfig's address, before anything listens there
    kubeconfig = api.kubeconfig(tmp_path / "kc")
    api.put_pool("pool", selector=LABELS, ports=[8000])
    add_pods(api, 1)
    run = await start_source(pool_name="pool", kubeconfig=str(kubeconfig))
    await run.until(lambda: run.source.statuses()["inferencepools"].error is not None)
    reason = run.source.not_ready_reason()
    assert reason is not None
    assert f"the API server at http://127.0.0.1:{port} is unreachable" in reason
    assert "retrying in" in reason
    await run.until(
        lambda: (
            run.metric(
                "epp_kubernetes_errors_total",
                resource="inferencepools",
                operation="list",
                reason="unreachable",
            )
            >= 2
        ),
        what="retries",
    )
    assert not run.datastore.synced

    await api.start(port=port)
    try:
        await run.until(lambda: run.ready() == {"vllm-0"})
        assert run.source.not_ready_reason() is None
    finally:
        await run.stop()
        await api.stop()


async def test_rbac_forbidden_names_the_missing_verb_and_resource(
    kube: FakeKubeApi, start_source: StartSource, caplog: pytest.LogCaptureFixture
) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    kube.forbid("list", "pods")
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.source.statuses().get("pods") is not None)
    await run.until(lambda: run.source.statuses()["pods"].error is not None)
    reason = run.source.not_ready_reason()
    assert reason is not None
    assert "forbidden: cannot list pods in namespace 'default'" in reason
    assert "lacks RBAC verb 'list' on resource 'pods' of the core API group" in reason
    assert 'cannot list resource \\"pods\\"' in reason or 'cannot list resource "pods"' in reason
    assert "lacks RBAC verb 'list' on resource 'pods'" in caplog.text

    # Granted: it recovers by itself.
    kube.allow("list", "pods")
    await run.until(lambda: run.ready() == {"vllm-0"})


async def test_rbac_forbidden_watch_and_pool(
    kube: FakeKubeApi, start_source: StartSource, caplog: pytest.LogCaptureFixture
) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    kube.forbid("list", "inferencepools")
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.source.statuses()["inferencepools"].error is not None)
    reason = run.source.not_ready_reason()
    assert reason is not None
    assert (
        "lacks RBAC verb 'list' on resource 'inferencepools' of API group"
        ' "inference.networking.k8s.io"' in reason
    )
    kube.allow("list", "inferencepools")
    kube.forbid("watch", "pods")
    await run.until(lambda: run.datastore.synced)  # the list is allowed
    await run.until(lambda: "lacks RBAC verb 'watch' on resource 'pods'" in caplog.text)
    assert (
        run.metric(
            "epp_kubernetes_errors_total", resource="pods", operation="watch", reason="forbidden"
        )
        >= 1
    )


async def test_bad_credentials_and_a_missing_crd(
    kube: FakeKubeApi, start_source: StartSource, tmp_path: Path
) -> None:
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    real_token = kube.token
    kube.token = "another"
    kubeconfig = kube.kubeconfig(tmp_path / "wrong")
    kube.token = real_token
    run = await start_source(pool_name="pool", kubeconfig=str(kubeconfig))
    await run.until(lambda: run.source.statuses()["inferencepools"].error is not None)
    assert "unauthorized" in (run.source.not_ready_reason() or "")

    kube.crds.discard(POOLS_V1)
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.source.statuses()["inferencepools"].error is not None)
    reason = run.source.not_ready_reason() or ""
    assert "not found: cannot list inferencepools" in reason
    assert "CustomResourceDefinition" in reason


async def test_shutdown_ends_the_watches(kube: FakeKubeApi, start_source: StartSource) -> None:
    add_pods(kube, 1)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.datastore.synced)
    await run.until(lambda: kube.watchers() == 2, what="both watches")
    await run.stop()
    assert run.source.statuses()["inferencepools"].state.value == "stopped"
    await run.until(lambda: kube.watchers() == 0, what="the server to see the watches end")


# ---------------------------------------------------------------------------
# Options and client configuration


def test_options_are_checked() -> None:
    assert KubeOptions(pool_name="p").check() == []
    assert KubeOptions(endpoint_selector=LABELS, endpoint_target_ports=(8000,)).check() == []
    both = KubeOptions(pool_name="p", endpoint_selector=LABELS).check()
    assert "exclusive" in both[0]
    missing = KubeOptions(endpoint_selector=LABELS).check()
    assert missing == ["standalone Kubernetes mode needs --endpoint-target-ports PORT"]
    replay_only = KubeOptions(pool_name="p", kv_events=KvEventPorts(replay_port=5558)).check()
    assert replay_only == ["--kv-events-replay-port needs --kv-events-port"]
    assert "--pool-group" in KubeOptions(pool_name="p", pool_group="x.io").check()[0]


def test_in_cluster_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.config import incluster_config

    token = tmp_path / "token"
    token.write_text("in-cluster-token")
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    configuration = load_client_configuration()
    assert configuration.host == "https://10.96.0.1:443"
    token_header = configuration.auth_settings()["BearerToken"]["value"]
    assert token_header.lower() == "bearer in-cluster-token"
    # The projected token rotates: the client re-reads it.
    assert configuration.refresh_api_key_hook is not None
    assert configuration.ssl_ca_cert == str(ca)
    # Keepalive on, the client's own retries off (the reflector retries).
    assert configuration.retries is False
    assert any(opt[1] == socket.SO_KEEPALIVE for opt in configuration.socket_options)


def test_kubeconfig_from_the_environment(
    kube: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = kube.kubeconfig(tmp_path / "kc")
    monkeypatch.setenv("KUBECONFIG", str(path))
    configuration = load_client_configuration()
    assert configuration.host == kube.url
    # An explicit --kubeconfig wins over the environment.
    other = tmp_path / "other"
    other.write_text(path.read_text().replace(kube.url, "http://127.0.0.1:1"))
    assert load_client_configuration(str(other)).host == "http://127.0.0.1:1"


def test_no_configuration_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nowhere"))
    with pytest.raises(KubeConfigError, match="give --kubeconfig FILE or set KUBECONFIG"):
        load_client_configuration()
    broken = tmp_path / "broken"
    broken.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(KubeConfigError, match="cannot configure the Kubernetes client"):
        load_client_configuration(str(broken))


async def test_pod_roles_reach_the_pd_profiles_through_the_watcher(
    kube: FakeKubeApi, start_source: StartSource
) -> None:
    """Prefill/decode roles come from the pods' `llm-d.ai/role` labels as the watcher
    sees them: a role changed on a live pod changes where llm-d's P/D config sends
    requests, with no restart."""
    role = "llm-d.ai/role"
    kube.put_pod("decode-0", labels={**LABELS, role: "decode"}, ip="10.0.0.1", ready=True)
    kube.put_pod("prefill-0", labels={**LABELS, role: "prefill"}, ip="10.0.0.2", ready=True)
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    run = await start_source(pool_name="pool")
    await run.until(lambda: run.ready() == {"decode-0", "prefill-0"})
    config = load_config(PD_CONFIG, PluginRegistry.from_entry_points(), datastore=run.datastore)
    director = Director(run.datastore, config, Telemetry(run.datastore))

    async def pick(prompt: str) -> tuple[str, dict[str, str]]:
        request = parse_request(
            request_id="r",
            method="POST",
            path="/v1/completions",
            headers={},
            body=b'{"model": "m", "prompt": "%s"}' % prompt.encode(),
        )
        decision = await director.pick_endpoint(request)
        director.finish(decision, ResponseInfo(completed=True))
        return decision.endpoint.name, dict(decision.result.request_headers)

    assert await pick("a long uncached document " * 40) == (
        "decode-0",
        {"x-prefiller-host-port": "10.0.0.2:8000"},
    )
    # The prefill pod becomes a decode pod: no prefill pod is left, so a new long
    # prompt runs whole on one of the two decode pods.
    kube.update_pod("prefill-0", labels={**LABELS, role: "decode"})
    await run.until(
        lambda: (e := run.datastore.get("prefill-0")) is not None and e.labels[role] == "decode"
    )
    name, headers = await pick("another long uncached document " * 40)
    assert headers == {}
    assert name in {"decode-0", "prefill-0"}
