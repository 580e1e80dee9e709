"""Pod roles where the simulator publishes labels: the fleet's endpoints file and
pod command lines, the fake Kubernetes API's pods, and the pod's own --role."""

from __future__ import annotations

import pytest

from sim.cli import _serve_parser, config_from_args, fleet_main
from sim.fleet import ROLE_LABEL, endpoints_document, plan_fleet, pod_argv
from sim.kubeapi import main as kubeapi_main
from sim.kubeapi import pod_labels
from sim.server import ROLE_LABEL as SERVER_ROLE_LABEL


def test_a_pd_fleet_labels_its_first_pods_prefill_and_the_rest_decode() -> None:
    pods = plan_fleet(4, 20_000, prefill_pods=1)
    assert [p.role for p in pods] == ["prefill", "decode", "decode", "decode"]
    document = endpoints_document(pods, "0.0.0.0")
    labels = [e["labels"] for e in document["endpoints"]]
    assert labels == [{ROLE_LABEL: "prefill"}] + [{ROLE_LABEL: "decode"}] * 3
    assert ROLE_LABEL == SERVER_ROLE_LABEL == "llm-d.ai/role"
    argv = pod_argv(pods[0], "127.0.0.1", ["--time-scale", "0.1"])
    assert argv[argv.index("--role") + 1] == "prefill"
    assert argv[-2:] == ["--time-scale", "0.1"]


def test_an_aggregated_fleet_has_no_roles_and_no_labels() -> None:
    pods = plan_fleet(3, 20_000)
    assert all(p.role is None for p in pods)
    assert all("labels" not in e for e in endpoints_document(pods, "h")["endpoints"])
    assert "--role" not in pod_argv(pods[0], "127.0.0.1", [])


@pytest.mark.parametrize("prefill_pods", [-1, 3, 4])
def test_a_pd_fleet_needs_a_decode_pod(prefill_pods: int) -> None:
    with pytest.raises(ValueError, match="--prefill-pods"):
        plan_fleet(3, 20_000, prefill_pods=prefill_pods)


def test_the_fleet_command_refuses_a_bad_prefill_count_and_a_role(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--n", "2", "--base-port", "20000", "--endpoints-file", "/tmp/never.yaml"]
    with pytest.raises(SystemExit):
        fleet_main([*args, "--prefill-pods", "2"])
    assert "--prefill-pods" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fleet_main([*args, "--role", "decode"])
    assert "--role" in capsys.readouterr().err


def test_a_pod_takes_its_role_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    parser = _serve_parser("sim serve")
    config = config_from_args(parser.parse_args(["--port", "1", "--role", "decode"]))
    assert config.role == "decode"
    assert config_from_args(parser.parse_args(["--port", "1"])).role is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "1", "--role", "encode"])
    with pytest.raises(SystemExit, match="--prefill-timeout"):
        config_from_args(parser.parse_args(["--port", "1", "--prefill-timeout", "0"]))


def test_the_fake_kube_api_labels_pd_pods() -> None:
    base = {"app": "vllm"}
    assert pod_labels(base, 0, 2) == {"app": "vllm", ROLE_LABEL: "prefill"}
    assert pod_labels(base, 1, 2) == {"app": "vllm", ROLE_LABEL: "prefill"}
    assert pod_labels(base, 2, 2) == {"app": "vllm", ROLE_LABEL: "decode"}
    assert pod_labels(base, 0, 0) == base
    assert base == {"app": "vllm"}  # not changed


def test_the_fake_kube_api_needs_a_decode_pod(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kubeapi_main(["--pods", "2", "--prefill-pods", "2"])
    assert "--prefill-pods" in capsys.readouterr().err


def test_a_pod_takes_its_kv_transfer_settings() -> None:
    parser = _serve_parser("sim serve")
    args = ["--port", "1", "--kv-transfer-bandwidth", "1e9", "--kv-transfer-latency", "0.01"]
    config = config_from_args(parser.parse_args(args))
    assert config.latency.kv_transfer_bandwidth == 1e9
    assert config.latency.kv_transfer_latency_s == 0.01
    default = config_from_args(parser.parse_args(["--port", "1"])).latency
    assert (default.kv_transfer_bandwidth, default.kv_transfer_latency_s) == (25e9, 0.002)


@pytest.mark.parametrize(
    "flags", [["--kv-transfer-bandwidth", "0"], ["--kv-transfer-latency", "-1"]]
)
def test_bad_kv_transfer_settings_are_refused(flags: list[str]) -> None:
    parser = _serve_parser("sim serve")
    with pytest.raises(SystemExit, match="kv_transfer"):
        config_from_args(parser.parse_args(["--port", "1", *flags]))


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--num-gpu-blocks", "1", "num_gpu_blocks must be >= 2"),
        ("--num-gpu-blocks", "-5", "num_gpu_blocks must be >= 2"),
        ("--block-size", "0", "block_size must be >= 1"),
        ("--max-num-seqs", "0", "max_num_seqs and max_num_batched_tokens must be >= 1"),
        ("--time-scale", "0", "time_scale must be > 0"),
    ],
)
def test_a_pod_refuses_an_engine_it_cannot_build(flag: str, value: str, message: str) -> None:
    parser = _serve_parser("sim serve")
    with pytest.raises(SystemExit, match=message):
        config_from_args(parser.parse_args(["--port", "1", flag, value]))
