"""Shared pieces of the simulator tests: the workspace's golden data, running pods.

Golden data lives next to the repository, in `../shared/testdata` (computed with
vLLM's own code; a real Qwen2.5 tokenizer). Tests that need it skip, saying why,
when the repository is checked out without it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sim.engine import EngineConfig
from sim.server import SimConfig, SimPod
from sim.tokenizer import HFTokenizer, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTDATA = (REPO_ROOT / ".." / "shared" / "testdata").resolve()
QWEN_DIR = TESTDATA / "tokenizers" / "qwen2_5"


def testdata_file(relative: str) -> Path:
    path = TESTDATA / relative
    if not path.exists():
        pytest.skip(f"golden test data not found: {path} (it lives in ../shared/testdata)")
    return path


def load_json(relative: str) -> Any:
    return json.loads(testdata_file(relative).read_text())


@pytest.fixture(scope="session")
def qwen() -> HFTokenizer:
    testdata_file("tokenizers/qwen2_5/tokenizer.json")
    tokenizer = load_tokenizer(QWEN_DIR)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


# Fast enough for tests (a 2,000-token prefill is ~1 ms of wall time), slow enough
# that steps still take time.
TEST_TIME_SCALE = 0.02

StartPod = Callable[..., Awaitable[SimPod]]


def pod_config(**overrides: Any) -> SimConfig:
    """A pod with KV events on free ports; `engine` fields may be given directly."""
    engine_fields = {
        k: overrides.pop(k) for k in list(overrides) if k in EngineConfig.__dataclass_fields__
    }
    engine_fields.setdefault("time_scale", TEST_TIME_SCALE)
    engine_fields.setdefault("hash_seed", "0")
    settings: dict[str, Any] = {"kv_events_port": 0, "replay_port": 0, "name": "sim-test"}
    settings.update(overrides)
    return SimConfig(engine=EngineConfig(**engine_fields), **settings)


@pytest.fixture
async def start_pod() -> AsyncIterator[StartPod]:
    pods: list[SimPod] = []

    async def start(tokenizer: Any = None, **overrides: Any) -> SimPod:
        pod = SimPod(pod_config(**overrides), tokenizer=tokenizer)
        await pod.start("127.0.0.1", 0)
        pods.append(pod)
        return pod

    yield start
    for pod in pods:
        await pod.stop()
