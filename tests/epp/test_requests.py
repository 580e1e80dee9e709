"""Request parsing: every OpenAI body shape, control headers, and bad input."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from epp.errors import BadRequest
from epp.requests import (
    CONTROL_HEADERS,
    FAIRNESS_ID_HEADER,
    MODEL_REWRITE_HEADER,
    OBJECTIVE_HEADER,
    Api,
    ChatPrompt,
    CompletionPrompt,
    ContentPart,
    InferenceRequest,
    Message,
    ResponsesPrompt,
    api_for_path,
    parse_request,
    rewrite_model,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"


def parse(
    path: str,
    body: bytes | dict[str, object] | list[object],
    headers: Mapping[str, str] | None = None,
    method: str = "POST",
) -> InferenceRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(
        request_id="req-1",
        method=method,
        path=path,
        headers=dict(headers) if headers is not None else {"content-type": "application/json"},
        body=raw,
    )


def bad(path: str, body: bytes, headers: Mapping[str, str] | None = None) -> str:
    """Parse a body that must be refused; returns the error message."""
    with pytest.raises(BadRequest) as info:
        parse(path, body, headers)
    assert info.value.status == 400
    assert info.value.message
    return info.value.message


# ---------------------------------------------------------------------------
# api_for_path


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/completions", Api.COMPLETIONS),
        ("/v1/chat/completions", Api.CHAT_COMPLETIONS),
        ("/v1/responses", Api.RESPONSES),
        ("/v1/embeddings", Api.EMBEDDINGS),
        ("/v1/chat/completions?api-version=2024-02-01", Api.CHAT_COMPLETIONS),
        ("/v1/completions/", Api.COMPLETIONS),
        ("/openai/deployments/x/chat/completions?a=b", Api.CHAT_COMPLETIONS),
        ("/v1/models", Api.OTHER),
        ("/health", Api.OTHER),
        ("/", Api.OTHER),
        ("", Api.OTHER),
        ("/v1/responses/resp_123", Api.OTHER),
        ("/v1/models?x=/v1/completions", Api.OTHER),
    ],
)
def test_api_for_path(path: str, api: Api) -> None:
    assert api_for_path(path) is api


# ---------------------------------------------------------------------------
# /v1/completions


def test_completions_string_prompt() -> None:
    req = parse(COMPLETIONS, {"model": "llama", "prompt": "Hello"})
    assert req.api is Api.COMPLETIONS
    assert req.model == "llama"
    assert req.target_model == "llama"
    assert not req.model_rewritten
    assert req.prompt == CompletionPrompt(("Hello",))
    assert req.stream is False
    assert req.cache_salt is None
    assert req.request_id == "req-1"
    assert req.method == "POST"
    assert req.path == COMPLETIONS


def test_completions_list_of_strings() -> None:
    req = parse(COMPLETIONS, {"model": "m", "prompt": ["a", "b", ""]})
    assert req.prompt == CompletionPrompt(("a", "b", ""))


def test_completions_token_ids() -> None:
    req = parse(COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]})
    assert req.prompt == CompletionPrompt(((1, 2, 3),))


def test_completions_list_of_token_id_lists() -> None:
    req = parse(COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]]})
    assert req.prompt == CompletionPrompt(((1, 2), (3,)))


def test_completions_stream_and_cache_salt() -> None:
    req = parse(COMPLETIONS, {"model": "m", "prompt": "x", "stream": True, "cache_salt": "s1"})
    assert req.stream is True
    assert req.cache_salt == "s1"


def test_stream_null_is_false() -> None:
    assert parse(COMPLETIONS, {"model": "m", "prompt": "x", "stream": None}).stream is False


def test_body_is_kept_byte_for_byte() -> None:
    body = b'{ "prompt" : "x",\n  "model":"m", "temperature": 1.0e0, "extra": {"k": [1, 2]} }'
    req = parse(COMPLETIONS, body)
    assert req.body == body
    assert req.model == "m"


def test_unknown_fields_are_ignored() -> None:
    req = parse(COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 5, "logprobs": None})
    assert req.prompt == CompletionPrompt(("x",))


# ---------------------------------------------------------------------------
# /v1/chat/completions


def test_chat_string_content() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "stream": True,
    }
    req = parse(CHAT, body)
    assert req.api is Api.CHAT_COMPLETIONS
    assert req.stream is True
    assert isinstance(req.prompt, ChatPrompt)
    messages = req.prompt.messages
    assert [m.role for m in messages] == ["system", "user"]
    assert [m.content for m in messages] == ["Be brief.", "Hi"]
    assert [m.text() for m in messages] == ["Be brief.", "Hi"]
    # `extra` is the message's exact JSON.
    assert json.loads(messages[1].extra or b"") == {"role": "user", "content": "Hi"}
    assert req.prompt.tools is None
    assert req.prompt.chat_template_kwargs is None


def test_chat_content_parts_with_image() -> None:
    image = b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}'
    body = (
        b'{"model": "vl", "messages": [{"role": "user", "content": ['
        b'{"type": "text", "text": "What is "}, ' + image + b', {"type": "text", "text": "this?"}'
        b"]}]}"
    )
    req = parse(CHAT, body)
    assert isinstance(req.prompt, ChatPrompt)
    (message,) = req.prompt.messages
    assert message.content == (
        ContentPart(type="text", text="What is "),
        ContentPart(type="image_url", data=image),
        ContentPart(type="text", text="this?"),
    )
    # Non-text parts are left out of the text.
    assert message.text() == "What is this?"


def test_chat_part_without_type_is_text() -> None:
    req = parse(CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"text": "hi"}]}]})
    assert isinstance(req.prompt, ChatPrompt)
    assert req.prompt.messages[0].content == (ContentPart(type="text", text="hi"),)


def test_chat_message_without_content() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "call it"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        ],
    }
    req = parse(CHAT, body)
    assert isinstance(req.prompt, ChatPrompt)
    assistant = req.prompt.messages[1]
    assert assistant.content is None
    assert assistant.text() == ""
    assert json.loads(assistant.extra or b"")["tool_calls"] == [{"id": "c1"}]


def test_chat_tools_and_template_kwargs_are_exact_json() -> None:
    tools = b'[{"type": "function", "function": {"name": "f", "parameters": {}}}]'
    kwargs = b'{"enable_thinking": false}'
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": '
        + tools
        + b', "chat_template_kwargs": '
        + kwargs
        + b"}"
    )
    req = parse(CHAT, body)
    assert isinstance(req.prompt, ChatPrompt)
    assert req.prompt.tools == tools
    assert req.prompt.chat_template_kwargs == kwargs


def test_chat_null_tools_is_none() -> None:
    req = parse(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": None})
    assert isinstance(req.prompt, ChatPrompt)
    assert req.prompt.tools is None


# ---------------------------------------------------------------------------
# /v1/responses and /v1/embeddings


def test_responses_string_input() -> None:
    req = parse(RESPONSES, {"model": "m", "input": "Tell me", "instructions": "Be kind"})
    assert req.api is Api.RESPONSES
    assert req.prompt == ResponsesPrompt(instructions="Be kind", input="Tell me")


def test_responses_item_list() -> None:
    body = {
        "model": "m",
        "instructions": "sys",
        "input": [
            {"role": "user", "content": "hello"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ],
    }
    req = parse(RESPONSES, body)
    assert isinstance(req.prompt, ResponsesPrompt)
    assert req.prompt.instructions == "sys"
    items = req.prompt.input
    assert isinstance(items, tuple)
    assert len(items) == 3
    assert items[0] == Message(role="user", content="hello", extra=items[0].extra)
    assert items[1].content == (ContentPart(type="input_text", text="a"),)
    assert items[2].role is None
    assert items[2].content is None
    assert json.loads(items[2].extra or b"")["output"] == "42"


def test_responses_without_instructions() -> None:
    req = parse(RESPONSES, {"model": "m", "input": "x"})
    assert req.prompt == ResponsesPrompt(instructions=None, input="x")


@pytest.mark.parametrize(
    ("value", "prompts"),
    [
        ("text", ("text",)),
        (["a", "b"], ("a", "b")),
        ([5, 6], ((5, 6),)),
        ([[5], [6, 7]], ((5,), (6, 7))),
    ],
)
def test_embeddings_input(value: object, prompts: tuple[object, ...]) -> None:
    req = parse(EMBEDDINGS, {"model": "emb", "input": value})
    assert req.api is Api.EMBEDDINGS
    assert req.prompt == CompletionPrompt(prompts)  # type: ignore[arg-type]


def test_embeddings_without_input() -> None:
    assert "`input`" in bad(EMBEDDINGS, b'{"model": "m"}')


# ---------------------------------------------------------------------------
# Headers


def test_control_headers() -> None:
    headers = {
        "content-type": "application/json",
        MODEL_REWRITE_HEADER: "llama-v2",
        OBJECTIVE_HEADER: "critical",
        FAIRNESS_ID_HEADER: "tenant-a",
        "x-other": "1",
    }
    req = parse(COMPLETIONS, {"model": "llama", "prompt": "x"}, headers)
    assert req.model == "llama"
    assert req.target_model == "llama-v2"
    assert req.model_rewritten
    assert req.objective == "critical"
    assert req.fairness_id == "tenant-a"
    # Control headers stay visible to plugins; they are removed upstream elsewhere.
    assert req.headers[MODEL_REWRITE_HEADER] == "llama-v2"
    assert req.headers["x-other"] == "1"


def test_empty_rewrite_header_is_ignored() -> None:
    req = parse(COMPLETIONS, {"model": "llama", "prompt": "x"}, {MODEL_REWRITE_HEADER: ""})
    assert req.target_model == "llama"
    assert not req.model_rewritten


def test_headers_are_a_read_only_copy() -> None:
    headers = {"content-type": "application/json", "x-a": "1"}
    req = parse(COMPLETIONS, {"model": "m", "prompt": "x"}, headers)
    headers["x-a"] = "2"
    assert req.headers["x-a"] == "1"
    with pytest.raises(TypeError):
        req.headers["x-a"] = "3"  # type: ignore[index]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"content-type": "application/json"},
        {"content-type": "application/json; charset=utf-8"},
        {"content-type": "Application/JSON"},
        {"content-type": "application/vnd+json"},
        {"content-type": "application/vnd.api+json; charset=UTF-8"},
    ],
)
def test_accepted_content_types(headers: dict[str, str]) -> None:
    assert parse(COMPLETIONS, {"model": "m", "prompt": "x"}, headers).model == "m"


def test_unsupported_content_type() -> None:
    message = bad(COMPLETIONS, b'{"model": "m", "prompt": "x"}', {"content-type": "text/plain"})
    assert "text/plain" in message
    assert "application/json" in message


# ---------------------------------------------------------------------------
# Other paths


def test_other_path_reads_model_from_json() -> None:
    req = parse("/v1/tokenize?x=1", {"model": "m", "prompt": "x"})
    assert req.api is Api.OTHER
    assert req.model == "m"
    assert req.target_model == "m"
    assert req.prompt is None


def test_other_path_with_rewrite_header() -> None:
    req = parse("/tokenize", {"model": "m"}, {MODEL_REWRITE_HEADER: "n"})
    assert req.target_model == "n"
    assert req.model_rewritten


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json at all",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"model": 5}',
        b'{"model": "m"',
        b'{"model": "\\ud800"}',
    ],
)
def test_other_path_never_errors(body: bytes) -> None:
    req = parse("/v1/models", body, {}, method="GET")
    assert req.api is Api.OTHER
    assert req.model == ""
    assert req.target_model == ""
    assert req.body == body


def test_other_path_with_rewrite_header_and_no_model() -> None:
    req = parse("/v1/models", b"", {MODEL_REWRITE_HEADER: "n"}, method="GET")
    assert req.model == ""
    assert req.target_model == ""
    assert not req.model_rewritten


def test_other_path_non_json_content_type_is_not_read() -> None:
    req = parse("/upload", b'{"model": "m"}', {"content-type": "text/plain"})
    assert req.model == ""


# ---------------------------------------------------------------------------
# Bad input: one test each.


def test_malformed_json() -> None:
    assert "not valid JSON" in bad(COMPLETIONS, b'{"model": "m", prompt: "x"}')


def test_truncated_json() -> None:
    assert "not valid JSON" in bad(COMPLETIONS, b'{"model": "m", "prompt": "x"')


def test_trailing_garbage() -> None:
    assert "not valid JSON" in bad(COMPLETIONS, b'{"model": "m", "prompt": "x"} {}')


def test_model_not_a_string() -> None:
    message = bad(COMPLETIONS, b'{"model": 5, "prompt": "x"}')
    assert "`body.model`" in message
    assert "str" in message


def test_missing_model() -> None:
    assert "`model`" in bad(COMPLETIONS, b'{"prompt": "x"}')


def test_empty_model() -> None:
    assert "`model`" in bad(CHAT, b'{"model": "", "messages": [{"role": "user", "content": "x"}]}')


def test_non_utf8_bytes() -> None:
    assert "UTF-8" in bad(COMPLETIONS, b'{"model": "m", "prompt": "caf\xe9"}')


def test_non_utf8_bytes_inside_a_message() -> None:
    # Messages are decoded lazily: invalid UTF-8 there must still be a 400.
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}'
    assert "UTF-8" in bad(CHAT, body)


def test_non_utf8_bytes_in_an_unread_field() -> None:
    # Fields the EPP skips (and forwards) must be valid UTF-8 too.
    body = b'{"model": "m", "prompt": "x", "user": "\xc3\x28"}'
    assert "UTF-8" in bad(COMPLETIONS, body)


def test_utf8_encoded_surrogate() -> None:
    # U+D800 encoded as UTF-8 bytes is not valid UTF-8.
    assert "UTF-8" in bad(COMPLETIONS, b'{"model": "m", "prompt": "\xed\xa0\x80"}')


def test_non_ascii_utf8_is_fine() -> None:
    req = parse(COMPLETIONS, '{"model": "m", "prompt": "café ☕ 😀"}'.encode())
    assert req.prompt == CompletionPrompt(("café ☕ 😀",))


def test_lone_surrogate_escape() -> None:
    message = bad(COMPLETIONS, b'{"model": "m", "prompt": "a\\ud800b"}')
    assert message == "the body is not valid JSON (a \\u escape is a lone UTF-16 surrogate)"


def test_lone_surrogate_escape_at_the_end_of_a_string() -> None:
    message = bad(COMPLETIONS, b'{"model": "m", "prompt": "a\\uDBFF"}')
    assert "lone UTF-16 surrogate" in message


def test_lone_low_surrogate_escape_in_message() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}'
    message = bad(CHAT, body)
    assert "not valid JSON" in message
    assert "surrogate" in message


def test_escaped_backslash_before_u_is_not_a_surrogate() -> None:
    # "\\ud800" is a backslash followed by the text "ud800": valid JSON.
    req = parse(COMPLETIONS, b'{"model": "m", "prompt": "\\\\ud800"}')
    assert req.prompt == CompletionPrompt(("\\ud800",))


def test_surrogate_pair_escape_is_fine() -> None:
    req = parse(COMPLETIONS, b'{"model": "m", "prompt": "\\ud83d\\ude00"}')
    assert req.prompt == CompletionPrompt(("\U0001f600",))


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, EMBEDDINGS])
def test_empty_body_on_api_path(path: str) -> None:
    message = bad(path, b"")
    assert path in message
    assert "body" in message


def test_body_not_an_object() -> None:
    assert "`body`" in bad(COMPLETIONS, b'["model", "m"]')


def test_prompt_mixing_ints_and_strings() -> None:
    message = bad(COMPLETIONS, b'{"model": "m", "prompt": [1, "a"]}')
    assert "`prompt` mixes" in message


def test_prompt_mixing_strings_and_ints() -> None:
    message = bad(COMPLETIONS, b'{"model": "m", "prompt": ["a", 1]}')
    assert "`prompt` mixes" in message
    assert "token ids" in message


def test_prompt_mixing_lists_and_strings() -> None:
    assert "`prompt` mixes" in bad(COMPLETIONS, b'{"model": "m", "prompt": [[1], "a"]}')


def test_prompt_bool_is_not_a_token_id() -> None:
    assert "`body.prompt[0]`" in bad(COMPLETIONS, b'{"model": "m", "prompt": [true]}')


def test_empty_prompt_list() -> None:
    assert "`prompt` is an empty list" in bad(COMPLETIONS, b'{"model": "m", "prompt": []}')


def test_empty_token_id_list() -> None:
    assert "`prompt[1]`" in bad(COMPLETIONS, b'{"model": "m", "prompt": [[1], []]}')


def test_missing_prompt() -> None:
    assert "`prompt`" in bad(COMPLETIONS, b'{"model": "m"}')


def test_stream_not_a_bool() -> None:
    assert "`body.stream`" in bad(COMPLETIONS, b'{"model": "m", "prompt": "x", "stream": "yes"}')


def test_empty_messages() -> None:
    assert "`messages`" in bad(CHAT, b'{"model": "m", "messages": []}')


def test_missing_messages() -> None:
    assert "`messages`" in bad(CHAT, b'{"model": "m"}')


def test_message_not_an_object() -> None:
    message = bad(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}, "hi"]}')
    assert "messages[1]" in message
    assert "object" in message


def test_message_content_of_wrong_type_names_its_path() -> None:
    message = bad(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": 5}]}')
    assert "`body.messages[0].content`" in message


def test_content_part_of_wrong_type_names_its_path() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'
    )
    assert "`body.messages[0].content[0].text`" in bad(CHAT, body)


def test_responses_without_input() -> None:
    assert "`input`" in bad(RESPONSES, b'{"model": "m", "instructions": "x"}')


def test_responses_with_empty_input_list() -> None:
    assert "`input`" in bad(RESPONSES, b'{"model": "m", "input": []}')


def test_responses_item_not_an_object() -> None:
    assert "input[0]" in bad(RESPONSES, b'{"model": "m", "input": [7]}')


def test_bad_request_error_body_is_openai_shaped() -> None:
    with pytest.raises(BadRequest) as info:
        parse(COMPLETIONS, b'{"prompt": "x"}')
    body = json.loads(info.value.body())
    assert body == {
        "error": {
            "message": info.value.message,
            "type": "invalid_request_error",
            "code": 400,
        }
    }


# ---------------------------------------------------------------------------
# rewrite_model


def test_rewrite_model_keeps_key_order_and_other_fields() -> None:
    body = b'{"a": 1, "model": "old", "messages": [{"role": "user", "content": "x"}], "z": null}'
    out = rewrite_model(body, "new")
    document = json.loads(out)
    assert list(document) == ["a", "model", "messages", "z"]
    assert document == {
        "a": 1,
        "model": "new",
        "messages": [{"role": "user", "content": "x"}],
        "z": None,
    }


def test_rewrite_model_keeps_every_other_value_byte_for_byte() -> None:
    values = [
        b'"temperature":0.70',
        b'"big":123456789012345678901234567890',
        b'"huge":1e400',
        b'"s":"caf\\u00e9 \\ud83d\\ude00 \\"q\\""',
        b'"nested":{"b":2,"a":[1.0,2e-3]}',
    ]
    body = b"{" + b",".join([values[0], b'"model":"old"', *values[1:]]) + b"}"
    out = rewrite_model(body, "new")
    for value in values:
        assert value in out
    assert b'"model":"new"' in out


def test_rewrite_model_adds_a_missing_model() -> None:
    assert json.loads(rewrite_model(b'{"prompt": "x"}', "m")) == {"prompt": "x", "model": "m"}


def test_rewrite_model_escapes_the_new_name() -> None:
    out = rewrite_model(b'{"model": "a"}', 'we"ird\\name')
    assert json.loads(out)["model"] == 'we"ird\\name'


def test_rewrite_model_of_a_non_object() -> None:
    with pytest.raises(BadRequest):
        rewrite_model(b"[1]", "m")


def test_rewrite_model_of_invalid_json() -> None:
    with pytest.raises(BadRequest):
        rewrite_model(b'{"model": ', "m")


def test_rewritten_request_round_trip() -> None:
    req = parse(
        CHAT,
        {"model": "a", "messages": [{"role": "user", "content": "x"}]},
        {MODEL_REWRITE_HEADER: "b"},
    )
    again = parse(CHAT, rewrite_model(req.body, req.target_model))
    assert again.model == "b"
    assert again.prompt == req.prompt


@pytest.mark.parametrize(
    ("headers", "objective", "fairness_id"),
    [
        ({}, None, None),
        (
            {"x-gateway-inference-objective": "gie", "x-gateway-inference-fairness-id": "a"},
            "gie",
            "a",
        ),
        (
            {
                "x-gateway-inference-objective": "gie",
                "x-llm-d-inference-objective": "llmd",
                "x-gateway-inference-fairness-id": "a",
                "x-llm-d-inference-fairness-id": "b",
            },
            "llmd",
            "b",
        ),
    ],
)
def test_objective_and_fairness_id_by_llm_ds_names_or_gies(
    headers: dict[str, str], objective: str | None, fairness_id: str | None
) -> None:
    parsed = parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers=headers,
        body=b'{"model": "m", "prompt": "p"}',
    )
    assert (parsed.objective, parsed.fairness_id) == (objective, fairness_id)
    assert set(headers) <= set(CONTROL_HEADERS)  # removed before going upstream
