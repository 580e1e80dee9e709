"""The alignment self-check against events hashed by the simulator's engine (an
independent implementation of vLLM's hashing, checked against vLLM's vectors)."""

from __future__ import annotations

from epp.kvindex.alignment import AlignmentChecker, AlignmentState
from epp.kvindex.events import BlockStored
from epp.kvindex.hashing import EngineHasher
from sim.hashing import BlockHasher, event_extra_keys, to_event_hash

TOKENS = list(range(100, 164))  # 4 blocks of 16


def engine_event(
    hasher: BlockHasher,
    tokens: list[int],
    salt: str | None = None,
    first_block: int = 0,
    parent: bytes | None = None,
) -> BlockStored:
    """A BlockStored as the engine publishes it for `tokens` (from `first_block`)."""
    digests = hasher.block_hashes(tokens, salt)
    size = hasher.block_size
    stored = digests[first_block:]
    return BlockStored(
        block_hashes=[to_event_hash(d) for d in stored],
        parent_block_hash=to_event_hash(digests[first_block - 1]) if first_block else None,
        token_ids=tokens[first_block * size : len(stored) * size + first_block * size],
        block_size=size,
        medium="gpu",
        extra_keys=[event_extra_keys(first_block + i, salt) for i in range(len(stored))],
    )


def test_aligned_events_pass() -> None:
    checker = AlignmentChecker(EngineHasher("sha256", "0", 16))
    state = AlignmentState()
    assert checker.check(state, engine_event(BlockHasher("sha256", "0", 16), TOKENS)) is True
    assert state.aligned is True
    assert state.checked_blocks == 4


def test_salted_events_pass_in_both_formats() -> None:
    for fmt in ("tagged", "plain"):
        checker = AlignmentChecker(EngineHasher("sha256", "0", 16, fmt))
        engine = BlockHasher("sha256", "0", 16, fmt)
        state = AlignmentState()
        assert checker.check(state, engine_event(engine, TOKENS, salt="tenant-1")) is True, fmt


def test_an_event_after_a_known_block_is_checked_from_its_parent() -> None:
    ours = EngineHasher("sha256", "0", 16)
    ours.keys(TOKENS[:32])  # a lookup hashed the first two blocks
    checker = AlignmentChecker(ours)
    state = AlignmentState()
    event = engine_event(BlockHasher("sha256", "0", 16), TOKENS, first_block=2)
    assert checker.check(state, event) is True
    # An unknown parent cannot be checked: skipped, not failed.
    unknown = engine_event(BlockHasher("sha256", "0", 16), list(range(500, 564)), first_block=2)
    assert checker.check(state, unknown) is None
    assert state.unverifiable == 1
    assert state.aligned is True


def test_a_wrong_seed_is_caught_and_named() -> None:
    checker = AlignmentChecker(EngineHasher("sha256", "0", 16))
    state = AlignmentState()
    event = engine_event(BlockHasher("sha256", "vllm-none-hash", 16), TOKENS)
    assert checker.check(state, event) is False
    assert state.aligned is False
    assert state.cause is not None
    assert "seed='vllm-none-hash'" in state.cause


def test_a_wrong_algorithm_is_caught_and_named() -> None:
    checker = AlignmentChecker(EngineHasher("sha256", "0", 16))
    state = AlignmentState()
    assert checker.check(state, engine_event(BlockHasher("sha256_cbor", "0", 16), TOKENS)) is False
    assert state.cause is not None
    assert "algo=sha256_cbor" in state.cause


def test_a_wrong_salt_format_is_caught_and_named() -> None:
    checker = AlignmentChecker(EngineHasher("sha256", "0", 16, "tagged"))
    state = AlignmentState()
    event = engine_event(BlockHasher("sha256", "0", 16, "plain"), TOKENS, salt="s")
    assert checker.check(state, event) is False
    assert state.cause is not None
    assert "extraKeys=plain" in state.cause


def test_a_wrong_block_size_is_caught_on_every_event() -> None:
    checker = AlignmentChecker(EngineHasher("sha256", "0", 16), warmup_blocks=0)
    state = AlignmentState()
    assert checker.check(state, engine_event(BlockHasher("sha256", "0", 32), TOKENS)) is False
    assert state.cause is not None
    assert "block size is 32" in state.cause


def test_after_the_warmup_only_a_sample_is_checked() -> None:
    ours = EngineHasher("sha256", "0", 16)
    checker = AlignmentChecker(ours, warmup_blocks=4, sample_every=8, max_blocks=1)
    engine = BlockHasher("sha256", "0", 16)
    state = AlignmentState()
    for i in range(40):
        checker.check(state, engine_event(engine, list(range(i * 100, i * 100 + 64))))
    assert state.checked_events == 1 + 40 // 8  # the warm-up event, then one in 8
    assert state.aligned is True


def test_events_it_cannot_rebuild_are_skipped() -> None:
    checker = AlignmentChecker(EngineHasher("sha256", "0", 16, "tagged"))
    state = AlignmentState()
    engine = BlockHasher("sha256", "0", 16)
    multimodal = engine_event(engine, TOKENS)
    multimodal.extra_keys = [[["img-hash", 0]], None, None, None]
    assert checker.check(state, multimodal) is None
    lora = engine_event(engine, TOKENS)
    lora.lora_name = "adapter"  # vLLM >= 0.31 hashes its path, which we do not know
    assert checker.check(state, lora) is None
    offloaded = engine_event(engine, TOKENS)
    offloaded.token_ids = []
    assert checker.check(state, offloaded) is None
    assert state.aligned is None
    assert state.mismatches == 0


def test_reset_starts_afresh() -> None:
    state = AlignmentState(aligned=False, mismatches=3, cause="x")
    state.reset()
    assert state == AlignmentState()
