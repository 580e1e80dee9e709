"""`concurrency-detector`: saturation and filter by this EPP's in-flight work."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from epp.plugins.concurrency_detector import ConcurrencyDetector

from epp.config import InvalidConfig
from epp.datastore import Endpoint
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints, make_request
from tests.plugins.llmd_helpers import load, request, routed


def detector(**params: object) -> ConcurrencyDetector:
    return ConcurrencyDetector(
        msgspec.convert(params, ConcurrencyDetector.Parameters), context("d")
    )


def busy(*counts: int) -> list[Endpoint]:
    endpoints = make_endpoints(len(counts))
    for endpoint, count in zip(endpoints, counts, strict=True):
        endpoint.in_flight = count
    return endpoints


def test_saturation_is_the_pools_requests_in_flight_over_its_capacity() -> None:
    d = detector(maxConcurrency=10)
    assert d.saturation(busy(0, 0)) == 0.0
    assert d.saturation(busy(10, 5)) == pytest.approx(15 / 20)
    # One pod far past its share counts in full: the pool's total is what is read.
    assert d.saturation(busy(30, 0)) == pytest.approx(1.5)
    assert d.saturation([]) == 1.0
    assert detector().saturation(busy(50)) == 0.5  # default capacity: 100


def test_the_filter_keeps_endpoints_under_capacity_with_headroom_and_fails_open() -> None:
    low, at, over = busy(9, 10, 11)
    kept = detector(maxConcurrency=10).filter(make_request(), CycleState(), [low, at, over])
    assert list(kept) == [low]
    roomy = detector(maxConcurrency=10, headroom=0.1)  # limit 11
    assert list(roomy.filter(make_request(), CycleState(), [low, at, over])) == [low, at]
    full = [at, over]
    assert list(detector(maxConcurrency=10).filter(make_request(), CycleState(), full)) == full


TOKENS_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
{producer}
- type: concurrency-detector
  parameters: {{concurrencyMode: tokens, maxTokenConcurrency: 1000{extra}}}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: max-score-picker
saturationDetector:
  pluginRef: concurrency-detector
"""


def test_tokens_mode_reads_the_in_flight_load_producers_tokens() -> None:
    config = load(TOKENS_CONFIG.format(producer="- type: inflight-load-producer", extra=""))
    assert config.saturation_detector is not None
    gate = config.saturation_detector.plugin
    assert isinstance(gate, ConcurrencyDetector)
    producer = config.plugins["inflight-load-producer"]
    pod, idle = make_endpoints(2)
    req = request("x" * 2000)  # 500 tokens at 4 characters a token
    cycle = CycleState()
    asyncio.run(producer.prepare(req, cycle, [pod, idle]))
    producer.pre_request(req, cycle, routed(("default", pod)))
    assert gate.in_flight(pod) == 500
    assert gate.saturation([pod, idle]) == pytest.approx(500 / 2000)
    assert list(gate.filter(req, CycleState(), [pod, idle])) == [pod, idle]  # under 1,000


@pytest.mark.parametrize(
    ("producer", "extra", "message"),
    [
        ("", "", "'inflight-load-producer': no plugin of that name is declared before"),
        (
            "- type: inflight-load-producer",
            ", inFlightLoadProducerName: other",
            "'other': no plugin of that name",
        ),
        (
            "- type: approx-prefix-cache-producer",
            ", inFlightLoadProducerName: approx-prefix-cache-producer",
            "class ApproxPrefixCacheProducer, where inflight-load-producer is needed",
        ),
    ],
)
def test_tokens_mode_without_its_producer_is_refused(
    producer: str, extra: str, message: str
) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(TOKENS_CONFIG.format(producer=producer, extra=extra))


@pytest.mark.parametrize(
    "bad",
    [
        {"maxConcurrency": 0},
        {"maxTokenConcurrency": -1},
        {"headroom": -0.5},
        {"concurrencyMode": "hybrid"},
    ],
)
def test_bad_parameters_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, ConcurrencyDetector.Parameters)


def test_a_producer_name_in_requests_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens only"):
        detector(inFlightLoadProducerName="inflight-load-producer")
