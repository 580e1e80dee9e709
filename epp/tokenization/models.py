"""Which tokenizer a request's model uses, and loading them in the background.

A request names a model (the body's `model`, or the rewrite header's): a base
model, or a LoRA adapter served on top of one. Tokenizers are configured per model
(`*` for every model without its own), from a local directory or a Hugging Face
Hub model id; an adapter uses its base model's tokenizer.

`{model: "*", huggingFace: "*"}` makes the model name itself the Hub id, as vLLM
does with `--model`: each model's tokenizer is fetched the first time a request
names it (`fetch_on_demand`), for at most `max_models` models, so that a flood of
made-up names cannot trigger unbounded downloads or memory. Models with their own
entry never take that path.

Configured tokenizers load once the server runs (a plugin's build never does I/O
beyond checking that configured directories exist), in a worker thread of their
own, so that a download never holds up the threads that tokenize prompts. Until a
model's tokenizer is ready, or if it failed, its requests get no precise score,
and `/debug/endpoints` and the logs say why.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from epp.tokenization.hub import HubFetchError, fetch_tokenizer
from epp.tokenization.tokenizer import PromptTokenizer, TokenizerLoadError

log = logging.getLogger(__name__)

ANY_MODEL: Final = "*"
# `huggingFace: "*"` (on the `*` entry): the request's model name is the Hub id.
SAME_AS_MODEL: Final = "*"
HUB_RETRY_S: Final = (10.0, 30.0, 60.0, 300.0)
DEFAULT_MAX_MODELS: Final = 8


@dataclass(frozen=True)
class TokenizerSource:
    model: str  # a model name, or "*"
    path: str | None = None  # a local directory
    hugging_face: str | None = None  # a Hub model id, or "*": the model's name
    revision: str | None = None

    @property
    def per_model(self) -> bool:
        """Every model's own Hub tokenizer, fetched when a request first names it."""
        return self.model == ANY_MODEL and self.hugging_face == SAME_AS_MODEL


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

    def describe(self) -> str:
        return f"{self.status.value}: {self.error}" if self.error else self.status.value


@dataclass(frozen=True, slots=True)
class Resolution:
    tokenizer: PromptTokenizer | None
    adapter: LoraAdapter | None = None
    # Why there is no tokenizer: "no-tokenizer", "loading", "failed", "model-limit"
    # (per-model Hub tokenizers: `max_models` other models already have theirs).
    reason: str | None = None


_Outcome = Literal["ready", "retry", "failed"]
_SourceKey = tuple[str | None, str | None, str | None]


