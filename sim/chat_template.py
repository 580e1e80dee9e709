"""Rendering chat messages with a model's Jinja chat template, as vLLM does.

vLLM renders chat requests through the tokenizer's `apply_chat_template`; what that
amounts to, and what this module reproduces:

- a sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`,
  the `loopcontrols` extension (`{% break %}`, `{% continue %}`), and
  `{% generation %}...{% endgeneration %}` blocks accepted (rendered as their body);
- a `tojson` filter that is plain `json.dumps` with `ensure_ascii=False` (Jinja's own
  `tojson` HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt), with
  the optional `indent`, `separators` and `sort_keys` arguments;
- globals `raise_exception(message)` (raises: the request is rejected) and
  `strftime_now(format)`;
- variables: `messages`, `tools`, `documents`, `add_generation_prompt`, every
  special token of the tokenizer config by its name (`bos_token`, `eos_token`,
  `pad_token`, `unk_token`, ..., `additional_special_tokens`), then the request's
  `chat_template_kwargs` on top.

`continue_final_message` renders the conversation and cuts it right after the final
message's content, so the model continues that message instead of starting a new one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Token names a tokenizer config may define, exposed to templates under these names.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders its body.

    Templates use it to mark assistant text for training masks; rendering a prompt
    only needs the text itself."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API is a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def special_tokens_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token variables a template sees, from a tokenizer_config.json.

    Values there are strings or serialised added tokens (`{"content": ...}`); unset
    tokens (null) are left out, so templates see them as undefined."""

    def text(value: Any) -> str | None:
        if isinstance(value, str):
            return value
        if isinstance(value, Mapping) and isinstance(value.get("content"), str):
            return str(value["content"])
        return None

    tokens: dict[str, Any] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = text(config.get(name))
        if value is not None:
            tokens[name] = value
    additional = config.get("additional_special_tokens")
    if isinstance(additional, list):
        tokens["additional_special_tokens"] = [t for t in map(text, additional) if t is not None]
    return tokens


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"invalid chat template: {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        variables: dict[str, Any] = {
            **self.special_tokens,
            "messages": list(messages),
            "tools": list(tools) if tools is not None else None,
            "documents": list(documents) if documents is not None else None,
            "add_generation_prompt": add_generation_prompt,
            **(template_kwargs or {}),
        }
        try:
            rendered = self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered


def _cut_after_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    final = messages[-1].get("content")
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message needs a final message with text")
    # Templates may strip the content's surrounding whitespace; fall back to that.
    for candidate in (final, final.strip()):
        at = rendered.rfind(candidate)
        if candidate and at >= 0:
            return rendered[: at + len(candidate)]
    raise ChatTemplateError("the final message does not appear in the rendered chat")
