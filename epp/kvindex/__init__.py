"""The prefix index built from the engines' KV events, and what reads it.

- `hashing`: vLLM's block hashes, computed for request prompts;
- `index`: which pod (and which KV-event stream of a pod) holds which block;
- `speculative`: short-lived entries recorded at pick time;
- `lookup`: the longest cached prefix of a prompt, per pod;
- `ingest`: KV-event batches applied to the index, with the alignment self-check;
- `alignment`: does our hash computation agree with an engine's?
"""
