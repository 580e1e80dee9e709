"""A model's tokenizer, made cheap enough for the pick path.

Loaded from a directory holding `tokenizer.json` (PyPI `tokenizers`) and
`tokenizer_config.json` (special tokens, the chat template; a `chat_template.jinja`
next to them wins, as in recent Hugging Face releases).

Tokenizing costs ~2-3 ms per 1,000 tokens. Two things make it cheap:

- **Piece cache.** The tokenizer splits its input at special tokens before
  normalising and pre-tokenising anything, so text cut in front of each special
  token tokenizes piece by piece to exactly the whole text's ids. Chat templates
  put special tokens around every message (ChatML's `<|im_start|>`/`<|im_end|>`),
  so a rendered conversation is a sequence of per-message pieces, and a system
  prompt or an earlier turn seen before costs a dictionary lookup. The cut is used
  only if the special tokens strip no neighbouring whitespace and are not
  normalised, and if a sample tokenizes identically both ways at load time; one
  request in `verify_every` is also tokenized whole, off the event loop, and a
  mismatch turns the cut off (and says so).
- **Off the event loop.** Text not in the cache and longer than `inline_chars` is
  tokenized in a worker thread (`encode_batch`, which releases the GIL), so long
  prompts never stall other requests; short ones are cheaper inline than a thread
  hop.

Completion prompts are tokenized with the tokenizer's own special tokens
(`add_special_tokens=True`, a BOS where the tokenizer adds one); they use the piece
cache only if those special tokens are a fixed prefix.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Final

from tokenizers import Tokenizer

from epp.tokenization.chat_template import ChatTemplate, special_tokens
from epp.tokenization.tokens import TOKEN_BYTES, token_bytes

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES: Final = 64 * 1024 * 1024
DEFAULT_INLINE_CHARS: Final = 2_000
DEFAULT_VERIFY_EVERY: Final = 1_000
_SAMPLE: Final = "Hi there{a} user\n  two  words {b}\n\nend {a}{b}x"


class TokenizerLoadError(Exception):
    pass


def _common_prefix(words: Sequence[str]) -> str:
    """The characters every word starts with."""
    first, last = min(words), max(words)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def _chat_template_source(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        value = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    else:
        value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class PromptTokenizer:
    """One tokenizer directory. Build it with `load` (blocking: use a thread)."""

    def __init__(
        self,
        name: str,
        model: Tokenizer,
        config: dict[str, Any],
        chat_template: ChatTemplate | None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        inline_chars: int = DEFAULT_INLINE_CHARS,
        verify_every: int = DEFAULT_VERIFY_EVERY,
    ) -> None:
        self.name = name
        self._model = model
        self.config = config
        self.chat_template = chat_template
        self.cache_bytes = cache_bytes
        self.inline_chars = inline_chars
        self.verify_every = verify_every
        self._cache: dict[str, bytes] = {}
        self._cached_bytes = 0
        self._calls = 0
        self._encode_batch = getattr(model, "encode_batch_fast", model.encode_batch)
        self._splitter = self._special_token_splitter()
        # The ids add_special_tokens=True adds in front of any text, if that is all
        # it does (a BOS); None: it does more, so such text is tokenized whole.
        self._special_prefix = self._fixed_special_prefix()
        self.cache_hits = 0
        self.cache_misses = 0
        self.threaded = 0  # encodings sent to a worker thread
        # Tokens the tokenizer itself produced (cache misses), not read from the
        # cache: what tokenizing has cost, in tokens (the routing lab charges it).
        self.tokens_encoded = 0

    @classmethod
    def load(cls, name: str, directory: Path, **kwargs: Any) -> PromptTokenizer:
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{directory}: no tokenizer.json")
        try:
            model = Tokenizer.from_file(str(tokenizer_file))
            config_file = directory / "tokenizer_config.json"
            config: dict[str, Any] = (
                json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            )
            source = _chat_template_source(directory, config)
            template = ChatTemplate(source, special_tokens(config)) if source else None
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise TokenizerLoadError(f"{directory}: cannot load the tokenizer: {exc}") from exc
        return cls(name, model, config, template, **kwargs)

    # -- set-up checks ---------------------------------------------------------------

    def _special_token_splitter(self) -> Callable[[str], list[str]] | None:
        """A function cutting text in front of every special token, if the cut is
        exact for this tokenizer (None if not)."""
        specials = [t for t in self._model.get_added_tokens_decoder().values() if t.special]
        if not specials or any(t.lstrip or t.rstrip or t.normalized for t in specials):
            return None
        contents = sorted((t.content for t in specials), key=len, reverse=True)
        alternation = "|".join(map(re.escape, contents))
        lead = _common_prefix(contents)
        if lead:
            # Every special token starts with `lead` ("<|" in ChatML): find those with
            # str.find, which is far cheaper on a long prompt than a regex scan, and
            # check each place with an anchored match.
            at = re.compile(alternation).match

            def split(text: str) -> list[str]:
                pos = text.find(lead)
                if pos < 0:
                    return [text]
                pieces = []
                cut = 0
                while pos >= 0:
                    if pos > cut and at(text, pos):
                        pieces.append(text[cut:pos])
                        cut = pos
                    pos = text.find(lead, pos + 1)
                pieces.append(text[cut:])
                return pieces

        else:
            pattern = re.compile(f"(?={alternation})")

            def split(text: str) -> list[str]:
                return pattern.split(text)

        sample = _SAMPLE.format(a=contents[0], b=contents[-1])
        whole = self._whole(sample, False)
        pieces = [t for p in split(sample) if p for t in self._whole(p, False)]
        return split if pieces == whole else None

    def _fixed_special_prefix(self) -> bytes | None:
        prefix = self._whole("", True)
        sample = "Hello world, a sample"
        if self._whole(sample, True) == prefix + self._whole(sample, False):
            return token_bytes(prefix)
        return None

    @property
    def piecewise(self) -> bool:
        return self._splitter is not None

    # -- encoding --------------------------------------------------------------------

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._model.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def _encode_many(self, texts: Sequence[str]) -> list[bytes]:
        encodings = self._encode_batch(list(texts), add_special_tokens=False)
        return [token_bytes(e.ids) for e in encodings]

    def encode_now(self, text: str, add_special_tokens: bool = False) -> bytes:
        """Tokenize on the calling thread, whole (reference and tests)."""
        return token_bytes(self._whole(text, add_special_tokens))

    async def encode(
        self, text: str, add_special_tokens: bool, executor: Executor | None = None
    ) -> bytes:
        """`text`'s token ids as token bytes, exactly as `encode(text,
        add_special_tokens)` gives them."""
        self._calls += 1
        prefix = b""
        if add_special_tokens:
            if self._special_prefix is None:
                return await self._encode_whole_cached(text, executor)
            prefix = self._special_prefix
        pieces = self._splitter(text) if self._splitter is not None else [text]
        cache = self._cache
        found = [cache.get(p) for p in pieces]
        missing = list(
            dict.fromkeys(p for p, f in zip(pieces, found, strict=True) if f is None and p)
        )
        fresh: dict[str, bytes] = {}
        if missing:
            self.cache_misses += len(missing)
            encoded = await self._run(self._encode_many, missing, executor)
            fresh = dict(zip(missing, encoded, strict=True))
            self.tokens_encoded += sum(map(len, encoded)) // TOKEN_BYTES
            for piece, ids in fresh.items():
                self._remember(piece, ids)
        self.cache_hits += len(pieces) - len(missing)
        data = prefix + b"".join(
            f if f is not None else fresh.get(p, b"") for p, f in zip(pieces, found, strict=True)
        )
        if (
            self._splitter is not None
            and self.verify_every
            and self._calls % self.verify_every == 0
        ):
            self._schedule_verification(text, data[len(prefix) :], executor)
        return data

    async def _encode_whole_cached(self, text: str, executor: Executor | None) -> bytes:
        key = "\x00whole:" + text
        cached = self._cache.get(key)
        if cached is not None:
            self.cache_hits += 1
            return cached
        self.cache_misses += 1
        data: bytes = await self._run(
            lambda t: token_bytes(self._whole(t[0], True)), [text], executor
        )
        self.tokens_encoded += len(data) // TOKEN_BYTES
        self._remember(key, data)
        return data

    async def _run(self, fn: Any, texts: Sequence[str], executor: Executor | None) -> Any:
        if sum(map(len, texts)) > self.inline_chars:
            self.threaded += 1
            return await asyncio.get_running_loop().run_in_executor(executor, fn, texts)
        return fn(texts)

    def _remember(self, piece: str, ids: bytes) -> None:
        size = len(piece) + len(ids) + 100  # + the entry and object overheads
        if size > self.cache_bytes // 4:
            return  # one giant prompt must not flush the cache
        if self._cached_bytes + size > self.cache_bytes:
            # Forget the oldest quarter in one pass.
            target = self.cache_bytes * 3 // 4
            for old in list(itertools.islice(iter(self._cache), max(1, len(self._cache) // 4))):
                self._cached_bytes -= len(old) + len(self._cache.pop(old)) + 100
                if self._cached_bytes <= target:
                    break
        self._cache[piece] = ids
        self._cached_bytes += size

    # -- verification ------------------------------------------------------------------

    def _schedule_verification(self, text: str, pieces: bytes, executor: Executor | None) -> None:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(executor, self.encode_now, text, False)

        def done(f: asyncio.Future[bytes]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            if f.result() != pieces:
                self._splitter = None
                self._cache.clear()
                self._cached_bytes = 0
                log.error(
                    "tokenizer %s: tokenizing at special tokens gave other ids than the whole"
                    " text; the piece cache is off from now on",
                    self.name,
                )

        future.add_done_callback(done)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes
