"""Shared pieces of the benchmark tests: tokenizers (loading the real one takes a
second, so once per session)."""

from __future__ import annotations

import pytest

from bench.workloads import Words, default_tokenizer_dir, load_words


@pytest.fixture(scope="session")
def builtin_words() -> Words:
    return load_words(None)


@pytest.fixture(scope="session")
def qwen_words() -> Words:
    directory = default_tokenizer_dir()
    if directory is None:
        pytest.skip("the Qwen2.5 tokenizer of ../shared/testdata is not here")
    return load_words(directory)
