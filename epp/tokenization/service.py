"""The prompt tokenization service: one model's tokenizer, for a plugin that hands
a request's token ids to others (llm-d's `token-producer`, plugins/token_producer.py).

Built from its settings (the plugin maps llm-d's parameters onto them), run by the
server, read by the plugin:

    run()              load the tokenizer in the background: a local directory, or
                       a Hugging Face Hub model's tokenizer files, retried with
                       backoff while the Hub cannot be reached
    tokenize(request)  the prompt's token ids (token bytes) as the engine will see
                       them (chat template, special tokens; epp/tokenization/prompts.py),
                       or `NoTokens` saying why not; long prompts are tokenized in
                       worker threads, so it never blocks the event loop

Every request is tokenized with `model`'s tokenizer, whatever model it names (as
llm-d's token producer does with its `modelName`), except the models given a local
directory of their own (`epp serve --tokenizer-dir MODEL=DIR`), which use that one.
Building starts no I/O; a local directory without tokenizer.json is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.logs import LogOnce
from epp.requests import ChatPrompt, CompletionPrompt, InferenceRequest, ResponsesPrompt
from epp.tokenization.models import ANY_MODEL, TokenizerRegistry, TokenizerSource
from epp.tokenization.prompts import Unsupported, prompt_tokens, token_id_prompt
from epp.tokenization.tokens import TOKEN_BYTES, token_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NoTokens:
    """The prompt was not tokenized: whoever reads its tokens goes without them."""

    reason: str  # a label: no_prompt, tokenizer_loading, tokenizer_failed, multimodal, ...
    detail: str


_REASONS = {
    "no-tokenizer": "no_tokenizer",
    "loading": "tokenizer_loading",
    "failed": "tokenizer_failed",
    "model-limit": "tokenizer_model_limit",
}


class PromptTokenization:
    def __init__(
        self,
        model: str,
        *,
        path: str | None = None,
        local_tokenizers: Sequence[tuple[str, str]] = (),
        cache_dir: str | None = None,
        offline: bool = False,
        workers: int = 2,
        name: str = "token-producer",
    ) -> None:
        """`model`: the Hub model id whose tokenizer serves every request; `path`: a
        local directory with that tokenizer instead of the Hub. `local_tokenizers`:
        (model, directory) pairs from `epp serve --tokenizer-dir`; a pair naming
        `model` itself replaces its tokenizer for every request. Raises ValueError
        for a directory without tokenizer.json."""
        self.name = name
        self.model = model
        local = dict(local_tokenizers)
        own = local.pop(model, path)
        default = (
            TokenizerSource(ANY_MODEL, path=own)
            if own is not None
            else TokenizerSource(ANY_MODEL, hugging_face=model)
        )
        self.registry = TokenizerRegistry(
            [TokenizerSource(m, path=d) for m, d in local.items()] + [default],
            cache_dir=cache_dir,
            offline=offline,
            workers=workers,
        )
        missing = self.registry.missing_directories()
        if missing:
            raise ValueError("; ".join(missing))
        self._log_once = LogOnce(log)

    # -- the Service contract (epp/scheduling/interfaces.py) -------------------------

    async def run(self) -> None:
        """Load the tokenizers, then hold them until cancelled."""
        try:
            await self.registry.load()
            await asyncio.Event().wait()
        finally:
            self.registry.close()

    def describe_endpoint(self, endpoint: Any) -> dict[str, Any]:
        """For /debug/endpoints: the tokenizers' state (the same for every endpoint,
        as the precise scorer's `tokenizers`)."""
        return {"tokenProducer": {"tokenizers": self.describe()}}

    def collector(self) -> None:
        return None

    def describe(self) -> dict[str, str]:
        """Each tokenizer's state (pending, loading, ready, failed: why)."""
        return self.registry.describe()

    # -- the read side -------------------------------------------------------------------

    async def tokenize(self, request: InferenceRequest) -> bytes | NoTokens:
        """The prompt's token ids as token bytes (token ids the client sent are used
        as they are), or why there are none (logged once per reason and model)."""
        model = request.target_model or request.model
        if request.prompt is None:
            return NoTokens("no_prompt", "the request has no prompt")
        try:
            data = token_id_prompt(request)
            if data is not None:
                return data
            resolution = self.registry.resolve(model)
            if resolution.tokenizer is None:
                reason = resolution.reason or "no-tokenizer"
                return self._skip(
                    _REASONS.get(reason, "no_tokenizer"),
                    model,
                    f"the tokenizer of {self.model!r} is {reason} ({self.describe()})",
                )
            return await prompt_tokens(request, resolution.tokenizer, self.registry.executor)
        except Unsupported as exc:
            return self._skip(exc.reason, model, str(exc))

    def _skip(self, reason: str, model: str, detail: str) -> NoTokens:
        # Loading is expected for a moment after start: said once, at info level.
        level = logging.INFO if reason == "tokenizer_loading" else logging.WARNING
        self._log_once(
            (reason, model),
            level,
            "%s: requests for model %r are not tokenized: %s",
            self.name,
            model,
            detail,
        )
        return NoTokens(reason, detail)


def estimated_tokens(request: InferenceRequest) -> bytes | None:
    """Tokenizer-free pseudo-tokens (llm-d's `estimate` backend): the prompt's UTF-8
    bytes, zero-padded and read 4 at a time as one token id each; token ids the
    client sent are used as they are. They never equal an engine's token ids, so
    they match no engine's KV blocks. None for a request without a text prompt."""
    prompt = request.prompt
    text: str
    if isinstance(prompt, CompletionPrompt):
        first = prompt.prompts[0]
        if isinstance(first, tuple):
            with contextlib.suppress(OverflowError, TypeError):
                return token_bytes(first)
            return None
        text = first
    elif isinstance(prompt, ChatPrompt):
        text = "".join(f"{m.role}\n{m.text()}\n" for m in prompt.messages)
    elif isinstance(prompt, ResponsesPrompt):
        text = prompt.instructions or ""
        if isinstance(prompt.input, str):
            text += prompt.input
        else:
            text += "".join(f"{m.role}\n{m.text()}\n" for m in prompt.input)
    else:
        return None
    raw = text.encode()
    return raw + bytes(-len(raw) % TOKEN_BYTES)
