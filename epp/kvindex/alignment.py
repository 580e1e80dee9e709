"""The alignment self-check: do the EPP's block hashes agree with an engine's?

The index is keyed by the engine's hashes and prompts are looked up by recomputing
them, so the two must be computed alike: same algorithm, NONE_HASH seed, block size
and extra-key format. When they differ nothing fails loudly by itself: lookups just
never match (or, worse, match the wrong things after a partial change). So every
stream's BlockStored events are checked against our own computation, from the
event's `token_ids` and parent:

- the event's `block_size` is compared with ours on every event (free);
- block hashes are recomputed for the first events of a stream (`warmup_blocks`),
  then for one event in `sample_every`, at most `max_blocks` blocks each, which
  keeps the cost (1.5 - 6 us per block) far below the ingestion budget;
- an event whose chain starts after a block we never hashed (an unknown parent
  digest), or whose extra keys we cannot rebuild (multimodal, an adapter with no
  configured path under vLLM >= 0.31's format), is skipped as unverifiable.

On the first disagreement the stream is marked misaligned (the scorer then stops
trusting that pod's precise score) and, when the event starts at block 0, the check
tries the other algorithms, seeds and formats to name the likely cause.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from epp.kvindex.events import BlockStored
from epp.kvindex.hashing import (
    DEFAULT_HASH_SEED,
    EXTRA_KEYS_FORMATS,
    HASH_ALGOS,
    EngineHasher,
    ExtraKeys,
    ExtraKeysFormat,
    HashContext,
    key_of,
)
from epp.tokenization.tokens import token_bytes

# Blocks hashed again per checked event, at most (the first ones of the event).
WARMUP_MAX_BLOCKS: Final = 16


@dataclass
class AlignmentState:
    """The check's state for one KV-event stream."""

    events_seen: int = 0
    checked_events: int = 0
    checked_blocks: int = 0
    unverifiable: int = 0
    mismatches: int = 0
    aligned: bool | None = None  # None: nothing checked yet
    cause: str | None = None  # why it is misaligned, as far as can be told

    def reset(self) -> None:
        """The engine restarted (or the stream's index was cleared): check afresh."""
        self.__init__()  # type: ignore[misc]


