"""A vLLM pod simulator (`python -m sim`): OpenAI API, vLLM metrics, a paged KV block
pool with vLLM's prefix caching, and vLLM's KV events over ZMQ. It is faithful where
routing can see it (block hashes, event bytes, cache hits, eviction order, queueing,
TTFT growing with uncached tokens) and simple everywhere else.

Modules: `hashing` (block hashes), `kv_cache` (block pool and per-request blocks),
`kv_events` (events and their msgpack encoding), `publisher` (ZMQ PUB + replay
ROUTER), `latency` (step-time model), `engine` (scheduler loop), `tokenizer` and
`chat_template`, `protocol` (OpenAI request/response shapes), `metrics`, `server`
(HTTP), `fleet` (N pods + endpoints file) and `cli`. The EPP never imports it, and it
never imports the EPP.

Time scale: every duration the engine computes is in simulated seconds and is slept
as `duration x --time-scale` of wall time (0.1: ten times faster than real time).
What the simulator reports (`/metrics` histograms, TTFT) is in simulated seconds,
i.e. wall time / time scale. A client measuring wall time divides by the time scale
to get simulated seconds. Knobs that are about the real world (`/sim/metrics-delay`,
KV-event timestamps) are in wall time. A time scale too small for the load (Python
cannot do a step's bookkeeping and HTTP writes within `step x scale` of wall time)
stretches simulated time: `/sim/state` reports it as `counters.lagSeconds` (next to
`busySeconds`, the engine's modelled busy time); keep it near 0.

Known deviations from vLLM (none of them changes which blocks are cached, which
events are published, or how the cache hits):

- one data-parallel rank (rank 0), no tensor parallelism, no LoRA, no multimodal
  inputs, no prompt embeddings: the only extra key is `cache_salt`;
- hash algorithms `sha256` and `sha256_cbor` only (no xxhash, no builtin `hash()`);
- FCFS scheduling only; chunked prefill always on; no speculative decoding and no
  async scheduling overlap; preemption is by recompute, of the last admitted request;
- prefill/decode disaggregation (docs/disaggregation.md) models NIXL's protocol and
  a transfer time, not the transfer: the prefill leg's blocks are freed at once
  (vLLM holds them until read), transfers never fail, there is no handshake;
- no re-emission of hits (`kv_cache_report_mode=full`), no offloading connectors;
- prefix-cache query/hit counters count each request once, at its first admission
  (vLLM counts lookups, including those of a request kept waiting);
- `/reset_prefix_cache` publishes AllBlocksCleared at once, as its own batch (vLLM
  publishes it with the next step's batch);
- `max_model_len` is capped at the pool size (vLLM refuses to start instead);
- the answer is a fixed text; `n > 1` is refused; sampling parameters, stop strings
  and logprobs are ignored; without `max_tokens` it stops after `--output-tokens`
  tokens with finish reason "stop" (no EOS token is generated);
- `usage.prompt_tokens_details.cached_tokens` is always present (vLLM needs
  `--enable-prompt-tokens-details`);
- `/sim/restart` keeps the sockets bound (subscribers stay connected), and in-flight
  requests get a 500 or a stream ending without `[DONE]` rather than a reset
  connection;
- tokenisation and HTTP handling take real wall time, so at small time scales they
  weigh more in simulated time than they would on a real server.
"""
