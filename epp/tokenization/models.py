"""Which tokenizer a request's model uses, and loading them all at start-up.

A request names a model (the body's `model`, or the rewrite header's): a base
model, or a LoRA adapter served on top of one. Tokenizers are configured per model
(`*` for every model without its own), from a local directory or a Hugging Face
Hub model id; an adapter uses its base model's tokenizer.

Loading happens in the background once the server runs (a plugin's build never
does I/O beyond checking that configured directories exist), in worker threads.
Until a model's tokenizer is ready, or if it failed, its requests get no precise
score, and `/debug/endpoints` and the logs say why.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from epp.tokenization.hub import HubFetchError, fetch_tokenizer
from epp.tokenization.tokenizer import PromptTokenizer, TokenizerLoadError

log = logging.getLogger(__name__)

ANY_MODEL: Final = "*"
HUB_RETRY_S: Final = (10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True)
class TokenizerSource:
    model: str  # a model name, or "*"
    path: str | None = None  # a local directory
    hugging_face: str | None = None  # a Hub model id
    revision: str | None = None


@dataclass(frozen=True)
class LoraAdapter:
    name: str  # what requests put in `model`
    base_model: str
    path: str | None = None  # as the engine loaded it; hashed by vLLM >= 0.31


class TokenizerStatus(enum.Enum):
    PENDING = "pending"  # the server has not started loading it yet
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class _Entry:
    source: TokenizerSource
    status: TokenizerStatus = TokenizerStatus.PENDING
    tokenizer: PromptTokenizer | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Resolution:
    tokenizer: PromptTokenizer | None
    adapter: LoraAdapter | None = None
    # Why there is no tokenizer: "no-tokenizer", "loading", "failed".
    reason: str | None = None


@dataclass
class TokenizerRegistry:
    sources: Sequence[TokenizerSource]
    adapters: Sequence[LoraAdapter] = ()
    cache_dir: str | None = None
    offline: bool = False
    workers: int = 2
    tokenizer_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._entries = {s.model: _Entry(s) for s in self.sources}
        self._adapters = {a.name: a for a in self.adapters}
        self._executor: ThreadPoolExecutor | None = None

    def missing_directories(self) -> list[str]:
        """Configured local directories without a tokenizer.json (a cheap check at
        build time, so a typo is a start-up error)."""
        return [
            f"model {s.model!r}: {s.path}/tokenizer.json does not exist"
            for s in self.sources
            if s.path is not None and not (Path(s.path) / "tokenizer.json").is_file()
        ]

    @property
    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="epp-tokenize"
            )
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def resolve(self, model: str) -> Resolution:
        adapter = self._adapters.get(model)
        base = adapter.base_model if adapter is not None else model
        entry = self._entries.get(base) or self._entries.get(ANY_MODEL)
        if entry is None:
            return Resolution(None, adapter, "no-tokenizer")
        if entry.tokenizer is None:
            return Resolution(
                None, adapter, "failed" if entry.status is TokenizerStatus.FAILED else "loading"
            )
        return Resolution(entry.tokenizer, adapter)

    def tokens_encoded(self) -> int:
        """Tokens the loaded tokenizers have produced so far (their cache misses)."""
        return sum(e.tokenizer.tokens_encoded for e in self._entries.values() if e.tokenizer)

    def describe(self) -> dict[str, str]:
        out = {}
        for model, entry in self._entries.items():
            text = entry.status.value
            if entry.error:
                text += f": {entry.error}"
            out[model] = text
        return out

    async def load(self) -> None:
        """Load every tokenizer (local ones first); Hub fetches are retried with
        backoff until they succeed."""
        loaded: dict[tuple[str | None, str | None, str | None], PromptTokenizer] = {}
        pending = list(self._entries.values())
        attempt = 0
        while pending:
            retry = []
            for entry in sorted(pending, key=lambda e: e.source.path is None):
                source = entry.source
                key = (source.path, source.hugging_face, source.revision)
                if key in loaded:
                    entry.tokenizer, entry.status, entry.error = (
                        loaded[key],
                        TokenizerStatus.READY,
                        None,
                    )
                    continue
                entry.status = TokenizerStatus.LOADING
                try:
                    tokenizer = await self._load_one(source)
                except (TokenizerLoadError, HubFetchError) as exc:
                    entry.status, entry.error = TokenizerStatus.FAILED, str(exc)
                    log.error(
                        "tokenizer for model %r: %s; its requests get no precise prefix score",
                        source.model,
                        exc,
                    )
                    if source.hugging_face is not None and not self.offline:
                        retry.append(entry)
                    continue
                loaded[key] = tokenizer
                entry.tokenizer, entry.status, entry.error = tokenizer, TokenizerStatus.READY, None
                log.info(
                    "tokenizer for model %r ready (%s; chat template: %s; piece cache: %s)",
                    source.model,
                    source.path or source.hugging_face,
                    "yes" if tokenizer.chat_template is not None else "no",
                    "on" if tokenizer.piecewise else "off",
                )
            pending = retry
            if pending:
                await asyncio.sleep(HUB_RETRY_S[min(attempt, len(HUB_RETRY_S) - 1)])
                attempt += 1

    async def _load_one(self, source: TokenizerSource) -> PromptTokenizer:
        loop = asyncio.get_running_loop()
        if source.path is not None:
            directory = Path(source.path)
        else:
            assert source.hugging_face is not None
            directory = await loop.run_in_executor(
                self.executor,
                fetch_tokenizer,
                source.hugging_face,
                source.revision,
                self.cache_dir,
                self.offline,
            )
        name = source.hugging_face or directory.name
        return await loop.run_in_executor(
            self.executor,
            lambda: PromptTokenizer.load(name, directory, **self.tokenizer_options),
        )
