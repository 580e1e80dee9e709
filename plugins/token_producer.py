"""`token-producer`: tokenizes the request's prompt once, for the plugins that read
token ids (llm-d's token producer; here `precise-prefix-cache-producer`).

A DataProducer. It leaves the prompt's token ids in the cycle under
`TOKENIZED_PROMPT` (llm-d's `TokenizedPrompt`); a request already tokenized by an
earlier token producer is left as it is. A prompt that cannot be tokenized as the
engine will (images, no chat template, the tokenizer still loading) gets none, and
its readers go without (every precise score 0 for it).

llm-d's backends, and what each is here:

- `modelName` (with or without a `vllm` block): llm-d asks vLLM's `/render`
  endpoints at `vllm.url` to render and tokenize the prompt with `modelName`'s
  tokenizer. This EPP does the same in-process (epp/tokenization: the chat template
  rendered as vLLM renders it, the same tokenizer files), so the token ids are the
  same and no render server is needed: `vllm.url`, `vllm.timeout` and
  `vllm.mmTimeout` are accepted and not used (a warning says so). The tokenizer is
  `modelName`'s from the Hugging Face Hub (`HF_HUB_OFFLINE`, `HF_HUB_CACHE`,
  `HF_TOKEN` as usual), or this EPP's `tokenizerDir` (a local directory), or
  `epp serve --tokenizer-dir MODEL=DIR`. It serves every request, whatever model it
  names (as in llm-d), except models given a directory of their own with
  `--tokenizer-dir`.
- `udsTokenizerConfig` (deprecated in llm-d): a tokenizer sidecar on a Unix socket.
  Refused when it names a `socketFile`: llm-d itself refuses it beside `modelName`,
  which it needs, and this EPP tokenizes in-process (remove it, keep `modelName`).
  Without a `socketFile` it is off, in llm-d as here.
- `estimate` (llm-d's default when no backend is set): tokenizer-free
  pseudo-tokens, 4 bytes of the prompt each. As in llm-d they match no engine's KV
  blocks, so a precise producer reading them scores every endpoint 0 (a warning
  says to set `modelName`). `estimate.image` and `estimate.video` tune llm-d's
  placeholder counts for images and videos; accepted and not used (prompts with
  media get no precise score here).

As in llm-d, `estimate` and `vllm`/`modelName` exclude each other. Unknown
parameters are errors.

Data producers run in the file's order here (llm-d orders them by what they read),
so a token producer must be declared before the plugins that read its tokens: one
declared after a `precise-prefix-cache-producer` is refused with a message saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from epp.datastore import Endpoint
from epp.durations import Duration, parse_duration
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, ServiceContext, StateKey
from epp.tokenization.service import NoTokens, PromptTokenization, estimated_tokens

log = logging.getLogger(__name__)

DEFAULT_VLLM_URL: Final = "http://localhost:8000"


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A request's prompt as token ids (llm-d's TokenizedPrompt)."""

    tokens: bytes  # token bytes (epp/tokenization/tokens.py)
    # The `estimate` backend's pseudo-tokens: they match no engine's blocks.
    estimated: bool = False


# Where a token producer leaves the request's tokens (llm-d's data key
# `TokenizedPrompt`): one per request, whichever token producer wrote it.
TOKENIZED_PROMPT: Final = StateKey[TokenizedPrompt]("TokenizedPrompt")


class VllmConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    url: str = DEFAULT_VLLM_URL
    timeout: Duration = "5s"
    mm_timeout: Duration = "30s"


class UdsTokenizerConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    socket_file: str = ""  # empty: the sidecar is off (llm-d's IsEnabled)
    use_tcp: bool = msgspec.field(default=False, name="useTCP")


class EstimateConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    # llm-d's multimodal placeholder estimation: accepted, not used here.
    image: dict[str, Any] | None = None
    video: dict[str, Any] | None = None


class TokenProducerParameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    model_name: str = ""
    vllm: VllmConfig | None = None
    uds_tokenizer_config: UdsTokenizerConfig | None = None
    estimate: EstimateConfig | None = None
    # This EPP's: a local directory with modelName's tokenizer (instead of the Hub),
    # the Hub cache, and the cache only (as HF_HUB_OFFLINE=1).
    tokenizer_dir: str | None = None
    tokenizers_cache_dir: str | None = None
    hugging_face_offline: bool = False


def backend(params: TokenProducerParameters) -> str:
    """ "vllm" or "estimate", as llm-d chooses it. Raises ValueError for what llm-d
    refuses, and for its tokenizer sidecar, which cannot work here."""
    uds = params.uds_tokenizer_config is not None and bool(params.uds_tokenizer_config.socket_file)
    vllm = params.vllm is not None or bool(params.model_name)
    estimate = params.estimate is not None
    if estimate and (uds or vllm):
        raise ValueError("only one of 'estimate', 'vllm', or 'udsTokenizerConfig' may be set")
    if uds:
        raise ValueError(
            "udsTokenizerConfig: the tokenizer sidecar (deprecated in llm-d) is not supported:"
            " remove it and set modelName; this EPP tokenizes prompts in-process with that"
            " model's tokenizer"
        )
    if vllm and not params.model_name:
        raise ValueError("'modelName' must be specified (the model whose tokenizer is used)")
    if params.vllm is not None:
        for field in ("timeout", "mm_timeout"):
            if parse_duration(getattr(params.vllm, field)) <= 0:
                raise ValueError(f"vllm.{field}: must be positive")
    if vllm:
        return "vllm"
    if params.tokenizer_dir is not None:
        raise ValueError("tokenizerDir: the estimate backend uses no tokenizer; set modelName")
    return "estimate"


def prompt_tokenization(
    params: TokenProducerParameters, context: ServiceContext
) -> PromptTokenization | None:
    """The tokenizer service of a `vllm` (modelName) token producer; None for
    `estimate`, which needs no tokenizer (the build step runs the service it gets,
    and there is none to run)."""
    if backend(params) == "estimate":
        return None
    return PromptTokenization(
        params.model_name,
        path=params.tokenizer_dir,
        local_tokenizers=context.settings.tokenizer_dirs,
        cache_dir=params.tokenizers_cache_dir,
        offline=params.hugging_face_offline,
        name=context.name,
    )


class TokenProducer:
    Parameters = TokenProducerParameters
    # Built by the framework from the parameters, run by the server.
    Service = staticmethod(prompt_tokenization)

    def __init__(self, params: TokenProducerParameters, context: PluginContext) -> None:
        self.name = context.name
        for name, plugin in context.plugins.items():
            if getattr(plugin, "reads_tokenized_prompt", False):
                raise ValueError(
                    f"declare it before {name!r}, which reads its tokens: data producers run"
                    " in the file's order here"
                )
        self.backend = backend(params)
        service = context.service
        self.tokenization = service if isinstance(service, PromptTokenization) else None
        if self.backend == "estimate":
            log.warning(
                "%s: the estimate backend's pseudo-tokens (4 bytes of the prompt each) match no"
                " engine's KV blocks: precise prefix scores will be 0. Set modelName to"
                " tokenize with the served model's tokenizer",
                self.name,
            )
        elif self.backend == "vllm" and params.vllm is not None:
            log.warning(
                "%s: vllm.url %s is not called: this EPP renders and tokenizes prompts"
                " in-process with the tokenizer of %r, as vLLM's /render would (nothing to do)",
                self.name,
                params.vllm.url,
                params.model_name,
            )

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        if cycle.get(TOKENIZED_PROMPT) is not None:
            return  # an earlier token producer tokenized it (llm-d's producer is idempotent)
        if self.tokenization is None:
            pseudo = estimated_tokens(request)
            if pseudo is not None:
                cycle.put(TOKENIZED_PROMPT, TokenizedPrompt(pseudo, estimated=True))
            return
        found = await self.tokenization.tokenize(request)
        if not isinstance(found, NoTokens):
            cycle.put(TOKENIZED_PROMPT, TokenizedPrompt(found))
