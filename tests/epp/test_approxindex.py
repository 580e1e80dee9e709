"""The approximate prefix index: chunking, chaining, salts, the LRU bound."""

from __future__ import annotations

import gc
import random
from collections.abc import Collection

import msgspec
import pytest
import xxhash

from epp import approxindex
from epp.approxindex import (
    ApproxPrefixIndex,
    PrefixDemand,
    PromptBlocks,
    chain_seed,
    prompt_blocks,
)
from epp.datastore import Endpoint
from epp.requests import InferenceRequest, parse_request
from tests.memory import traced_growth
from tests.plugins.helpers import make_endpoints


def request(body: dict[str, object], path: str = "/v1/completions") -> InferenceRequest:
    return parse_request(
        request_id="r", method="POST", path=path, headers={}, body=msgspec.json.encode(body)
    )


def blocks_of(
    body: dict[str, object], path: str = "/v1/completions", **kwargs: int
) -> PromptBlocks:
    found = prompt_blocks(request(body, path), kwargs.pop("block_size", 4), 4.0, **kwargs)
    assert found is not None
    return found


def test_text_is_cut_into_blocks_of_tokens_times_chars_per_token() -> None:
    # 4 tokens x 4 characters = 16 characters per block; the partial tail counts.
    blocks = blocks_of({"model": "m", "prompt": "x" * 40})
    assert blocks.total == 3
    assert len(blocks.all()) == 3
    capped = blocks_of({"model": "m", "prompt": "x" * 400}, max_blocks=5)
    assert capped.total == 5


def test_token_id_prompts_are_cut_by_ids() -> None:
    blocks = blocks_of({"model": "m", "prompt": list(range(10))})
    assert blocks.total == 3  # 4 + 4 + 2 ids


def test_equal_prefixes_share_leading_hashes_and_chain() -> None:
    a = blocks_of({"model": "m", "prompt": "A" * 32 + "tail one"}).all()
    b = blocks_of({"model": "m", "prompt": "A" * 32 + "tail two"}).all()
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    # A block's hash depends on everything before it, not only on its own text.
    c = blocks_of({"model": "m", "prompt": "B" * 16 + "A" * 16}).all()
    assert c[1] != a[1]


def test_model_and_salt_are_in_the_first_block() -> None:
    base = blocks_of({"model": "m", "prompt": "same text here!!"}).all()
    salted = blocks_of({"model": "m", "prompt": "same text here!!", "cache_salt": "tenant-a"}).all()
    other_model = blocks_of({"model": "m2", "prompt": "same text here!!"}).all()
    assert base != salted != other_model
    assert chain_seed("m", None) == chain_seed("m", "")
    assert chain_seed("m", "a") != chain_seed("m", "b")


def test_chat_and_responses_prompts_have_blocks() -> None:
    chat = blocks_of(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hi"},
            ],
        },
        "/v1/chat/completions",
    )
    assert chat.total >= 2
    # A role is part of the prefix: the same text as another role is another prefix.
    swapped = blocks_of(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "You are terse."},
                {"role": "user", "content": "hi"},
            ],
        },
        "/v1/chat/completions",
    )
    assert chat.hash(0) != swapped.hash(0)
    responses = blocks_of(
        {"model": "m", "input": "hello there", "instructions": "be brief"}, "/v1/responses"
    )
    assert responses.total >= 1
    assert prompt_blocks(request({"model": "m"}, "/v1/models"), 4) is None


def chained(text: str, step: int, seed: int, blocks: int) -> list[int]:
    """The definition of a text's block hashes: each block of `step` characters
    encoded as UTF-8 (surrogates passed through), hashed on the one before."""
    hashes: list[int] = []
    previous = seed
    for n in range(blocks):
        chunk = text[n * step : (n + 1) * step].encode("utf-8", "surrogatepass")
        previous = xxhash.xxh3_64_intdigest(chunk, previous)
        hashes.append(previous)
    return hashes


@pytest.mark.parametrize(
    "text",
    [
        "plain ASCII words, " * 40,
        "x" * 16 * 5,  # whole blocks only
        "naïve café, 日本語 and emoji 😀 " * 10,
        "ASCII until the very end" * 5 + "é",
        "a lone surrogate \ud800 in ASCII " * 6,
        "\udc80" * 40,
        "",
    ],
)
@pytest.mark.parametrize("max_blocks", [0, 1, 3])
def test_ascii_and_other_text_hash_as_their_utf8_blocks(text: str, max_blocks: int) -> None:
    """ASCII text is encoded once and sliced; other text is encoded block by block.
    Both give each block the hash of its own UTF-8 bytes, chained, whether the
    blocks are asked for one at a time, all at once, walked in order (with a
    block asked for ahead of the walk) or beyond the cap."""
    step, seed = 16, 12345
    one_by_one = PromptBlocks(text, step, seed, max_blocks)
    expected = chained(text, step, seed, one_by_one.uncapped + 1)
    assert [one_by_one.hash(i) for i in range(one_by_one.total)] == expected[: one_by_one.total]
    at_once = PromptBlocks(text, step, seed, max_blocks)
    assert at_once.all() == expected[: at_once.total]
    # Past the cap (no caller asks, but the hash is still the block's own).
    assert at_once.hash(at_once.total) == expected[at_once.total]
    walked = PromptBlocks(text, step, seed, max_blocks)
    walk = walked.hashes()
    seen = [next(walk)] if walked.total else []
    if walked.total > 2:
        assert walked.hash(2) == expected[2]
    seen.extend(walk)
    assert seen == expected[: walked.total]
    # The encoded text goes once every block within the cap is hashed.
    for blocks in (one_by_one, at_once, walked):
        assert blocks._ascii is None


def test_an_ascii_prefix_hashes_alike_in_ascii_and_in_other_text() -> None:
    """The leading blocks an ASCII prompt shares with a prompt that goes on in
    other characters hash alike: a prefix is matched whatever follows it."""
    head = "shared system prompt, ASCII only. " * 4
    ascii_blocks = blocks_of({"model": "m", "prompt": head + "and an ASCII question"})
    other_blocks = blocks_of({"model": "m", "prompt": head + "and a question in 日本語"})
    assert ascii_blocks._ascii is not None
    assert other_blocks._ascii is None
    whole = len(head) // 16
    assert ascii_blocks.all()[:whole] == other_blocks.all()[:whole]


def reference_match(
    index: ApproxPrefixIndex, blocks: PromptBlocks, candidates: Collection[Endpoint]
) -> dict[Endpoint, int]:
    """`match`'s definition: per candidate holding the first block, the number of
    leading blocks it holds, walking the blocks while any candidate still holds
    them all."""
    matched: dict[Endpoint, int] = {}
    alive = set(candidates)
    for i in range(blocks.total):
        alive &= index.holders(blocks.hash(i))
        if not alive:
            break
        for endpoint in alive:
            matched[endpoint] = i + 1
    return matched


def test_match_is_the_leading_blocks_each_candidate_holds() -> None:
    """`match` against its definition, over prompts sharing prefixes of every
    length, recorded on one pod or several, some evicted, for every subset of
    candidates: the same runs, and hashing stops where no candidate goes on."""
    rng = random.Random(11)
    pods = make_endpoints(5)
    index = ApproxPrefixIndex()
    stems = ["".join(rng.choice("abc") for _ in range(16 * 12)) for _ in range(3)]
    for _ in range(200):
        stem = rng.choice(stems)
        text = stem[: rng.randrange(0, len(stem))] + "x" * rng.randrange(0, 40)
        recorded = blocks_of({"model": "m", "prompt": text})
        index.add(rng.choice(pods), recorded.all(), capacity=rng.choice([8, 40, 1000]))
        probe_text = rng.choice(stems)[: rng.randrange(1, 16 * 12)]
        candidates = rng.sample(pods, rng.randrange(1, len(pods) + 1))
        probe = blocks_of({"model": "m", "prompt": probe_text})
        found = index.match(probe, candidates)
        hashed = len(probe._hashes)
        fresh = blocks_of({"model": "m", "prompt": probe_text})
        expected = reference_match(index, fresh, candidates)
        assert found == expected
        deepest = max(expected.values(), default=0)
        assert hashed == min(deepest + 1, probe.total)


