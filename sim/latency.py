"""How long one engine step takes: a roofline model of an ~8B model on one H100.

One step runs every scheduled request's new tokens through the model at once
(prefill chunks and single decode tokens mixed, like vLLM's chunked prefill). Its
time is a fixed overhead plus the larger of

- compute: `2 x params` FLOPs per new token (the matrix multiplies), plus attention
  `4 x layers x hidden` FLOPs per (new token, token it attends to) pair - the
  quadratic term: new tokens attend to the cached prefix and to each other
  (causally);
- memory: reading the weights once per step, plus reading the KV cache of every
  scheduled request's context and writing the new tokens' KV.

Prefill is compute-bound (time grows with the uncached tokens, and quadratically
with the context); decode is memory-bound (one weight read shared by the whole
batch, so per-token time grows slowly with batch size and with context length).

Constants and where they come from:

- GPU: NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16 tensor-core peak,
  3.35 TB/s HBM3 bandwidth.
- Model: Llama-3.1-8B's published configuration: ~8.0e9 parameters in BF16
  (2 bytes each), 32 layers, hidden size 4096, 8 KV heads of dimension 128 (so
  2 x 32 x 8 x 128 x 2 B = 128 KiB of KV cache per token).
- `2 x params` FLOPs per token and `4 x layers x hidden` per attention pair: the
  standard transformer FLOP count (a multiply-add is 2 FLOPs; QK^T and AV each cost
  2 x hidden per pair and layer).
- Efficiencies (fractions of peak actually reached): 0.70 for the large prefill
  matrix multiplies, 0.50 for attention kernels, 0.80 of HBM bandwidth, and a 1 ms
  per-step overhead (scheduling, sampling, kernel launches). They are calibrated so
  that the model lands on commonly reported vLLM figures for an 8B model on one
  H100: prefill of 2,000 uncached tokens ~49 ms (TTFT at low load ~45-50 ms), and a
  decode step ~7 ms at batch 1 (~140 tokens/s for one stream), ~15 ms for 64
  streams with 2,000 tokens of context each.

KV transfer (prefill/decode disaggregation, docs/disaggregation.md): a decode pod
pulls the prompt's KV cache from the prefill pod before it decodes. The transfer
takes `kv_transfer_latency_s + bytes / kv_transfer_bandwidth`, the bytes being the
tokens moved x the model's KV bytes per token (128 KiB for Llama-3.1-8B in BF16,
above). Defaults:

- bandwidth 25 GB/s: a 400 Gb/s RDMA NIC per GPU (ConnectX-7, the H100 nodes' usual
  pairing) is 50 GB/s at line rate; a NIXL read of a prompt's KV is one descriptor
  per layer and block (a few KiB to 64 KiB each for an 8B model), which reaches
  about half of line rate. 2,000 tokens (262 MB) take ~10.5 ms on the wire, ~12.5
  ms with the fixed cost below: a quarter of their prefill (~49 ms above).
- latency 2 ms per transfer: the decode engine posts the read in one step and sees
  it complete in a later one (vLLM polls finished transfers once per engine step),
  plus the prefill pod's completion notification; a few milliseconds between
  nodes. The one-time NIXL handshake between two engines is not charged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    params: float = 8.0e9
    bytes_per_param: float = 2.0  # BF16
    num_layers: int = 32
    hidden_size: int = 4096
    num_kv_heads: int = 8
    head_dim: int = 128

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        # K and V, every layer, every KV head, BF16.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2.0

    @property
    def attention_flops_per_pair(self) -> float:
        return 4.0 * self.num_layers * self.hidden_size


@dataclass(frozen=True)
class GpuProfile:
    peak_flops: float = 989e12  # H100 SXM5, dense BF16
    memory_bandwidth: float = 3.35e12  # H100 SXM5, HBM3, bytes/s


LLAMA_3_1_8B = ModelProfile()
H100_SXM = GpuProfile()


@dataclass(frozen=True)
class StepChunk:
    """One request's share of a step: `new_tokens` computed after `context_tokens`."""

    new_tokens: int
    context_tokens: int


@dataclass(frozen=True)
class LatencyModel:
    model: ModelProfile = LLAMA_3_1_8B
    gpu: GpuProfile = H100_SXM
    gemm_efficiency: float = 0.70
    attention_efficiency: float = 0.50
    memory_efficiency: float = 0.80
    step_overhead_s: float = 0.001
    # KV-cache transfer between pods (module docstring): bytes/s, and a fixed cost.
    kv_transfer_bandwidth: float = 25e9
    kv_transfer_latency_s: float = 0.002

    def __post_init__(self) -> None:
        if not self.kv_transfer_bandwidth > 0:
            raise ValueError("kv_transfer_bandwidth must be > 0")
        if not self.kv_transfer_latency_s >= 0:
            raise ValueError("kv_transfer_latency_s must be >= 0")

    def kv_transfer_bytes(self, tokens: int) -> float:
        """The KV cache of `tokens` tokens, in bytes."""
        return tokens * self.model.kv_bytes_per_token

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds (simulated) to pull the KV cache of `tokens` tokens from another pod;
        0 when there is nothing to pull."""
        if tokens <= 0:
            return 0.0
        return self.kv_transfer_latency_s + self.kv_transfer_bytes(tokens) / (
            self.kv_transfer_bandwidth
        )

    def step_time(self, chunks: Iterable[StepChunk]) -> float:
        """Seconds (simulated) for one engine step computing `chunks`."""
        new_tokens = 0
        attention_pairs = 0.0
        kv_tokens_touched = 0
        for chunk in chunks:
            n, c = chunk.new_tokens, chunk.context_tokens
            new_tokens += n
            # Each new token attends to the context and, causally, to the new
            # tokens before it (and itself).
            attention_pairs += n * c + n * (n + 1) / 2
            kv_tokens_touched += c + n
        return self.time_of(new_tokens, attention_pairs, kv_tokens_touched)

    def time_of(self, new_tokens: int, attention_pairs: float, kv_tokens_touched: int) -> float:
        """`step_time` from the step's totals: new tokens, (new token, attended token)
        pairs, and KV-cache tokens read or written."""
        if new_tokens == 0:
            return 0.0
        gemm_flops, gemm_rate, pair_flops, attention_rate, weights, kv_bytes, bandwidth = (
            self._rates
        )
        gemm_s = (gemm_flops * new_tokens) / gemm_rate
        attention_s = (pair_flops * attention_pairs) / attention_rate
        compute_s = gemm_s + attention_s
        memory_s = (weights + kv_bytes * kv_tokens_touched) / bandwidth
        return self.step_overhead_s + max(compute_s, memory_s)

    @functools.cached_property
    def _rates(self) -> tuple[float, float, float, float, float, float, float]:
        # The constant factors of `time_of` (called once per engine step), each the
        # very expression it stands for, so the products come out bit for bit the same.
        model, gpu = self.model, self.gpu
        return (
            2.0 * model.params,
            gpu.peak_flops * self.gemm_efficiency,
            model.attention_flops_per_pair,
            gpu.peak_flops * self.attention_efficiency,
            model.weight_bytes,
            model.kv_bytes_per_token,
            gpu.memory_bandwidth * self.memory_efficiency,
        )

    def prefill_time(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """One request's prefill alone in a step (what its TTFT is made of at low load)."""
        return self.step_time([StepChunk(uncached_tokens, cached_tokens)])

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        """A decode step of `batch_size` requests with `context_tokens` each."""
        return self.step_time([StepChunk(1, context_tokens)] * batch_size)
