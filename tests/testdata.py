"""The workspace's golden test data (`../shared/testdata`): vLLM block hashes and
KV-event payloads computed with vLLM's own code, a real Qwen2.5 tokenizer. Tests
that need it skip, saying why, where the repository is checked out without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTDATA = (REPO_ROOT / ".." / "shared" / "testdata").resolve()
QWEN_DIR = TESTDATA / "tokenizers" / "qwen2_5"


def testdata_file(relative: str) -> Path:
    path = TESTDATA / relative
    if not path.exists():
        pytest.skip(f"golden test data not found: {path} (it lives in ../shared/testdata)")
    return path


def load_json(relative: str) -> Any:
    return json.loads(testdata_file(relative).read_text())


def qwen_dir() -> Path:
    testdata_file("tokenizers/qwen2_5/tokenizer.json")
    return QWEN_DIR


def token_range(spec: str) -> list[int]:
    """`"1..16"` -> [1, ..., 16] (how the golden files write token ids)."""
    first, last = spec.split("..")
    return list(range(int(first), int(last) + 1))
