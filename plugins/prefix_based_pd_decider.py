"""`prefix-based-pd-decider`: disaggregate a request when the decode endpoint would
have to prefill many tokens itself (llm-d's decider of the same name).

Asked by `disagg-profile-handler` once the decode profile has picked endpoint D.
With the prompt's P tokens and the C of them D already caches, it disaggregates
iff all of:

- `nonCachedTokens` > 0 (0, the default, turns the decider off: never);
- P >= `promptTokens` (default 0: any length);
- P - C >= `nonCachedTokens`.

A prompt D mostly holds (a conversation's next turn on the pod that served the
last one) is cheaper to finish on D than to prefill elsewhere and ship over; a
long uncached one is worth a prefill endpoint.

P is counted as `inflight-load-producer` counts it: characters / `charsPerToken`
(this EPP's, 4.0) for text, exactly for token ids, every prompt of a batch. C is
read from the `PrefixMatchInfo` of `prefixMatchInfoProducerName` (default
`approx-prefix-cache-producer`): the leading blocks D holds times the block size,
at most P. So P - C is the same "uncached tokens" the in-flight load charges.
Without that match info (the producer is not in the config, or failed) the
request is not disaggregated: what D caches is unknown, and running both stages
on D always works. A warning says so once.

Negative thresholds are refused. The decision's numbers (P, C, P - C and the
thresholds) go to /debug/explain through the profile handler's note.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Final

import msgspec

from epp.approxindex import DEFAULT_CHARS_PER_TOKEN
from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, DisaggDecision, PluginContext, prefix_match_key

from .inflight_load_producer import DEFAULT_PREFIX_PRODUCER, count_prompt_tokens

log = logging.getLogger(__name__)

OFF: Final = "nonCachedTokens is 0: the decider is off"


class PrefixBasedPdDecider:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        non_cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
        prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
        prefix_match_info_producer_name: str = ""
        # This EPP's: characters per token when a prompt is text.
        chars_per_token: Annotated[float, msgspec.Meta(gt=0.0)] = DEFAULT_CHARS_PER_TOKEN

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        if not math.isfinite(params.chars_per_token):
            raise ValueError(
                f"charsPerToken must be a finite number > 0, got {params.chars_per_token}"
            )
        self.name = context.name
        self.non_cached_tokens = params.non_cached_tokens
        self.prompt_tokens = params.prompt_tokens
        self.producer = params.prefix_match_info_producer_name or DEFAULT_PREFIX_PRODUCER
        self.key = prefix_match_key(self.producer)
        self.chars_per_token = params.chars_per_token
        self._warned = False

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint | None
    ) -> DisaggDecision:
        thresholds = {"nonCachedTokens": self.non_cached_tokens, "promptTokens": self.prompt_tokens}
        if self.non_cached_tokens <= 0:
            return DisaggDecision(False, OFF, thresholds)
        if decode is None:
            return DisaggDecision(False, "no decode endpoint to judge", thresholds)
        info = cycle.get(self.key)
        if info is None:
            self._warn_once()
            return DisaggDecision(False, f"no prefix match info from {self.producer!r}", thresholds)
        prompt = count_prompt_tokens(request, self.chars_per_token)
        cached = min(prompt, round(info.matched.get(decode, 0.0) * info.block_size_tokens))
        uncached = prompt - cached
        facts = {
            "promptTokens": prompt,
            "cachedTokens": cached,
            "uncachedTokens": uncached,
            "thresholds": thresholds,
        }
        if prompt < self.prompt_tokens:
            return DisaggDecision(
                False, f"prompt of {prompt} tokens < promptTokens {self.prompt_tokens}", facts
            )
        if uncached < self.non_cached_tokens:
            return DisaggDecision(
                False,
                f"{uncached} uncached tokens on the decode endpoint"
                f" < nonCachedTokens {self.non_cached_tokens}",
                facts,
            )
        return DisaggDecision(
            True,
            f"{uncached} uncached tokens on the decode endpoint"
            f" >= nonCachedTokens {self.non_cached_tokens}",
            facts,
        )

    def _warn_once(self) -> None:
        # Logged, not raised: the request is still served, by the decode endpoint alone.
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: no prefix match info from producer %r: requests are not disaggregated"
                " (declare that producer, or name another with prefixMatchInfoProducerName)",
                self.name,
                self.producer,
            )