@dataclass
class TokenizerRegistry:
    sources: Sequence[TokenizerSource]
    adapters: Sequence[LoraAdapter] = ()
    cache_dir: str | None = None
    offline: bool = False
    workers: int = 2
    tokenizer_options: dict[str, Any] = field(default_factory=dict)
    # Models whose tokenizer `huggingFace: "*"` may fetch (the first ones named).
    max_models: int = DEFAULT_MAX_MODELS

    def __post_init__(self) -> None:
        self._entries = {s.model: _Entry(s) for s in self.sources if not s.per_model}
        self._per_model = any(s.per_model for s in self.sources)
        # Per-model Hub tokenizers, by model, in the order requests first named them.
        self._fetched: dict[str, _Entry] = {}
        # Entries waiting for `fetch_on_demand` (created without a running loop: an
        # asyncio.Queue binds to the loop that first waits on it).
        self._wanted: asyncio.Queue[_Entry] = asyncio.Queue()
        self._adapters = {a.name: a for a in self.adapters}
        # Every distinct tokenizer loaded, by source: models with the same source
        # share one (and its piece cache).
        self._loaded: dict[_SourceKey, PromptTokenizer] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._loader: ThreadPoolExecutor | None = None

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
        """The threads that tokenize long prompts."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="epp-tokenize"
            )
        return self._executor

    @property
    def loader(self) -> ThreadPoolExecutor:
        """The thread that downloads and parses tokenizers, one at a time: a slow
        download must not take a tokenizing thread while requests flow."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="epp-tokenizer-load"
            )
        return self._loader

    def close(self) -> None:
        for executor in (self._executor, self._loader):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._loader = None

    def adapter(self, model: str) -> LoraAdapter | None:
        return self._adapters.get(model)

    def resolve(self, model: str) -> Resolution:
        """The tokenizer for `model`'s requests. With per-model Hub tokenizers, the
        first call for a model without an entry of its own queues its fetch."""
        adapter = self._adapters.get(model)
        base = adapter.base_model if adapter is not None else model
        entry = self._entries.get(base)
        # (A request without a model names no Hub id: nothing to fetch.)
        if entry is None and self._per_model and base:
            entry = self._fetched.get(base) or self._want(base)
            if entry is None:
                return Resolution(None, adapter, "model-limit")
        entry = entry or self._entries.get(ANY_MODEL)
        if entry is None:
            return Resolution(None, adapter, "no-tokenizer")
        if entry.tokenizer is None:
            return Resolution(
                None, adapter, "failed" if entry.status is TokenizerStatus.FAILED else "loading"
            )
        return Resolution(entry.tokenizer, adapter)

    def _want(self, model: str) -> _Entry | None:
        """A new per-model entry, queued for `fetch_on_demand`; None past the cap."""
        if len(self._fetched) >= self.max_models:
            return None
        entry = _Entry(TokenizerSource(model, hugging_face=model))
        self._fetched[model] = entry
        self._wanted.put_nowait(entry)
        return entry

    def tokens_encoded(self) -> int:
        """Tokens the loaded tokenizers have produced so far (their cache misses)."""
        return sum(t.tokens_encoded for t in self._loaded.values())

    def describe(self) -> dict[str, str]:
        """Each model's tokenizer state, for /debug/endpoints: the configured ones,
        then the per-model Hub ones in the order they were first asked for."""
        out = {model: entry.describe() for model, entry in self._entries.items()}
        if self._per_model:
            out[ANY_MODEL] = (
                f"per model from the Hugging Face Hub ({len(self._fetched)} of at most"
                f" {self.max_models} models)"
            )
            for model, entry in self._fetched.items():
                out.setdefault(model, entry.describe())
        return out

    async def load(self) -> None:
        """Load every configured tokenizer (local ones first); Hub fetches that may
        succeed later are retried with backoff until they do."""
        pending = sorted(self._entries.values(), key=lambda e: e.source.path is None)
        attempt = 0
        while pending:
            pending = [e for e in pending if await self._attempt(e) == "retry"]
            if pending:
                await asyncio.sleep(_backoff(attempt))
                attempt += 1

    async def fetch_on_demand(self) -> None:
        """Fetch each per-model Hub tokenizer `resolve` asks for, each retried with
        backoff, until cancelled (returns at once without `huggingFace: "*"`)."""
        if not self._per_model:
            return
        async with asyncio.TaskGroup() as group:
            while True:
                entry = await self._wanted.get()
                group.create_task(
                    self._load_retrying(entry), name=f"tokenizer {entry.source.model}"
                )

    async def _load_retrying(self, entry: _Entry) -> None:
        attempt = 0
        while await self._attempt(entry) == "retry":
            await asyncio.sleep(_backoff(attempt))
            attempt += 1

    async def _attempt(self, entry: _Entry) -> _Outcome:
        """Load `entry`'s tokenizer once (or share an identical source's)."""
        source = entry.source
        key = (source.path, source.hugging_face, source.revision)
        tokenizer = self._loaded.get(key)
        if tokenizer is None:
            entry.status = TokenizerStatus.LOADING
            try:
                tokenizer = await self._load_one(source)
            except (TokenizerLoadError, HubFetchError) as exc:
                entry.status, entry.error = TokenizerStatus.FAILED, str(exc)
                retry = isinstance(exc, HubFetchError) and exc.retryable
                log.error(
                    "tokenizer for model %r: %s; its requests get no precise prefix score%s",
                    source.model,
                    exc,
                    " until a retry succeeds" if retry else "",
                )
                return "retry" if retry else "failed"
            self._loaded[key] = tokenizer
            log.info(
                "tokenizer for model %r ready (%s; chat template: %s; piece cache: %s)",
                source.model,
                source.path or source.hugging_face,
                "yes" if tokenizer.chat_template is not None else "no",
                "on" if tokenizer.piecewise else "off",
            )
        entry.tokenizer, entry.status, entry.error = tokenizer, TokenizerStatus.READY, None
        return "ready"

    async def _load_one(self, source: TokenizerSource) -> PromptTokenizer:
        loop = asyncio.get_running_loop()
        if source.path is not None:
            directory = Path(source.path)
        else:
            assert source.hugging_face is not None
            directory = await loop.run_in_executor(
                self.loader,
                fetch_tokenizer,
                source.hugging_face,
                source.revision,
                self.cache_dir,
                self.offline,
            )
        name = source.hugging_face or directory.name
        return await loop.run_in_executor(
            self.loader,
            lambda: PromptTokenizer.load(name, directory, **self.tokenizer_options),
        )


def _backoff(attempt: int) -> float:
    return HUB_RETRY_S[min(attempt, len(HUB_RETRY_S) - 1)]
