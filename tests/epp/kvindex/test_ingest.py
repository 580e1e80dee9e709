"""KV events into the index keyed by the EPP's own block keys: with no hash settings,
events hashed exactly as vLLM hashes them (any seed, any algorithm, both wire
encodings, int and bytes hashes) make the holding pod score 1; salts, LoRA
adapters and media keep blocks apart; removals, clears, replays, token-less
offload events and bad events do what they should and nothing else."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.kvindex import service as service_module
from epp.kvindex.blockkeys import HashContext
from epp.kvindex.events import HASH_MASK, decode_batch
from epp.kvindex.ingest import MAP_SLACK, StreamIndex
from epp.kvindex.service import PrecisePrefixConfig, PrecisePrefixService, PromptMatch
from epp.tokenization.tokens import token_bytes
from sim.hashing import BlockHasher, event_extra_keys, to_event_hash
from sim.kv_events import BlockStored, EventBatchEncoder
from tests.memory import traced_growth

BS = 16
TOKENS = list(range(5000, 5000 + 6 * BS))  # 6 blocks


def service(**config: Any) -> tuple[PrecisePrefixService, Endpoint, Endpoint]:
    """A service with no hash settings at all (the defaults), two pods."""
    datastore = Datastore()
    datastore.replace_all([EndpointSpec("a", "10.0.0.1:8000"), EndpointSpec("b", "10.0.0.2:8000")])
    a, b = datastore.get("a"), datastore.get("b")
    assert a is not None
    assert b is not None
    return PrecisePrefixService(PrecisePrefixConfig(**config), datastore), a, b


def score(
    svc: PrecisePrefixService, endpoint: Endpoint, tokens: list[int], **context: Any
) -> float:
    others = list(svc.subscriber.datastore.all_endpoints())
    return svc.lookup(token_bytes(tokens), HashContext(**context), others).score(endpoint)


def random_seed() -> str:
    return f"{random.getrandbits(64):x}"


def digests(algo: str, seed: str, tokens: list[int], salt: str | None = None) -> list[bytes]:
    """vLLM's full block digests, from the simulator's hasher (checked against vLLM's
    vectors)."""
    return BlockHasher(algo, seed, BS).block_hashes(tokens, salt)  # type: ignore[arg-type]


def feed(svc: PrecisePrefixService, endpoint: Endpoint, payload: bytes) -> StreamIndex:
    return svc.feed(endpoint, decode_batch(payload))


def sim_stored(
    hashes: list[bytes], tokens: list[int], first: int = 0, salt: str | None = None
) -> BlockStored:
    """The simulator's BlockStored for blocks first.. of a request (parent: the block
    before, as vLLM chains events)."""
    return BlockStored(
        block_hashes=tuple(hashes[first:]),
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tuple(tokens[first * BS : len(hashes) * BS]),
        block_size=BS,
        extra_keys=tuple(event_extra_keys(i, salt) for i in range(first, len(hashes))),
    )


# -- any engine, no settings ------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("wire", ["array", "map"])
@pytest.mark.parametrize("int_hashes", [True, False])
def test_any_seed_and_algorithm_scores_one_with_no_hash_settings(
    algo: str, wire: str, int_hashes: bool
) -> None:
    svc, a, b = service()
    hashes = digests(algo, random_seed(), TOKENS)
    encoder = EventBatchEncoder(format=wire, int_hashes=int_hashes)  # type: ignore[arg-type]
    # Two steps of one request: blocks 0-1, then 2-5 chained on block 1.
    feed(svc, a, encoder.encode(1.0, [sim_stored(hashes[:2], TOKENS)]))
    stream = feed(svc, a, encoder.encode(2.0, [sim_stored(hashes, TOKENS, first=2)]))
    assert score(svc, a, TOKENS) == 1.0
    assert score(svc, b, TOKENS) == 0.0
    assert score(svc, a, TOKENS[: 3 * BS] + [1, 2, 3] * BS) == 0.5  # diverges at block 3
    assert svc.precise.trusted(a)
    assert stream.alignment.aligned is True
    assert not stream.counters.rejected
    assert not stream.counters.ignored
    # The digest is the XOR of the engine's hashes (low 60 bits), as before.
    expected = 0
    for digest in hashes:
        expected ^= int.from_bytes(digest[-8:], "big") & HASH_MASK
    assert svc.precise.describe(a)["digest"] == {"gpu": f"{expected:016x}"}


def test_pods_with_different_seeds_share_keys() -> None:
    svc, a, b = service()
    encoder = EventBatchEncoder()
    feed(svc, a, encoder.encode(1.0, [sim_stored(digests("sha256", "0", TOKENS), TOKENS)]))
    feed(svc, b, encoder.encode(1.0, [sim_stored(digests("xxhash", "9", TOKENS), TOKENS)]))
    assert score(svc, a, TOKENS) == score(svc, b, TOKENS) == 1.0
    assert svc.precise.index.physical_keys() == 6  # one entry per block for both pods


# -- salts, LoRA, media --------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["0", None])
def test_cache_salt_isolation(seed: str | None) -> None:
    """A salted request is credited only for blocks stored under its own salt."""
    svc, a, b = service()
    engine_seed = seed or random_seed()
    encoder = EventBatchEncoder()
    salted = digests("sha256", engine_seed, TOKENS, "tenant-1")
    plain = digests("sha256", engine_seed, TOKENS)
    feed(svc, a, encoder.encode(1.0, [sim_stored(salted, TOKENS, salt="tenant-1")]))
    feed(svc, b, encoder.encode(1.0, [sim_stored(plain, TOKENS)]))
    assert score(svc, a, TOKENS, cache_salt="tenant-1") == 1.0
    assert score(svc, b, TOKENS, cache_salt="tenant-1") == 0.0  # unsalted blocks
    assert score(svc, a, TOKENS, cache_salt="tenant-2") == 0.0  # another salt's
    assert score(svc, a, TOKENS) == 0.0  # an unsalted request on salted blocks
    assert score(svc, b, TOKENS) == 1.0


def old_engine_event(hashes: list[int], tokens: list[int], **fields: Any) -> dict[str, Any]:
    """A map-encoded BlockStored with only what an older vLLM publishes."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        **fields,
    }


def payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def sglang_event(
    hashes: list[int], tokens: list[int], parent: int | None = None, salt: str | None = None
) -> dict[str, Any]:
    """A BlockStored as SGLang publishes it: map-encoded, the salt in a field of its
    own, hashes signed 64-bit ints, no medium."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": None,
        "cache_salt": salt,
        "session_id": None,
        "lora_name": None,
    }


def test_sglang_events_index_and_their_salt_field_keeps_tenants_apart() -> None:
    svc, a, b = service()
    rng = random.Random(5)
    signed = [rng.randrange(-(2**63), 2**63) for _ in range(8)]
    longer = TOKENS + list(range(9000, 9000 + 2 * BS))
    # Pod a: a salted request, its first 6 blocks, then 2 more chained on them.
    feed(svc, a, payload(sglang_event(signed[:6], TOKENS, salt="tenant-1")))
    feed(svc, a, payload(sglang_event(signed[6:], longer[6 * BS :], signed[5])))
    # Pod b: the same tokens unsalted, under other hashes.
    feed(svc, b, payload(sglang_event([h ^ 1 for h in signed[:6]], TOKENS)))
    assert score(svc, a, longer, cache_salt="tenant-1") == 1.0
    assert score(svc, b, TOKENS, cache_salt="tenant-1") == 0.0
    assert score(svc, a, TOKENS, cache_salt="tenant-2") == 0.0
    assert score(svc, a, TOKENS) == 0.0
    assert score(svc, b, TOKENS) == 1.0


def test_engines_before_0_17_publish_no_salt_a_salted_request_never_matches_them() -> None:
    """Their events carry no extra keys: blocks are keyed unsalted. A salted request
    never gets credit for them (its block 0 key has the salt); an unsalted request
    may match blocks a salted request left there (the documented asymmetry)."""
    svc, a, _ = service()
    hashes = [
        to_event_hash(d) & HASH_MASK for d in BlockHasher("sha256", "0", BS).block_hashes(TOKENS)
    ]
    feed(svc, a, payload(old_engine_event(hashes, TOKENS)))
    assert score(svc, a, TOKENS, cache_salt="tenant-1") == 0.0
    assert score(svc, a, TOKENS) == 1.0


def test_lora_blocks_match_requests_for_the_same_adapter_name() -> None:
    svc, a, b = service()
    hashes = [random.getrandbits(64) for _ in range(6)]
    feed(
        svc,
        a,
        payload(
            # vLLM >= 0.17: the name in lora_name and first in each block's extra keys
            old_engine_event(hashes, TOKENS, lora_name="sql", extra_keys=[["sql"]] * 6, lora_id=3)
        ),
    )
    # vLLM 0.14 - 0.16: the name, no extra keys
    feed(svc, b, payload(old_engine_event(hashes, TOKENS, lora_name="sql", lora_id=3)))
    assert score(svc, a, TOKENS, lora_name="sql") == 1.0
    assert score(svc, b, TOKENS, lora_name="sql") == 1.0
    assert score(svc, a, TOKENS) == 0.0  # the base model's request
    assert score(svc, a, TOKENS, lora_name="chat") == 0.0  # another adapter


def test_a_salted_lora_request() -> None:
    svc, a, _ = service()
    extra = [["sql", "tenant-1"]] + [["sql"]] * 5
    feed(svc, a, payload(old_engine_event([1, 2, 3, 4, 5, 6], TOKENS, lora_name="sql",
                                          extra_keys=extra)))  # fmt: skip
    assert score(svc, a, TOKENS, lora_name="sql", cache_salt="tenant-1") == 1.0
    assert score(svc, a, TOKENS, lora_name="sql") == 0.0
    assert score(svc, a, TOKENS, cache_salt="tenant-1") == 0.0


def test_adapters_known_only_by_id_never_match() -> None:
    """Before vLLM 0.14 events name no adapter: such blocks are keyed apart rather
    than counted for the base model."""
    svc, a, _ = service()
    feed(svc, a, payload(old_engine_event([1, 2, 3, 4, 5, 6], TOKENS, lora_id=7)))
    assert svc.precise.streams(a)[0].blocks == 6
    assert score(svc, a, TOKENS) == 0.0


@pytest.mark.parametrize(
    "extra",
    [
        [[["img-hash", 0]]] + [None] * 5,  # vLLM 0.19+: (identifier, offset)
        [["img-hash"]] + [None] * 5,  # before 0.19: the identifier (read as a salt)
        [None, [b"\x01" * 32], None, None, None, None],  # prompt embeddings' digest
    ],
)
def test_multimodal_blocks_never_match_a_text_prompt(extra: list[Any]) -> None:
    svc, a, _ = service()
    feed(svc, a, payload(old_engine_event([1, 2, 3, 4, 5, 6], TOKENS, extra_keys=extra)))
    assert svc.precise.streams(a)[0].blocks == 6
    assert score(svc, a, TOKENS) < 1.0
    if extra[0] is not None:
        assert score(svc, a, TOKENS) == 0.0


# -- the map: removals, clears, replays, offloading, bad events -------------------------------


def hand(hashes: list[int], parent: int | None = None, tokens: list[int] | None = None,
         medium: str = "GPU", **fields: Any) -> dict[str, Any]:  # fmt: skip
    """A BlockStored of blocks of TOKENS, by index in the hand-made hashes 1.. ."""
    if tokens is None:
        tokens = [t for h in hashes for t in TOKENS[(h - 1) * BS : h * BS]]
    return {**old_engine_event(hashes, tokens, medium=medium), "parent_block_hash": parent,
            **fields}  # fmt: skip


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def test_removals_resolve_through_the_map_and_replays_are_idempotent() -> None:
    svc, a, _ = service()
    stream = feed(svc, a, payload(hand([1, 2]), hand([3, 4, 5, 6], parent=2)))
    feed(svc, a, payload(hand([3, 4, 5, 6], parent=2)))  # the same event again
    assert stream.blocks == 6
    assert score(svc, a, TOKENS) == 1.0
    feed(svc, a, payload(removed([4])))
    assert stream.blocks == 5
    assert score(svc, a, TOKENS) == 0.5  # blocks 0-2
    assert 4 not in stream.engine_keys
    assert len(stream.engine_keys) == 5


def test_unknown_parent_wrong_token_count_and_unknown_removal_are_counted_not_indexed() -> None:
    svc, a, _ = service()
    stream = feed(
        svc,
        a,
        payload(
            hand([3, 4], parent=99),  # parent never stored
            hand([1, 2], tokens=TOKENS[: BS + 3]),  # not 2 x 16 tokens
            hand([1], tokens=[-1] * BS),  # not uint32
            removed([42]),  # never stored
        ),
    )
    counters = stream.counters
    assert counters.ignored == {"unknown_parent": 1}
    assert counters.rejected == {"bad_token_count": 1, "bad_token_ids": 1}
    assert counters.unknown_hashes == {"unknown_removal": 1}
    assert counters.events_applied == 1  # the removal (it removed nothing)
    assert stream.blocks == 0
    assert stream.engine_keys == {}
    assert svc.precise.index.stats.entries == 0


def test_tokenless_offload_events_resolve_through_the_map() -> None:
    """CPU-offload connectors publish BlockStored with no tokens (block size 0
    sometimes, no parent): the blocks the GPU stored are found by their hashes."""
    svc, a, _ = service()
    stream = feed(svc, a, payload(hand([1, 2, 3, 4, 5, 6])))
    feed(svc, a, payload(hand([1, 2, 3, 9], tokens=[], medium="CPU", block_size=0)))
    assert svc.precise.describe(a)["blocksByMedium"] == {"gpu": 6, "cpu": 3}
    assert stream.counters.unknown_hashes == {"unknown_block": 1}
    # The GPU copies go; the CPU ones still count (weighted 0.8) and their hashes
    # stay known until the CPU copies go too.
    feed(svc, a, payload(removed([1, 2, 3, 4, 5, 6])))
    assert score(svc, a, TOKENS) == pytest.approx(3 * 0.8 / 6)
    assert set(stream.engine_keys) == {1, 2, 3}
    feed(svc, a, payload(removed([1, 2, 3], medium="CPU")))
    assert stream.blocks == 0
    assert stream.engine_keys == {}


def test_all_blocks_cleared_and_a_restart_drop_the_map() -> None:
    svc, a, _ = service()
    stream = feed(svc, a, payload(hand([1, 2, 3])))
    feed(svc, a, payload({"type": "AllBlocksCleared"}))
    assert stream.blocks == 0
    assert stream.engine_keys == {}
    assert score(svc, a, TOKENS) == 0.0
    # After the clear, a child of a block stored before is an unknown parent.
    feed(svc, a, payload(hand([4], parent=3)))
    assert stream.counters.ignored == {"unknown_parent": 1}
    feed(svc, a, payload(hand([1, 2, 3])))
    stream.clear("restart")  # what the subscriber does when seq goes back
    assert stream.engine_keys == {}
    assert score(svc, a, TOKENS) == 0.0
    svc.precise.remove_endpoint(a)
    assert stream.engine_keys == {}


def test_a_block_size_other_than_ours_is_rejected_with_a_hint() -> None:
    svc, a, _ = service(block_size=16)
    event = hand([1, 2, 3], tokens=TOKENS[: 3 * 32], block_size=32)
    stream = feed(svc, a, payload(event))
    assert stream.counters.rejected == {"block_size_mismatch": 1}
    assert stream.blocks == 0
    assert not svc.precise.trusted(a)
    assert "set blockSize" in str(svc.precise.describe(a)["alignmentCause"])


def test_the_same_tokens_under_two_hashes_stay_held_until_both_go() -> None:
    """An engine before vLLM 0.17 caching one prompt under two salts: two hashes,
    one key (no salt in its events). Removing one hash leaves the block held."""
    svc, a, _ = service()
    stream = feed(svc, a, payload(hand([1, 2])))
    feed(svc, a, payload(old_engine_event([11, 12], TOKENS[: 2 * BS])))
    assert stream.blocks == 2
    feed(svc, a, payload(removed([1, 2])))
    assert stream.blocks == 2
    assert score(svc, a, TOKENS[: 2 * BS]) == 1.0
    feed(svc, a, payload(removed([11, 12])))
    assert stream.blocks == 0
    assert stream.engine_keys == {}


def test_the_map_is_trimmed_of_what_the_index_no_longer_holds() -> None:
    """Blocks evicted by the index's bound (or whose removal was lost) leave their
    hashes in the map until it outgrows twice the stream's live entries."""
    svc, a, _ = service(max_index_entries=1000)
    stream: StreamIndex | None = None
    for i in range(2 * MAP_SLACK):
        tokens = [i * BS + t for t in range(BS)]
        stream = feed(svc, a, payload(old_engine_event([i + 1], tokens)))
    assert stream is not None
    assert stream.blocks <= 1000
    assert len(stream.engine_keys) <= 2 * 1000 + MAP_SLACK
    assert stream.counters.map_trimmed > 0
    # What is left resolves: the newest blocks are still removable.
    feed(svc, a, payload(removed([2 * MAP_SLACK])))
    assert stream.counters.unknown_hashes == {}


