"""`predicted-ttft-detector`: saturation read from the predicted-TTFT model's wait."""

from __future__ import annotations

import msgspec
import pytest
from epp.plugins.predicted_ttft_detector import PredictedTtftDetector
from epp.plugins.utilization_detector import UtilizationDetector
from prometheus_client import CollectorRegistry

from epp.config import InvalidConfig
from epp.datastore import Datastore, EndpointMetrics
from epp.scheduling import PluginContext
from tests.plugins.helpers import make_endpoints
from tests.plugins.llmd_helpers import load, routed
from tests.plugins.test_predicted_ttft import DONE, Fleet


def detector(fleet: Fleet, **params: object) -> PredictedTtftDetector:
    ctx = PluginContext(
        "predicted-ttft-detector",
        "predicted-ttft-detector",
        Datastore(),
        CollectorRegistry(),
        {"predicted-ttft-producer": fleet.producer},
        clock=fleet.clock,
    )
    return PredictedTtftDetector(msgspec.convert(params, PredictedTtftDetector.Parameters), ctx)


def test_a_pod_reads_as_full_when_its_predicted_wait_reaches_the_threshold() -> None:
    fleet = Fleet()
    busy, idle = make_endpoints(2)
    d = detector(fleet, waitThreshold="400ms")
    assert d.saturation([busy, idle]) == 0.0
    fleet.route(busy)  # a 4,000-token prefill queued on `busy`
    wait = fleet.producer.predicted_wait(busy)
    assert 0.05 < wait < 0.4  # the prior's ~30 ms per 1,000 tokens
    assert d.load(busy) == pytest.approx(wait / 0.4)
    assert d.saturation([busy, idle]) == pytest.approx(wait / 0.4 / 2)  # the mean
    # Work queued past the threshold counts as full, not more: one stuck pod does
    # not hold back a pool whose other pods have room.
    for _ in range(20):
        fleet.route(busy)
    assert d.load(busy) == 1.0
    assert d.saturation([busy, idle]) == 0.5
    assert d.saturation([busy]) == 1.0
    assert d.saturation([]) == 1.0  # no candidate: no room


def test_the_reading_falls_as_the_queue_drains_and_first_tokens_come() -> None:
    fleet = Fleet()
    (pod,) = make_endpoints(1)
    d = detector(fleet, waitThreshold="1s")
    req, cycle = fleet.route(pod)
    queued = d.saturation([pod])
    fleet.clock.advance(fleet.producer.predicted_wait(pod) / 2)
    assert d.saturation([pod]) == pytest.approx(queued / 2)  # predicted draining
    result = routed(("default", pod))
    fleet.producer.response_first_chunk(req, cycle, result, 0.02)
    decoding = d.saturation([pod])
    assert 0.0 < decoding < queued / 2  # one decoding request is all that is left
    fleet.producer.post_response(req, cycle, result, DONE)
    assert d.saturation([pod]) == 0.0


def test_waiting_requests_count_while_fresh_and_stale_metrics_never_freeze_it() -> None:
    fleet = Fleet()
    (pod,) = make_endpoints(1)
    d = detector(fleet, waitThreshold="200ms")
    # Three requests the pod reports waiting (another EPP replica's): the prior's
    # 50 ms each.
    pod.metrics = EndpointMetrics(updated_at=fleet.clock(), waiting_requests=3)
    assert d.saturation([pod]) == pytest.approx(0.75)
    # The scrapes stop: the waiting count is no longer known and is left out; the
    # reading is this EPP's own accounting, which says the pod is idle. The
    # utilization detector reads the same pod as full for admission.
    fleet.clock.advance(5.0)
    assert d.saturation([pod]) == 0.0
    utilization = UtilizationDetector(
        UtilizationDetector.Parameters(),
        PluginContext("u", "u", Datastore(), CollectorRegistry(), {}, clock=fleet.clock),
    )
    assert utilization.saturation([pod]) == 1.0


def _config(plugins: str, detector_params: str = "") -> str:
    return f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
{plugins}
- type: predicted-ttft-detector{detector_params}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: max-score-picker
saturationDetector:
  pluginRef: predicted-ttft-detector
"""


def test_it_loads_as_flow_controls_gate_with_its_producer() -> None:
    config = load(
        _config(
            "- type: approx-prefix-cache-producer\n- type: predicted-ttft-producer",
            "\n  parameters: {waitThreshold: 250ms}",
        )
    )
    assert config.saturation_detector is not None
    gate = config.saturation_detector.plugin
    assert isinstance(gate, PredictedTtftDetector)
    assert gate.threshold_s == 0.25
    assert gate.producer is config.plugins["predicted-ttft-producer"]


@pytest.mark.parametrize(
    ("plugins", "params", "message"),
    [
        ("- type: approx-prefix-cache-producer", "", "no plugin of that name is declared before"),
        (
            "- type: approx-prefix-cache-producer\n- type: predicted-ttft-producer",
            "\n  parameters: {predictedTtftProducerName: approx-prefix-cache-producer}",
            "where predicted-ttft-producer is needed",
        ),
        (
            "- type: approx-prefix-cache-producer\n- type: predicted-ttft-producer",
            "\n  parameters: {waitThreshold: 0s}",
            "waitThreshold must be positive",
        ),
        (
            "- type: approx-prefix-cache-producer\n- type: predicted-ttft-producer",
            "\n  parameters: {waitThreshold: soon}",
            "waitThreshold",
        ),
    ],
)
def test_a_bad_setup_is_refused_with_what_to_do(plugins: str, params: str, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(_config(plugins, params))
