"""A trace's prompts in the lab: the text `bench run` sends for the same seed, and
the ids the simulator's tokenizer makes of it, built from remembered blocks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.lab.workload import trace_workload
from bench.workloads import (
    TRACE_BLOCK_TOKENS,
    Words,
    prompt_ids,
    trace,
    trace_block_words,
)


def test_a_blocks_words_are_what_random_choices_draws(builtin_words: Words) -> None:
    # `trace_block_words` draws as random.choices does, so traces replayed before
    # it drew that way keep their text.
    for seed in (0, 7):
        for hash_id in (0, 1, 55, 10**9):
            drawn = random.Random(f"trace:{seed}:{hash_id}").choices(
                builtin_words.words, k=TRACE_BLOCK_TOKENS
            )
            assert trace_block_words(builtin_words, seed, hash_id) == drawn


def write_trace(path: Path) -> None:
    rows = [
        (0, 700, 3, [1, 2]),
        (10, 1024, 2, [1, 2, 3]),  # shares two blocks with the first
        (20, 1, 1, [4]),
        (30, 512, 1, [5, 1]),  # ends on a block boundary; its second block unused
        (40, 1500, 4, [1, 2, 6]),
    ]
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
        for t, n, o, h in rows
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize("max_input_len", [None, 600])
def test_trace_prompts_are_bench_runs_text_and_the_tokenizers_ids(
    tmp_path: Path, qwen_words: Words, max_input_len: int | None
) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path)
    lab = trace_workload(path, qwen_words, seed=3, max_input_len=max_input_len)
    sent = trace(qwen_words, path, seed=3, max_input_len=max_input_len)
    for _ in range(2):  # the second time from remembered blocks
        for session, reference in zip(lab.sessions, sent.sessions, strict=True):
            (turn,) = session.turns
            (expected,) = reference.turns
            body, ids = turn.build()
            messages = json.loads(body)["messages"]
            assert tuple((m["role"], m["content"]) for m in messages) == expected.messages
            assert ids == prompt_ids(qwen_words.tokenizer, expected)
