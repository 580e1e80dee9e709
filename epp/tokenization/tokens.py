"""Token ids as bytes: how prompts travel between the tokenizers, the block hashing
and the prefix indexes.

A prompt's token ids are kept as a native uint32 array's bytes (`token_bytes`):
cheap to slice, compare and use as dictionary keys, and a whole block of them
compares with one memcmp.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Final

TOKEN_TYPECODE: Final = "I"
TOKEN_BYTES: Final = 4
# C's unsigned int is 4 bytes on every platform CPython supports that we run on.
assert array.array(TOKEN_TYPECODE).itemsize == TOKEN_BYTES


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the uint32 array bytes the hashing and the index work on.
    Raises OverflowError for ids outside 0 .. 2**32 - 1."""
    return array.array(TOKEN_TYPECODE, token_ids).tobytes()


def token_ids(data: bytes) -> list[int]:
    """The inverse of `token_bytes`."""
    return array.array(TOKEN_TYPECODE, data).tolist()
