"""The prefix index built from the engines' KV events, and what reads it.

- `blockkeys`: the index's own block keys, a chained hash of token ids;
- `index`: which pod (and which KV-event stream of a pod) holds which block;
- `speculative`: short-lived entries recorded at pick time;
- `lookup`: the longest cached prefix of a prompt, per pod;
- `ingest`: KV-event batches applied to the index (own keys, the engine-hash map);
- `alignment`: do the engines and the EPP agree on block size and tokenization?
- `hashing`: vLLM's own block hashes, for the benchmarks and tests.
"""
