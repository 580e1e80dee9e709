"""The simulated Kubernetes API server (sim/kubeapi.py) behaves like the real one
where the EPP's watcher depends on it, checked through the official client and its
own watch helper."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from sim.kubeapi import KubeApiThread, parse_label_selector

TOKEN = "sim-token"


@pytest.fixture
def kube() -> Iterator[KubeApiThread]:
    with KubeApiThread(token=TOKEN, bookmark_interval_s=0.1) as running:
        yield running


def core_api(kube: KubeApiThread, tmp_path: Path) -> k8s.CoreV1Api:
    configuration = k8s.Configuration()
    kubeconfig = kube.call(kube.api.kubeconfig, tmp_path / "kc")
    k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration
    )
    return k8s.CoreV1Api(k8s.ApiClient(configuration))


def pod(name: str, app: str) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, labels={"app": app}),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="c", image="i")]),
    )


def test_objects_are_created_read_replaced_and_deleted(kube: KubeApiThread, tmp_path: Path) -> None:
    api = core_api(kube, tmp_path)
    created = api.create_namespaced_pod("default", pod("a", "vllm"))
    assert created.metadata.resource_version
    with pytest.raises(ApiException) as conflict:
        api.create_namespaced_pod("default", pod("a", "vllm"))
    assert conflict.value.status == 409
    read = api.read_namespaced_pod("a", "default")
    assert read.metadata.uid == created.metadata.uid
    read.metadata.labels = {"app": "other"}
    replaced = api.replace_namespaced_pod("a", "default", read)
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    api.delete_namespaced_pod("a", "default")
    with pytest.raises(ApiException) as missing:
        api.read_namespaced_pod("a", "default")
    assert missing.value.status == 404


def test_lists_filter_by_label_and_field_selectors(kube: KubeApiThread, tmp_path: Path) -> None:
    for name, app in (("a", "vllm"), ("b", "vllm"), ("c", "sglang")):
        kube.call(kube.api.put_pod, name, labels={"app": app}, ip="10.0.0.1")
    api = core_api(kube, tmp_path)
    names = [p.metadata.name for p in api.list_namespaced_pod("default").items]
    assert names == ["a", "b", "c"]
    vllm = api.list_namespaced_pod("default", label_selector="app=vllm")
    assert [p.metadata.name for p in vllm.items] == ["a", "b"]
    assert vllm.metadata.resource_version == str(kube.api.rv)
    sets = api.list_namespaced_pod("default", label_selector="app in (sglang, x),app!=y")
    assert [p.metadata.name for p in sets.items] == ["c"]
    by_name = api.list_namespaced_pod("default", field_selector="metadata.name=b")
    assert [p.metadata.name for p in by_name.items] == ["b"]
    with pytest.raises(ApiException) as bad:
        api.list_namespaced_pod("default", field_selector="spec.nodeName=x")
    assert bad.value.status == 400


def test_a_watch_follows_objects_in_and_out_of_its_selector(
    kube: KubeApiThread, tmp_path: Path
) -> None:
    api = core_api(kube, tmp_path)
    kube.call(kube.api.put_pod, "a", labels={"app": "vllm"}, ip="10.0.0.1")
    rv = api.list_namespaced_pod("default", label_selector="app=vllm").metadata.resource_version
    kube.call(kube.api.put_pod, "b", labels={"app": "sglang"}, ip="10.0.0.2")  # not selected
    kube.call(kube.api.update_pod, "b", labels={"app": "vllm"})  # moves in
    kube.call(kube.api.update_pod, "a", labels={"app": "sglang"})  # moves out
    kube.call(kube.api.delete_pod, "b")
    seen: list[tuple[str, str]] = []
    stream = k8s_watch.Watch().stream(  # type: ignore[no-untyped-call]
        api.list_namespaced_pod,
        "default",
        label_selector="app=vllm",
        resource_version=rv,
        allow_watch_bookmarks=True,
        timeout_seconds=1,
    )
    events: list[dict[str, Any]] = list(stream)
    for event in events:
        if event["type"] != "BOOKMARK":
            seen.append((event["type"], event["object"].metadata.name))
    assert seen == [("ADDED", "b"), ("DELETED", "a"), ("DELETED", "b")]
    # A quiet watch gets bookmarks carrying the current resourceVersion.
    assert any(e["type"] == "BOOKMARK" for e in events)


def test_an_expired_resource_version_is_410_gone(kube: KubeApiThread, tmp_path: Path) -> None:
    api = core_api(kube, tmp_path)
    kube.call(kube.api.put_pod, "a", labels={"app": "vllm"}, ip="10.0.0.1")
    old = str(kube.api.rv)
    kube.call(kube.api.put_pod, "b", labels={"app": "vllm"}, ip="10.0.0.2")
    kube.call(kube.api.compact)
    with pytest.raises(ApiException) as gone:
        list(
            k8s_watch.Watch().stream(  # type: ignore[no-untyped-call]
                api.list_namespaced_pod, "default", resource_version=old, timeout_seconds=1
            )
        )
    assert gone.value.status == 410


def test_authentication_rbac_and_unknown_resources(kube: KubeApiThread, tmp_path: Path) -> None:
    api = core_api(kube, tmp_path)
    kube.call(kube.api.forbid, "list", "pods")
    with pytest.raises(ApiException) as forbidden:
        api.list_namespaced_pod("default")
    assert forbidden.value.status == 403
    assert 'cannot list resource \\"pods\\"' in forbidden.value.body
    kube.call(kube.api.allow, "list", "pods")
    api.api_client.configuration.api_key = {}
    with pytest.raises(ApiException) as unauthorized:
        api.list_namespaced_pod("default")
    assert unauthorized.value.status == 401
    custom = k8s.CustomObjectsApi(core_api(kube, tmp_path).api_client)
    with pytest.raises(ApiException) as no_crd:
        custom.list_namespaced_custom_object("example.com", "v1", "default", "widgets")
    assert no_crd.value.status == 404


def test_label_selector_syntax() -> None:
    requirements = parse_label_selector("app in (vllm, sglang),tier!=cpu,gpu,!spot")
    labels = {"app": "sglang", "gpu": "h100"}
    assert all(r.matches(labels) for r in requirements)
    assert not all(r.matches({**labels, "spot": "1"}) for r in requirements)
    assert not all(r.matches({**labels, "tier": "cpu"}) for r in requirements)
    assert not all(r.matches({"app": "sglang"}) for r in requirements)  # no gpu label
    with pytest.raises(ValueError, match="unable to parse"):
        parse_label_selector("app in vllm")
