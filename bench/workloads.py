"""Workloads for the routing benchmark: seeded, reproducible OpenAI chat requests.

A workload is a list of sessions. A session is one or more turns, each a chat request
(`messages`, `max_tokens`); the turns of a session are sent one after the other, each
only once the previous answer has arrived. Single-request workloads have one turn per
session; multi-turn conversations resend their whole history each turn.

Text is made of "clean words": vocabulary entries that are a space plus 3-10 lowercase
letters and that the tokenizer encodes back to exactly that one token. A text of n
such words is n tokens long on its own and inside the chat template (the template's
special tokens and newlines split the text before it is tokenized), so lengths are
exact and are measured with the same tokenizer and chat template the simulator uses
(`sim.tokenizer`: the real Qwen2.5 tokenizer when available, else the built-in one).

Workloads (lengths in tokens):

- `shared-prefix`: SGLang's generated-shared-prefix: `groups` system prompts of
  `system_len` tokens, `prompts_per_group` questions of `question_len` tokens each,
  answers of `output_len` tokens; the G x P requests are shuffled so groups interleave.
- `hot-prefix`: the same shape, but one group carries `hot_share` of the `requests`
  (the rest spread evenly over the other groups), shuffled.
- `multi-turn`: `conversations` of `turns` turns: a system prompt shared by every
  conversation, then per turn a new user message of `question_len` tokens; each turn
  resends the history, the previous answers included. The answers in the history are
  the simulator's (its answer text is fixed: the first `output_len` tokens of
  `sim.tokenizer.ANSWER_TEXT`, repeated), so the workload is known in advance and its
  bounds are exact.
- `no-reuse`: `requests` prompts of `question_len` tokens that share nothing but
  the chat template's opening (no system prompt of their own; Qwen's template then
  adds its default one): what a prefix-aware router has nothing to gain on, so it
  shows what its load balancing is worth alone.
- `rag`: retrieval-augmented questions: `requests` prompts, each a short system
  instruction of `system_len` tokens shared by all, then one user message holding a
  retrieved document of `document_len` tokens (one of `documents`, the popular ones
  more often: Zipf weights 1 / rank) followed by a question of `question_len` tokens;
  short answers of `output_len` tokens. Long prompts whose documents recur, short
  outputs: the shape prefill/decode disaggregation is for.
- `tenants` (`python -m bench lab`, and `python -m bench run` through real Envoy,
  which sends each request's headers): two tenants and three priorities, for flow
  control (docs/flow-control.md). `requests` single-turn
  prompts, each a tenant's own system prompt of `system_len` tokens and a question
  of `question_len`, answers of `output_len`. Each request carries its tenant in
  `x-llm-d-inference-fairness-id` (`steady` or `bursty`) and its objective in
  `x-llm-d-inference-objective` (`critical` 10%, `standard` 60%, `batch` 30% of
  each tenant's requests, drawn independently). The two tenants offer the same rate
  outside the burst window; in the middle third of the run the bursty one offers
  5 times as much. Arrival times come with the workload (sorted uniform draws, i.e.
  Poisson arrivals given their number), in units where the steady tenant offers one
  request per second; the lab and `bench run` scale them to the load asked for, so
  `--load` is the mean offered load over the whole run.
- `trace`: replay of a Mooncake-style JSONL trace, one request per line
  `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`. Each hash id
  stands for a 512-token block; its words are drawn from a generator seeded by
  (seed, hash id), so equal ids give equal text. The prompt is the blocks' text cut to
  `input_length` tokens, as one user message after a fixed short system prompt.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizerModel

from epp.requests import LLMD_FAIRNESS_ID_HEADER, LLMD_OBJECTIVE_HEADER
from sim.tokenizer import Tokenizer, answer_token_ids, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
# The real Qwen2.5 tokenizer of the workspace's test data (tokenizer.json and the
# chat template in tokenizer_config.json); without it, the simulator's built-in one.
# Not resolved: where ../shared is a symbolic link, results still name it
# ../shared/... (bench.provenance.portable_path).
DEFAULT_TOKENIZER = Path(
    os.path.normpath(ROOT / ".." / "shared" / "testdata" / "tokenizers" / "qwen2_5")
)

WORKLOADS = ("shared-prefix", "hot-prefix", "multi-turn", "no-reuse", "rag", "trace")
# Workloads whose requests carry headers and whose arrival times come with them:
# `bench lab` and `bench run` offer them beside WORKLOADS (`--load` or `--rate`
# scales their times).
LAB_WORKLOADS = ("tenants",)
TRACE_BLOCK_TOKENS = 512
TRACE_SYSTEM_PROMPT = "You are a helpful assistant."


def default_tokenizer_dir() -> Path | None:
    return DEFAULT_TOKENIZER if (DEFAULT_TOKENIZER / "tokenizer.json").is_file() else None


@dataclass(frozen=True)
class Turn:
    """One chat request: the messages as sent (history included) and its answer length."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    # Request headers beside the body (lower-case names): the tenants workload's
    # fairness id and objective.
    headers: tuple[tuple[str, str], ...] = ()

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI chat request, streamed with usage in the last chunk."""
        return {
            "model": model,
            "messages": [{"role": role, "content": content} for role, content in self.messages],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


@dataclass(frozen=True)
class Session:
    id: int
    # The prefix group (system prompt) it belongs to; -1 when there is none.
    group: int
    turns: tuple[Turn, ...]
    # Trace replay: when it arrives (simulated seconds from the start); else None
    # and the arrival process decides.
    arrival_s: float | None = None
    # Simulated seconds between an answer and the next turn.
    think_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    params: dict[str, Any]
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def nominal_order(self) -> list[Turn]:
        """Every request in the order the bounds assume: sessions by arrival (trace) or
        as listed, each session's turns in order. For multi-turn workloads the turns of
        different conversations interleave in time; this order keeps each conversation's
        turns in sequence, which is all the bounds depend on when conversations share
        nothing but the system prompt."""
        return [turn for s in self.nominal_sessions() for turn in s.turns]

    def nominal_sessions(self) -> list[Session]:
        """The sessions in `nominal_order`'s order."""
        return sorted(
            self.sessions,
            key=lambda s: (s.arrival_s if s.arrival_s is not None else 0.0, s.id),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "sessions": len(self.sessions),
            "requests": self.num_requests,
        }