def test_match_counts_leading_blocks_per_candidate() -> None:
    index = ApproxPrefixIndex()
    a, b, c = make_endpoints(3)
    long = blocks_of({"model": "m", "prompt": "P" * 64})  # 4 blocks
    half = blocks_of({"model": "m", "prompt": "P" * 32 + "Q" * 32})
    index.add(a, long.all(), 100)
    index.add(b, half.all(), 100)
    assert index.match(long, [a, b, c]) == {a: 4, b: 2}
    assert index.match(long, [b, c]) == {b: 2}
    assert index.match(blocks_of({"model": "m", "prompt": "Z" * 64}), [a, b, c]) == {}
    assert index.size == 8


def test_a_prefix_under_one_salt_gives_no_affinity_under_another() -> None:
    index = ApproxPrefixIndex()
    (a,) = make_endpoints(1)
    prompt = {"model": "m", "prompt": "shared system prompt " * 10}
    index.add(a, blocks_of({**prompt, "cache_salt": "A"}).all(), 100)
    assert index.match(blocks_of({**prompt, "cache_salt": "A"}), [a])[a] > 0
    assert index.match(blocks_of({**prompt, "cache_salt": "B"}), [a]) == {}
    assert index.match(blocks_of(prompt), [a]) == {}


def test_lru_bound_evicts_the_tail_first() -> None:
    index = ApproxPrefixIndex()
    (a,) = make_endpoints(1)
    blocks = blocks_of({"model": "m", "prompt": "x" * 16 * 10})  # 10 blocks
    index.add(a, blocks.all(), 4)
    assert index.blocks_of(a) == 4
    assert index.size == 4
    assert index.evictions == 6
    # The first blocks were inserted last: what is left is the shared head.
    assert index.match(blocks, [a]) == {a: 4}
    other = blocks_of({"model": "m", "prompt": "y" * 16 * 3})
    index.add(a, other.all(), 4)
    assert index.blocks_of(a) == 4
    assert index.match(other, [a]) == {a: 3}


def test_memory_stays_within_the_bound_however_many_blocks_go_through() -> None:
    """Evicting under the bound frees what it evicts: after the index is full, the
    memory it holds does not grow with the blocks that pass through it (lru-dict's
    popitem kept every evicted block's hash, about 90 bytes each: epp/lru.py)."""
    index = ApproxPrefixIndex()
    (a,) = make_endpoints(1)

    def add(prompts: range) -> None:
        for n in prompts:  # 8 blocks of new text each
            index.add(a, blocks_of({"model": "m", "prompt": f"{n:08d}" * 16}).all(), 64, 32)

    add(range(100))  # full: 64 blocks, 32 in the window
    # 40,000 more blocks evicted after the first 4,000.
    growth = traced_growth(lambda: add(range(100, 600)), lambda: add(range(600, 5600)))
    assert index.size == 64
    assert index.evictions >= 5500 * 8 - 64
    assert growth < 64 * 1024


def test_shared_blocks_and_removal() -> None:
    index = ApproxPrefixIndex()
    a, b = make_endpoints(2)
    blocks = blocks_of({"model": "m", "prompt": "s" * 48})
    index.add(a, blocks.all(), 100)
    index.add(b, blocks.all(), 100)
    assert index.match(blocks, [a, b]) == {a: 3, b: 3}
    index.remove(a)
    assert index.match(blocks, [a, b]) == {b: 3}
    assert index.size == 3
    index.remove(b)
    assert index.size == 0
    assert index.distinct_blocks == 0
    assert index.holders(blocks.hash(0)) == set()


def test_hashing_stops_where_no_candidate_can_match() -> None:
    index = ApproxPrefixIndex()
    (a,) = make_endpoints(1)
    blocks = blocks_of({"model": "m", "prompt": "q" * 16 * 200}, max_blocks=0)
    assert blocks.total == 200
    index.match(blocks, [a])
    assert len(blocks._hashes) == 1  # the first block matched nobody


