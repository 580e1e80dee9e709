"""Token ids as the bytes the prefix indexes hash."""

from __future__ import annotations

import pytest

from epp.tokenization.tokens import token_bytes, token_ids


def test_token_bytes_round_trip_and_refuse_out_of_range_ids() -> None:
    assert token_ids(token_bytes([0, 1, 151_000, 2**32 - 1])) == [0, 1, 151_000, 2**32 - 1]
    with pytest.raises(OverflowError):
        token_bytes([2**32])
    with pytest.raises(OverflowError):
        token_bytes([-1])
