"""Property-based tests of the request parser, and of what the precise prefix
scorer does with whatever it accepts (tokenizing with the real Qwen2.5 tokenizer
and rendering its real chat template).

The invariants: any path, content type and body either parses or is refused with
`BadRequest` and a message (never another exception); the message never echoes the
prompt; a valid request keeps its model, salt, prompt and exact body bytes; a model
rewrite changes the model and nothing else; and the precise scorer's preparation
of any parsed request never raises (what it cannot tokenize as the engine would,
it skips, counted)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from epp.datastore import Datastore
from epp.errors import BadRequest
from epp.kvindex.service import NoLookup, PrecisePrefixConfig, PrecisePrefixService
from epp.requests import (
    ChatPrompt,
    CompletionPrompt,
    InferenceRequest,
    parse_request,
    rewrite_model,
)
from tests.fuzzing import examples
from tests.plugins.helpers import make_endpoints
from tests.testdata import qwen_dir

MARKER = "Zq9-private-prompt-marker"
PATHS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
    "/v1/completions?x=1",
    "/openai/v1/chat/completions/",
    "/",
    "",
]
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain",
                 "application/vnd.api+json", ""]  # fmt: skip

texts = st.text(max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)
fields = st.sampled_from(
    ["model", "prompt", "messages", "input", "instructions", "cache_salt", "stream", "tools",
     "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
     "add_special_tokens", "prompt_embeds"]
)  # fmt: skip
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio"])},
    optional={"text": texts | json_values, "image_url": json_values},
)
message_values = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | json_values,
        "content": texts | st.lists(parts, max_size=3) | json_values,
        "name": texts,
        "tool_calls": json_values,
        "type": st.sampled_from(["message", "function_call"]),
    },
)
structured_bodies = st.dictionaries(
    fields,
    json_values | st.lists(message_values, max_size=3) | st.just(MARKER),
    max_size=6,
)


def _parse(path: str, body: bytes, content_type: str | None = None) -> InferenceRequest:
    headers = {} if content_type is None else {"content-type": content_type}
    return parse_request(request_id="f", method="POST", path=path, headers=headers, body=body)


def _outcome(path: str, body: bytes, content_type: str | None = None) -> Any:
    """The parsed request, or the BadRequest it was refused with."""
    try:
        return _parse(path, body, content_type)
    except BadRequest as error:
        return error


@settings(max_examples=examples(300))
@given(
    st.sampled_from(PATHS),
    st.sampled_from(CONTENT_TYPES),
    st.binary(max_size=200) | structured_bodies.map(lambda b: json.dumps(b).encode()),
)
def test_any_body_parses_or_is_a_bad_request(
    path: str, content_type: str | None, body: bytes
) -> None:
    request = _outcome(path, body, content_type)
    if isinstance(request, BadRequest):
        assert request.message
        assert request.status == 400
        json.loads(request.body())  # the OpenAI error shape is always valid JSON
        return
    assert isinstance(request, InferenceRequest)
    assert request.body is body  # forwarded as received, never re-serialised
    assert isinstance(request.model, str)
    assert request.cache_salt is None or isinstance(request.cache_salt, str)


@settings(max_examples=examples(200))
@given(st.sampled_from(PATHS[:4]), structured_bodies, st.sampled_from(["prompt", "model", "x"]))
def test_an_error_message_never_echoes_the_prompt(
    path: str, body: dict[str, Any], where: str
) -> None:
    body = {**body, where: MARKER} if where != "x" else body
    body.setdefault("prompt", f"{MARKER} {MARKER}")
    outcome = _outcome(path, json.dumps(body).encode())
    if isinstance(outcome, BadRequest):
        assert MARKER not in outcome.message, outcome.message


@settings(max_examples=examples(200))
@given(
    texts.filter(bool),
    st.none() | texts,
    texts | st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
    st.dictionaries(st.sampled_from(["temperature", "n", "user", "seed"]), json_values, max_size=3),
)
def test_a_valid_completion_keeps_what_the_client_sent(
    model: str, salt: str | None, prompt: str | list[int], extra: dict[str, Any]
) -> None:
    body: dict[str, Any] = {**extra, "model": model, "prompt": prompt}
    if salt is not None:
        body["cache_salt"] = salt
    raw = json.dumps(body).encode()
    request = _parse("/v1/completions", raw)
    assert (request.model, request.cache_salt) == (model, salt)
    assert isinstance(request.prompt, CompletionPrompt)
    assert request.prompt.prompts == ((prompt if isinstance(prompt, str) else tuple(prompt)),)
    assert request.body == raw


@settings(max_examples=examples(200))
@given(texts.filter(bool), st.lists(message_values, min_size=1, max_size=4), texts.filter(bool))
def test_a_model_rewrite_changes_the_model_and_nothing_else(
    model: str, messages: list[dict[str, Any]], new_model: str
) -> None:
    raw = json.dumps({"model": model, "messages": messages, "temperature": 0.5}).encode()
    try:
        request = _parse("/v1/chat/completions", raw)
    except BadRequest:
        return  # messages no chat API accepts
    assert isinstance(request.prompt, ChatPrompt)
    rewritten = rewrite_model(request.body, new_model)
    before, after = json.loads(raw), json.loads(rewritten)
    assert after.pop("model") == new_model
    before.pop("model")
    assert after == before


# ---------------------------------------------------------------------------
# The precise scorer's preparation (tokenizer, chat template) of anything parsed


@pytest.fixture(scope="module")
def precise() -> Iterator[tuple[asyncio.Runner, PrecisePrefixService]]:
    config = msgspec.convert(
        {"blockSize": 4, "tokenizers": [{"model": "*", "path": str(qwen_dir())}]},
        PrecisePrefixConfig,
    )
    runner = asyncio.Runner()
    service = PrecisePrefixService(config, Datastore())
    runner.run(service.tokenizers.load())
    assert service.tokenizers.describe() == {"*": "ready"}
    logging.disable(logging.ERROR)  # skipped requests are logged once per cause
    try:
        yield runner, service
    finally:
        logging.disable(logging.NOTSET)
        service.tokenizers.close()
        runner.close()


chat_options = {
    "tools": json_values | st.just([{"type": "function", "function": {"name": "f"}}]),
    "chat_template_kwargs": json_values | st.just({"enable_thinking": False}),
    "add_generation_prompt": json_values,
    "continue_final_message": st.booleans(),
    "documents": json_values,
    "add_special_tokens": json_values,
    "cache_salt": texts,
}
# Requests shaped like real ones, with any field anywhere odd: most get through the
# parser, so the tokenizer and the chat template see them.
plausible_requests = st.one_of(
    st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries(
            {"model": st.just("m"), "messages": st.lists(message_values, min_size=1, max_size=4)},
            optional=chat_options,
        ),
    ),
    st.tuples(
        st.just("/v1/completions"),
        st.fixed_dictionaries(
            {"model": st.just("m"), "prompt": texts | st.lists(st.integers(-1, 2**33), max_size=9)},
            optional={"add_special_tokens": json_values, "prompt_embeds": json_values},
        ),
    ),
    st.tuples(
        st.just("/v1/responses"),
        st.fixed_dictionaries(
            {"model": st.just("m"), "input": texts | st.lists(message_values, max_size=3)},
            optional={"instructions": texts | json_values},
        ),
    ),
    st.tuples(st.sampled_from(PATHS[:4]), structured_bodies),
)


@settings(max_examples=examples(200))
@given(plausible_requests)
def test_the_precise_service_looks_up_any_parsed_request_without_raising(
    precise: tuple[asyncio.Runner, PrecisePrefixService], pair: tuple[str, dict[str, Any]]
) -> None:
    runner, service = precise
    path, body = pair
    request = _outcome(path, json.dumps(body).encode())
    if isinstance(request, BadRequest):
        event("refused by the parser")
        return
    endpoints = make_endpoints(2)
    found = runner.run(service.lookup_request(request, endpoints))
    if isinstance(found, NoLookup):
        event(f"skipped: {found.reason}")
        assert found.reason in service.stats.skipped
    elif found is None:
        event("no prompt")
    else:
        event("tokenized and looked up")
        assert all(0.0 <= found.score(e) <= 1.0 for e in endpoints)