def test_a_prompt_that_extends_a_whole_earlier_prompt_continues_it() -> None:
    a, b = make_endpoints(2)
    index = ApproxPrefixIndex()
    system = "s" * 64  # 4 blocks of 16 characters, shared by every prompt below
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "q" * 40}]
    first = blocks_of({"model": "m", "messages": chat}, "/v1/chat/completions")
    index.add(a, first.all(), 1000)
    index.mark_end(first)
    # The next turn: the whole first prompt, the answer, a new question.
    turn = [*chat, {"role": "assistant", "content": "r" * 40}, {"role": "user", "content": "w"}]
    second = blocks_of({"model": "m", "messages": turn}, "/v1/chat/completions")
    matched = index.match(second, [a, b])
    assert matched == {a: first.full}
    assert index.continues(second, matched)
    # Another conversation over the same system prompt shares a prefix only.
    other = [{"role": "system", "content": system}, {"role": "user", "content": "z" * 40}]
    third = blocks_of({"model": "m", "messages": other}, "/v1/chat/completions")
    matched = index.match(third, [a, b])
    assert 0 < matched[a] < first.full
    assert not index.continues(third, matched)
    # Nothing matched: nothing continued.
    assert not index.continues(blocks_of({"model": "m", "prompt": "n" * 80}), {})


def test_the_last_prompt_ends_are_remembered_and_the_oldest_goes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(approxindex, "MAX_PROMPT_ENDS", 3)
    (a,) = make_endpoints(1)
    index = ApproxPrefixIndex()
    firsts = [blocks_of({"model": "m", "prompt": c * 64}) for c in "abcde"]
    nexts = [blocks_of({"model": "m", "prompt": c * 64 + "next turn"}) for c in "abcde"]
    for first in firsts:
        index.add(a, first.all(), 1000)

    def continued() -> list[bool]:
        return [index.continues(turn, index.match(turn, [a])) for turn in nexts]

    assert continued() == [False] * 5
    for first in firsts[:3]:
        index.mark_end(first)
    assert continued() == [True, True, True, False, False]
    index.mark_end(firsts[0])  # marked again: the most recent now
    index.mark_end(firsts[3])  # a fourth: the oldest, the second, goes
    assert continued() == [True, False, True, True, False]


def test_a_prompt_cut_by_the_cap_marks_no_end() -> None:
    (a,) = make_endpoints(1)
    index = ApproxPrefixIndex()
    capped = blocks_of({"model": "m", "prompt": "x" * 400}, max_blocks=5)
    index.add(a, capped.all(), 1000)
    index.mark_end(capped)
    longer = blocks_of({"model": "m", "prompt": "x" * 800}, max_blocks=5)
    matched = index.match(longer, [a])
    assert matched == {a: 5}
    # Both are cut at block 5: the second is not known to extend the first.
    assert not index.continues(longer, matched)


def test_the_window_run_is_the_leading_blocks_among_the_latest_distinct_recorded() -> None:
    """`recent_run` against its definition, over prompts that share prefixes of
    every length: the latest `window` distinct blocks recorded (each prompt's
    deepest first), and the prompt's leading blocks among them."""
    rng = random.Random(7)
    (pod,) = make_endpoints(1)
    index = ApproxPrefixIndex()
    stems = [" ".join(rng.choice("abcdefgh") * 4 for _ in range(12)) for _ in range(3)]
    recorded: list[int] = []
    window = 10
    for _ in range(60):
        text = (
            rng.choice(stems)[: rng.randrange(8, 60)]
            + " " * rng.randrange(0, 3)
            + "x" * (rng.randrange(0, 40))
        )
        blocks = blocks_of({"model": "m", "prompt": text})
        probe = blocks_of({"model": "m", "prompt": rng.choice(stems)})
        run = index.match(probe, [pod]).get(pod, 0)
        latest: list[int] = []
        for h in reversed(recorded):
            if h not in latest:
                latest.append(h)
        latest = latest[:window]
        expected = next((i for i in range(run) if probe.hash(i) not in latest), run)
        assert index.recent_run(probe, pod, run) == expected
        index.add(pod, blocks.all(), capacity=1000, window=window)
        recorded.extend(reversed(blocks.all()))


