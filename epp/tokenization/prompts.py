"""From a parsed request to the token ids the engine will see for its prompt.

- `/v1/completions`, `/v1/embeddings`: the first prompt (a batch goes to one pod,
  whose cache its first prompt best describes); token ids are used as they are,
  text is tokenized with the tokenizer's special tokens (`add_special_tokens`,
  default true, as in vLLM);
- `/v1/chat/completions`: the messages rendered with the model's chat template the
  way vLLM renders them (contents as strings or as part lists, tool-call arguments
  as objects), then tokenized without adding special tokens (the template has
  them; `add_special_tokens` in the body overrides, as in vLLM);
- `/v1/responses`: `instructions` as a system message, then the input's messages.

Prompts the engine hashes with content the EPP does not have (images, audio, prompt
embeddings) get `Unsupported`: their blocks cannot be computed, so the pick goes on
without a precise score rather than with a wrong one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any, Final

import msgspec

from epp.requests import (
    ChatPrompt,
    CompletionPrompt,
    ContentPart,
    InferenceRequest,
    Message,
    ResponsesPrompt,
)
from epp.tokenization.chat_template import ChatTemplateError, ContentFormat
from epp.tokenization.tokenizer import PromptTokenizer
from epp.tokenization.tokens import token_bytes

TEXT_PART_TYPES: Final = frozenset({"text", "input_text", "output_text"})


class Unsupported(Exception):
    """The prompt cannot be tokenized as the engine will; the reason is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class _ChatOptions(msgspec.Struct):
    """The chat request fields that change the rendered prompt; the parser of
    `epp.requests` does not keep them."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[Any] | None = None


class _CompletionOptions(msgspec.Struct):
    add_special_tokens: bool = True
    prompt_embeds: Any = None


_chat_options: Final = msgspec.json.Decoder(_ChatOptions)
_completion_options: Final = msgspec.json.Decoder(_CompletionOptions)
_json: Final = msgspec.json.Decoder()


def _options(decoder: msgspec.json.Decoder[Any], body: bytes, default: Any) -> Any:
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return default  # the engine will refuse the request; any pod will do


def token_id_prompt(request: InferenceRequest) -> bytes | None:
    """The prompt's token bytes when the client sent token ids (no tokenizer needed)."""
    prompt = request.prompt
    if isinstance(prompt, CompletionPrompt) and isinstance(prompt.prompts[0], tuple):
        try:
            return token_bytes(prompt.prompts[0])
        except (OverflowError, TypeError) as exc:
            raise Unsupported("bad_token_ids", str(exc)) from None
    return None


async def prompt_tokens(
    request: InferenceRequest, tokenizer: PromptTokenizer, executor: Executor | None = None
) -> bytes:
    """The prompt's token ids as token bytes. Raises `Unsupported`."""
    prompt = request.prompt
    if isinstance(prompt, CompletionPrompt):
        first = prompt.prompts[0]
        options = _options(_completion_options, request.body, _CompletionOptions())
        if options.prompt_embeds is not None:
            raise Unsupported("prompt_embeds")
        if isinstance(first, tuple):
            try:
                return token_bytes(first)
            except (OverflowError, TypeError) as exc:
                raise Unsupported("bad_token_ids", str(exc)) from None
        return await tokenizer.encode(first, options.add_special_tokens, executor)
    if isinstance(prompt, ChatPrompt):
        chat = _options(_chat_options, request.body, _ChatOptions())
        text = _render(
            tokenizer,
            prompt.messages,
            tools=_decode(prompt.tools),
            kwargs=_decode(prompt.chat_template_kwargs),
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            documents=chat.documents,
        )
        return await tokenizer.encode(text, chat.add_special_tokens, executor)
    if isinstance(prompt, ResponsesPrompt):
        messages: list[Message] = []
        if prompt.instructions:
            messages.append(Message("system", prompt.instructions))
        if isinstance(prompt.input, str):
            messages.append(Message("user", prompt.input))
        else:
            for item in prompt.input:
                if item.role is None:
                    raise Unsupported("responses_item", "an input item that is not a message")
                messages.append(item)
        text = _render(tokenizer, messages)
        return await tokenizer.encode(text, False, executor)
    raise Unsupported("no_prompt")


def _decode(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return _json.decode(raw)
    except msgspec.DecodeError:
        return None


def _render(
    tokenizer: PromptTokenizer,
    messages: tuple[Message, ...] | list[Message],
    *,
    tools: Any = None,
    kwargs: Any = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    documents: Any = None,
) -> str:
    template = tokenizer.chat_template
    if template is None:
        raise Unsupported("no_chat_template", f"{tokenizer.name} has no chat template")
    conversation = [_message(m, template.content_format) for m in messages]
    try:
        return template.render(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools if isinstance(tools, list) else None,
            documents=documents,
            template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )
    except ChatTemplateError as exc:
        raise Unsupported("chat_template_error", str(exc)) from None


def _content(content: str | tuple[ContentPart, ...] | None, fmt: ContentFormat) -> Any:
    if content is None:
        return [] if fmt == "openai" else ""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if fmt == "openai" else content
    texts = []
    for part in content:
        if part.type not in TEXT_PART_TYPES or part.text is None:
            # Images, audio, files: the engine hashes their content into the blocks.
            raise Unsupported("multimodal", f"a {part.type!r} content part")
        texts.append(part.text)
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _message(message: Message, fmt: ContentFormat) -> dict[str, Any]:
    """A chat message as vLLM hands it to a template."""
    out: dict[str, Any] = {"role": message.role, "content": _content(message.content, fmt)}
    if message.extra is None:
        return out
    try:
        extra = _json.decode(message.extra)
    except msgspec.DecodeError:
        return out
    if not isinstance(extra, dict):
        return out
    name = extra.get("name")
    if isinstance(name, str):
        out["name"] = name
    if message.role == "tool" and isinstance(extra.get("tool_call_id"), str):
        out["tool_call_id"] = extra["tool_call_id"]
    calls = extra.get("tool_calls")
    if message.role == "assistant" and isinstance(calls, list) and calls:
        # Tool-use templates expect arguments as objects; the API sends JSON strings.
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(msgspec.DecodeError):
                    function["arguments"] = _json.decode(function["arguments"])
        out["tool_calls"] = calls
    return out
