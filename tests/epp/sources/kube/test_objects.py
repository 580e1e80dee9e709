"""InferencePool and pod objects: what the Kubernetes source takes from them."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datastore import EndpointSpec
from epp.sources.kube.objects import (
    InvalidPool,
    KvEventPorts,
    PodInfo,
    host_port,
    parse_pool,
    parse_ports_flag,
    parse_selector_flag,
    pod_endpoints,
    pod_info,
    port_problem,
)


def v1_pool(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "vllm"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
    }
    base.update(spec)
    return {"metadata": {"name": "pool"}, "spec": base}


def test_v1_pool() -> None:
    pool = parse_pool(v1_pool(targetPorts=[{"number": 8000}, {"number": 8001}]))
    assert pool.selector == (("app", "vllm"),)
    assert pool.target_ports == (8000, 8001)
    assert pool.label_selector == "app=vllm"
    assert pool.picker_ref == "epp:9002"
    assert pool.failure_mode == "FailOpen"


def test_v1alpha2_pool_field_names() -> None:
    pool = parse_pool(
        {
            "spec": {
                "selector": {"app": "vllm", "tier": "gpu"},
                "targetPortNumber": 8000,
                "extensionRef": {"name": "epp", "portNumber": 9002, "failureMode": "FailClose"},
            }
        }
    )
    assert pool.selector == (("app", "vllm"), ("tier", "gpu"))
    assert pool.target_ports == (8000,)
    assert pool.picker_ref == "epp:9002"
    assert pool.failure_mode == "FailClose"


def test_the_selector_is_order_independent() -> None:
    a = parse_pool(v1_pool(selector={"matchLabels": {"a": "1", "b": "2"}}))
    b = parse_pool(v1_pool(selector={"matchLabels": {"b": "2", "a": "1"}}))
    assert a == b


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"selector": {"matchLabels": {}}}, "selector is empty"),
        ({"selector": {"matchLabels": {"bad key!": "x"}}}, "not a valid label key"),
        ({"selector": {"matchLabels": {"app": "bad value!"}}}, "not a valid label value"),
        (
            {"selector": {"matchLabels": {"a": "b"}, "matchExpressions": [{"key": "x"}]}},
            "matchExpressions",
        ),
        ({"targetPorts": []}, "no target port"),
        ({"targetPorts": [{"number": 0}]}, "not a port number"),
        ({"targetPorts": [{"number": 8000}, {"number": 8000}]}, "listed twice"),
        ({"targetPorts": [{"number": 8000 + i} for i in range(9)]}, "at most 8"),
        ({"targetPorts": "8000"}, "must be a list"),
    ],
)
def test_invalid_pools(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidPool, match=message):
        parse_pool(v1_pool(**spec))


def test_a_pool_without_ports_is_invalid() -> None:
    with pytest.raises(InvalidPool, match="targetPorts"):
        parse_pool({"spec": {"selector": {"matchLabels": {"a": "b"}}}})


def test_selector_and_ports_flags() -> None:
    assert parse_selector_flag("app=vllm, tier==gpu") == {"app": "vllm", "tier": "gpu"}
    assert parse_selector_flag("example.com/role=decode") == {"example.com/role": "decode"}
    assert parse_ports_flag("8000,8001") == (8000, 8001)
    for bad in ("app", "=x", "", "app=a b"):
        with pytest.raises(ValueError, match=r"key=value|empty|not a valid"):
            parse_selector_flag(bad)
    for bad in ("x", "0", "8000,8000", ""):
        with pytest.raises(ValueError, match=r"ports|port"):
            parse_ports_flag(bad)


def pod(**overrides: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": "vllm-0", "labels": {"app": "vllm", "zone": "a"}},
        "status": {
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        obj[section][field] = value
    return obj


def test_pod_info() -> None:
    info = pod_info(pod())
    assert info == PodInfo("vllm-0", "10.0.0.7", True, False, {"app": "vllm", "zone": "a"})
    assert not pod_info(pod(status__conditions=[{"type": "Ready", "status": "False"}])).ready
    assert not pod_info(pod(status__conditions=[])).ready
    assert pod_info(pod(metadata__deletionTimestamp="2026-01-01T00:00:00Z")).terminating
    assert pod_info(pod(status__podIP="")).ip is None


def test_one_endpoint_per_port_named_by_rank_with_kv_ports() -> None:
    specs, ready = pod_endpoints(
        pod_info(pod()), (8000, 8001), KvEventPorts(port=5557, replay_port=5600)
    )
    assert ready
    assert specs == [
        EndpointSpec(
            "vllm-0-rank-0",
            "10.0.0.7:8000",
            kv_events="tcp://10.0.0.7:5557",
            kv_events_replay="tcp://10.0.0.7:5600",
            labels={"app": "vllm", "zone": "a"},
        ),
        EndpointSpec(
            "vllm-0-rank-1",
            "10.0.0.7:8001",
            kv_events="tcp://10.0.0.7:5558",
            kv_events_replay="tcp://10.0.0.7:5601",
            labels={"app": "vllm", "zone": "a"},
        ),
    ]


def test_one_port_keeps_the_pod_name_and_no_kv_socket_unless_configured() -> None:
    (spec,), _ = pod_endpoints(pod_info(pod()), (8000,), KvEventPorts())
    assert spec.name == "vllm-0"
    assert spec.kv_events is None
    assert spec.kv_events_replay is None


def test_no_endpoints_without_ip_or_while_terminating() -> None:
    assert pod_endpoints(pod_info(pod(status__podIP=None)), (8000,), KvEventPorts()) == ([], False)
    terminating = pod_info(pod(metadata__deletionTimestamp="2026-01-01T00:00:00Z"))
    assert pod_endpoints(terminating, (8000,), KvEventPorts()) == ([], False)


def test_an_unready_pod_gives_unready_endpoints() -> None:
    unready = pod_info(pod(status__conditions=[{"type": "Ready", "status": "False"}]))
    specs, ready = pod_endpoints(unready, (8000,), KvEventPorts())
    assert [s.address for s in specs] == ["10.0.0.7:8000"]
    assert not ready


def test_active_ports_annotation_restricts_the_ranks() -> None:
    info = pod_info(pod(metadata__annotations={"inference.networking.k8s.io/active-ports": "8001"}))
    specs, _ = pod_endpoints(info, (8000, 8001), KvEventPorts(port=5557))
    assert [(s.name, s.address, s.kv_events) for s in specs] == [
        ("vllm-0-rank-1", "10.0.0.7:8001", "tcp://10.0.0.7:5558")
    ]
    # A malformed annotation restricts nothing.
    odd = pod_info(pod(metadata__annotations={"inference.networking.k8s.io/active-ports": "x"}))
    assert len(pod_endpoints(odd, (8000, 8001), KvEventPorts())[0]) == 2


@pytest.mark.parametrize(
    ("annotation", "container_ports", "problem"),
    [
        (None, None, None),
        (None, [8000, 8001], None),
        ("8001", None, None),
        ("8001,9999", None, "names port(s) 9999 that the pool does not target (8000, 8001)"),
        ("9999", None, "none of its active ports is a target port: it has no endpoint"),
        ("x", None, "is not a comma-separated list of ports; ignored"),
        ("0", None, "is not a comma-separated list of ports; ignored"),
        (None, [7000], "target port(s) 8000, 8001 not among its containers' declared ports"),
    ],
)
def test_port_problems(
    annotation: str | None, container_ports: list[int] | None, problem: str | None
) -> None:
    obj = pod()
    if annotation is not None:
        obj["metadata"]["annotations"] = {"inference.networking.k8s.io/active-ports": annotation}
    if container_ports is not None:
        obj["spec"] = {
            "containers": [{"name": "c", "ports": [{"containerPort": p} for p in container_ports]}]
        }
    found = port_problem(pod_info(obj), (8000, 8001))
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert found.startswith("pod vllm-0: ")
        assert problem in found


def test_ipv6_addresses_are_bracketed() -> None:
    assert host_port("fd00::7", 8000) == "[fd00::7]:8000"
    assert host_port("10.0.0.7", 8000) == "10.0.0.7:8000"
    (spec,), _ = pod_endpoints(
        pod_info(pod(status__podIP="fd00::7")), (8000,), KvEventPorts(port=5557)
    )
    assert spec.address == "[fd00::7]:8000"
    assert spec.kv_events == "tcp://[fd00::7]:5557"