# -- speculative entries -------------------------------------------------------------------


@pytest.mark.parametrize("disaggregated", [False, True])
def test_a_pick_is_held_speculatively_on_every_pod_that_holds_its_kv(disaggregated: bool) -> None:
    """A disaggregated pick's prefill pod computed the prompt's blocks and keeps them:
    until either engine's events arrive, both count as holding them."""
    svc, decode, prefill = service(block_size=BS, speculative_indexing=True)
    datastore = svc.subscriber.datastore
    datastore.replace_all(
        [*(e.spec for e in (decode, prefill)), EndpointSpec("c", "10.0.0.3:8000")]
    )
    other = datastore.get("c")
    assert other is not None
    pods = [decode, prefill, other]
    # Each engine reported something else: a stream each, trusted, none holds TOKENS.
    elsewhere = [t + 100_000 for t in TOKENS]
    for pod in pods:
        feed(
            svc,
            pod,
            EventBatchEncoder().encode(
                1.0, [sim_stored(digests("sha256", "s", elsewhere), elsewhere)]
            ),
        )
    found = svc.lookup(token_bytes(TOKENS), HashContext(), pods)
    assert {pod: found.score(pod) for pod in pods} == {decode: 0.0, prefill: 0.0, other: 0.0}
    svc.record_pick(found, (decode, prefill) if disaggregated else (decode,))
    again = svc.lookup(token_bytes(TOKENS), HashContext(), pods)
    held = {pod.name: again.score(pod) for pod in pods}
    assert held == {"a": 1.0, "b": 1.0 if disaggregated else 0.0, "c": 0.0}
    svc.record_pick(again, ())  # nothing picked: nothing recorded, nothing raised


