"""Workloads: deterministic for a seed, with the requested shapes and token lengths."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.client import Arrivals, start_times
from bench.workloads import (
    TRACE_BLOCK_TOKENS,
    Words,
    WorkloadSpec,
    answer_ids,
    answer_text,
    hot_prefix,
    multi_turn,
    prompt_ids,
    shared_prefix,
    token_sequences,
    trace,
)


def content_tokens(words: Words, text: str) -> int:
    return len(words.tokenizer.encode(text, add_special_tokens=False))


def test_same_seed_same_workload_other_seed_other_workload(builtin_words: Words) -> None:
    spec = {"groups": 4, "prompts_per_group": 3, "system_len": 40, "question_len": 8}
    first = shared_prefix(builtin_words, seed=7, **spec)
    assert first == shared_prefix(builtin_words, seed=7, **spec)
    assert first != shared_prefix(builtin_words, seed=8, **spec)
    built = WorkloadSpec("shared-prefix", seed=7, options=spec).build(builtin_words)
    assert built == first


def test_shared_prefix_shape_and_exact_lengths(qwen_words: Words) -> None:
    workload = shared_prefix(
        qwen_words, groups=6, prompts_per_group=5, system_len=300, question_len=40, output_len=9
    )
    assert workload.num_requests == 30
    assert Counter(s.group for s in workload.sessions) == dict.fromkeys(range(6), 5)
    groups = [s.group for s in workload.sessions]
    assert groups != sorted(groups), "shuffled: groups interleave"
    systems: dict[int, str] = {}
    for session in workload.sessions:
        (turn,) = session.turns
        (role_s, system), (role_u, question) = turn.messages
        assert (role_s, role_u, turn.max_tokens) == ("system", "user", 9)
        assert systems.setdefault(session.group, system) == system
        assert content_tokens(qwen_words, system) == 300
        assert content_tokens(qwen_words, question) == 40
        # The chat template adds the same few tokens around every request.
        assert len(prompt_ids(qwen_words.tokenizer, turn)) == 300 + 40 + 13
    assert len(set(systems.values())) == 6
    body = workload.sessions[0].turns[0].body("sim-model")
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]


def test_hot_prefix_gives_the_hot_group_its_share(builtin_words: Words) -> None:
    workload = hot_prefix(builtin_words, groups=5, requests=40, system_len=20, question_len=4)
    counts = Counter(s.group for s in workload.sessions)
    assert counts[0] == 20  # 50% by default
    assert sorted(counts[g] for g in range(1, 5)) == [5, 5, 5, 5]
    skewed = hot_prefix(builtin_words, groups=3, requests=40, hot_share=0.8, system_len=8)
    assert Counter(s.group for s in skewed.sessions)[0] == 32
    with pytest.raises(ValueError, match="hot_share"):
        hot_prefix(builtin_words, hot_share=1.5)


def test_no_reuse_prompts_share_nothing_but_the_template(qwen_words: Words) -> None:
    workload = WorkloadSpec("no-reuse", options={"requests": 20, "question_len": 64}).build(
        qwen_words
    )
    assert workload.num_requests == 20
    prompts = [prompt_ids(qwen_words.tokenizer, s.turns[0]) for s in workload.sessions]
    assert all(len(p) == len(prompts[0]) for p in prompts)
    # The template's opening (Qwen's adds its default system prompt) is all they
    # share: after it, no two agree on the next 16 tokens.
    head = next(i for i, (a, b) in enumerate(zip(*prompts[:2], strict=False)) if a != b)
    assert 0 < head < 64
    assert all(p[:head] == prompts[0][:head] for p in prompts)
    assert len({tuple(p[head : head + 16]) for p in prompts}) == 20


def test_multi_turn_resends_its_history_with_the_simulator_s_answers(
    qwen_words: Words,
) -> None:
    workload = multi_turn(
        qwen_words, conversations=3, turns=4, system_len=50, question_len=20, output_len=12
    )
    assert workload.num_requests == 12
    reply = answer_text(qwen_words.tokenizer, 12)
    assert len(answer_ids(qwen_words.tokenizer, 12)) == 12
    systems = set()
    for session in workload.sessions:
        assert len(session.turns) == 4
        for k, turn in enumerate(session.turns):
            roles = [role for role, _ in turn.messages]
            assert roles == ["system"] + ["user", "assistant"] * k + ["user"]
            assert all(text == reply for role, text in turn.messages if role == "assistant")
            if k:
                previous = session.turns[k - 1].messages
                assert turn.messages[: len(previous)] == previous
        systems.add(session.turns[0].messages[0][1])
    assert len(systems) == 1, "one system prompt shared by every conversation"
    lengths = [len(p) for p, _ in token_sequences(qwen_words.tokenizer, workload.sessions[0].turns)]
    assert lengths == sorted(lengths)


def write_trace(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_trace_replay_synthesises_each_hash_block_once(
    builtin_words: Words, tmp_path: Path
) -> None:
    path = write_trace(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2]},
            {"timestamp": 4000, "input_length": 600, "output_length": 3, "hash_ids": [3, 4]},
        ],
    )
    workload = trace(builtin_words, path, speed=2.0)
    assert [s.arrival_s for s in workload.sessions] == [0.0, 0.25, 1.5]
    texts = [s.turns[0].messages[1][1] for s in workload.sessions]
    assert [content_tokens(builtin_words, t) for t in texts] == [700, 1024, 600]
    assert texts[1].startswith(texts[0]), "same hash ids, same tokens"
    assert texts[2][:50] != texts[0][:50]
    assert [s.turns[0].max_tokens for s in workload.sessions] == [5, 7, 3]
    assert trace(builtin_words, path, speed=2.0) == workload
    assert trace(builtin_words, path, seed=1) != trace(builtin_words, path, seed=0)
    assert trace(builtin_words, path, limit=2).num_requests == 2
    cut = trace(builtin_words, path, max_input_len=100)
    assert content_tokens(builtin_words, cut.sessions[1].turns[0].messages[1][1]) == 100


def test_a_bad_trace_record_is_named(builtin_words: Words, tmp_path: Path) -> None:
    too_long = {"timestamp": 0, "input_length": TRACE_BLOCK_TOKENS + 1, "output_length": 1}
    path = write_trace(tmp_path / "bad.jsonl", [{**too_long, "hash_ids": [1]}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: input_length"):
        trace(builtin_words, path)
    path = write_trace(tmp_path / "worse.jsonl", [{"timestamp": 0}])
    with pytest.raises(ValueError, match=r"worse.jsonl:1: not a trace record"):
        trace(builtin_words, path)


def test_poisson_arrivals_are_seeded_and_at_the_rate(builtin_words: Words) -> None:
    workload = shared_prefix(builtin_words, groups=50, prompts_per_group=40, system_len=4)
    arrivals = Arrivals("poisson", rate=10.0)
    times = start_times(workload.sessions, arrivals, seed=3)
    assert times == start_times(workload.sessions, arrivals, seed=3)
    assert times != start_times(workload.sessions, arrivals, seed=4)
    assert times == sorted(times)
    mean_gap = times[-1] / len(times)
    assert 0.09 < mean_gap < 0.11
    burst = start_times(workload.sessions, Arrivals("poisson", rate=float("inf")), seed=0)
    assert set(burst) == {0.0}
    with pytest.raises(ValueError, match="rate"):
        Arrivals("poisson", rate=0.0)


def test_bursts_keep_the_mean_rate_and_arrive_together(builtin_words: Words) -> None:
    workload = shared_prefix(builtin_words, groups=50, prompts_per_group=40, system_len=4)
    plain = start_times(workload.sessions, Arrivals("poisson", rate=10.0), seed=3)
    bursty = start_times(workload.sessions, Arrivals("poisson", rate=10.0, burst=8), seed=3)
    # Sessions come 8 at an instant; one burst's start differs from the next's.
    groups = [bursty[i : i + 8] for i in range(0, len(bursty), 8)]
    assert all(len(set(g)) == 1 for g in groups)
    assert len({g[0] for g in groups}) == len(groups)
    assert 0.09 < bursty[-1] / len(bursty) < 0.11  # the same mean gap as plain Poisson
    assert bursty != plain
    # One session per burst is plain Poisson, draw for draw.
    assert start_times(workload.sessions, Arrivals("poisson", rate=10.0, burst=1), seed=3) == plain
    assert "bursts of 8" in Arrivals("poisson", rate=10.0, burst=8).label()
    with pytest.raises(ValueError, match="at least 1"):
        Arrivals("poisson", rate=10.0, burst=0)
    with pytest.raises(ValueError, match="Poisson"):
        Arrivals("closed", concurrency=4, burst=2)
