"""Analytic bounds on the prefix-cache hit rate of a workload, from its actual tokens.

Everything is in tokens and in the engine's full blocks of `b` tokens, with vLLM's
prefix-caching rules as the simulator implements them:

- request i has prompt T_i of L_i tokens; it can hit at most
  `c_i = floor((L_i - 1) / b)` blocks (the last prompt token is always computed);
- once it has run, the blocks it leaves cached are the full blocks of
  `C_i = T_i + G_i[:-1]` (prompt, then the generated tokens but the last one);
- a block hits only when the whole prefix before it does too (chained hashes), so what
  request i can reuse from an earlier request j is the number of leading full blocks
  that T_i and C_j share, `lcp(i, j)`, capped at c_i.

Let `n_k(i)` = the number of earlier requests j < i with `lcp(i, j) >= k`. The hit rate
is hit tokens over prompt tokens, `H / sum_i L_i`, where:

- `h_star` (one copy of every prefix, an infinite cache: the best any router can do
  when each request may reuse what ANY earlier request left behind):
  `H* = sum_i b * max_{j<i} min(lcp(i, j), c_i) = sum_i b * #{k <= c_i : n_k(i) >= 1}`.
- `h_random` (each request sent to one of N pods uniformly at random, independently;
  an infinite cache per pod). Request i hits at least k blocks iff one of the `n_k(i)`
  earlier requests sharing k blocks with it went to its pod; each did with probability
  1/N, independently, so `P(hit_i >= k) = 1 - (1 - 1/N)^{n_k(i)}` and, summing over k,
  `E[H_rand] = sum_i b * sum_{k=1..c_i} (1 - (1 - 1/N)^{n_k(i)})`.
  Prompt tokens do not depend on the routing, so `h_random = E[H_rand] / sum_i L_i` is
  exactly the expected token hit rate of uniformly random routing.
- `h_round_robin` (request i to pod i mod N, infinite caches) is computed the same way
  with only the earlier requests of the same pod; a check on the measurement more than
  a bound (it holds exactly when requests arrive in the nominal order one at a time).

The bounds ignore time: a request counts the blocks of every earlier request as
cached, even if that request is still running (the engine only shares blocks whose
tokens are computed), and nothing is ever evicted. Measured hit rates under load
and with finite caches are therefore lower.

`n_k(i)` is kept as a count per chained block key: `count[key_k(C_j)]` is incremented
once for every prefix key of every request, so `n_k(i) = count[key_k(T_i)]`; that is
O(total blocks) time and memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Bounds:
    h_star: float
    h_random: float
    h_round_robin: float
    block_size: int
    pods: int
    requests: int
    prompt_tokens: int

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def block_keys(token_ids: Sequence[int], block_size: int, blocks: int) -> list[int]:
    """Chained keys of the first `blocks` full blocks: key k stands for tokens 0..k*b."""
    keys = []
    key = 0
    for k in range(blocks):
        key = hash((key, tuple(token_ids[k * block_size : (k + 1) * block_size])))
        keys.append(key)
    return keys


def compute_bounds(
    sequences: Iterable[tuple[Sequence[int], Sequence[int]]],
    block_size: int,
    pods: int,
    star_hits: list[tuple[int, int]] | None = None,
) -> Bounds:
    """Bounds for (prompt ids, generated ids) pairs in arrival order. With `star_hits`,
    each request's (prompt tokens, hit tokens under h_star) is appended to it."""
    if block_size < 1 or pods < 1:
        raise ValueError("block_size and pods must be >= 1")
    miss_one = 1.0 - 1.0 / pods
    seen: set[int] = set()  # h_star: every key cached anywhere
    counts: Counter[int] = Counter()  # h_random: n_k per key
    per_pod: list[set[int]] = [set() for _ in range(pods)]  # h_round_robin
    star = rand = robin = 0.0
    prompt_tokens = 0
    requests = 0
    for i, (prompt, generated) in enumerate(sequences):
        prompt_tokens += len(prompt)
        requests += 1
        cap = max(0, (len(prompt) - 1) // block_size)
        cached = list(prompt) + list(generated[:-1])
        keys = block_keys(cached, block_size, len(cached) // block_size)
        # The prompt's own keys are the first c_i keys of its cached sequence.
        asked = keys[:cap]
        hit = 0
        for key in asked:
            if key not in seen:
                break
            hit += 1
        star += hit * block_size
        if star_hits is not None:
            star_hits.append((len(prompt), hit * block_size))
        expected = 0.0
        for key in asked:
            n = counts.get(key, 0)
            if n == 0:
                break  # chained keys: nobody shares a longer prefix either
            expected += 1.0 - miss_one**n
        rand += expected * block_size
        pod = per_pod[i % pods]
        hit = 0
        for key in asked:
            if key not in pod:
                break
            hit += 1
        robin += hit * block_size
        seen.update(keys)
        counts.update(keys)
        pod.update(keys)
    if prompt_tokens == 0:
        return Bounds(0.0, 0.0, 0.0, block_size, pods, requests, 0)
    return Bounds(
        h_star=star / prompt_tokens,
        h_random=rand / prompt_tokens,
        h_round_robin=robin / prompt_tokens,
        block_size=block_size,
        pods=pods,
        requests=requests,
        prompt_tokens=prompt_tokens,
    )
