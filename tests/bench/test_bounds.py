"""The analytic bounds on hand-built token sequences whose answer is known."""

from __future__ import annotations

import pytest

from bench.bounds import compute_bounds
from bench.workloads import Words, shared_prefix, token_sequences

B = 16


def seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_identical_requests_hit_all_but_the_first() -> None:
    prompt = seq(0, 10 * B + 5)  # 10 full blocks, and a partial one that never hits
    bounds = compute_bounds([(prompt, [])] * 20, B, pods=4)
    assert bounds.h_star == pytest.approx(19 * 10 * B / (20 * len(prompt)))
    assert bounds.h_star > 0.9


def test_the_last_prompt_token_is_never_a_hit() -> None:
    prompt = seq(0, 4 * B)  # exactly 4 blocks: at most 3 hit (vLLM recomputes the last token)
    bounds = compute_bounds([(prompt, [])] * 2, B, pods=1)
    assert bounds.h_star == pytest.approx(3 * B / (2 * 4 * B))


def test_disjoint_requests_hit_nothing() -> None:
    requests: list[tuple[list[int], list[int]]] = [(seq(1000 * i, 8 * B), []) for i in range(10)]
    bounds = compute_bounds(requests, B, pods=3)
    assert (bounds.h_star, bounds.h_random, bounds.h_round_robin) == (0.0, 0.0, 0.0)


def test_h_random_for_two_pods_on_three_identical_requests() -> None:
    # Request 1 finds request 0 on its pod with probability 1/2; request 2 finds one of
    # the two earlier ones with probability 1 - 1/4. Each hit is 3 blocks.
    prompt = seq(0, 3 * B + 1)
    bounds = compute_bounds([(prompt, [])] * 3, B, pods=2)
    assert bounds.h_random == pytest.approx((0.5 + 0.75) * 3 * B / (3 * len(prompt)))
    # Round-robin: 0 and 2 on pod 0, 1 on pod 1: only request 2 hits.
    assert bounds.h_round_robin == pytest.approx(3 * B / (3 * len(prompt)))
    assert bounds.h_star == pytest.approx(2 * 3 * B / (3 * len(prompt)))


def test_partial_sharing_counts_each_depth() -> None:
    # a: blocks X Y; b: blocks X Z (shares 1 block with a); c: X Y again (2 with a, 1 with b).
    x, y, z = seq(0, B), seq(100, B), seq(200, B)
    a, b, c = x + y + [7], x + z + [7], x + y + [7]
    bounds = compute_bounds([(a, []), (b, []), (c, [])], B, pods=2)
    total = 3 * (2 * B + 1)
    assert bounds.h_star == pytest.approx((0 + B + 2 * B) / total)
    # b: depth 1 shared with 1 earlier -> 1/2. c: depth 1 with 2 earlier -> 3/4,
    # depth 2 with 1 earlier (a) -> 1/2.
    assert bounds.h_random == pytest.approx((0.5 + 0.75 + 0.5) * B / total)


def test_generated_tokens_left_in_the_cache_count() -> None:
    # Turn 2 resends turn 1's prompt and answer: it can reuse the answer's blocks too,
    # but not the answer's last token (never computed).
    prompt = seq(0, 2 * B)
    answer = seq(500, B + 1)
    turn2 = prompt + answer + seq(900, B)
    bounds = compute_bounds([(prompt, answer), (turn2, [])], B, pods=1)
    assert bounds.h_star == pytest.approx(3 * B / (len(prompt) + len(turn2)))


def test_shared_prefix_matches_the_closed_forms() -> None:
    # G groups x P prompts, S system + Q question tokens, S a multiple of the block:
    # h* = (P-1) S / (P (S+Q)) and h_random = (P - E[D]) S / (P (S+Q)) with
    # E[D] = N (1 - (1 - 1/N)^P) the expected number of pods a group lands on.
    groups, per_group, system, question, pods = 5, 12, 8 * B, 3 * B, 4
    requests: list[tuple[list[int], list[int]]] = []
    for p in range(per_group):
        for g in range(groups):
            requests.append(
                (seq(10_000 * g, system) + seq(10**6 + 1000 * (g * 100 + p), question), [])
            )
    bounds = compute_bounds(requests, B, pods)
    assert bounds.h_star == pytest.approx(
        (per_group - 1) * system / (per_group * (system + question))
    )
    expected_pods = pods * (1 - (1 - 1 / pods) ** per_group)
    assert bounds.h_random == pytest.approx(
        (per_group - expected_pods) * system / (per_group * (system + question))
    )


def test_sglang_defaults_land_near_the_published_estimates(builtin_words: Words) -> None:
    workload = shared_prefix(builtin_words, groups=64, prompts_per_group=16)
    bounds = compute_bounds(
        token_sequences(builtin_words.tokenizer, workload.nominal_order()), B, 8
    )
    assert bounds.requests == 1024
    assert bounds.h_star == pytest.approx(0.882, abs=0.01)
    assert bounds.h_random == pytest.approx(0.53, abs=0.015)
