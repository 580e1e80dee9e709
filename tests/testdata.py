"""The workspace's golden test data (`../shared/testdata`): vLLM block hashes and
KV-event payloads computed with vLLM's own code, a real Qwen2.5 tokenizer. Tests
that need it skip, saying why, where the repository is checked out without it."""

from __future__ import annotations

import json
import shutil
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


def hub_cache(cache: Path, repo_id: str, commit: str = "1" * 40) -> Path:
    """The Qwen2.5 tokenizer as `repo_id` in the Hugging Face Hub's cache layout under
    `cache`, as `hf download` leaves it (models--Org--Name/{refs/main,
    snapshots/<commit>/...}): its snapshot folder."""
    source = qwen_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def token_range(spec: str) -> list[int]:
    """`"1..16"` -> [1, ..., 16] (how the golden files write token ids)."""
    first, last = spec.split("..")
    return list(range(int(first), int(last) + 1))
