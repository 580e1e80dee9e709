"""Parse an HTTP request once into the immutable `InferenceRequest` that plugins read.

The body is decoded a single time, straight into typed structs (msgspec), and the
original bytes are kept: an unchanged body goes back to Envoy as received, never
re-serialised. Supported APIs, chosen by the request path:

| path suffix            | prompt field                                          |
|------------------------|-------------------------------------------------------|
| `/v1/completions`      | `prompt`: string, strings, token ids, token-id lists  |
| `/v1/chat/completions` | `messages`: string or content-part content            |
| `/v1/responses`        | `input` (string or items), `instructions`             |
| `/v1/embeddings`       | `input`: like `prompt`                                |

Any other path is routed without a prompt (its `model` is read if the body is a JSON
object), so health checks, `/v1/models` and engine-specific endpoints pass through.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

import msgspec

from epp.errors import BadRequest

# Request control headers. They steer the EPP and are removed before the request
# goes upstream. The objective (its priority) and the fairness id (its flow) go by
# llm-d's names and by GIE's older ones; llm-d's win when both are sent.
MODEL_REWRITE_HEADER: Final = "x-gateway-model-name-rewrite"
OBJECTIVE_HEADER: Final = "x-gateway-inference-objective"
FAIRNESS_ID_HEADER: Final = "x-gateway-inference-fairness-id"
LLMD_OBJECTIVE_HEADER: Final = "x-llm-d-inference-objective"
LLMD_FAIRNESS_ID_HEADER: Final = "x-llm-d-inference-fairness-id"
CONTROL_HEADERS: Final = (
    MODEL_REWRITE_HEADER,
    OBJECTIVE_HEADER,
    FAIRNESS_ID_HEADER,
    LLMD_OBJECTIVE_HEADER,
    LLMD_FAIRNESS_ID_HEADER,
)

# Disaggregated serving (llm-d's contract with the sidecar on the decode pod): the
# endpoint to run the prefill on, "ip:port", set by the EPP on a disaggregated pick;
# and, for encoders, a comma-separated list of them. Only the EPP may set these: a
# client's own copy is removed before the request goes upstream, so no client can
# point a sidecar at a host of its choosing.
PREFILLER_HEADER: Final = "x-prefiller-host-port"
ENCODERS_HEADER: Final = "x-encoder-hosts-ports"
EPP_SET_HEADERS: Final = (PREFILLER_HEADER, ENCODERS_HEADER)


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    OTHER = "other"


# Longest suffix first: "/chat/completions" also ends with "/completions".
_API_BY_SUFFIX: Final = (
    ("/chat/completions", Api.CHAT_COMPLETIONS),
    ("/completions", Api.COMPLETIONS),
    ("/responses", Api.RESPONSES),
    ("/embeddings", Api.EMBEDDINGS),
)


def api_for_path(path: str) -> Api:
    """The API a request path names; the query string is ignored."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in _API_BY_SUFFIX:
        if path.endswith(suffix):
            return api
    return Api.OTHER


# ---------------------------------------------------------------------------
# Prompt shapes handed to plugins.


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a message's content. `text` for text parts; for any other part
    (image, audio, file, ...) `data` is its exact JSON, which identifies it."""

    type: str
    text: str | None = None
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """A chat message, or an item of a Responses API `input` list."""

    role: str | None
    content: str | tuple[ContentPart, ...] | None
    # Everything else about the message (tool calls, names, item type...) as exact JSON,
    # for plugins that need it, e.g. to render a chat template.
    extra: bytes | None = None

    def text(self) -> str:
        """The message's text parts joined, without non-text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """`/v1/completions` `prompt` or `/v1/embeddings` `input`: one or more prompts,
    each a string or a list of token ids (a list of several is a batch)."""

    prompts: tuple[str | tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """`/v1/chat/completions` messages, and the request fields a chat template reads."""

    messages: tuple[Message, ...]
    tools: bytes | None = None  # exact JSON of `tools`
    chat_template_kwargs: bytes | None = None


@dataclass(frozen=True, slots=True)
class ResponsesPrompt:
    """`/v1/responses`: `instructions` and `input` (a string or a list of items)."""

    instructions: str | None
    input: str | tuple[Message, ...]


Prompt = CompletionPrompt | ChatPrompt | ResponsesPrompt


# ---------------------------------------------------------------------------
# The request object.


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One HTTP request as plugins see it. Immutable; built once per request."""

    request_id: str
    path: str
    method: str
    api: Api
    # The model the client asked for ("" when the request has none, e.g. GET /v1/models).
    # It may name a base model or a LoRA adapter: LoRA-aware plugins compare it with
    # the adapters each endpoint reports.
    model: str = ""
    # The model the request is served as: `model`, or the value of the
    # x-gateway-model-name-rewrite header (the body is rewritten to match).
    target_model: str = ""
    stream: bool = False
    cache_salt: str | None = None
    prompt: Prompt | None = None
    # Lower-cased header names; control headers included (they are removed upstream).
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    objective: str | None = None
    fairness_id: str | None = None

    @property
    def model_rewritten(self) -> bool:
        return self.target_model != self.model


