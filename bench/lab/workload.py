"""The lab's requests: built when they are sent, for the router and for the engine.

A lab turn gives the body a client sends (the same OpenAI chat request `bench run`
sends, so the EPP parses, tokenizes and hashes exactly what it would in
production) and the prompt's token ids the engine computes on (what the simulator
would get by rendering the chat template and tokenizing it). Both are built only
when the turn is sent, so an hour-long trace never sits in memory as text.

Token ids without tokenizing everything: the workloads' text is made of "clean
words", each one token wherever it stands (bench/workloads.py), so a prompt's ids
are the template's own pieces (tokenized once each and remembered) with each
message's word ids in between. Any other text (the simulator's answers in a
multi-turn history) is tokenized once and remembered. `PromptIds` checks this
against the real tokenizer on the first turns of every run and refuses to go on
if they differ.

Capacity (`capacity_rps`): the request rate at which the fleet's engines would be
computing all the time if no request found anything in the cache, at the compute
roofline: per request, its whole prompt prefilled alone (the step-time model's
`prefill_time`), plus the matrix multiplies of its output tokens (2 x parameters
FLOPs each at the model's GEMM efficiency) as if decoding were batched for free;
capacity = pods / the mean of that over the workload's requests. `--load F`
offers F times that rate. Real decoding is memory-bound and costs more, so a
fleet saturates below load 1.0 unless the cache saves prefill: a router that
finds cached prefixes keeps up where one that does not falls behind.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workloads import (
    TRACE_BLOCK_TOKENS,
    TRACE_SYSTEM_PROMPT,
    Turn,
    Words,
    Workload,
    read_trace,
    trace_block_indices,
    trace_params,
)
from sim.latency import LatencyModel

MODEL = "sim-model"
# How many turns of a run are checked against the real tokenizer.
VERIFY_TURNS = 3
# How many token ids of recent message contents `PromptIds` remembers (8 MiB of
# them): counted in tokens, so that the unique questions of a shared-prefix
# workload do not push its few long system prompts out.
TEXT_MEMORY_TOKENS = 1 << 20
# How many of a trace's blocks (`_TraceBlocks`) are remembered: about 270 MB of them.
# A conversation trace reuses blocks from turn to turn: on the mooncake conversation
# trace (12,000 requests) this many catch nine tenths of the reuse, 8,192 half.
TRACE_BLOCK_MEMORY = 32_768


@dataclass(frozen=True)
class LabTurn:
    """One request: `build()` gives (body for the router, prompt token ids for the engine)."""

    max_tokens: int
    prompt_len: int  # tokens (for the capacity estimate; exact for generated workloads)
    build: Callable[[], tuple[bytes, list[int]]]
    # Headers the client sends beside the body (lower-case names), e.g. the tenants
    # workload's fairness id and objective.
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LabSession:
    id: int
    group: int
    turns: Sequence[LabTurn]
    arrival_s: float | None = None  # trace timestamps; else the arrival process decides
    think_s: float = 0.0


@dataclass(frozen=True)
class LabWorkload:
    name: str
    params: dict[str, Any]
    sessions: Sequence[LabSession]
    # For `bench run`'s bounds (hit-rate ceiling): the generated workload, if any.
    source: Workload | None = None
    # The tenants workload's burst window, in the sessions' arrival time.
    burst_window_s: tuple[float, float] | None = None

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "sessions": len(self.sessions),
            "requests": self.num_requests,
        }


class PromptIds:
    """A chat prompt's token ids as the simulator computes them, fast (see the module
    docstring)."""

    def __init__(self, words: Words) -> None:
        self.words = words
        self.tokenizer = words.tokenizer
        template = self.tokenizer.chat_template
        if template is None:
            raise ValueError(f"tokenizer {self.tokenizer.name} has no chat template")
        self.template = template
        self._word_ids: dict[str, int] = {}  # clean word without its leading space -> id
        self._pieces: dict[str, list[int]] = {}
        # Recent message contents' ids, up to TEXT_MEMORY_TOKENS ids in all.
        self._texts: OrderedDict[str, list[int]] = OrderedDict()
        self._texts_tokens = 0
        self._vocabulary_ids: list[int] | None = None
        self.checked = 0

    def _table(self) -> dict[str, int]:
        table = self._word_ids
        if not table:
            for word in self.words.words:
                (table[word[1:]],) = self.tokenizer.encode(word, add_special_tokens=False)
        return table

    def _word_ids_of(self, words: list[str]) -> list[int] | None:
        """The ids of `words` (without their leading space), or None if one is not a
        clean word of the workload's vocabulary."""
        table = self._table()
        try:
            return [table[w] for w in words]
        except KeyError:
            return None

    def vocabulary_ids(self) -> list[int]:
        """The token id of each of the workload's clean words (`Words.words`)."""
        if self._vocabulary_ids is None:
            table = self._table()
            self._vocabulary_ids = [table[w[1:]] for w in self.words.words]
        return self._vocabulary_ids

    def _piece(self, text: str) -> list[int]:
        found = self._pieces.get(text)
        if found is None:
            found = self._pieces[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return found

    def _content(self, text: str) -> list[int]:
        found = self._texts.get(text)
        if found is not None:
            self._texts.move_to_end(text)
            return found
        parts = text.split(" ")
        ids = self._word_ids_of(parts[1:]) if parts[0] == "" and len(parts) > 1 else None
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._texts[text] = ids
        self._texts_tokens += len(ids)
        while self._texts_tokens > TEXT_MEMORY_TOKENS and len(self._texts) > 1:
            self._texts_tokens -= len(self._texts.popitem(last=False)[1])
        return ids

    def ids(
        self,
        messages: Sequence[tuple[str, str]],
        content_ids: Sequence[Sequence[int] | None] = (),
    ) -> list[int]:
        """`content_ids`: the ids of the first messages' contents where the caller has
        them already (None where not): clean words' ids (`vocabulary_ids`)."""
        rendered = self.template.render([{"role": r, "content": c} for r, c in messages])
        out: list[int] = []
        at = 0
        for i, (_, content) in enumerate(messages):
            found = rendered.find(content, at) if content else at
            if found < 0:
                raise ValueError("the chat template does not render message contents verbatim")
            out += self._piece(rendered[at:found]) if found > at else []
            known = content_ids[i] if i < len(content_ids) else None
            out += self._content(content) if known is None else known
            at = found + len(content)
        out += self._piece(rendered[at:]) if at < len(rendered) else []
        if self.checked < VERIFY_TURNS:
            self.checked += 1
            real = self.tokenizer.encode(rendered, add_special_tokens=False)
            if real != out:
                raise ValueError(
                    "the lab's token ids differ from the tokenizer's for this workload's"
                    " prompts: its text must be made of the workload's clean words"
                )
        return out


def _body(messages: Sequence[tuple[str, str]], max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": r, "content": c} for r, c in messages],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def from_workload(workload: Workload, words: Words) -> LabWorkload:
    """A generated `bench run` workload (shared-prefix, hot-prefix, multi-turn, ...)."""
    builder = PromptIds(words)

    def turn(t: Turn) -> LabTurn:
        length = sum(len(c.split(" ")) - 1 for _, c in t.messages)
        return LabTurn(
            t.max_tokens,
            length,
            lambda: (_body(t.messages, t.max_tokens), builder.ids(t.messages)),
            t.headers,
        )

    sessions = [
        LabSession(s.id, s.group, [turn(t) for t in s.turns], s.arrival_s, s.think_s)
        for s in workload.sessions
    ]
    window = workload.params.get("burst_window")
    return LabWorkload(
        workload.name,
        workload.params,
        sessions,
        workload,
        burst_window_s=(float(window[0]), float(window[1])) if window else None,
    )


@dataclass(frozen=True)
class _TraceBlock:
    text: str  # its words (`trace_block_words`) joined
    # Their token ids (clean words: one token each). A tuple of ints: once it is
    # old enough, the garbage collector no longer walks it.
    ids: tuple[int, ...]


class _TraceBlocks:
    """A trace's 512-token blocks, drawn from (seed, hash id) as bench/workloads.py
    draws them, with their token ids, remembered for the most recent blocks (about
    8 KB each: drawing and joining a block's words takes a quarter of a millisecond,
    most of a long trace's prompt building)."""

    def __init__(
        self, words: Words, seed: int, builder: PromptIds, capacity: int = TRACE_BLOCK_MEMORY
    ) -> None:
        self.words = words
        self.seed = seed
        self.builder = builder
        self.capacity = capacity
        self._cache: OrderedDict[int, _TraceBlock] = OrderedDict()

    def __call__(self, hash_id: int) -> _TraceBlock:
        found = self._cache.get(hash_id)
        if found is not None:
            self._cache.move_to_end(hash_id)
            return found
        drawn = trace_block_indices(self.words, self.seed, hash_id)
        found = _TraceBlock(
            "".join(map(self.words.words.__getitem__, drawn)),
            tuple(map(self.builder.vocabulary_ids().__getitem__, drawn)),
        )
        self._cache[hash_id] = found
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return found

    def prompt(self, hash_ids: Sequence[int], length: int) -> tuple[str, tuple[int, ...]]:
        """The first `length` words of the blocks, as one text (bench/workloads.py's),
        and their ids; only the blocks they reach are drawn."""
        used = [self(h) for h in hash_ids[: -(-length // TRACE_BLOCK_TOKENS)]]
        ids = tuple(itertools.islice(itertools.chain.from_iterable(b.ids for b in used), length))
        texts = [b.text for b in used]
        cut = length - (len(used) - 1) * TRACE_BLOCK_TOKENS  # words of the last block
        if used and cut < TRACE_BLOCK_TOKENS:
            # Its first `cut` words: each is a space and letters.
            texts[-1] = " ".join(texts[-1].split(" ", cut + 1)[: cut + 1])
        return "".join(texts), ids


def trace_workload(
    path: Path,
    words: Words,
    *,
    seed: int = 0,
    limit: int | None = None,
    speed: float = 1.0,
    max_input_len: int | None = None,
) -> LabWorkload:
    """A Mooncake-style trace, as `bench run --workload trace` replays it (the same
    text for the same seed), with its prompts built when sent."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    records = read_trace(path, limit)
    if not records:
        raise ValueError(f"{path}: no trace records")
    builder = PromptIds(words)
    blocks = _TraceBlocks(words, seed, builder)
    start = min(r.timestamp_ms for r in records)

    def make(hash_ids: tuple[int, ...], length: int, output: int) -> LabTurn:
        def build() -> tuple[bytes, list[int]]:
            text, ids = blocks.prompt(hash_ids, length)
            messages = (("system", TRACE_SYSTEM_PROMPT), ("user", text))
            return _body(messages, output), builder.ids(messages, (None, ids))

        return LabTurn(output, length, build)

    sessions = []
    for i, record in enumerate(records):
        length = record.input_length
        if max_input_len is not None:
            length = min(length, max_input_len)
        turn = make(record.hash_ids, length, record.output_length)
        arrival = (record.timestamp_ms - start) / 1000.0 / speed
        group = record.hash_ids[0] if record.hash_ids else -1
        sessions.append(LabSession(i, group, [turn], arrival))
    params = trace_params(path, limit, speed, max_input_len, seed, len(records))
    return LabWorkload("trace", params, sessions)


def service_time_s(prompt_len: int, output_len: int, latency: LatencyModel) -> float:
    """One request's engine time with nothing cached, at the compute roofline (see
    the module docstring): its prompt prefilled alone, and the matrix multiplies of
    its output tokens as if batched for free."""
    per_output_token = (2.0 * latency.model.params) / (
        latency.gpu.peak_flops * latency.gemm_efficiency
    )
    return latency.prefill_time(prompt_len) + output_len * per_output_token


def capacity_rps(workload: LabWorkload, pods: int, latency: LatencyModel) -> float:
    turns = [t for s in workload.sessions for t in s.turns]
    if not turns:
        raise ValueError("an empty workload has no capacity")
    mean = sum(service_time_s(t.prompt_len, t.max_tokens, latency) for t in turns) / len(turns)
    return pods / mean