# -- text ------------------------------------------------------------------------------


@dataclass
class Words:
    """Clean words of a tokenizer: each (with its leading space) is exactly one token."""

    tokenizer: Tokenizer
    words: list[str]

    def text(self, rng: random.Random, n: int) -> str:
        return "".join(rng.choices(self.words, k=n))


_CLEAN = re.compile(r"Ġ([a-z]{3,10})")


@functools.lru_cache(maxsize=4)
def load_words(directory: Path | None) -> Words:
    """The tokenizer in `directory` (None: the simulator's built-in one) and its clean
    words (loading takes about a second, hence the cache)."""
    tokenizer = load_tokenizer(directory)
    if directory is None:
        # The built-in tokenizer makes one token of any space + word: syllable words.
        onsets = [
            "b",
            "c",
            "d",
            "f",
            "g",
            "h",
            "j",
            "k",
            "l",
            "m",
            "n",
            "p",
            "r",
            "s",
            "t",
            "v",
            "w",
            "z",
        ]
        syllables = [o + v for o in onsets for v in "aeiou"]
        words = [" " + a + b + c for a, b, c in itertools.product(syllables, repeat=3)]
        return Words(tokenizer, words[:20_000])
    vocab = HFTokenizerModel.from_file(str(directory / "tokenizer.json")).get_vocab()
    words = []
    for piece, token in sorted(vocab.items()):
        match = _CLEAN.fullmatch(piece)
        if match is None:
            continue
        word = " " + match.group(1)
        if tokenizer.encode(word, add_special_tokens=False) == [token]:
            words.append(word)
    if len(words) < 1000:
        raise ValueError(f"{directory}: too few clean words in the vocabulary ({len(words)})")
    return Words(tokenizer, words)


# -- the simulator's answers --------------------------------------------------------------


def answer_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """The token ids the simulator generates for an answer of n tokens."""
    answer = answer_token_ids(tokenizer)
    return [answer[i % len(answer)] for i in range(n)]


def answer_text(tokenizer: Tokenizer, n: int) -> str:
    """The text a streamed answer of n tokens adds up to (decoded token by token)."""
    return "".join(tokenizer.decode([t]) for t in answer_ids(tokenizer, n))


# -- generators ----------------------------------------------------------------------------


