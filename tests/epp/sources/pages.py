"""Model-server /metrics pages shaped like real ones, for the parser tests and the
scraping-cost measurement.

`vllm_page` renders what a vLLM v1 server with one model serves: the Python process
collector, vLLM's gauges and counters, about a dozen histograms (the bulk of the
page), the LoRA and cache-config info series, and the HTTP middleware's request
histograms per route. With the defaults it is about 40 KB, like a real page.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_HTTP_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0)


def _labels(pairs: dict[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def _num(value: float) -> str:
    return repr(float(value))


class _Page:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict[str, str], value: float | str) -> None:
        text = value if isinstance(value, str) else _num(value)
        self.lines.append(f"{name}{_labels(labels) if labels else ''} {text}")

    def histogram(
        self, name: str, label_sets: Sequence[dict[str, str]], bounds: Iterable[float], seed: int
    ) -> None:
        """One histogram family, its series per label set in turn (prometheus_client's
        order: a label set's buckets, count and sum, then the next set's)."""
        self.family(name, "histogram", "Distribution of " + name.split(":")[-1] + ".")
        for k, labels in enumerate(label_sets):
            total = 0
            for i, bound in enumerate(bounds):
                total += (seed * 7 + i * 13 + k) % 50
                self.sample(name + "_bucket", {**labels, "le": _num(bound)}, total)
            self.sample(name + "_bucket", {**labels, "le": "+Inf"}, total)
            self.sample(name + "_count", labels, total)
            self.sample(name + "_sum", labels, total * 0.37 + seed)

    def text(self) -> bytes:
        return ("\n".join(self.lines) + "\n").encode()


def vllm_page(
    *,
    waiting: float | str = 3,
    running: float | str = 12,
    kv_usage: float | str = 0.42,
    engines: int = 1,
    lora: Sequence[tuple[str, str, int, float]] | None = (("sql-lora", "", 4, 1700000000.0),),
    block_size: str = "16",
    num_gpu_blocks: str = "27500",
    kv_name: str = "vllm:kv_cache_usage_perc",
    model: str = MODEL,
    seed: int = 1,
) -> bytes:
    """A vLLM page. `lora`: (running adapters, waiting adapters, max_lora, value) per
    `vllm:lora_requests_info` series (None: LoRA not enabled). With several engines
    (data parallel) every engine reports the same numbers."""
    page = _Page()
    for generation in range(3):
        if generation == 0:
            page.family("python_gc_objects_collected_total", "counter", "Objects collected.")
        page.sample("python_gc_objects_collected_total", {"generation": str(generation)}, 1234.0)
    page.family("python_info", "gauge", "Python platform information.")
    page.sample(
        "python_info",
        {"implementation": "CPython", "major": "3", "minor": "12", "patchlevel": "3"},
        1.0,
    )
    for name, value in (
        ("process_virtual_memory_bytes", 5.4e10),
        ("process_resident_memory_bytes", 3.2e9),
        ("process_start_time_seconds", 1.7e9),
        ("process_cpu_seconds_total", 4242.5),
        ("process_open_fds", 87.0),
        ("process_max_fds", 1048576.0),
    ):
        page.family(name, "gauge", name.replace("_", " ") + ".")
        page.sample(name, {}, value)
    bases = [{"engine": str(i), "model_name": model} for i in range(engines)]

    page.family("vllm:num_requests_running", "gauge", "Requests in the running batch.")
    for base in bases:
        page.sample("vllm:num_requests_running", base, running)
    page.family("vllm:num_requests_waiting", "gauge", "Requests waiting to run.")
    for base in bases:
        page.sample("vllm:num_requests_waiting", base, waiting)
    page.family(kv_name, "gauge", "KV cache usage, 1 is full.")
    for base in bases:
        page.sample(kv_name, base, kv_usage)
    if lora is not None:
        page.family("vllm:lora_requests_info", "gauge", "Running stats on LoRA requests.")
        for running_adapters, waiting_adapters, max_lora, value in lora:
            page.sample(
                "vllm:lora_requests_info",
                {
                    "max_lora": str(max_lora),
                    "running_lora_adapters": running_adapters,
                    "waiting_lora_adapters": waiting_adapters,
                },
                value,
            )
    page.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.")
    page.sample(
        "vllm:cache_config_info",
        {
            "block_size": block_size,
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": num_gpu_blocks,
            "prefix_caching_hash_algo": "sha256",
        },
        1.0,
    )
    for name in (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ):
        page.family(name + "_total", "counter", name.split(":")[1].replace("_", " ") + ".")
        for base in bases:
            page.sample(name + "_total", base, 98765.0 + seed)
    page.family("vllm:request_success_total", "counter", "Finished requests.")
    for base in bases:
        for reason in ("stop", "length", "abort"):
            page.sample("vllm:request_success_total", {**base, "finished_reason": reason}, 42.0)
    histograms = (
        ("vllm:request_prompt_tokens", _TOKEN_BUCKETS),
        ("vllm:request_generation_tokens", _TOKEN_BUCKETS),
        ("vllm:iteration_tokens_total", _ITERATION_BUCKETS),
        ("vllm:request_max_num_generation_tokens", _TOKEN_BUCKETS),
        ("vllm:request_params_max_tokens", _TOKEN_BUCKETS),
        ("vllm:time_to_first_token_seconds", _LATENCY_BUCKETS),
        ("vllm:time_per_output_token_seconds", _LATENCY_BUCKETS),
        ("vllm:inter_token_latency_seconds", _LATENCY_BUCKETS),
        ("vllm:e2e_request_latency_seconds", _LATENCY_BUCKETS),
        ("vllm:request_queue_time_seconds", _LATENCY_BUCKETS),
        ("vllm:request_inference_time_seconds", _LATENCY_BUCKETS),
        ("vllm:request_prefill_time_seconds", _LATENCY_BUCKETS),
        ("vllm:request_decode_time_seconds", _LATENCY_BUCKETS),
    )
    for i, (name, bounds) in enumerate(histograms):
        page.histogram(name, bases, bounds, seed + i)
    routes = ("/v1/completions", "/v1/chat/completions", "/metrics", "/health")
    page.histogram(
        "http_request_duration_seconds",
        [{"handler": r, "method": "POST" if j < 2 else "GET"} for j, r in enumerate(routes)],
        _HTTP_BUCKETS,
        seed + 20,
    )
    return page.text()


def sglang_page(
    *,
    queue: float | str = 2,
    running: float | str = 7,
    token_usage: float | str = 0.3,
    page_size: str = "1",
    num_pages: str = "300000",
) -> bytes:
    page = _Page()
    base = {"model_name": MODEL, "tp_rank": "0"}
    for name, value in (
        ("sglang:num_queue_reqs", queue),
        ("sglang:num_running_reqs", running),
        ("sglang:token_usage", token_usage),
        ("sglang:gen_throughput", 321.5),
        ("sglang:cache_hit_rate", 0.71),
    ):
        page.family(name, "gauge", name.split(":")[1].replace("_", " ") + ".")
        page.sample(name, base, value)
    page.family("sglang:cache_config_info", "gauge", "Cache configuration.")
    page.sample("sglang:cache_config_info", {"page_size": page_size, "num_pages": num_pages}, 1.0)
    page.histogram("sglang:time_to_first_token_seconds", [base], _LATENCY_BUCKETS, 3)
    return page.text()
