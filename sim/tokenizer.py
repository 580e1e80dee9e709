"""Tokenizers for the simulator: a real Hugging Face one, or a built-in stand-in.

`load_tokenizer(directory)` reads `tokenizer.json` (PyPI `tokenizers`) and
`tokenizer_config.json` (special tokens, chat template) from a model directory, like
vLLM does for `--tokenizer`. Completion prompts are tokenized with the tokenizer's
own special-token handling (`add_special_tokens=True`, e.g. a BOS token where the
tokenizer's post-processor adds one); chat prompts are rendered with the chat
template, which already contains the special tokens, and tokenized without adding
them again.

Tokenizing costs ~3 ms per 1,000 tokens of wall time, which the time scale would
magnify (at 0.1, a 5,000-token prompt would add ~150 simulated ms to its TTFT). So
text tokenized without added special tokens (chat prompts) is cut in front of each
special token and every piece's ids are cached: the tokenizer splits its input at
special tokens before normalising and pre-tokenising, so the pieces' ids
concatenated are exactly the whole text's (checked when the tokenizer is loaded;
the cache is off if the check fails or a special token strips neighbouring spaces).
A conversation's earlier turns and a shared system prompt are then tokenized once.
Completion prompts have no such boundaries and are tokenized whole; send token ids
to skip tokenization altogether.

`BuiltinTokenizer` is what the simulator uses without `--tokenizer`, so it runs
anywhere with no model files. It is deterministic across processes and prefix
stable (a shared text prefix gives a shared token prefix, up to the word boundary):

- text is split into pieces: ChatML special tokens (`<|...|>`), words with their
  leading space (`" hello"`), single punctuation characters with their leading space,
  and runs of whitespace (newlines never lead a word; a run of spaces before a
  word leaves its last one to it);
- a special token's id is fixed (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2);
  any other piece's id is 1,000 + CRC-32(piece, UTF-8) mod 99,000 (so < 100,000);
- chat messages are rendered with a ChatML template (the same markup as Qwen's).
It only decodes the tokens it generates (the simulator's fixed answer).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizerModel

from sim.chat_template import ChatTemplate, special_tokens_from_config

# The simulated model's answer; output tokens cycle through its tokens.
ANSWER_TEXT = (
    " This is a simulated answer from a vLLM pod: the tokens are real,"
    " the words are always the same."
)


class Tokenizer(Protocol):
    name: str
    chat_template: ChatTemplate | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


# Bounds of the tokenizers' caches (entries); a full cache is emptied and refilled.
SEGMENT_CACHE_ENTRIES = 20_000
PIECE_CACHE_ENTRIES = 1_000_000


class HFTokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json)."""

    def __init__(
        self, directory: Path, chat_template_override: str | None = None, name: str = ""
    ) -> None:
        self.name = name or directory.name
        self._model = HFTokenizerModel.from_file(str(directory / "tokenizer.json"))
        self._segments: dict[str, list[int]] = {}
        self._splitter = self._special_token_splitter()
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = (
            json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        )
        self.config = config
        source = chat_template_override or _template_source(config.get("chat_template"))
        self.chat_template = (
            ChatTemplate(source, special_tokens_from_config(config)) if source else None
        )

    def _special_token_splitter(self) -> re.Pattern[str] | None:
        specials = [t for t in self._model.get_added_tokens_decoder().values() if t.special]
        if not specials or any(t.lstrip or t.rstrip or t.normalized for t in specials):
            return None
        contents = sorted((t.content for t in specials), key=len, reverse=True)
        splitter = re.compile("(?=" + "|".join(map(re.escape, contents)) + ")")
        # The pieces must tokenize exactly like the whole: check on a sample.
        sample = f"Hi there{contents[-1]} user\n  two  words {contents[0]}\n\nend "
        whole = self._encode_whole(sample, False)
        pieces = [t for piece in splitter.split(sample) for t in self._encode_whole(piece, False)]
        return splitter if pieces == whole else None

    def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._model.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens or self._splitter is None:
            return self._encode_whole(text, add_special_tokens)
        ids: list[int] = []
        for piece in self._splitter.split(text):
            if not piece:
                continue
            cached = self._segments.get(piece)
            if cached is None:
                cached = self._encode_whole(piece, False)
                if len(self._segments) >= SEGMENT_CACHE_ENTRIES:
                    self._segments.clear()
                self._segments[piece] = cached
            ids.extend(cached)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._model.decode(list(token_ids), skip_special_tokens=True))


def _template_source(value: Any) -> str | None:
    """tokenizer_config's `chat_template`: a string, or a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


BUILTIN_SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# As a real tokenizer's pre-tokenizer does, so that a word is the same piece
# whatever precedes it: a word or punctuation character takes one leading space
# (or tab), never a newline; newlines go with the whitespace before them; a run of
# spaces before a word leaves its last one to it; nothing runs into a special
# token ("\n<|im_start|>": "\n", "<|im_start|>").
_SPECIAL = r"<\|[^|<>\s]{1,40}\|>"
_PIECES = re.compile(
    rf"{_SPECIAL}|[^\S\r\n]?\w+|[^\S\r\n]?(?!{_SPECIAL})[^\w\s]|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_VOCAB_BASE = 1_000
_VOCAB_SPAN = 99_000


@dataclass
class BuiltinTokenizer:
    """A deterministic word-piece tokenizer needing no files (see the module doc)."""

    name: str = "builtin"

    def __post_init__(self) -> None:
        self.chat_template: ChatTemplate | None = ChatTemplate(
            BUILTIN_CHAT_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        )
        self._pieces: dict[int, str] = {v: k for k, v in BUILTIN_SPECIAL_TOKENS.items()}
        self._ids: dict[str, int] = {}
        # Only the answer's pieces are remembered for decoding: remembering every
        # piece ever seen would grow without bound over a long benchmark.
        for piece in _PIECES.findall(ANSWER_TEXT):
            self._pieces[self._piece_id(piece)] = piece

    @staticmethod
    def _piece_id(piece: str) -> int:
        special = BUILTIN_SPECIAL_TOKENS.get(piece)
        if special is not None:
            return special
        return _VOCAB_BASE + zlib.crc32(piece.encode("utf-8")) % _VOCAB_SPAN

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._ids
        out = []
        for piece in _PIECES.findall(text):
            token = ids.get(piece)
            if token is None:
                token = self._piece_id(piece)
                if len(ids) >= PIECE_CACHE_ENTRIES:
                    ids.clear()
                ids[piece] = token
            out.append(token)
        return out

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(
            self._pieces.get(t, "") for t in token_ids if t not in BUILTIN_SPECIAL_TOKENS.values()
        )


def load_tokenizer(
    directory: str | Path | None, chat_template_path: str | Path | None = None
) -> HFTokenizer | BuiltinTokenizer:
    """The tokenizer in `directory`, or the built-in one when it is None."""
    override = Path(chat_template_path).read_text(encoding="utf-8") if chat_template_path else None
    if directory is None:
        builtin = BuiltinTokenizer()
        if override is not None:
            builtin.chat_template = ChatTemplate(override, {"eos_token": "<|im_end|>"})
        return builtin
    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    return HFTokenizer(path, override)


def answer_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The token ids the simulated model generates, in order (then again)."""
    ids = tokenizer.encode(ANSWER_TEXT, add_special_tokens=False)
    if not ids:
        raise ValueError("the tokenizer produced no tokens for the answer text")
    return ids