# ---------------------------------------------------------------------------
# Wire structs: only the fields the EPP reads. Unknown fields are ignored.


class _Part(msgspec.Struct, frozen=True):
    type: str = "text"
    text: str | None = None


class _Message(msgspec.Struct, frozen=True):
    role: str | None = None
    content: str | list[msgspec.Raw] | None = None
    type: str | None = None


class _Common(msgspec.Struct, frozen=True):
    model: str | None = None
    stream: bool | None = False
    cache_salt: str | None = None


class _CompletionBody(_Common, frozen=True):
    # msgspec allows one array type per union, so element types are checked below.
    prompt: str | list[str | int | list[int]] | None = None


class _EmbeddingsBody(_Common, frozen=True):
    input: str | list[str | int | list[int]] | None = None


class _ChatBody(_Common, frozen=True):
    messages: list[msgspec.Raw] | None = None
    # msgspec.Raw cannot be part of a union (`Raw | None` only accepts null): an
    # absent field is the empty Raw, and `_raw_or_none` maps it (and null) to None.
    tools: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    chat_template_kwargs: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _ResponsesBody(_Common, frozen=True):
    input: str | list[msgspec.Raw] | None = None
    instructions: str | None = None


class _AnyBody(msgspec.Struct, frozen=True):
    model: str | None = None


_decoders: Final[dict[Api, msgspec.json.Decoder[Any]]] = {
    Api.COMPLETIONS: msgspec.json.Decoder(_CompletionBody),
    Api.EMBEDDINGS: msgspec.json.Decoder(_EmbeddingsBody),
    Api.CHAT_COMPLETIONS: msgspec.json.Decoder(_ChatBody),
    Api.RESPONSES: msgspec.json.Decoder(_ResponsesBody),
}
_message_decoder: Final = msgspec.json.Decoder(_Message)
_part_decoder: Final = msgspec.json.Decoder(_Part)
_any_decoder: Final = msgspec.json.Decoder(_AnyBody)


# A \uD800-\uDBFF escape without a low surrogate after it (an even run of
# backslashes before it, so it is an escape and not escaped text).
_LONE_HIGH_SURROGATE: Final = re.compile(
    rb"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)


def _describe(exc: Exception, where: str = "body", body: bytes = b"") -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "the body is not valid UTF-8"
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        # msgspec names the decoded value `$` (and leaves the path out when the error
        # is about the value itself); say where it is in the body (`body`, or
        # `body.messages[2]` for a message decoded on its own) so the message reads
        # on its own.
        if " - at `$" not in text:
            return f"{text} - at `{where}`"
        return (
            text.replace("`$.", f"`{where}.")
            .replace("`$[", f"`{where}[")
            .replace("`$`", f"`{where}`")
        )
    if body and _LONE_HIGH_SURROGATE.search(body):
        # msgspec calls this "Input data was truncated", which misleads.
        return "the body is not valid JSON (a \\u escape is a lone UTF-16 surrogate)"
    return f"the body is not valid JSON ({text})"


def _raw_or_none(raw: msgspec.Raw) -> bytes | None:
    value = bytes(raw)
    return None if not value or value == b"null" else value


def _decode_message(raw: msgspec.Raw, where: str) -> Message:
    try:
        wire = _message_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"invalid {where}: {_describe(exc, f'body.{where}')}") from None
    content: str | tuple[ContentPart, ...] | None
    if isinstance(wire.content, list):
        parts = []
        for i, raw_part in enumerate(wire.content):
            try:
                part = _part_decoder.decode(raw_part)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                part_where = f"{where}.content[{i}]"
                raise BadRequest(
                    f"invalid {part_where}: {_describe(exc, f'body.{part_where}')}"
                ) from None
            if part.text is not None:
                parts.append(ContentPart(type=part.type, text=part.text))
            else:
                parts.append(ContentPart(type=part.type, data=bytes(raw_part)))
        content = tuple(parts)
    else:
        content = wire.content
    return Message(role=wire.role, content=content, extra=bytes(raw))


def _prompt_list(
    value: str | list[str | int | list[int]] | None, field_name: str
) -> CompletionPrompt:
    if value is None:
        raise BadRequest(f"the request body has no `{field_name}`")
    if isinstance(value, str):
        return CompletionPrompt((value,))
    if not value:
        raise BadRequest(f"`{field_name}` is an empty list")
    mixed = BadRequest(
        f"`{field_name}` mixes strings, token ids and token-id lists: it must be a string,"
        " a list of strings, a list of token ids or a list of token-id lists"
    )
    first = value[0]
    if isinstance(first, int):
        if not all(type(t) is int for t in value):
            raise mixed
        return CompletionPrompt((tuple(value),))  # type: ignore[arg-type]
    kind = type(first)
    if not all(type(item) is kind for item in value):
        raise mixed
    if kind is str:
        return CompletionPrompt(tuple(value))  # type: ignore[arg-type]
    for i, ids in enumerate(value):
        if not ids:
            raise BadRequest(f"`{field_name}[{i}]` is an empty token-id list")
    return CompletionPrompt(tuple(tuple(ids) for ids in value))  # type: ignore[arg-type]