def test_prefix_demand_is_each_keys_decayed_share_of_the_requests() -> None:
    demand = PrefixDemand(window=4)
    assert demand.share(1) == 0.0  # nothing counted yet
    for key in (1, None, 1, 2):
        demand.add(key)
    # Weights 1, 4/3, (4/3)^2, (4/3)^3: later requests weigh more.
    weights = [(4 / 3) ** i for i in range(4)]
    assert demand.share(1) == pytest.approx((weights[0] + weights[2]) / sum(weights))
    assert demand.share(2) == pytest.approx(weights[3] / sum(weights))
    assert demand.share(None) == 0.0
    assert demand.share(3) == 0.0
    # Thousands of requests later the weights are rescaled, not overflowed, and a
    # key that stopped coming is forgotten.
    for _ in range(5000):
        demand.add(2)
    assert demand.share(2) == pytest.approx(1.0)
    assert demand.share(1) < 1e-9


def test_prefix_demand_keeps_the_most_wanted_keys_within_its_bound() -> None:
    demand = PrefixDemand(window=1000, max_keys=8)
    for _ in range(20):
        demand.add(0)  # one key wanted often
    for key in range(1, 50):
        demand.add(key)  # many wanted once
    assert demand.share(0) > 0.2
    assert sum(demand.share(k) > 0.0 for k in range(50)) <= 8


@pytest.mark.parametrize(("window", "max_keys"), [(1, 10), (0, 10), (10, 0)])
def test_prefix_demand_refuses_a_window_or_bound_that_counts_nothing(
    window: int, max_keys: int
) -> None:
    with pytest.raises(ValueError, match="window must be >= 2 and max_keys >= 1"):
        PrefixDemand(window=window, max_keys=max_keys)


def collector_walk(root: object) -> int:
    """How many references the cyclic garbage collector follows from `root` through
    the tracked containers it reaches (types, shared by everything, not followed)."""
    seen: set[int] = set()
    stack = [root]
    followed = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, type):
            continue
        seen.add(id(obj))
        referents = gc.get_referents(obj)
        followed += len(referents)
        stack.extend(referents)
    return followed


def test_the_garbage_collector_walks_as_much_of_a_full_index_as_of_an_empty_one() -> None:
    """A full collection must not stall the event loop in proportion to the index:
    however many blocks the endpoints hold, shared or not, in windows or evicted,
    the collector follows the same few references through it."""
    rng = random.Random(3)
    pods = make_endpoints(4)
    walks = []
    for prompts in (1, 400):
        index = ApproxPrefixIndex()
        shared = [rng.getrandbits(64) for _ in range(20)]
        for i in range(prompts):
            own = [rng.getrandbits(64) for _ in range(30)]
            for pod in pods[: len(pods) if i == 0 else 1 + i % len(pods)]:
                index.add(pod, shared + own, capacity=5_000, window=1_000)
            index.mark_end(blocks_of({"model": "m", "prompt": f"prompt {i} " * 8}))
        index.remove(pods[-1])
        if prompts > 1:
            assert index.size > 10_000
            assert index.evictions > 0
        walks.append(collector_walk(index))
    assert walks[0] == walks[1]


def test_an_endpoint_taking_a_removed_ones_place_inherits_none_of_its_blocks() -> None:
    index = ApproxPrefixIndex()
    a, b, c = make_endpoints(3)
    mine = blocks_of({"model": "m", "prompt": "a" * 64})
    theirs = blocks_of({"model": "m", "prompt": "b" * 64})
    index.add(a, mine.all(), 100)
    index.add(b, mine.all()[:2], 100)
    index.remove(a)
    index.add(c, theirs.all(), 100)  # c is given the slot a had
    assert index.match(mine, [a, b, c]) == {b: 2}
    assert index.match(theirs, [a, b, c]) == {c: 4}
    assert index.holders(mine.hash(0)) == {b}
    assert index.size == 6
    index.add(a, theirs.all(), 100)  # a comes back: a slot of its own again
    assert index.match(theirs, [a, b, c]) == {a: 4, c: 4}
