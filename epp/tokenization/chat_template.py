"""Chat templates rendered the way vLLM renders them (through Hugging Face's
`apply_chat_template`), so the EPP tokenizes exactly the text the engine will.

What that rendering is:

- a sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`,
  the `loopcontrols` extension (`{% break %}`, `{% continue %}`), and
  `{% generation %}...{% endgeneration %}` blocks (rendered as their body);
- a `tojson` filter that is `json.dumps` with `ensure_ascii=False` by default (not
  Jinja's, which HTML-escapes `<`, `>`, `&`, `'` and would change the prompt), with
  its `indent`, `separators` and `sort_keys` arguments;
- globals `raise_exception(message)` (the template refuses the conversation) and
  `strftime_now(format)`;
- variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the
  tokenizer config's special tokens by name (`bos_token`, `eos_token`, ...,
  `additional_special_tokens`), then the request's `chat_template_kwargs` on top.

`continue_final_message` renders the conversation and cuts it right after the final
message's content (the model continues it instead of starting a new turn).

vLLM hands a template message contents either as strings (text parts joined with
newlines) or as OpenAI-style part lists, depending on whether the template loops
over `message['content']`; `content_format` detects that the same way, from the
template's syntax tree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

# Token names a tokenizer config may define; templates see them under these names.
SPECIAL_TOKEN_NAMES: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template refused the conversation or failed to render it."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}` marks assistant text for training masks; a prompt only
    needs the text, so the block renders as its body."""

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


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token variables of a tokenizer_config.json. Values there are
    strings or serialised added tokens (`{"content": ...}`); unset ones are left out,
    so a template sees them as undefined."""

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
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [t for t in map(text, extra) if t is not None]
    return tokens


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """Does the template iterate over a message's `content` (OpenAI part lists)?"""
    for loop in tree.find_all(jinja2.nodes.For):
        target = loop.iter
        # `for part in message['content']`, `... in message.content`, and the same
        # behind a filter (`message['content'] | selectattr(...)`).
        while isinstance(target, jinja2.nodes.Filter) and target.node is not None:
            target = target.node
        if isinstance(target, jinja2.nodes.Getattr) and target.attr == "content":
            return True
        if (
            isinstance(target, jinja2.nodes.Getitem)
            and isinstance(target.arg, jinja2.nodes.Const)
            and target.arg.value == "content"
        ):
            return True
    return False


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens."""

    def __init__(self, source: str, tokens: Mapping[str, Any] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(tokens or {})
        env = environment()
        try:
            self._template = env.from_string(source)
            tree = env.parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"invalid chat template: {exc}") from exc
        self.content_format: ContentFormat = "openai" if _loops_over_content(tree) else "string"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
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
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered


def _cut_after_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    final = messages[-1].get("content")
    if isinstance(final, list):
        final = "".join(str(p.get("text", "")) for p in final if isinstance(p, Mapping))
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message needs a final message with text")
    # Templates may strip the content's surrounding whitespace; fall back to that.
    for candidate in (final, final.strip()):
        at = rendered.rfind(candidate)
        if candidate and at >= 0:
            return rendered[: at + len(candidate)]
    raise ChatTemplateError("the final message does not appear in the rendered chat")