class AlignmentChecker:
    def __init__(
        self,
        hasher: EngineHasher,
        lora_paths: Mapping[str, str] | None = None,
        warmup_blocks: int = 64,
        sample_every: int = 32,
        max_blocks: int = 2,
    ) -> None:
        self.hasher = hasher
        self.lora_paths = dict(lora_paths or {})
        self.warmup_blocks = warmup_blocks
        self.sample_every = max(1, sample_every)
        self.max_blocks = max(1, max_blocks)

    def check(self, state: AlignmentState, event: BlockStored) -> bool | None:
        """True: the blocks checked agree; False: they do not (the state says why);
        None: nothing was checked."""
        tokens = event.token_ids
        if not tokens:
            return None  # offloading connectors send CPU/storage blocks without tokens
        hasher = self.hasher
        n = len(event.block_hashes)
        if event.block_size != hasher.block_size:
            if event.block_size > 0 and len(tokens) == n * event.block_size:
                self._mismatch(
                    state,
                    f"the engine's block size is {event.block_size}, the scorer's blockSize"
                    f" is {hasher.block_size}",
                )
                return False
            state.unverifiable += 1
            return None
        if len(tokens) != n * hasher.block_size:
            state.unverifiable += 1
            return None
        if not _valid_token_ids(tokens):
            # The wire format only promises a list: ids that are not uint32 cannot
            # be hashed as the engine hashes them (and some values cannot be
            # serialised at all), so the event is unverifiable, never a crash.
            state.unverifiable += 1
            return None
        state.events_seen += 1
        warming = state.checked_blocks < self.warmup_blocks
        if not warming and state.events_seen % self.sample_every:
            return None
        if event.parent_block_hash is None:
            parent = hasher.none_hash
            first_index = 0
        else:
            known = hasher.digest_for_key(event.parent_block_hash)
            if known is None:
                state.unverifiable += 1
                return None
            parent, first_index = known, 1
        extras = self._extra_keys(event, first_index)
        if extras is None:
            state.unverifiable += 1
            return None
        limit = min(n, WARMUP_MAX_BLOCKS if warming else self.max_blocks)
        size = hasher.block_size
        for j in range(limit):
            digest = hasher.digest(parent, tuple(tokens[j * size : (j + 1) * size]), extras[j])
            key = key_of(digest)
            if key != event.block_hashes[j]:
                self._mismatch(state, self._diagnose(event) if first_index == 0 else None)
                return False
            hasher.remember(key, digest)
            parent = digest
        state.checked_events += 1
        state.checked_blocks += limit
        if state.aligned is None:
            state.aligned = True
        return True

    def _extra_keys(self, event: BlockStored, first_index: int) -> list[ExtraKeys] | None:
        """The extra keys our hasher would use for the event's blocks, rebuilt from
        what the event says (its untagged extra keys, its LoRA name); None when they
        cannot be rebuilt."""
        fmt = self.hasher.extra_keys_format
        lora = event.lora_name
        path = self.lora_paths.get(lora) if lora is not None else None
        context = HashContext(lora_name=lora, lora_path=path)
        if not context.hashable(fmt):
            return None
        published = event.extra_keys
        out: list[ExtraKeys] = []
        for j in range(len(event.block_hashes)):
            index = first_index + j  # 0 for the request's first block, else "not 0"
            item = published[j] if published is not None and j < len(published) else None
            expected = [lora] if lora is not None else []
            salt: str | None = None
            if index == 0:
                if published is None:
                    return None  # engines before vLLM 0.17 do not say if block 0 is salted
                if item is not None and not isinstance(item, list | tuple):
                    return None  # a malformed event: not ours to rebuild
                values = list(item) if item is not None else []
                if values[: len(expected)] != expected or not all(
                    isinstance(v, str) for v in values
                ):
                    return None  # multimodal or prompt-embeds keys: not ours to rebuild
                rest = values[len(expected) :]
                if len(rest) > 1:
                    return None
                salt = rest[0] if rest else None
            elif item is not None and (
                not isinstance(item, list | tuple) or list(item) != expected
            ):
                return None  # not a list of keys (a malformed event): not ours to rebuild
            out.append(
                HashContext(cache_salt=salt, lora_name=lora, lora_path=path).extra_keys(index, fmt)
            )
        return out

    def _mismatch(self, state: AlignmentState, cause: str | None) -> None:
        state.mismatches += 1
        state.aligned = False
        if state.cause is None:
            state.cause = cause or (
                "the engine's block hashes differ from the scorer's; check hashAlgo"
                " (--prefix-caching-hash-algo), hashSeed (the engine's PYTHONHASHSEED,"
                f" else {DEFAULT_HASH_SEED!r}), extraKeysFormat and blockSize"
                f" (configured: {self.hasher.describe()})"
            )

    def _diagnose(self, event: BlockStored) -> str:
        """Which configuration reproduces the event's first block, if any."""
        current = self.hasher
        seeds = dict.fromkeys(
            [current.seed, DEFAULT_HASH_SEED, "0", os.environ.get("PYTHONHASHSEED", "0")]
        )
        size = event.block_size
        first = tuple(event.token_ids[:size])
        item = event.extra_keys[0] if event.extra_keys else None
        values = [v for v in item if isinstance(v, str)] if isinstance(item, list) else []
        lora = event.lora_name
        salt = values[-1] if values and values[-1] != lora else None
        for algo in HASH_ALGOS:
            for seed in seeds:
                for fmt in EXTRA_KEYS_FORMATS:
                    context = HashContext(
                        cache_salt=salt, lora_name=lora, lora_path=self.lora_paths.get(lora or "")
                    )
                    if not context.hashable(fmt):
                        continue
                    try:
                        trial = EngineHasher(algo, seed, size, fmt, memo_blocks=16, digest_keys=16)
                    except (ValueError, ImportError):
                        continue
                    extra = context.extra_keys(0, _fmt(fmt))
                    if key_of(trial.digest(None, first, extra)) == event.block_hashes[0]:
                        return (
                            "the engine hashes blocks with"
                            f" algo={algo}, seed={seed!r}, extraKeys={fmt}, blockSize={size};"
                            f" the scorer is configured with {current.describe()}"
                        )
        return (
            "no known configuration reproduces the engine's block hashes (a random seed:"
            " vLLM < 0.29 without PYTHONHASHSEED? a different extra-keys layout?);"
            f" the scorer is configured with {current.describe()}"
        )


def _valid_token_ids(tokens: Sequence[object]) -> bool:
    """Every id an int in the uint32 range, as engines emit them (checked in C). The
    wire decoder only checked that `token_ids` is a list."""
    try:
        token_bytes(tokens)  # type: ignore[arg-type]
    except (OverflowError, TypeError):
        return False
    return True


def _fmt(fmt: str) -> ExtraKeysFormat:
    return "tagged" if fmt == "tagged" else "plain"
