"""The OpenAI request and response shapes vLLM serves, for the simulator.

Requests are validated the way vLLM validates them where a client could notice
(400 with an OpenAI error body), and parsed into plain dataclasses. Responses and
SSE chunks are built as dicts with vLLM's field names.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    """A request vLLM would refuse: status, message, OpenAI error type, param."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        error_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.error_type, self.param)


def error_body(
    message: str, status: int, error_type: str, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


# A prompt is text to tokenize or token ids to use as they are.
Prompt = str | list[int]


@dataclass(frozen=True)
class KVTransferParams:
    """A request's `kv_transfer_params` (vLLM's KV connector; NIXL's fields): a
    prefill leg asks for a remote decode, a decode leg names the prefill pod's engine
    and the blocks its KV cache is in."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: tuple[int, ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None


def _block_ids(value: Any) -> tuple[int, ...]:
    """`remote_block_ids`: a list of block ids, or (vLLM with several KV cache groups)
    a list of such lists, of which the simulator's one group is the first."""
    if value is None:
        return ()
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        value = value[0]
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise RequestError(
            "'kv_transfer_params.remote_block_ids' must be a list of block ids (integers >= 0)",
            param="kv_transfer_params",
        )
    return tuple(value)


def parse_kv_transfer_params(value: Any) -> KVTransferParams | None:
    if value is None:
        return None
    param = "kv_transfer_params"
    if not isinstance(value, Mapping):
        raise RequestError("'kv_transfer_params' must be an object", param=param)
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        flag = value.get(key, False)
        if flag is None:
            flag = False
        if not isinstance(flag, bool):
            raise RequestError(f"'kv_transfer_params.{key}' must be a boolean", param=param)
        flags[key] = flag
    if flags["do_remote_decode"] and flags["do_remote_prefill"]:
        raise RequestError(
            "'kv_transfer_params' cannot ask for both a remote decode and a remote prefill",
            param=param,
        )
    texts: dict[str, str | None] = {}
    for key in ("remote_engine_id", "remote_host"):
        text = value.get(key)
        if text is not None and not isinstance(text, str):
            raise RequestError(f"'kv_transfer_params.{key}' must be a string", param=param)
        texts[key] = text
    port = value.get("remote_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise RequestError("'kv_transfer_params.remote_port' must be an integer", param=param)
    return KVTransferParams(
        do_remote_decode=flags["do_remote_decode"],
        do_remote_prefill=flags["do_remote_prefill"],
        remote_engine_id=texts["remote_engine_id"],
        remote_block_ids=_block_ids(value.get("remote_block_ids"))
        if flags["do_remote_prefill"]
        else (),
        remote_host=texts["remote_host"],
        remote_port=port,
    )


@dataclass(frozen=True)
class GenerationRequest:
    chat: bool
    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    max_tokens: int | None
    cache_salt: str | None
    add_special_tokens: bool
    # Completions: one or more prompts (one choice each).
    prompts: list[Prompt] = field(default_factory=list)
    # Chat: the conversation, message contents flattened to text.
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    kv_transfer_params: KVTransferParams | None = None


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", param=key)
    return value


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer", param=key)
    if value < 1:
        raise RequestError(f"{key} must be at least 1, got {value}.", param=key)
    return value


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, Mapping):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise RequestError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
    options = options or {}
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise RequestError("the simulator only supports n=1", param="n")
    return {
        "model": model,
        "stream": stream,
        "include_usage": bool(options.get("include_usage", False)),
        "continuous_usage_stats": bool(options.get("continuous_usage_stats", False)),
        "cache_salt": salt,
        "kv_transfer_params": parse_kv_transfer_params(body.get("kv_transfer_params")),
    }


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def parse_completion(body: Any) -> GenerationRequest:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    prompts: list[Prompt]
    if prompt == []:
        raise RequestError("Prompt cannot be empty.", param="prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and _is_token_list(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_list(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    elif prompt is None:
        raise RequestError("Either prompt or prompt_embeds must be provided.", param="prompt")
    else:
        raise RequestError(
            "'prompt' must be a string, a list of strings, a list of token ids"
            " or a list of lists of token ids",
            param="prompt",
        )
    for p in prompts:
        if len(p) == 0:
            raise RequestError("Prompt cannot be empty.", param="prompt")
    common = _common(body)
    if common["kv_transfer_params"] is not None and len(prompts) > 1:
        raise RequestError("'kv_transfer_params' needs a single prompt", param="kv_transfer_params")
    return GenerationRequest(
        chat=False,
        max_tokens=_optional_int(body, "max_tokens"),
        add_special_tokens=_bool(body, "add_special_tokens", True),
        prompts=prompts,
        **common,
    )


def _message_text(content: Any, index: int) -> str | None:
    """A message's content as the text a string-content template sees.

    A list of parts becomes its text parts joined by newlines (vLLM's "string"
    content format)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise RequestError(
                    f"messages[{index}].content: only text parts are supported by the simulator",
                    param="messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"messages[{index}].content: a text part needs 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise RequestError(f"messages[{index}].content must be a string or a list of parts")


def parse_chat(body: Any) -> GenerationRequest:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(raw):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] must be an object with a 'role'")
        converted = dict(message)
        converted["content"] = _message_text(message.get("content"), index)
        messages.append(converted)
    max_tokens = _optional_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens")
    tools = body.get("tools")
    documents = body.get("documents")
    kwargs = body.get("chat_template_kwargs") or {}
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    if documents is not None and not isinstance(documents, list):
        raise RequestError("'documents' must be a list", param="documents")
    if not isinstance(kwargs, Mapping):
        raise RequestError("'chat_template_kwargs' must be an object")
    return GenerationRequest(
        chat=True,
        max_tokens=max_tokens,
        # Chat prompts come out of the template with their special tokens.
        add_special_tokens=_bool(body, "add_special_tokens", False),
        messages=messages,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        continue_final_message=_bool(body, "continue_final_message", False),
        tools=tools,
        documents=documents,
        chat_template_kwargs=dict(kwargs),
        **_common(body),
    )


# --- responses -------------------------------------------------------------------


@dataclass
class ChoiceResult:
    index: int
    prompt_tokens: int
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def usage(choices: Sequence[ChoiceResult]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)},
    }


@dataclass(frozen=True)
class ResponseHeader:
    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, choices: Sequence[ChoiceResult]) -> dict[str, Any]:
        if self.chat:
            body = self._head("chat.completion")
            body["choices"] = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                }
                for c in choices
            ]
        else:
            body = self._head("text_completion")
            body["choices"] = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                }
                for c in choices
            ]
        body["usage"] = usage(choices)
        return body

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role and empty content."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return body

    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            body = self._head("chat.completion.chunk")
            choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None}
        else:
            body = self._head("text_completion")
            choice = {"index": index, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = None
        body["choices"] = [choice]
        return body

    def usage_chunk(self, choices: Sequence[ChoiceResult]) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(choices)
        return body