def _parse_prompt(api: Api, wire: _Common) -> Prompt:
    if isinstance(wire, _CompletionBody):
        return _prompt_list(wire.prompt, "prompt")
    if isinstance(wire, _EmbeddingsBody):
        return _prompt_list(wire.input, "input")
    if isinstance(wire, _ChatBody):
        if not wire.messages:
            raise BadRequest("`messages` must be a non-empty list")
        messages = tuple(
            _decode_message(raw, f"messages[{i}]") for i, raw in enumerate(wire.messages)
        )
        return ChatPrompt(
            messages=messages,
            tools=_raw_or_none(wire.tools),
            chat_template_kwargs=_raw_or_none(wire.chat_template_kwargs),
        )
    assert isinstance(wire, _ResponsesBody), api
    if wire.input is None or (isinstance(wire.input, list) and not wire.input):
        raise BadRequest("the request body has no `input`")
    items: str | tuple[Message, ...]
    if isinstance(wire.input, str):
        items = wire.input
    else:
        items = tuple(_decode_message(raw, f"input[{i}]") for i, raw in enumerate(wire.input))
    return ResponsesPrompt(instructions=wire.instructions, input=items)


def _is_json_content_type(content_type: str | None) -> bool:
    if not content_type:
        return True  # like vLLM (FastAPI): a missing content type is read as JSON
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def parse_request(
    *,
    request_id: str,
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    body_seen: bool = True,
) -> InferenceRequest:
    """Build the `InferenceRequest` for one HTTP request, or raise `BadRequest`.

    `headers` must have lower-case names. An empty body on a non-API path (GET
    /v1/models, health checks) is valid and routes without a model.
    `body_seen=False`: the proxy does not show this EPP the body (a STREAMED or
    NONE body mode), so the request is routed on its headers alone.
    """
    api = api_for_path(path)
    rewrite = headers.get(MODEL_REWRITE_HEADER) or None

    def build(
        model: str = "", stream: bool = False, salt: str | None = None, prompt: Prompt | None = None
    ) -> InferenceRequest:
        return InferenceRequest(
            request_id=request_id,
            path=path,
            method=method,
            api=api,
            model=model,
            target_model=(rewrite or model) if model else "",
            stream=stream,
            cache_salt=salt,
            prompt=prompt,
            headers=MappingProxyType(dict(headers)),
            body=body,
            objective=headers.get(LLMD_OBJECTIVE_HEADER) or headers.get(OBJECTIVE_HEADER),
            fairness_id=(headers.get(LLMD_FAIRNESS_ID_HEADER) or headers.get(FAIRNESS_ID_HEADER)),
        )

    if not body_seen:
        return build()
    if api is Api.OTHER:
        model = ""
        if body and _is_json_content_type(headers.get("content-type")):
            try:
                model = _any_decoder.decode(body).model or ""
            except (
                msgspec.DecodeError,
                msgspec.ValidationError,
                UnicodeDecodeError,
                RecursionError,
            ):
                model = ""  # not ours to judge: the upstream answers it
        return build(model)

    if not body:
        raise BadRequest(f"{path} needs a JSON request body")
    content_type = headers.get("content-type")
    if not _is_json_content_type(content_type):
        raise BadRequest(f"unsupported content type {content_type!r}: send application/json")
    try:
        # msgspec checks UTF-8 only in the strings it decodes, not in the values it
        # skips or keeps raw (unknown fields, messages, tools), which plugins decode
        # later. Check the whole body once; the ASCII test makes the usual case cheap.
        if not body.isascii():
            body.decode("utf-8")
        wire: _Common = _decoders[api].decode(body)
    except RecursionError:
        raise BadRequest("the body is not valid JSON (nested too deeply)") from None
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise BadRequest(_describe(exc, body=body)) from None
    if not wire.model:
        raise BadRequest("the request body has no `model`")
    try:
        prompt = _parse_prompt(api, wire)
    except RecursionError:
        raise BadRequest("the body is not valid JSON (nested too deeply)") from None
    return build(wire.model, bool(wire.stream), wire.cache_salt, prompt)


# Top-level values are kept as raw JSON: a rewrite changes `model` and nothing else
# (no number reformatted, no escape changed, no value out of Python's float range lost).
_top_level_decoder: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_generic_encoder: Final = msgspec.json.Encoder()


def rewrite_model(body: bytes, model: str) -> bytes:
    """The body with its `model` replaced. Only called when a rewrite is asked for:
    an unchanged body is never re-serialised. Key order and every other value are
    preserved byte for byte (only the whitespace between top-level members goes)."""
    try:
        document = _top_level_decoder.decode(body)
    except RecursionError:
        raise BadRequest("cannot rewrite the model of this body: nested too deeply") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"cannot rewrite the model of this body: {_describe(exc)}") from None
    document["model"] = msgspec.Raw(_generic_encoder.encode(model))
    return _generic_encoder.encode(document)
