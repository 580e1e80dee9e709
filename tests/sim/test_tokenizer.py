"""Tokenizers and chat templates: the real Qwen2.5 tokenizer, and the built-in one."""

from __future__ import annotations

import pytest

from sim.chat_template import ChatTemplate, ChatTemplateError, special_tokens_from_config
from sim.tokenizer import ANSWER_TEXT, BuiltinTokenizer, HFTokenizer, answer_token_ids

IM_START, IM_END = 151644, 151645

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]

# What Qwen2.5's template renders for CONVERSATION with add_generation_prompt:
# one <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant header.
EXPECTED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
    "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_qwen_multi_turn_rendering(qwen: HFTokenizer) -> None:
    assert qwen.chat_template is not None
    assert qwen.chat_template.render(CONVERSATION) == EXPECTED


def test_qwen_default_system_prompt(qwen: HFTokenizer) -> None:
    assert qwen.chat_template is not None
    rendered = qwen.chat_template.render([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
        " assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = qwen.chat_template.render(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert no_prompt == rendered.removesuffix("<|im_start|>assistant\n")


def test_qwen_tokens_of_the_rendered_chat(qwen: HFTokenizer) -> None:
    ids = qwen.encode(EXPECTED, add_special_tokens=False)
    # Special tokens are single tokens, not spelled out, and none is added.
    assert ids.count(IM_START) == 5
    assert ids.count(IM_END) == 4
    assert ids[0] == IM_START
    assert ids[-3:] == [IM_START, *qwen.encode("assistant\n", add_special_tokens=False)]
    assert qwen._model.decode(ids, skip_special_tokens=False) == EXPECTED


def test_qwen_cached_pieces_tokenize_like_the_whole(qwen: HFTokenizer) -> None:
    # The tokenizer caches the ids of the pieces between special tokens; the
    # result must be what tokenizing the whole text at once gives.
    assert qwen._splitter is not None
    turns = [*CONVERSATION, {"role": "assistant", "content": "Rome.\n\n  Indeed  "}]
    assert qwen.chat_template is not None
    for messages in (CONVERSATION, turns, [*turns, {"role": "user", "content": " x"}]):
        text = qwen.chat_template.render(messages)
        whole = qwen._model.encode(text, add_special_tokens=False).ids
        assert qwen.encode(text, add_special_tokens=False) == whole
        assert qwen.encode(text, add_special_tokens=False) == whole  # from the cache


def test_qwen_tools_use_plain_json(qwen: HFTokenizer) -> None:
    assert qwen.chat_template is not None
    tool = {"type": "function", "function": {"name": "lookup", "description": "a < b & café"}}
    rendered = qwen.chat_template.render([{"role": "user", "content": "x"}], tools=[tool])
    # Not HTML-escaped, not ASCII-escaped: json.dumps(ensure_ascii=False).
    assert (
        '{"type": "function", "function": {"name": "lookup", "description": "a < b & café"}}'
        in rendered
    )
    assert "<tools>" in rendered


def test_qwen_config_special_tokens(qwen: HFTokenizer) -> None:
    tokens = special_tokens_from_config(qwen.config)
    assert tokens["eos_token"] == "<|im_end|>"
    assert tokens["pad_token"] == "<|endoftext|>"
    assert "bos_token" not in tokens  # null in the config: undefined in templates
    assert "<|im_start|>" in tokens["additional_special_tokens"]


def test_qwen_answer_decodes_token_by_token(qwen: HFTokenizer) -> None:
    ids = answer_token_ids(qwen)
    assert "".join(qwen.decode([t]) for t in ids) == ANSWER_TEXT


def test_template_features() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
        "{% endif %}{% generation %}{{ m.content | tojson }}{% endgeneration %}"
        "{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}{{ extra }}",
        {"eos_token": "</s>"},
    )
    messages = [{"role": "u", "content": "é<"}, {"role": "u", "content": "b"}, {"role": "u"}]
    assert template.render(messages, template_kwargs={"extra": "!"}) == '"é<""b"</s>!'
    with pytest.raises(ChatTemplateError, match="no bad"):
        template.render([{"role": "bad", "content": ""}])


def test_continue_final_message() -> None:
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    rendered = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered == "<user>Hi</user><assistant>Hel"
    with pytest.raises(ChatTemplateError):
        template.render(messages, add_generation_prompt=True, continue_final_message=True)


def test_sandbox_blocks_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([])


def test_builtin_tokenizer_is_deterministic_and_prefix_stable() -> None:
    tokenizer = BuiltinTokenizer()
    text = "The quick brown fox, jumps over the lazy dog."
    ids = tokenizer.encode(text)
    assert ids == BuiltinTokenizer().encode(text)
    assert ids[:3] == tokenizer.encode("The quick brown")
    assert tokenizer.encode(text + " Again")[: len(ids)] == ids
    assert all(0 <= t < 100_000 for t in ids)
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tokenizer.decode(answer_token_ids(tokenizer)) == ANSWER_TEXT
    assert tokenizer.chat_template is not None
    rendered = tokenizer.chat_template.render([{"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "before",
    ["", "\n", "\n\n", "  ", "\t", " \n", "word", "x.", "<|im_start|>user\n", "<|im_end|>\n"],
)
def test_builtin_words_are_the_same_pieces_whatever_precedes_them(before: str) -> None:
    """A message's words tokenize alike alone and inside the rendered chat, as a real
    tokenizer's pre-tokenizer makes them: newlines never join the next word, a space
    run leaves its last space to the word, nothing runs into a special token."""
    tokenizer = BuiltinTokenizer()
    words = " alpha beta, gamma."
    assert tokenizer.encode(before + words)[-5:] == tokenizer.encode(words)
    for text in ("Hello there.", " Hello there."):
        head = tokenizer.encode(before + "\n", add_special_tokens=False)
        assert tokenizer.encode(before + "\n" + text) == head + tokenizer.encode(text)
    assert tokenizer.encode("\n<|im_start|>")[-1] == 1  # the special token, whole
    assert tokenizer.encode("\n\n") == tokenizer.encode("\n\n")[:1]  # one newline run