def shared_prefix(
    words: Words,
    *,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    seed: int = 0,
) -> Workload:
    rng = random.Random(f"shared-prefix:{seed}")
    systems = [words.text(rng, system_len) for _ in range(groups)]
    sessions = []
    for g, system in enumerate(systems):
        for _ in range(prompts_per_group):
            question = words.text(rng, question_len)
            turn = Turn((("system", system), ("user", question)), output_len)
            sessions.append((g, turn))
    rng.shuffle(sessions)
    params = {
        "groups": groups,
        "prompts_per_group": prompts_per_group,
        "system_len": system_len,
        "question_len": question_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload(
        "shared-prefix",
        params,
        tuple(Session(i, g, (turn,)) for i, (g, turn) in enumerate(sessions)),
    )


def hot_prefix(
    words: Words,
    *,
    groups: int = 16,
    requests: int = 512,
    hot_share: float = 0.5,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    seed: int = 0,
) -> Workload:
    if not 0.0 <= hot_share <= 1.0:
        raise ValueError("hot_share must be in [0, 1]")
    if groups < 2:
        raise ValueError("hot-prefix needs at least 2 groups")
    rng = random.Random(f"hot-prefix:{seed}")
    systems = [words.text(rng, system_len) for _ in range(groups)]
    hot = round(hot_share * requests)
    # Group 0 is the hot one; the other groups take the rest in turn.
    assignment = [0] * hot + [1 + i % (groups - 1) for i in range(requests - hot)]
    sessions = []
    for g in assignment:
        question = words.text(rng, question_len)
        sessions.append((g, Turn((("system", systems[g]), ("user", question)), output_len)))
    rng.shuffle(sessions)
    params = {
        "groups": groups,
        "requests": requests,
        "hot_share": hot_share,
        "system_len": system_len,
        "question_len": question_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload(
        "hot-prefix",
        params,
        tuple(Session(i, g, (turn,)) for i, (g, turn) in enumerate(sessions)),
    )


def multi_turn(
    words: Words,
    *,
    conversations: int = 32,
    turns: int = 6,
    system_len: int = 1024,
    question_len: int = 256,
    output_len: int = 128,
    think_s: float = 0.0,
    seed: int = 0,
) -> Workload:
    rng = random.Random(f"multi-turn:{seed}")
    system = words.text(rng, system_len)
    reply = answer_text(words.tokenizer, output_len)
    sessions = []
    for c in range(conversations):
        history: list[tuple[str, str]] = [("system", system)]
        session_turns = []
        for _ in range(turns):
            history.append(("user", words.text(rng, question_len)))
            session_turns.append(Turn(tuple(history), output_len))
            history.append(("assistant", reply))
        sessions.append(Session(c, 0, tuple(session_turns), think_s=think_s))
    params = {
        "conversations": conversations,
        "turns": turns,
        "system_len": system_len,
        "question_len": question_len,
        "output_len": output_len,
        "think_s": think_s,
        "seed": seed,
    }
    return Workload("multi-turn", params, tuple(sessions))


def no_reuse(
    words: Words,
    *,
    requests: int = 512,
    question_len: int = 1024,
    output_len: int = 256,
    seed: int = 0,
) -> Workload:
    rng = random.Random(f"no-reuse:{seed}")
    sessions = tuple(
        Session(i, -1, (Turn((("user", words.text(rng, question_len)),), output_len),))
        for i in range(requests)
    )
    params = {
        "requests": requests,
        "question_len": question_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload("no-reuse", params, sessions)


def rag(
    words: Words,
    *,
    documents: int = 64,
    requests: int = 512,
    system_len: int = 64,
    document_len: int = 4096,
    question_len: int = 32,
    output_len: int = 32,
    seed: int = 0,
) -> Workload:
    if documents < 1:
        raise ValueError("rag needs at least 1 document")
    rng = random.Random(f"rag:{seed}")
    system = words.text(rng, system_len)
    texts = [words.text(rng, document_len) for _ in range(documents)]
    # Zipf popularity: document i (0-based) is retrieved with weight 1 / (i + 1).
    weights = [1.0 / (i + 1) for i in range(documents)]
    picks = rng.choices(range(documents), weights=weights, k=requests)
    sessions = []
    for i, d in enumerate(picks):
        # Clean words each start with a space: the document and the question join
        # into one text of document_len + question_len tokens.
        user = texts[d] + words.text(rng, question_len)
        turn = Turn((("system", system), ("user", user)), output_len)
        sessions.append(Session(i, d, (turn,)))
    params = {
        "documents": documents,
        "requests": requests,
        "system_len": system_len,
        "document_len": document_len,
        "question_len": question_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload("rag", params, tuple(sessions))


# The tenants workload (flow control): its fixed shape.
FAIRNESS_ID_HEADER = LLMD_FAIRNESS_ID_HEADER
OBJECTIVE_HEADER = LLMD_OBJECTIVE_HEADER
TENANTS = ("steady", "bursty")
# Objectives and the share of each tenant's requests that carries each one; their
# priorities are the config's (`inferenceObjectives` of manifests/config/flow-control.yaml:
# critical 10, standard 0, batch -1).
OBJECTIVE_MIX = (("critical", 0.1), ("standard", 0.6), ("batch", 0.3))
BURST_FACTOR = 5.0
BURST_WINDOW = (1.0 / 3.0, 2.0 / 3.0)  # fractions of the run's arrival span


def tenants(
    words: Words,
    *,
    requests: int = 4000,
    system_len: int = 64,
    question_len: int = 1024,
    output_len: int = 64,
    seed: int = 0,
) -> Workload:
    """Two tenants, three objectives, one burst (see the module docstring).

    Intensities in unit time: steady 1 req/s throughout, bursty 1 req/s outside the
    window and BURST_FACTOR inside it, over a span T with T x (2 + (BURST_FACTOR - 1)
    x w) = `requests` (w the window's fraction of T). Each tenant's count is its
    expected share, its times drawn from its intensity."""
    if requests < 2:
        raise ValueError("tenants needs at least 2 requests")
    rng = random.Random(f"tenants:{seed}")
    start, end = BURST_WINDOW
    width = end - start
    span = requests / (2.0 + (BURST_FACTOR - 1.0) * width)
    steady_n = round(span)
    bursty_n = requests - steady_n
    # The bursty tenant's arrivals: inside the window with probability
    # BURST_FACTOR x w / (1 + (BURST_FACTOR - 1) x w), uniform there, else uniform
    # over the rest of the span.
    inside = BURST_FACTOR * width / (1.0 + (BURST_FACTOR - 1.0) * width)
    systems = {t: words.text(rng, system_len) for t in TENANTS}
    arrivals: list[tuple[float, str]] = [
        (rng.uniform(0.0, span), "steady") for _ in range(steady_n)
    ]
    for _ in range(bursty_n):
        if rng.random() < inside:
            at = rng.uniform(start, end) * span
        else:
            u = rng.uniform(0.0, 1.0 - width)
            at = (u if u < start else u + width) * span
        arrivals.append((at, "bursty"))
    arrivals.sort()
    names = [name for name, _ in OBJECTIVE_MIX]
    weights = [share for _, share in OBJECTIVE_MIX]
    sessions = []
    for i, (at, tenant) in enumerate(arrivals):
        objective = rng.choices(names, weights=weights)[0]
        question = words.text(rng, question_len)
        headers = ((FAIRNESS_ID_HEADER, tenant), (OBJECTIVE_HEADER, objective))
        turn = Turn((("system", systems[tenant]), ("user", question)), output_len, headers)
        sessions.append(Session(i, TENANTS.index(tenant), (turn,), arrival_s=at))
    params = {
        "requests": requests,
        "system_len": system_len,
        "question_len": question_len,
        "output_len": output_len,
        "tenants": list(TENANTS),
        "objectives": dict(OBJECTIVE_MIX),
        "burst_factor": BURST_FACTOR,
        # In the workload's own time units (steady tenant: 1 request per unit);
        # results.json's `setup.burst_window_s` has it in the run's seconds.
        "span": span,
        "burst_window": [start * span, end * span],
        "seed": seed,
    }
    return Workload("tenants", params, tuple(sessions))


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, limit: int | None = None) -> list[TraceRecord]:
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                record = TraceRecord(
                    float(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record: {exc}") from exc
            if record.input_length < 1 or record.output_length < 1:
                raise ValueError(f"{path}:{number}: lengths must be >= 1")
            if record.input_length > TRACE_BLOCK_TOKENS * len(record.hash_ids):
                raise ValueError(
                    f"{path}:{number}: input_length {record.input_length} exceeds its"
                    f" {len(record.hash_ids)} blocks of {TRACE_BLOCK_TOKENS} tokens"
                )
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    return records


def trace(
    words: Words,
    path: Path,
    *,
    limit: int | None = None,
    speed: float = 1.0,
    max_input_len: int | None = None,
    seed: int = 0,
) -> Workload:
    """Replay of a Mooncake-style trace; `speed` > 1 replays it faster."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    records = read_trace(path, limit)
    if not records:
        raise ValueError(f"{path}: no trace records")
    blocks: dict[int, list[str]] = {}

    def block(hash_id: int) -> list[str]:
        found = blocks.get(hash_id)
        if found is None:
            found = blocks[hash_id] = trace_block_words(words, seed, hash_id)
        return found

    start = min(r.timestamp_ms for r in records)
    sessions = []
    for i, record in enumerate(records):
        length = record.input_length
        if max_input_len is not None:
            length = min(length, max_input_len)
        pieces = [w for h in record.hash_ids for w in block(h)][:length]
        turn = Turn(
            (("system", TRACE_SYSTEM_PROMPT), ("user", "".join(pieces))), record.output_length
        )
        arrival = (record.timestamp_ms - start) / 1000.0 / speed
        sessions.append(Session(i, record.hash_ids[0] if record.hash_ids else -1, (turn,), arrival))
    params = trace_params(path, limit, speed, max_input_len, seed, len(records))
    return Workload("trace", params, tuple(sessions))


def trace_block_words(words: Words, seed: int, hash_id: int) -> list[str]:
    """The words of a trace's 512-token block: drawn from (seed, hash id), so that
    equal ids give equal text in every replay (`bench run` and the lab alike)."""
    vocabulary = words.words
    return [vocabulary[i] for i in trace_block_indices(words, seed, hash_id)]


def trace_block_indices(words: Words, seed: int, hash_id: int) -> list[int]:
    """Where in `words.words` the words of `trace_block_words` are: `random.choices(
    words.words, k=TRACE_BLOCK_TOKENS)` of a generator seeded with (seed, hash id),
    drawn as `choices` draws (floor(random() x n), one call each; a test holds the
    two equal), so the lab can look the words' token ids up by index."""
    draw = random.Random(f"trace:{seed}:{hash_id}").random
    n = float(len(words.words))
    return [math.floor(draw() * n) for _ in itertools.repeat(None, TRACE_BLOCK_TOKENS)]


def trace_params(
    path: Path, limit: int | None, speed: float, max_input_len: int | None, seed: int, records: int
) -> dict[str, Any]:
    """How a trace replay was made, for the results file."""
    return {
        "trace": str(path),
        "limit": limit,
        "speed": speed,
        "max_input_len": max_input_len,
        "seed": seed,
        "records": records,
    }


# -- measuring -----------------------------------------------------------------------------


def prompt_ids(tokenizer: Tokenizer, turn: Turn) -> list[int]:
    """The prompt's token ids exactly as the simulator computes them for the request."""
    template = tokenizer.chat_template
    if template is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no chat template")
    messages = [{"role": role, "content": content} for role, content in turn.messages]
    return tokenizer.encode(template.render(messages), add_special_tokens=False)


def token_sequences(
    tokenizer: Tokenizer, turns: Sequence[Turn]
) -> Iterator[tuple[list[int], list[int]]]:
    """For each turn: its prompt ids, and the answer ids the simulator generates."""
    answers: dict[int, list[int]] = {}
    for turn in turns:
        answer = answers.get(turn.max_tokens)
        if answer is None:
            answer = answers[turn.max_tokens] = answer_ids(tokenizer, turn.max_tokens)
        yield prompt_ids(tokenizer, turn), answer


@dataclass
class WorkloadSpec:
    """What the command line asks for; `build` makes the workload."""

    name: str
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    trace_path: Path | None = None

    def build(self, words: Words) -> Workload:
        options = {k: v for k, v in self.options.items() if v is not None}
        if self.name == "shared-prefix":
            return shared_prefix(words, seed=self.seed, **options)
        if self.name == "hot-prefix":
            return hot_prefix(words, seed=self.seed, **options)
        if self.name == "multi-turn":
            return multi_turn(words, seed=self.seed, **options)
        if self.name == "no-reuse":
            return no_reuse(words, seed=self.seed, **options)
        if self.name == "rag":
            return rag(words, seed=self.seed, **options)
        if self.name == "tenants":
            return tenants(words, seed=self.seed, **options)
        if self.name == "trace":
            if self.trace_path is None:
                raise ValueError("the trace workload needs a trace file (--trace FILE)")
            return trace(words, self.trace_path, seed=self.seed, **options)
        raise ValueError(
            f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS + LAB_WORKLOADS)}"
        )


# -- the command line ------------------------------------------------------------------------

# Which workload takes which option (`bench run` and `bench lab` flags, by their
# argparse dest), and the option's name in the generator above.
WORKLOAD_OPTIONS: dict[str, dict[str, str]] = {
    "shared-prefix": {
        "groups": "groups",
        "prompts_per_group": "prompts_per_group",
        "system_len": "system_len",
        "question_len": "question_len",
        "output_len": "output_len",
    },
    "hot-prefix": {
        "groups": "groups",
        "requests": "requests",
        "hot_share": "hot_share",
        "system_len": "system_len",
        "question_len": "question_len",
        "output_len": "output_len",
    },
    "multi-turn": {
        "conversations": "conversations",
        "turns": "turns",
        "system_len": "system_len",
        "question_len": "question_len",
        "output_len": "output_len",
        "think_time": "think_s",
    },
    "no-reuse": {
        "requests": "requests",
        "question_len": "question_len",
        "output_len": "output_len",
    },
    "rag": {
        "documents": "documents",
        "requests": "requests",
        "system_len": "system_len",
        "document_len": "document_len",
        "question_len": "question_len",
        "output_len": "output_len",
    },
    "tenants": {
        "requests": "requests",
        "system_len": "system_len",
        "question_len": "question_len",
        "output_len": "output_len",
    },
    "trace": {"trace_limit": "limit", "trace_speed": "speed", "max_input_len": "max_input_len"},
}
ALL_WORKLOAD_OPTIONS = sorted({k for opts in WORKLOAD_OPTIONS.values() for k in opts})


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload shape flags `bench run` and `bench lab` share."""
    shape = parser.add_argument_group("workload shape (tokens; defaults are the workload's)")
    shape.add_argument("--groups", type=int)
    shape.add_argument("--prompts-per-group", type=int)
    shape.add_argument(
        "--requests", type=int, help="hot-prefix, no-reuse, rag, tenants: total requests"
    )
    shape.add_argument("--documents", type=int, help="rag: distinct documents")
    shape.add_argument("--document-len", type=int, help="rag: tokens per document")
    shape.add_argument("--hot-share", type=float, help="hot-prefix: the hot group's share")
    shape.add_argument("--conversations", type=int)
    shape.add_argument("--turns", type=int)
    shape.add_argument("--think-time", type=float, help="multi-turn: seconds between turns")
    shape.add_argument("--system-len", type=int)
    shape.add_argument("--question-len", type=int)
    shape.add_argument("--output-len", type=int)
    shape.add_argument("--trace", type=Path, help="Mooncake-style JSONL trace to replay")
    shape.add_argument("--trace-limit", type=int, help="replay only the first N records")
    shape.add_argument("--trace-speed", type=float, help="replay N times faster")
    shape.add_argument("--max-input-len", type=int, help="trace: cut longer prompts")


def tokenizer_from_arg(value: str | None) -> Path | None:
    """`--tokenizer`: a directory, 'builtin' (None: the simulator's own), or absent
    (the Qwen2.5 one of the workspace's test data when present)."""
    if value == "builtin":
        return None
    if value is not None:
        return Path(value).resolve()
    return default_tokenizer_dir()


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The workload the shape flags ask for; ValueError naming flags that do not apply."""
    given = {k: getattr(args, k) for k in ALL_WORKLOAD_OPTIONS if getattr(args, k) is not None}
    allowed = WORKLOAD_OPTIONS[args.workload]
    wrong = sorted(k for k in given if k not in allowed)
    if wrong:
        names = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise ValueError(f"{names} do(es) not apply to the {args.workload} workload")
    if args.workload == "trace" and args.trace is None:
        raise ValueError("the trace workload needs --trace FILE")
    return WorkloadSpec(
        args.workload,
        seed=args.seed,
        options={allowed[k]: v for k, v in given.items()},
        trace_path=args.trace,
    )
