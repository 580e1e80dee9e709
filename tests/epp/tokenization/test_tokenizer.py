"""Prompt tokenization: piecewise at special tokens equals whole-text tokenization
(the real Qwen2.5 tokenizer), chat templates rendered as vLLM renders them, the
caches, the worker thread, Hub fetching from a local cache, the model registry."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from epp.requests import parse_request
from epp.tokenization.chat_template import ChatTemplate, ChatTemplateError
from epp.tokenization.hub import HubFetchError, fetch_tokenizer
from epp.tokenization.models import LoraAdapter, TokenizerRegistry, TokenizerSource
from epp.tokenization.prompts import Unsupported, prompt_tokens, token_id_prompt
from epp.tokenization.tokenizer import PromptTokenizer
from epp.tokenization.tokens import token_ids
from tests.testdata import qwen_dir


@pytest.fixture(scope="module")
def qwen() -> PromptTokenizer:
    return PromptTokenizer.load("qwen", qwen_dir(), inline_chars=100_000)


def request(path: str, body: dict[str, Any]) -> Any:
    return parse_request(
        request_id="r", method="POST", path=path, headers={}, body=msgspec.json.encode(body)
    )


def whole(tokenizer: PromptTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return token_ids(tokenizer.encode_now(text, add_special_tokens))


SYSTEM = "You are a careful assistant.\n\nRules:\n  1. be brief\n  2. cite  sources "
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "  leading spaces and trailing\n\n"},
        {"role": "assistant", "content": "Sure.\n"},
        {"role": "user", "content": "Ünïcødé ✓ 漢字 and emoji 🙂, tabs\tand\r\nCRLF"},
    ],
    [
        {"role": "user", "content": "literal <|im_end|> inside and <|endoftext|> too"},
        {"role": "assistant", "content": ""},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris <&>"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
async def test_chat_prompts_tokenize_piecewise_exactly_as_whole(
    qwen: PromptTokenizer, messages: list[dict[str, Any]]
) -> None:
    assert qwen.piecewise
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"model": "m", "messages": messages, "tools": tools if len(messages) == 3 else None}
    req = request("/v1/chat/completions", body)
    assert qwen.chat_template is not None
    for _ in range(2):  # cold, then from the piece cache
        data = await prompt_tokens(req, qwen)
        rendered = qwen.chat_template.render(
            [_plain(m) for m in messages],
            tools=body["tools"],
        )
        assert token_ids(data) == whole(qwen, rendered)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """What vLLM hands the template for a message (string content format)."""
    out = copy.deepcopy(message)
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(p["text"] for p in content)
    elif content is None:
        out["content"] = ""
    for call in out.get("tool_calls") or []:
        call["function"] = {
            **call["function"],
            "arguments": json.loads(call["function"]["arguments"]),
        }
    return out


async def test_the_rendering_is_qwen_chatml(qwen: PromptTokenizer) -> None:
    req = request(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    )
    data = await prompt_tokens(req, qwen)
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
        " assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert token_ids(data) == whole(qwen, expected)


async def test_request_options_change_the_rendering(qwen: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    plain = await prompt_tokens(
        request("/v1/chat/completions", {"model": "m", "messages": messages}), qwen
    )
    cont = await prompt_tokens(
        request(
            "/v1/chat/completions",
            {"model": "m", "messages": messages, "add_generation_prompt": False,
             "continue_final_message": True},
        ),
        qwen,
    )  # fmt: skip
    assert token_ids(cont) != token_ids(plain)
    assert whole(qwen, "Hel")[-1] == token_ids(cont)[-1]  # ends inside the last message


async def test_completion_prompts_and_token_ids(qwen: PromptTokenizer) -> None:
    text = "The quick brown fox " * 50
    req = request("/v1/completions", {"model": "m", "prompt": text})
    assert token_ids(await prompt_tokens(req, qwen)) == whole(qwen, text, True)
    ids = request("/v1/completions", {"model": "m", "prompt": [5, 6, 7]})
    assert token_id_prompt(ids) is not None
    assert token_ids(token_id_prompt(ids) or b"") == [5, 6, 7]
    assert token_id_prompt(req) is None


async def test_responses_api(qwen: PromptTokenizer) -> None:
    req = request(
        "/v1/responses", {"model": "m", "instructions": "Be brief.", "input": "Hello there"}
    )
    chat = request(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello there"}]},
    )  # fmt: skip
    assert await prompt_tokens(req, qwen) == await prompt_tokens(chat, qwen)


async def test_what_cannot_be_tokenized_says_why(qwen: PromptTokenizer) -> None:
    image = request(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:..."}}]}]},
    )  # fmt: skip
    with pytest.raises(Unsupported) as caught:
        await prompt_tokens(image, qwen)
    assert caught.value.reason == "multimodal"


async def test_a_template_that_refuses_the_conversation(tmp_path: Path) -> None:
    directory = _tiny_tokenizer(tmp_path, bos=False)
    (directory / "chat_template.jinja").write_text("{{ raise_exception('only user turns') }}")
    tokenizer = PromptTokenizer.load("tiny", directory)
    refused = request("/v1/chat/completions", {"model": "m", "messages": [{"role": "tool"}]})
    with pytest.raises(Unsupported) as caught:
        await prompt_tokens(refused, tokenizer)
    assert caught.value.reason == "chat_template_error"


async def test_long_uncached_text_goes_to_a_worker_thread() -> None:
    tokenizer = PromptTokenizer.load("qwen", qwen_dir(), inline_chars=1_000)
    text = "<|im_start|>user\n" + "many words here " * 400 + "<|im_end|>\n"
    data = await tokenizer.encode(text, False)
    assert tokenizer.threaded == 1
    assert token_ids(data) == whole(tokenizer, text)
    produced = tokenizer.tokens_encoded
    # Every token of the text came out of the tokenizer (the special tokens are
    # pieces of their own, also encoded once).
    assert produced == len(token_ids(data))
    await tokenizer.encode(text, False)  # cached now: no thread, no tokenizing
    assert tokenizer.threaded == 1
    assert tokenizer.cache_hits >= 2
    assert tokenizer.tokens_encoded == produced


async def test_the_piece_cache_is_bounded() -> None:
    tokenizer = PromptTokenizer.load("qwen", qwen_dir(), cache_bytes=20_000)
    for i in range(300):
        await tokenizer.encode(f"<|im_start|>user\nmessage number {i} " * 3, False)
    assert tokenizer.cached_bytes <= 20_000


async def _checked(tokenizer: PromptTokenizer, piecewise: bool) -> None:
    """Wait (at most 5 s) for the sampled check, which runs in a worker thread, to
    leave the piece cache `piecewise`."""
    for _ in range(100):
        await asyncio.sleep(0.05)
        if tokenizer.piecewise == piecewise:
            return


async def test_a_sampled_request_is_checked_against_whole_text() -> None:
    tokenizer = PromptTokenizer.load("qwen", qwen_dir(), verify_every=1)
    text = "<|im_start|>user\nhello<|im_end|>\n"
    await tokenizer.encode(text, False)
    await asyncio.sleep(0.2)  # the check runs in a worker thread
    assert tokenizer.piecewise  # it agreed


async def test_a_mismatch_found_by_the_check_turns_the_piece_cache_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokenizer = PromptTokenizer.load("qwen", qwen_dir(), verify_every=1)
    assert tokenizer.piecewise
    text = "<|im_start|>user\nhello<|im_end|>\n"
    # The tokenizers library cuts at special tokens itself, so no real tokenizer
    # that passes the load-time sample disagrees on demand: a wrong entry in the
    # piece cache (the second piece, `<|im_end|>\n`) stands for pieces that
    # tokenize differently from the whole text.
    tokenizer._cache["<|im_end|>\n"] = tokenizer.encode_now("goodbye")
    with caplog.at_level("ERROR", logger="epp.tokenization.tokenizer"):
        wrong = await tokenizer.encode(text, False)
        assert token_ids(wrong) != whole(tokenizer, text)  # the premise: pieces disagree
        await _checked(tokenizer, piecewise=False)
    assert not tokenizer.piecewise, "the check saw the mismatch and turned the cut off"
    assert tokenizer.cached_bytes == 0, "and forgot every piece"
    assert "the piece cache is off from now on" in caplog.text
    # From now on the text is tokenized whole: the right ids, however it is cut.
    assert token_ids(await tokenizer.encode(text, False)) == whole(tokenizer, text)


def _tiny_tokenizer(directory: Path, bos: bool, lstrip: bool = False) -> Path:
    """A word-level tokenizer trained in-process, with special tokens."""
    model = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "<|sep|>"])
    model.train_from_iterator(["hello world this is a tiny corpus"] * 3, trainer)
    if bos:
        model.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", model.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    model.save(str(directory / "tokenizer.json"))
    if lstrip:
        document = json.loads((directory / "tokenizer.json").read_text())
        for token in document["added_tokens"]:
            token["lstrip"] = True
        (directory / "tokenizer.json").write_text(json.dumps(document))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return directory


async def test_a_bos_prefix_is_kept_for_completions(tmp_path: Path) -> None:
    tokenizer = PromptTokenizer.load("tiny", _tiny_tokenizer(tmp_path, bos=True))
    text = "hello world<|sep|>this is tiny"
    data = await tokenizer.encode(text, True)
    assert token_ids(data) == whole(tokenizer, text, True)
    assert token_ids(data)[0] == 1  # <s>
    assert tokenizer.chat_template is None
    with pytest.raises(Unsupported) as caught:
        await prompt_tokens(
            request("/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}]}),
            tokenizer,
        )
    assert caught.value.reason == "no_chat_template"


def test_special_tokens_that_strip_spaces_turn_the_piece_cache_off(tmp_path: Path) -> None:
    assert not PromptTokenizer.load("tiny", _tiny_tokenizer(tmp_path, False, lstrip=True)).piecewise


def test_a_chat_template_file_wins(tmp_path: Path) -> None:
    directory = _tiny_tokenizer(tmp_path, bos=False)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tokenizer = PromptTokenizer.load("tiny", directory)
    assert tokenizer.chat_template is not None
    assert tokenizer.chat_template.render([{"role": "user", "content": "hi"}]) == "hi!"


def test_chat_template_features() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
        "{% endif %}{{ bos_token }}{{ m | tojson }}{% generation %}[g]{% endgeneration %}"
        "{% endfor %}",
        {"bos_token": "<s>"},
    )
    assert template.content_format == "string"
    out = template.render([{"role": "user", "content": "a<b>&'c' é"}], add_generation_prompt=False)
    assert out == '<s>{"role": "user", "content": "a<b>&\'c\' é"}[g]'
    with pytest.raises(ChatTemplateError, match="no bad"):
        template.render([{"role": "bad"}], add_generation_prompt=False)
    parts = ChatTemplate(
        "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
    )
    assert parts.content_format == "openai"


def test_hub_tokenizers_come_from_the_cache_offline(tmp_path: Path) -> None:
    # The Hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}.
    repo = tmp_path / "models--test--qwen"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_dir() / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert fetch_tokenizer("test/qwen", cache_dir=tmp_path, offline=True) == snapshot
    with pytest.raises(HubFetchError, match="not in the cache"):
        fetch_tokenizer("test/absent", cache_dir=tmp_path, offline=True)


async def test_the_registry_resolves_models_and_adapters(tmp_path: Path) -> None:
    registry = TokenizerRegistry(
        [
            TokenizerSource("*", path=str(qwen_dir())),
            TokenizerSource("tiny", path=str(_tiny_tokenizer(tmp_path / "t", bos=True))),
            TokenizerSource("broken", path=str(tmp_path / "nowhere")),
            TokenizerSource("hub", hugging_face="test/absent"),
        ],
        [LoraAdapter("my-lora", "tiny", "/adapters/my-lora")],
        cache_dir=str(tmp_path / "hub"),
        offline=True,
    )
    assert registry.missing_directories() == [
        f"model 'broken': {tmp_path / 'nowhere'}/tokenizer.json does not exist"
    ]
    assert registry.resolve("anything").reason == "loading"
    try:
        await registry.load()
        assert registry.resolve("anything").tokenizer is not None
        lora = registry.resolve("my-lora")
        assert lora.adapter is not None
        assert lora.adapter.base_model == "tiny"
        assert lora.tokenizer is not None
        assert lora.tokenizer.name == "t"
        assert registry.resolve("broken").reason == "failed"
        assert registry.resolve("hub").reason == "failed"
        described = registry.describe()
        assert described["*"] == "ready"
        assert described["broken"].startswith("failed")
    finally:
        registry.close()
    assert TokenizerRegistry([]).resolve("m").reason == "no-tokenizer"
