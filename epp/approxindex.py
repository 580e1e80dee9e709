"""The approximate prefix index: which endpoint was recently sent which prompt
prefix, learnt from this EPP's own routing decisions (GIE's approximate prefix
cache, for pools whose engines publish no KV events).

Prompts are cut into blocks without a tokenizer: a block is `block_size_tokens`
tokens, estimated as `block_size_tokens * chars_per_token` characters of the
prompt text (4 characters per token on average for English), or exactly
`block_size_tokens` ids of a prompt given as token ids. Each block's hash chains
the previous one's (xxh3-64, seeded with the previous hash), so equal hashes mean
equal prefixes; the chain starts from a hash of the target model and the request's
`cache_salt`, so two models, or two tenants with different salts, never share an
entry. The last, partial block is hashed too (as GIE does): an identical prompt
matches to its end. At most `max_blocks` blocks are hashed, computed only as far as
a lookup needs them.

The index keeps, per endpoint, an LRU of block hashes capped at that endpoint's
capacity, and for each hash the endpoints holding it. A lookup walks the prompt's
blocks from the first and stops at the first block no remaining candidate holds:
an endpoint's match is the number of consecutive leading blocks it holds. Adding a
prompt for an endpoint inserts its blocks deepest first, so the shared first
blocks are the most recently used and, under pressure, the deep tail goes first.

Memory: one entry per (endpoint, block), at most the sum of the endpoints'
capacities (about 230 bytes each in CPython, a window entry included). An endpoint
removed from the pool leaves the index with all its entries.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Final

import xxhash

from epp.datastore import Endpoint
from epp.kvindex.index import UNBOUNDED, bits
from epp.lru import LRU, pop_least_recent
from epp.requests import ChatPrompt, CompletionPrompt, InferenceRequest, Message, ResponsesPrompt

DEFAULT_CHARS_PER_TOKEN: Final = 4.0
# Prompt ends remembered for `continues` (8 bytes of hash and a dict entry each).
MAX_PROMPT_ENDS: Final = 65_536

# Separators that cannot appear in JSON text unescaped, so message boundaries and
# roles cannot be forged by message content.
_RECORD: Final = "\x1e"
_UNIT: Final = "\x1f"

_hash = xxhash.xxh3_64_intdigest


def _message_text(message: Message) -> str:
    if message.content is None:
        body = ""
    elif isinstance(message.content, str):
        body = message.content
    else:
        # Non-text parts (images, audio) count by their exact JSON: another image is
        # another prefix.
        body = "".join(
            part.text if part.text is not None else (part.data or b"").decode("utf-8", "replace")
            for part in message.content
        )
    return f"{_RECORD}{message.role or ''}{_UNIT}{body}"


def prompt_units(request: InferenceRequest) -> str | Sequence[int] | None:
    """What a request's prompt is cut into blocks from: its text, its token ids, or
    None for a request without a prompt."""
    prompt = request.prompt
    if prompt is None:
        return None
    if isinstance(prompt, CompletionPrompt):
        # A batch is several sequences; the first one's prefix stands for them.
        return prompt.prompts[0] if prompt.prompts else None
    if isinstance(prompt, ChatPrompt):
        tools = prompt.tools.decode("utf-8", "replace") if prompt.tools else ""
        return tools + "".join(_message_text(m) for m in prompt.messages)
    assert isinstance(prompt, ResponsesPrompt)
    head = f"{_RECORD}instructions{_UNIT}{prompt.instructions or ''}"
    if isinstance(prompt.input, str):
        return head + _RECORD + prompt.input
    return head + "".join(_message_text(m) for m in prompt.input)


def _token_bytes(ids: Sequence[int]) -> bytes:
    try:
        return array("q", ids).tobytes()
    except OverflowError:
        return repr(tuple(ids)).encode()


class PromptBlocks:
    """A prompt's chained block hashes, computed on demand."""

    __slots__ = ("_ascii", "_data", "_hashes", "_seed", "_step", "full", "total", "uncapped")

    def __init__(self, data: str | Sequence[int], step: int, seed: int, max_blocks: int) -> None:
        """`step`: characters (text) or ids (token ids) per block; `max_blocks` 0:
        no limit. `total` blocks are hashed and matched, of the prompt's
        `uncapped`."""
        blocks = math.ceil(len(data) / step) if data else 0
        self.uncapped = blocks
        self.total = min(blocks, max_blocks) if max_blocks > 0 else blocks
        # Whole blocks within the cap (the last, partial block is hashed too).
        self.full = min(len(data) // step, self.total)
        self._data = data
        self._step = step
        self._hashes: list[int] = []
        self._seed = seed
        # ASCII text (`isascii` is O(1)): a character slice of it encodes to the
        # byte slice at the same offsets, so the text within the cap is encoded
        # once here and sliced per block, not sliced and encoded block by block;
        # other text is encoded per block as UTF-8 (surrogates passed through).
        self._ascii: bytes | None = None
        if isinstance(data, str) and self.total > 0 and data.isascii():
            self._ascii = data[: self.total * step].encode("ascii")

    @property
    def is_text(self) -> bool:
        """Cut from text (blocks of characters), not from token ids."""
        return isinstance(self._data, str)

    @property
    def units(self) -> int:
        """The prompt's length: characters (text) or ids (token ids)."""
        return len(self._data)

    @property
    def step(self) -> int:
        """Characters (text) or ids (token ids) per block."""
        return self._step

    def hash(self, i: int) -> int:
        """Block i's hash (0 <= i < total)."""
        hashes = self._hashes
        n = len(hashes)
        if n > i:
            return hashes[i]
        data = self._data
        step = self._step
        total = self.total
        encoded = self._ascii
        previous = hashes[-1] if hashes else self._seed
        while n <= i:
            if encoded is not None and n < total:
                chunk: bytes = encoded[n * step : (n + 1) * step]
            else:
                units = data[n * step : (n + 1) * step]
                chunk = (
                    units.encode("utf-8", "surrogatepass")
                    if isinstance(units, str)
                    else _token_bytes(units)
                )
            previous = _hash(chunk, previous)
            hashes.append(previous)
            n += 1
        if n >= total:
            self._ascii = None  # every block within the cap is hashed
        return previous

    def hashes(self) -> Iterator[int]:
        """The hashes of the blocks within the cap, from the first, each computed
        when first reached: `hash(0)`, `hash(1)`, ... without a call for each (a
        lookup walks a prompt's blocks in order)."""
        hashes = self._hashes
        step = self._step
        total = self.total
        previous = self._seed
        n = 0
        while n < total:
            if n < len(hashes):
                previous = hashes[n]
            elif (encoded := self._ascii) is not None:
                # `hash(n)`'s ASCII path, inline.
                previous = _hash(encoded[n * step : (n + 1) * step], previous)
                hashes.append(previous)
                if n + 1 == total:
                    self._ascii = None  # every block within the cap is hashed
            else:
                previous = self.hash(n)
            yield previous
            n += 1

    def all(self) -> list[int]:
        if self.total:
            self.hash(self.total - 1)
        return self._hashes[: self.total]


def chain_seed(model: str, cache_salt: str | None) -> int:
    """Where a request's hash chain starts: its model and salt go into block 0.

    Both are length-prefixed, so no choice of model name can produce another
    (model, salt) pair's seed: a separator alone could be forged by a model name
    that contains it (JSON strings may carry any control character), letting a
    request for model "m<sep>A" score the blocks of tenant A's salt. An empty salt
    is no salt, as in vLLM."""
    model_bytes = model.encode("utf-8", "surrogatepass")
    salt_bytes = (cache_salt or "").encode("utf-8", "surrogatepass")
    return _hash(
        len(model_bytes).to_bytes(8, "big")
        + model_bytes
        + len(salt_bytes).to_bytes(8, "big")
        + salt_bytes
    )


def prompt_blocks(
    request: InferenceRequest,
    block_size_tokens: int,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    max_blocks: int = 0,
) -> PromptBlocks | None:
    """The request's blocks, or None when it has no prompt."""
    data = prompt_units(request)
    if data is None:
        return None
    step = (
        block_size_tokens
        if not isinstance(data, str)
        else _block_chars(block_size_tokens, chars_per_token)
    )
    seed = chain_seed(request.target_model or request.model, request.cache_salt)
    return PromptBlocks(data, step, seed, max_blocks)


def _block_chars(block_size_tokens: int, chars_per_token: float) -> int:
    return max(1, round(block_size_tokens * chars_per_token))


class PrefixDemand:
    """How many of the recent requests ended their longest held prefix on each
    block: a prefix many requests want, held by few pods, is a hot one
    (`predicted-ttft-scorer`'s `hotPrefixQueueWeight`).

    A request's weight decays by `1 - 1/window` with each later one, counted in
    requests, not seconds, so the same traffic reads the same on the wall clock and
    in the lab's virtual time. At most `max_keys` blocks are kept: past that, the
    less wanted half goes. Memory: a dict entry per block kept."""

    def __init__(self, window: int = 256, max_keys: int = 4096) -> None:
        if window < 2 or max_keys < 1:
            raise ValueError(f"window must be >= 2 and max_keys >= 1, got {window}, {max_keys}")
        self._growth = 1.0 / (1.0 - 1.0 / window)
        self._max_keys = max_keys
        # Later requests weigh more instead of earlier ones decaying: one add
        # touches one entry, not all of them.
        self._weight = 1.0
        self._total = 0.0
        self._counts: dict[int, float] = {}

    def share(self, key: int | None) -> float:
        """The decayed share of recent requests added with `key`, in [0, 1]."""
        if key is None or self._total <= 0.0:
            return 0.0
        return self._counts.get(key, 0.0) / self._total

    def add(self, key: int | None) -> None:
        """One request, whose longest held prefix ended on block `key` (None: it
        held none; it still counts in the shares' total)."""
        weight = self._weight
        self._total += weight
        if key is not None:
            counts = self._counts
            counts[key] = counts.get(key, 0.0) + weight
            if len(counts) > self._max_keys:
                kept = sorted(counts.items(), key=lambda kv: kv[1])[len(counts) // 2 :]
                self._counts = dict(kept)
        self._weight = weight * self._growth
        if self._weight > 1e100:
            # Rescaled long before a float overflows; the shares are unchanged.
            scale = 1.0 / self._weight
            self._weight = 1.0
            self._total *= scale
            self._counts = {k: v * scale for k, v in self._counts.items()}


class ApproxPrefixIndex:
    """Per-endpoint LRUs of block hashes, and the endpoints holding each hash.

    The garbage collector never walks the index, however large: the LRUs are
    lru-dict's, which it does not track, and the owners map holds ints only (an
    endpoint is a bit of a slot mask), which CPython does not track either. With
    OrderedDict LRUs and endpoint-valued owners, every full collection walked all
    the entries with the event loop stalled (docs/performance.md, "Garbage
    collection")."""

    def __init__(self) -> None:
        # Each endpoint recorded has a slot: bit `1 << slot` in the owner masks.
        self._bit_of: dict[Endpoint, int] = {}
        self._endpoint_at: list[Endpoint | None] = []
        self._free_slots: list[int] = []
        self._lrus: dict[Endpoint, LRU[int, None]] = {}
        # Per endpoint, the blocks recorded within its last `window` distinct ones
        # (`add`'s window): what its cache can still hold, a subset of its LRU.
        self._recent: dict[Endpoint, LRU[int, None]] = {}
        # Per hash, the mask of the endpoints holding it.
        self._owners: dict[int, int] = {}
        self.evictions = 0
        self._size = 0
        # The last whole block of each prompt recorded, most recent last: a later
        # prompt whose match ends on one of them continues that prompt.
        self._ends: LRU[int, None] = LRU(MAX_PROMPT_ENDS)

    @property
    def size(self) -> int:
        """Entries (endpoint, block) in the index."""
        return self._size

    def blocks_of(self, endpoint: Endpoint) -> int:
        lru = self._lrus.get(endpoint)
        return len(lru) if lru is not None else 0

    def holders(self, h: int) -> set[Endpoint]:
        """The endpoints holding block hash `h`."""
        endpoints = self._endpoint_at
        found: set[Endpoint] = set()
        for slot in bits(self._owners.get(h, 0)):
            endpoint = endpoints[slot]
            assert endpoint is not None
            found.add(endpoint)
        return found

    @property
    def distinct_blocks(self) -> int:
        """Block hashes held by at least one endpoint."""
        return len(self._owners)

    def match(self, blocks: PromptBlocks, candidates: Collection[Endpoint]) -> dict[Endpoint, int]:
        """Per candidate holding the prompt's first block: how many leading blocks
        it holds. Stops hashing where no candidate can match any further."""
        matched: dict[Endpoint, int] = {}
        owners_of = self._owners
        hashes = blocks.hashes()
        first = next(hashes, None)
        owners = None if first is None else owners_of.get(first)
        if owners is None:
            return matched
        bit_of = self._bit_of
        wanted = 0
        for endpoint in candidates:
            wanted |= bit_of.get(endpoint, 0)
        alive = owners & wanted
        if not alive:
            return matched
        endpoints = self._endpoint_at
        # The endpoints in `alive` hold blocks [0, depth). An endpoint's match is
        # set when it drops out and the last ones' at the end, not on every block.
        depth = 1
        for h in hashes:
            owners = owners_of.get(h)
            if owners is None:
                break
            survivors = alive & owners
            if survivors == alive:
                depth += 1  # the usual case: every endpoint still matching holds it
                continue
            for slot in bits(alive ^ survivors):
                matched[endpoints[slot]] = depth  # type: ignore[index]
            alive = survivors
            if not alive:
                break  # before the next block is hashed: nobody can match it
            depth += 1
        for slot in bits(alive):
            matched[endpoints[slot]] = depth  # type: ignore[index]
        return matched

    def add(
        self, endpoint: Endpoint, hashes: Sequence[int], capacity: int, window: int | None = None
    ) -> None:
        """Record that `endpoint` now holds the blocks `hashes` (a prompt's, in
        order), keeping at most `capacity` blocks for it; with `window`, also which
        of them are among its last `window` distinct blocks (`recent_run`)."""
        if window is not None:
            recent = self._recent.get(endpoint)
            if recent is None:
                recent = self._recent[endpoint] = LRU(UNBOUNDED)
            for h in reversed(hashes):
                recent[h] = None
            limit = min(window, capacity)
            while len(recent) > limit:
                pop_least_recent(recent)
        lru = self._lrus.get(endpoint)
        if lru is None:
            lru = self._lrus[endpoint] = LRU(UNBOUNDED)
        bit = self._bit_of.get(endpoint)
        if bit is None:
            bit = self._take_slot(endpoint)
        owners_of = self._owners
        held = len(lru)
        for h in reversed(hashes):
            if h not in lru:
                owners = owners_of.get(h)
                owners_of[h] = bit if owners is None else owners | bit
            lru[h] = None  # (again): now the most recently used
        self._size += len(lru) - held
        if len(lru) > capacity:
            evicted = [pop_least_recent(lru) for _ in range(len(lru) - capacity)]
            self.evictions += len(evicted)
            self._disown(evicted, bit)

    def mark_end(self, blocks: PromptBlocks) -> None:
        """Remember where `blocks` (a recorded prompt) ends, if it ends within the
        cap: a prompt cut by the cap has no end here to continue."""
        if blocks.full < 1 or blocks.total < blocks.uncapped:
            return
        ends = self._ends
        ends[blocks.hash(blocks.full - 1)] = None  # the oldest goes past MAX_PROMPT_ENDS

    def continues(self, blocks: PromptBlocks, matched: Mapping[Endpoint, int]) -> bool:
        """Whether the prompt's longest match ends exactly where an earlier recorded
        prompt ended: the prompt is that one plus more (a conversation's next turn,
        an agent's next step), not only a prefix shared with others."""
        deepest = max(matched.values(), default=0)
        return 0 < deepest <= blocks.full and blocks.hash(deepest - 1) in self._ends

    def recent_run(self, blocks: PromptBlocks, endpoint: Endpoint, run: int) -> int:
        """How many of the prompt's first `run` blocks (those `match` found on
        `endpoint`) are among its last recorded ones (`add`'s window), from the
        first."""
        recent = self._recent.get(endpoint)
        if recent is None or run <= 0:
            return 0
        # A prompt's blocks were last recorded in order, the first latest: every
        # prompt holding block i + 1 holds block i (the hashes chain), and `add`
        # records a prompt's blocks deepest first. So the window, the latest
        # distinct blocks, holds a leading run of them, found by bisection.
        low, high = 0, run  # blocks [0, low) are in the window; [high, run) are not
        while low < high:
            middle = (low + high) // 2
            if blocks.hash(middle) in recent:
                low = middle + 1
            else:
                high = middle
        return low

    def remove(self, endpoint: Endpoint) -> None:
        """Forget everything about an endpoint (it left the pool)."""
        self._recent.pop(endpoint, None)
        lru = self._lrus.pop(endpoint, None)
        bit = self._bit_of.pop(endpoint, None)
        if bit is None:
            return
        if lru is not None:
            self._disown(lru.keys(), bit)
        # Its bit is in no mask any more: the slot can go to another endpoint.
        slot = bit.bit_length() - 1
        self._endpoint_at[slot] = None
        self._free_slots.append(slot)

    def _take_slot(self, endpoint: Endpoint) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._endpoint_at[slot] = endpoint
        else:
            slot = len(self._endpoint_at)
            self._endpoint_at.append(endpoint)
        bit = self._bit_of[endpoint] = 1 << slot
        return bit

    def _disown(self, hashes: Sequence[int], bit: int) -> None:
        """`hashes` are no longer held by the endpoint of `bit`."""
        self._size -= len(hashes)
        owners_of = self._owners
        keep = ~bit
        for h in hashes:
            rest = owners_of.get(h, 0) & keep
            if rest:
                owners_of[h] = rest
            else:
                owners_of.pop(h, None)
