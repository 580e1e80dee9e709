"""The alignment self-check: the block size on every event, and the tokenization
probes (a pick predicts a block key the chosen pod's events should bring)."""

from __future__ import annotations

import random

from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.kvindex.alignment import AlignmentChecker, AlignmentState
from epp.kvindex.blockkeys import BlockKeys
from epp.kvindex.events import HASH_MASK, BlockStored, EventBatch
from epp.kvindex.index import PrefixIndex
from epp.kvindex.ingest import PreciseIndex, StreamIndex
from sim.hashing import BlockHasher, to_event_hash

OWN = BlockKeys(16)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def setup(
    ranks: int = 1, **checker: int
) -> tuple[PreciseIndex, Endpoint, list[StreamIndex], Clock]:
    clock = Clock()
    datastore = Datastore()
    datastore.replace_all([EndpointSpec("pod", "10.0.0.1:8000")])
    endpoint = datastore.get("pod")
    assert endpoint is not None
    precise = PreciseIndex(
        PrefixIndex(100_000, {"gpu": 1.0}),
        16,
        AlignmentChecker(16, 1, clock=clock, window_s=10.0, **checker),  # type: ignore[arg-type]
        None,
    )
    streams = [precise.add_stream(endpoint, rank) for rank in range(ranks)]
    return precise, endpoint, streams, clock


def event(tokens: list[int], seed: str = "0", block_size: int = 16) -> BlockStored:
    """What an engine with this seed publishes for the full blocks of `tokens`."""
    digests = BlockHasher("sha256", seed, block_size).block_hashes(tokens)
    return BlockStored(
        block_hashes=[to_event_hash(d) & HASH_MASK for d in digests],
        parent_block_hash=None,
        token_ids=tokens[: len(digests) * block_size],
        block_size=block_size,
        medium="gpu",
    )


def apply(stream: StreamIndex, *events: BlockStored) -> None:
    stream.apply(EventBatch(0.0, list(events)))


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * 16)]


def probe_key(tokens: list[int]) -> int:
    return OWN.keys(tokens)[3]  # the 4th block (PROBE_BLOCKS)


def test_any_engine_seed_is_aligned() -> None:
    """The index hashes token ids itself: a seed or algorithm of the engine's own
    is no longer a misalignment (it used to distrust the pod)."""
    precise, endpoint, (stream,), _ = setup()
    for seed in ("0", "vllm-none-hash", f"{random.getrandbits(64):x}"):
        apply(stream, event(prompt(1), seed))
    assert stream.alignment.aligned is True
    assert stream.alignment.checked_blocks == 18
    assert precise.trusted(endpoint)
    assert stream.alignment.mismatches == 0


def test_a_wrong_block_size_is_caught_on_every_event_and_nothing_is_indexed() -> None:
    precise, endpoint, (stream,), _ = setup()
    apply(stream, event(prompt(1, 4), block_size=32), event(prompt(2, 4), block_size=32))
    assert stream.alignment.aligned is False
    assert stream.alignment.mismatches == 1  # marked once; the events are still counted
    assert stream.counters.rejected["block_size_mismatch"] == 2
    assert stream.alignment.cause is not None
    assert "block size is 32" in stream.alignment.cause
    assert "set blockSize" in stream.alignment.cause
    assert not precise.trusted(endpoint)
    assert stream.blocks == 0
    assert stream.engine_keys == {}
    # A restart (the stream cleared) checks afresh.
    stream.clear("restart")
    apply(stream, event(prompt(3)))
    assert stream.alignment.aligned is True
    assert precise.trusted(endpoint)


def test_a_probe_is_confirmed_by_the_events_that_follow_the_pick() -> None:
    precise, endpoint, (stream,), _ = setup()
    tokens = prompt(1)
    precise.expect(endpoint, probe_key(tokens), held=False)
    assert len(stream.alignment.pending) == 1
    apply(stream, event(tokens, seed="any"))
    assert stream.alignment.pending == {}
    assert stream.alignment.confirmed == 1
    assert stream.alignment.tokenization is True


def test_a_probe_held_at_pick_time_is_confirmed_at_once() -> None:
    precise, endpoint, (stream,), _ = setup()
    precise.expect(endpoint, 12345, held=True)
    assert stream.alignment.pending == {}
    assert stream.alignment.confirmed == 1


def test_misses_with_events_flowing_flag_the_tokenization_and_a_confirmation_clears_it() -> None:
    precise, endpoint, (stream,), clock = setup(misses_to_flag=3, min_events=2)
    describe = precise.describe
    assert describe(endpoint)["tokenizationAgreement"] is None
    for i in range(3):
        # The EPP tokenized prompt 100 + i one way, the engine cached other tokens.
        precise.expect(endpoint, probe_key(prompt(100 + i)), held=False)
        apply(stream, event(prompt(200 + i)), event(prompt(300 + i)))
        clock.now += 11.0
        apply(stream, event(prompt(400 + i)))  # the expiry is settled on the next batch
    assert stream.alignment.missed == 3
    assert stream.alignment.tokenization is False
    info = describe(endpoint)
    assert info["tokenizationAgreement"] is False
    assert info["tokenizationProbes"]["missed"] == 3
    assert info["trusted"] is True  # flagged, not distrusted: scores are unchanged
    tokens = prompt(7)
    precise.expect(endpoint, probe_key(tokens), held=False)
    apply(stream, event(tokens))
    assert stream.alignment.tokenization is True
    assert stream.alignment.consecutive_misses == 0


def test_a_silent_stream_makes_a_probe_inconclusive_not_a_miss() -> None:
    """A pod whose events did not flow (no room, a long queue, events lost) proves
    nothing: no miss, no flag."""
    precise, endpoint, (stream,), clock = setup(misses_to_flag=1, min_events=2)
    for i in range(5):
        precise.expect(endpoint, probe_key(prompt(100 + i)), held=False)
        clock.now += 11.0
        apply(stream)  # a batch with no BlockStored
    assert stream.alignment.missed == 0
    assert stream.alignment.inconclusive == 5
    assert stream.alignment.tokenization is None


def test_one_rank_confirms_the_probe_for_the_endpoint() -> None:
    precise, endpoint, (rank0, rank1), clock = setup(ranks=2, misses_to_flag=1, min_events=1)
    tokens = prompt(1)
    precise.expect(endpoint, probe_key(tokens), held=False)
    apply(rank1, event(tokens))  # the request went to rank 1
    apply(rank0, event(prompt(2)), event(prompt(3)))  # rank 0 was busy with others
    clock.now += 11.0
    apply(rank0, event(prompt(4)))
    assert rank1.alignment.confirmed == 1
    assert rank0.alignment.missed == 0
    assert precise.describe(endpoint)["tokenizationAgreement"] is True


def test_waiting_probes_are_bounded() -> None:
    precise, endpoint, (stream,), _ = setup(max_pending=4)
    for i in range(10):
        precise.expect(endpoint, probe_key(prompt(i)), held=False)
    assert len(stream.alignment.pending) == 4
    assert stream.alignment.inconclusive == 6


def test_one_pick_in_sample_every_is_probed() -> None:
    checker = AlignmentChecker(16, 8, clock=Clock())
    assert sum(checker.wants_probe() for _ in range(80)) == 10


def test_reset_starts_afresh() -> None:
    state = AlignmentState(aligned=False, mismatches=3, cause="x", tokenization=False)
    state.reset()
    assert state == AlignmentState()
