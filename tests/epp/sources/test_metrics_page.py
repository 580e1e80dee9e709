"""Reading model-server /metrics pages: the partial parser against prometheus_client's
real one, every engine's names, and every kind of bad input."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.datastore import CACHE_INFO, KV_CACHE_USAGE, LORA, RUNNING, WAITING, Endpoint, EndpointSpec
from epp.sources.metrics import (
    BUILTIN_ENGINES,
    EngineSpec,
    MetricsExtractor,
    MetricSpec,
    PageError,
    ReadCache,
    SinglePassReader,
    read_page,
    read_series,
)
from tests.epp.sources.pages import sglang_page, vllm_page

VLLM = BUILTIN_ENGINES["vllm"]
SGLANG = BUILTIN_ENGINES["sglang"]


def reference(page: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What prometheus_client's full parser reads, per series name."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def reference_samples(page: bytes, name: str) -> list[tuple[dict[str, str], float]]:
    return reference(page).get(name, [])


@pytest.mark.parametrize(
    "page",
    [
        vllm_page(),
        vllm_page(engines=2, waiting=5, running=1, kv_usage=0.9),
        vllm_page(lora=(("a,b", "c", 3, 1.0), ("a", "", 3, 2.0))),
        sglang_page(),
    ],
    ids=["vllm", "vllm-dp2", "vllm-two-lora-series", "sglang"],
)
def test_the_partial_parser_reads_what_the_full_parser_reads(page: bytes) -> None:
    names = {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
        "vllm:request_success_total",
        "vllm:e2e_request_latency_seconds_bucket",
        "http_request_duration_seconds_bucket",
        "python_info",
        "process_open_fds",
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_config_info",
    }
    full = reference(page)
    cache = ReadCache()
    for name in names:
        for read in (read_series(page, name), read_series(page, name, cache)):
            assert not read.problems
            assert [(dict(s.labels), s.value) for s in read.samples] == full.get(name, []), name


def test_realistic_vllm_page_is_read() -> None:
    page = vllm_page(waiting=3, running=12, kv_usage=0.42)
    assert len(page) > 30_000  # tens of KB, mostly histograms
    values = read_page(page, VLLM)
    assert values["waiting_requests"] == 3
    assert values["running_requests"] == 12
    assert values["kv_cache_usage"] == 0.42
    assert values["running_adapters"] == frozenset({"sql-lora"})
    assert values["waiting_adapters"] == frozenset()
    assert values["max_adapters"] == 4
    assert values["block_size"] == 16
    assert values["num_gpu_blocks"] == 27500
    assert values["missing"] == {}


def test_sglang_page_is_read_with_its_names() -> None:
    values = read_page(sglang_page(queue=2, running=7, token_usage=0.3), SGLANG)
    assert (values["waiting_requests"], values["running_requests"]) == (2, 7)
    assert values["kv_cache_usage"] == 0.3
    assert (values["block_size"], values["num_gpu_blocks"]) == (1, 300000)
    assert LORA in values["missing"]  # type: ignore[operator]


def test_data_parallel_engines_are_summed_and_kv_is_the_fullest() -> None:
    page = vllm_page(engines=2, waiting=4, running=3).replace(
        b'vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42',
        b'vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.7',
    )
    values = read_page(page, VLLM)
    assert (values["waiting_requests"], values["running_requests"]) == (8, 6)
    assert values["kv_cache_usage"] == 0.7


def test_latest_lora_series_wins() -> None:
    page = vllm_page(lora=(("old", "", 2, 100.0), ("new-a,new-b", "queued", 4, 200.0)))
    values = read_page(page, VLLM)
    assert values["running_adapters"] == frozenset({"new-a", "new-b"})
    assert values["waiting_adapters"] == frozenset({"queued"})
    assert values["max_adapters"] == 4


def test_older_vllm_kv_gauge_is_read() -> None:
    values = read_page(vllm_page(kv_name="vllm:gpu_cache_usage_perc", kv_usage=0.25), VLLM)
    assert values["kv_cache_usage"] == 0.25


def test_a_name_that_prefixes_another_metric_is_matched_exactly() -> None:
    page = (
        b"# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        b'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n'
        b"vllm:num_requests_waiting 2.0\n"
        b"vllm:num_requests_running 1\n"
        b"vllm:kv_cache_usage_perc 0.5\n"
    )
    values = read_page(page, VLLM)
    assert values["waiting_requests"] == 2


def test_labels_with_escapes_and_braces_are_read() -> None:
    page = (
        b'vllm:num_requests_waiting{model_name="a}b\\"c\\\\d\\ne",engine="0"} 1 1700000000000\n'
        b'vllm:num_requests_running{model_name="x"} 2\n'
        b"vllm:kv_cache_usage_perc 0.1\n"
    )
    read = read_series(page, "vllm:num_requests_waiting")
    assert not read.problems
    (sample,) = read.samples
    assert sample.value == 1
    assert sample.labels == {"model_name": 'a}b"c\\d\ne', "engine": "0"}
    assert reference_samples(page, "vllm:num_requests_waiting") == [(dict(sample.labels), 1.0)]


@pytest.mark.parametrize(
    ("value", "reason"),
    [("NaN", "is NaN"), ("+Inf", "is infinite"), ("-3", "is negative"), ("-Inf", "infinite")],
)
def test_nan_infinite_or_negative_counts_are_missing_not_wrong(value: str, reason: str) -> None:
    values = read_page(vllm_page(waiting=value), VLLM)
    missing = values["missing"]
    assert isinstance(missing, dict)
    assert reason in missing[WAITING]
    assert "waiting_requests" not in values  # the default stays, flagged, not the bad number
    assert values["running_requests"] == 12


@pytest.mark.parametrize("value", ["NaN", "1.5", "-0.1", "85"])
def test_kv_usage_outside_zero_one_is_missing(value: str) -> None:
    values = read_page(vllm_page(kv_usage=value), VLLM)
    missing = values["missing"]
    assert isinstance(missing, dict)
    assert "expected a fraction" in missing[KV_CACHE_USAGE]
    assert "kv_cache_usage" not in values


def test_metrics_missing_from_the_page_are_listed() -> None:
    page = vllm_page(lora=None).replace(b"vllm:num_requests_running", b"vllm:other_gauge")
    values = read_page(page, VLLM)
    missing = values["missing"]
    assert isinstance(missing, dict)
    assert set(missing) == {RUNNING, LORA}
    assert "not on the page" in missing[RUNNING]
    assert values["waiting_requests"] == 3


def test_unusable_cache_info_is_missing() -> None:
    values = read_page(vllm_page(num_gpu_blocks="None"), VLLM)
    missing = values["missing"]
    assert isinstance(missing, dict)
    assert CACHE_INFO in missing
    assert "block_size" not in values


@pytest.mark.parametrize(
    "page",
    [
        b"<html><body>502 Bad Gateway</body></html>",
        b"",
        bytes(range(256)) * 40,
        sglang_page(),  # the wrong engine
        b"vllm:num_requests_waiting{engine=0 3\n",  # broken lines only
    ],
    ids=["html", "empty", "binary", "wrong-engine", "broken-line"],
)
def test_a_page_without_the_engines_metrics_is_refused(page: bytes) -> None:
    with pytest.raises(PageError, match="none of the vllm engine's metrics"):
        read_page(page, VLLM)


def test_unreadable_sample_lines_are_reported() -> None:
    page = (
        b'vllm:num_requests_waiting{engine="0"} three\n'
        b"vllm:num_requests_running 1\n"
        b"vllm:kv_cache_usage_perc 0.2\n"
    )
    values = read_page(page, VLLM)
    missing = values["missing"]
    assert isinstance(missing, dict)
    assert "not a number" in missing[WAITING]


def test_metric_specs_parse_gie_syntax() -> None:
    assert MetricSpec.parse("vllm:num_requests_waiting") == MetricSpec("vllm:num_requests_waiting")
    spec = MetricSpec.parse('nv_trt_llm_request_metrics{request_type=waiting, x="y z"}')
    assert spec.labels == (("request_type", "waiting"), ("x", "y z"))
    for bad in ("", "1abc", "name{label}", "name{=x}"):
        with pytest.raises(ValueError, match=r"spec|label"):
            MetricSpec.parse(bad)


def test_label_filtered_specs_select_their_series() -> None:
    page = (
        b'nv_trt_llm_request_metrics{request_type="waiting"} 4\n'
        b'nv_trt_llm_request_metrics{request_type="scheduled"} 9\n'
        b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"} 0.5\n'
        b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"} 32\n'
        b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 1000\n'
    )
    values = read_page(page, BUILTIN_ENGINES["triton-tensorrt-llm"])
    assert (values["waiting_requests"], values["running_requests"]) == (4, 9)
    assert values["kv_cache_usage"] == 0.5
    assert (values["block_size"], values["num_gpu_blocks"]) == (32, 1000)


def endpoint(labels: dict[str, str] | None = None) -> Endpoint:
    return Endpoint(EndpointSpec("pod", "10.0.0.1:8000", labels=labels or {}))


def test_engine_is_chosen_by_endpoint_label() -> None:
    extractor = MetricsExtractor()
    sglang = endpoint({"inference.networking.k8s.io/engine-type": "sglang"})
    assert extractor.extract(sglang_page(queue=6), sglang, now=5.0).waiting_requests == 6
    llmd = endpoint({"llm-d.ai/engine-type": "sglang"})
    assert extractor.extract(sglang_page(queue=1), llmd).waiting_requests == 1
    assert extractor.extract(vllm_page(waiting=2), endpoint()).waiting_requests == 2
    with pytest.raises(PageError, match="engine type 'mystery'"):
        extractor.extract(
            vllm_page(), endpoint({"inference.networking.k8s.io/engine-type": "mystery"})
        )


def test_custom_engine_and_default_engine() -> None:
    custom = EngineSpec(
        "mine",
        waiting=(MetricSpec.parse("my_queue{state=waiting}"),),
        running=(MetricSpec("my_running"),),
        custom=(("queue.gold", MetricSpec.parse("my_queue{tier=gold}")),),
    )
    extractor = MetricsExtractor({"mine": custom}, default_engine="mine")
    page = (
        b'my_queue{state="waiting",tier="gold"} 3\n'
        b'my_queue{state="running",tier="gold"} 1\n'
        b"my_running 2\n"
    )
    snapshot = extractor.extract(page, endpoint(), now=1.0, staleness_s=3.0)
    assert (snapshot.waiting_requests, snapshot.running_requests) == (3, 2)
    assert snapshot.custom == {"queue.gold": 3.0}
    assert KV_CACHE_USAGE in snapshot.missing  # the engine has no KV metric: neutral, not 0
    assert snapshot.staleness_s == 3.0
    with pytest.raises(ValueError, match="defaultEngine 'nope'"):
        MetricsExtractor(default_engine="nope")


def test_label_cache_stays_bounded() -> None:
    extractor = MetricsExtractor()
    for i in range(4200):
        page = (
            b"vllm:num_requests_waiting 1\n"
            b'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a%d"} 1\n' % i
        )
        assert extractor.extract(page, endpoint()).running_adapters == {f"a{i}"}
    assert len(extractor._read_cache.labels) <= 4096


SINGLE_PASS_PAGES = {
    "vllm": vllm_page(),
    "vllm-dp2": vllm_page(engines=2, waiting=4, running=3),
    "vllm-two-lora": vllm_page(lora=(("old", "", 2, 100.0), ("a,b", "q", 4, 200.0))),
    "vllm-no-lora": vllm_page(lora=None),
    "vllm-older-kv-name": vllm_page(kv_name="vllm:gpu_cache_usage_perc", kv_usage=0.25),
    "vllm-nan-waiting": vllm_page(waiting="NaN"),
    "vllm-negative-running": vllm_page(running="-1"),
    "vllm-kv-above-one": vllm_page(kv_usage="1.5"),
    "vllm-bad-cache-info": vllm_page(num_gpu_blocks="None"),
    "vllm-running-missing": vllm_page().replace(b"vllm:num_requests_running", b"vllm:other_gauge"),
    "vllm-unreadable-line": vllm_page(waiting="three"),
    "sglang": sglang_page(),
    "sglang-nan": sglang_page(token_usage="NaN"),
}


@pytest.mark.parametrize("name", sorted(SINGLE_PASS_PAGES))
def test_the_single_pass_reader_reads_what_read_page_reads(name: str) -> None:
    page = SINGLE_PASS_PAGES[name]
    engine = SGLANG if name.startswith("sglang") else VLLM
    assert SinglePassReader.suits(engine)
    reader = SinglePassReader(engine, ReadCache())
    expected = read_page(page, engine)
    for _ in range(2):  # the second time from what the first remembered
        single_pass = reader.read(page)
        # It declines what it does not read itself, and read_page reads it instead.
        assert single_pass is None or single_pass == expected
    # Pages it reads itself: all but another KV name and unreadable lines.
    declined = {"vllm-older-kv-name", "vllm-unreadable-line"}
    assert (reader.read(page) is None) == (name in declined)


def test_engines_with_label_selectors_are_read_by_read_page() -> None:
    assert not SinglePassReader.suits(BUILTIN_ENGINES["triton-tensorrt-llm"])
    assert not SinglePassReader.suits(BUILTIN_ENGINES["trtllm-serve"])  # cache info from gauges


@pytest.mark.parametrize(
    "page",
    [
        b"",
        b"<html>502</html>",
        sglang_page(),
        b"vllm:num_requests_waiting 1\n",
        b"\n".join(line for line in vllm_page().split(b"\n") if not line.startswith(b"#")),
    ],
    ids=["empty", "html", "wrong-engine", "first-line-only", "no-comment-lines"],
)
def test_the_single_pass_reader_leaves_other_pages_to_read_page(page: bytes) -> None:
    assert SinglePassReader(VLLM, ReadCache()).read(page) is None


@pytest.mark.parametrize("first", ["single-pass", "read_page"])
def test_both_readers_keep_their_facts_in_one_cache(first: str) -> None:
    cache = ReadCache()
    reader = SinglePassReader(VLLM, cache)
    page = vllm_page(waiting=3)
    if first == "single-pass":
        assert reader.read(page) is not None
    else:
        read_page(page, VLLM, cache)
    # One table per engine and fact, made for the engine's specs...
    specs, known = cache.facts[("vllm", WAITING)]
    assert specs is VLLM.waiting
    ((block, derived),) = known.items()
    assert block.startswith(b"vllm:num_requests_waiting")
    assert derived == ({"": 3}, None)
    # ... and what it holds is a lookup for both readers: a planted value is what
    # they read.
    known[block] = ({"": 99}, None)
    single_pass = reader.read(page)
    assert single_pass is not None
    assert single_pass["waiting_requests"] == 99
    assert read_page(page, VLLM, cache)["waiting_requests"] == 99


def test_another_engine_config_under_the_same_name_does_not_share_facts() -> None:
    cache = ReadCache()
    page = vllm_page(waiting=3)
    assert read_page(page, VLLM, cache)["waiting_requests"] == 3
    known = cache.facts[("vllm", WAITING)][1]
    for block in known:
        known[block] = ({"": 99}, None)
    other = EngineSpec("vllm", waiting=(MetricSpec("vllm:num_requests_waiting"),))
    assert read_page(page, other, cache)["waiting_requests"] == 3
