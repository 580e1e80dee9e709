"""A linear model of time to first token, fitted online from what the EPP observes.

    ttft = w . x        x = (1, queued_s, prefill_ktokens, attention_mpairs, decoding, waiting,
                             transfer_ktokens, overdue)

- `queued_s`: the predicted prefill work ahead of the request on the pod, in
  seconds (the ledger's backlog, `epp.ttft.ledger`);
- `prefill_ktokens`: the request's own uncached prompt tokens, in thousands;
- `attention_mpairs`: the attention those tokens compute, in millions of (new
  token, attended token) pairs: u x (m + u / 2) for u uncached tokens after m
  cached ones. Prefill time is linear in tokens for the matrix multiplies and
  grows with this for attention, which matters for long prompts;
- `decoding`: requests the pod is decoding, whose tokens share every step;
- `waiting`: requests the pod itself reports waiting (its scraped metrics): an
  engine whose batch is full (max_num_seqs, or no KV blocks left) makes new
  requests wait for a running one to end, and requests from other EPP replicas
  or clients queue there unseen by this EPP's own ledger (the producer can count
  only those its ledger does not account for);
- `transfer_ktokens`: for a disaggregated request (prefill on one pod, decode on
  another), the prompt tokens whose KV cache the decode pod pulls from the
  prefill pod, in thousands (0 for a request served whole). The other features
  then describe the prefill pod (its queue, its uncached tokens) and the decode
  pod's batch (`decoding`, the first decode step joins it). A request served
  whole never informs this weight, and its fit is unchanged by it (a feature that
  is always 0 leaves the other weights' updates exactly as they were);
- `overdue`: requests this EPP sent to the pod that have not produced their
  first token although the time predicted for it has passed. The ledger's
  backlog drains at one second per second and so reads empty when a pod falls
  behind (its KV cache full of long prompts, a batch that frees blocks only as
  requests finish); these requests say by how much it is behind. Counted only
  where the producer is asked to (`countOverdue`), 0 otherwise, which leaves
  every other weight's fit exactly as without the feature.

The weights are fitted by recursive least squares with exponential forgetting
(each observation's weight decays by `forgetting` per later observation, so the
fit follows a fleet whose speed changes), starting from a prior that is right in
magnitude for a mid-sized model on a current GPU and that the first few dozen
observations override. A residual is clipped to a few times the running median
absolute residual before it updates (Huber-like), so one bad observation does
not move the fit much.

Predictions use the least-squares weights constrained to be non-negative (a
negative cost of a token makes no physical sense and would invert routing). The
fit itself stays unconstrained, and the constrained weights are derived from it
and its covariance: a negative weight is fixed at zero and the others take the
values least squares gives them under that constraint (for a Gaussian fit,
conditioning on the weight being 0: w -= P[:, i] w_i / P[i, i]), repeated while
another one is negative. Clamping the negative weight alone would not do: when
two features move together (uncached tokens and attention pairs, on a workload
whose prompts are alike), the fit trades one against the other, and dropping
the negative side of the trade adds its share back to every prediction (measured
on hot-prefix: +19% median bias, error p50 19% against 11% with the constrained
weights). The update is O(k^2) for k = 7 features, the constraint O(k^2) per
negative weight: a few microseconds in Python.

A weight may be given a bound above 0 (`lower`), enforced the same way. When
every prompt has about the same length (independent questions of one size), the
observations cannot tell the fixed cost from the cost per prompt token: the fit
trades one for the other, and the noise (queue waits the features miss) can
drive the prefill weight to 0, with the fixed weight taking the whole of it. The
predictions stay right, but a request's own prefill is then predicted to take
no time, so the ledger charges nothing for it and every pod's queue reads empty
(the producer's `minPrefillWeightMs`). Conditioned on the bound, the fixed
weight gives up what the prefill weight is held at, and the predictions stay
where they were.

With `relative` set, each observation is weighted by the inverse of the TTFT
predicted for it (weighted least squares): the noise of a TTFT grows with it (a
request that waits seconds behind a full KV cache starts a second early or late
for reasons no feature sees, a 50 ms one a few milliseconds), so an observation
of seconds tells less about the weights than one of milliseconds, and an
unweighted fit lets the long waits of a fleet in overload pull every weight
their way, the short predictions with them. Scaling the observation and its
features by sqrt(reference / predicted) is that weighting in the same update.
The prediction, not the observed TTFT, sets the weight: weighting by the
observation would favour the observations that came out short and bias every
prediction low. Predictions under `relative_floor_s` weigh as one at the floor
(10 ms unless set): the floor sets how far the shortest TTFTs are weighted up
against the rest (tenfold at 10 ms against 100 ms; with the floor at 300 ms,
every TTFT under it weighs alike).

The covariance is made symmetric again after every update: the features' scales
differ by many orders of magnitude, and the rounding of the in-place update,
left to accumulate, cost it its positive definiteness after a few thousand
observations of long-prompt traffic, after which the update divided by nearly
zero and the fit exploded. Should it still lose definiteness (a negative
variance, or a negative x'Px for an observation), it is started again from the
prior, keeping the fit (`covariance_resets` counts it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

FEATURES: Final = (
    "fixed",
    "queued",
    "prefill",
    "attention",
    "decoding",
    "waiting",
    "transfer",
    "overdue",
)

# Prior weights: 20 ms fixed (HTTP, scheduling, one step), the backlog counted
# as it is predicted, 30 ms per 1,000 uncached tokens (~33k tokens/s), 1 ms per
# million attention pairs, 1 ms per decoding request, 50 ms per waiting request,
# 5 ms per 1,000 tokens of KV cache moved between pods (a mid-sized model's
# ~128 KiB per token over ~25 GB/s).
PRIOR_WEIGHTS: Final = (0.02, 1.0, 0.03, 0.001, 0.001, 0.05, 0.005, 0.05)
# How far the prior may be from the truth (variance of each weight), and the
# typical error of one observation (seconds): least squares weighs the prior
# against observations by the ratio of the two, so with these a dozen
# observations outweigh the prior.
PRIOR_VARIANCE: Final = (1e-2, 1.0, 1e-2, 1e-4, 1e-4, 1e-2, 1e-4, 1e-2)
OBSERVATION_ERROR_S: Final = 0.01
# With `relative` fitting, an observation predicted at this TTFT would keep its
# unweighted weight (so the prior weighs as much against it as unweighted), and
# predictions below the floor (`relative_floor_s`, this by default) weigh as much
# as one at the floor: with a floor above the reference, every observation
# weighs reference / floor of an unweighted one or less.
RELATIVE_REFERENCE_S: Final = 0.1
RELATIVE_FLOOR_S: Final = 0.01


@dataclass(frozen=True, slots=True)
class TtftFeatures:
    """What a prediction is made of, for one request on one pod."""

    queued_s: float
    prefill_tokens: float
    attention_pairs: float
    decoding: int
    waiting: int = 0
    transfer_tokens: float = 0.0  # KV cache pulled from a prefill pod (disaggregated)
    overdue: int = 0  # queued requests past their predicted first token

    def vector(self) -> tuple[float, ...]:
        return (
            1.0,
            self.queued_s,
            self.prefill_tokens / 1e3,
            self.attention_pairs / 1e6,
            float(self.decoding),
            float(self.waiting),
            self.transfer_tokens / 1e3,
            float(self.overdue),
        )


def attention_pairs(uncached: float, cached: float) -> float:
    """(new token, attended token) pairs of prefilling `uncached` tokens after
    `cached` ones, causally."""
    return uncached * (cached + uncached / 2.0)


class OnlineTtftModel:
    """The weights and their running fit (see the module docstring)."""

    def __init__(
        self,
        forgetting: float = 0.995,
        prior: Sequence[float] = PRIOR_WEIGHTS,
        prior_variance: Sequence[float] = PRIOR_VARIANCE,
        clip: float = 4.0,
        lower: Sequence[float] | None = None,
        relative: bool = False,
        relative_floor_s: float = RELATIVE_FLOOR_S,
    ) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {forgetting}")
        if len(prior) != len(FEATURES) or len(prior_variance) != len(FEATURES):
            raise ValueError(f"the model has {len(FEATURES)} weights")
        self.lower = [0.0] * len(FEATURES) if lower is None else [float(v) for v in lower]
        if len(self.lower) != len(FEATURES) or not all(0.0 <= v < float("inf") for v in self.lower):
            raise ValueError(f"lower needs {len(FEATURES)} finite bounds >= 0, got {lower}")
        self.forgetting = forgetting
        self.clip = clip
        if not 0.0 < relative_floor_s < float("inf"):
            raise ValueError(f"relative_floor_s must be a positive time, got {relative_floor_s}")
        self.relative = relative
        self.relative_floor_s = relative_floor_s
        self._fit = list(prior)  # the unconstrained least-squares estimate
        # What predictions use: the fit within its bounds (`within_bounds`).
        self.weights = [max(b, w) for b, w in zip(self.lower, prior, strict=True)]
        # Forgetting inflates the variance of a weight no observation informs (a
        # fleet that never decodes tells nothing of `decoding`) without bound, and
        # the first observation that does would then swing it wildly ("windup"):
        # a weight's variance is kept at most 100 times its prior.
        self._prior_variance = [v / OBSERVATION_ERROR_S**2 for v in prior_variance]
        self._cap = [100.0 * v for v in self._prior_variance]
        self._p = self._prior_covariance()
        self.covariance_resets = 0

        # Running scale of the residuals (an exponential median estimate).
        self._scale: float | None = None
        self.observations = 0

    def _prior_covariance(self) -> list[list[float]]:
        k = len(self._prior_variance)
        return [[self._prior_variance[i] if i == j else 0.0 for j in range(k)] for i in range(k)]

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.weights, x, strict=True))

    def _residual(self, x: Sequence[float], y: float) -> float:
        return y - sum(w * v for w, v in zip(self._fit, x, strict=True))

    def observe(self, x: Sequence[float], y: float) -> float:
        """Fit one observation (`x`, observed TTFT `y` seconds); returns the
        prediction it had before the update."""
        before = self.predict(x)
        if self.relative:
            # Weighted least squares, weight 1 / predicted (module docstring).
            s = math.sqrt(RELATIVE_REFERENCE_S / max(before, self.relative_floor_s))
            x = [v * s for v in x]
            y *= s
        residual = self._residual(x, y)
        scale = self._scale
        if scale is not None:
            # Move the median estimate up or down by a fraction of itself.
            scale *= 1.05 if abs(residual) > scale else 0.95
            limit = self.clip * scale
            residual = max(-limit, min(limit, residual))
        else:
            scale = max(abs(residual), 1e-3)
        self._scale = max(scale, 1e-4)
        lam = self.forgetting
        p = self._p
        k = len(x)
        px = [sum(p[i][j] * x[j] for j in range(k)) for i in range(k)]
        spread = sum(x[i] * px[i] for i in range(k))
        if not spread >= 0.0 or not all(p[i][i] > 0.0 for i in range(k)):
            # Rounding has cost the covariance its definiteness (module docstring):
            # the denominator below could cross zero. Start it again from the prior,
            # keeping the fit.
            self._p = p = self._prior_covariance()
            self.covariance_resets += 1
            px = [sum(p[i][j] * x[j] for j in range(k)) for i in range(k)]
            spread = sum(x[i] * px[i] for i in range(k))
        denominator = lam + spread
        gain = [v / denominator for v in px]
        for i in range(k):
            self._fit[i] += gain[i] * residual
            row = p[i]
            for j in range(k):
                row[j] = (row[j] - gain[i] * px[j]) / lam
        for i in range(k):  # symmetric, as a covariance is (rounding makes it drift)
            for j in range(i):
                p[i][j] = p[j][i] = 0.5 * (p[i][j] + p[j][i])
        for i in range(k):
            if p[i][i] > self._cap[i]:
                shrink = (self._cap[i] / p[i][i]) ** 0.5
                for j in range(k):
                    p[i][j] *= shrink
                    p[j][i] *= shrink
        self.weights = within_bounds(self._fit, p, self.lower)
        self.observations += 1
        return before

    def describe(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.weights, strict=True))


def within_bounds(
    fit: Sequence[float],
    covariance: Sequence[Sequence[float]],
    lower: Sequence[float] | None = None,
) -> list[float]:
    """The least-squares weights under the constraint that none is below its
    bound in `lower` (0 each by default), from the unconstrained `fit` and its
    `covariance` (the module docstring says why): the weight furthest below its
    bound is fixed at the bound and the others conditioned on it, until none is
    below."""
    k = len(fit)
    bounds = [0.0] * k if lower is None else list(lower)
    w = list(fit)
    p = [list(row) for row in covariance]
    fixed: set[int] = set()
    while True:
        below = [i for i in range(k) if i not in fixed and w[i] < bounds[i]]
        if not below:
            break
        i = min(below, key=lambda j: w[j] - bounds[j])
        fixed.add(i)
        pii = p[i][i]
        if pii > 0.0:
            column = [p[r][i] for r in range(k)]
            shift = (w[i] - bounds[i]) / pii
            w = [w[r] - column[r] * shift for r in range(k)]
            p = [[p[r][c] - column[r] * column[c] / pii for c in range(k)] for r in range(k)]
        w[i] = bounds[i]
    # Rounding can leave a fixed weight a hair below its bound, and a conditioned one as well.
    return [max(b, v) for b, v in zip(bounds, w, strict=True)]