# -- routed prompts' ends ------------------------------------------------------------------


def test_a_routed_prompts_end_is_remembered_until_newer_ones_push_it_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`continues` knows a prompt that goes on from an earlier routed one, for the
    last MAX_PROMPT_ENDS routed prompts: the oldest end, and its anchor, go first."""
    monkeypatch.setattr(service_module, "MAX_PROMPT_ENDS", 3)
    svc, a, _ = service(block_size=BS)
    firsts = [list(range(10_000 * (p + 1), 10_000 * (p + 1) + 2 * BS)) for p in range(5)]
    # Each conversation's next turn: its first turn plus a block of its own.
    nexts = [first + [90_000 + p * BS + t for t in range(BS)] for p, first in enumerate(firsts)]

    def lookup(tokens: list[int]) -> PromptMatch:
        return svc.lookup(token_bytes(tokens), HashContext(), [a])

    for turn in nexts:  # the engine holds every conversation's next turn
        stored = sim_stored(digests("sha256", "s", turn), turn)
        feed(svc, a, EventBatchEncoder().encode(1.0, [stored]))
    assert not any(svc.continues(lookup(turn)) for turn in nexts)  # nothing routed yet
    for first in firsts[:3]:
        svc.record_pick(lookup(first), (a,))
    assert [svc.continues(lookup(turn)) for turn in nexts] == [True, True, True, False, False]
    svc.record_pick(lookup(firsts[3]), (a,))  # a fourth end: the first one's goes
    assert [svc.continues(lookup(turn)) for turn in nexts] == [False, True, True, True, False]
    assert len(svc._end_anchors) <= 3


def test_prompt_ends_past_the_bound_leave_no_memory_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once MAX_PROMPT_ENDS prompts are remembered, each new one pushes the oldest
    end and anchor out and frees them: the service's memory stays level however
    many prompts are routed (lru-dict's popitem kept every evicted anchor: epp/lru.py)."""
    monkeypatch.setattr(service_module, "MAX_PROMPT_ENDS", 16)
    svc, a, _ = service(block_size=BS)
    shared = list(range(500, 500 + BS))  # a system prompt the engine holds
    feed(
        svc,
        a,
        EventBatchEncoder().encode(1.0, [sim_stored(digests("sha256", "s", shared), shared)]),
    )

    def route(prompts: range) -> None:
        for p in prompts:  # then two blocks of tokens no other prompt has
            tokens = shared + list(range(10_000 * (p + 1), 10_000 * (p + 1) + 2 * BS))
            svc.record_pick(svc.lookup(token_bytes(tokens), HashContext(), [a]), (a,))

    route(range(100))  # past the bound
    growth = traced_growth(lambda: route(range(100, 400)), lambda: route(range(400, 2400)))
    assert len(svc._end_anchors) <= 16
    assert len(svc._anchor_order) <= 16
    assert growth < 32 * 1024
