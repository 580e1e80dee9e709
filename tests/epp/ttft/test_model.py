"""The online TTFT model: it learns a fleet's rates, resists outliers, stays physical."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest

from epp.ttft.model import (
    FEATURES,
    RELATIVE_FLOOR_S,
    OnlineTtftModel,
    TtftFeatures,
    attention_pairs,
    within_bounds,
)


def _fleet(rng: random.Random) -> tuple[TtftFeatures, float]:
    """A request on a pod whose truth is 8 ms fixed + queue + 50 us per uncached
    token + 0.2 ms per million attention pairs + 0.5 ms per decoding request."""
    cached = rng.choice((0, 1024, 3072))
    uncached = rng.randint(64, 4096)
    features = TtftFeatures(
        queued_s=rng.choice((0.0, 0.0, rng.uniform(0.0, 0.3))),
        prefill_tokens=uncached,
        attention_pairs=attention_pairs(uncached, cached),
        decoding=rng.randint(0, 40),
    )
    ttft = (
        0.008
        + features.queued_s
        + 50e-6 * uncached
        + 0.2e-3 * features.attention_pairs / 1e6
        + 0.5e-3 * features.decoding
    )
    return features, ttft * rng.uniform(0.95, 1.05)


Draw = Callable[[random.Random], tuple[TtftFeatures, float]]


def _train(model: OnlineTtftModel, draw: Draw, rng: random.Random, n: int) -> None:
    for _ in range(n):
        features, ttft = draw(rng)
        model.observe(features.vector(), ttft)


def _errors(model: OnlineTtftModel, draw: Draw, rng: random.Random, n: int) -> list[float]:
    """|predicted - observed| / observed of `n` fresh requests, sorted."""
    errors = []
    for _ in range(n):
        features, ttft = draw(rng)
        errors.append(abs(model.predict(features.vector()) - ttft) / ttft)
    return sorted(errors)


def test_it_learns_the_fleets_rates_from_observations() -> None:
    rng = random.Random(7)
    model = OnlineTtftModel()
    _train(model, _fleet, rng, 600)
    weights = model.describe()
    assert weights["fixed"] == pytest.approx(0.008, rel=0.3)
    assert weights["queued"] == pytest.approx(1.0, rel=0.1)
    assert weights["prefill"] == pytest.approx(0.050, rel=0.1)  # seconds per 1,000 tokens
    assert weights["decoding"] == pytest.approx(0.0005, rel=0.3)
    errors = _errors(model, _fleet, rng, 200)
    assert errors[len(errors) // 2] < 0.05


def test_an_outlier_moves_it_little_and_weights_stay_physical() -> None:
    rng = random.Random(3)
    model = OnlineTtftModel()
    _train(model, _fleet, rng, 400)
    before = dict(model.describe())
    features, _ = _fleet(rng)
    model.observe(features.vector(), 60.0)  # a stalled pod: a minute for one request
    after = model.describe()
    assert after["prefill"] == pytest.approx(before["prefill"], rel=0.2)
    # Observations that say tokens cost nothing (or less) never make a weight negative.
    for _ in range(200):
        model.observe(TtftFeatures(0.0, 4000, 0.0, 0).vector(), 0.0)
    assert all(w >= 0.0 for w in model.weights)


def test_a_negative_weight_is_fixed_at_zero_and_the_others_take_its_share() -> None:
    # Two correlated weights, the second negative: least squares with it at 0 moves
    # the first by cov / var of the second times its value.
    assert within_bounds([1.0, -1.0], [[1.0, 0.5], [0.5, 1.0]]) == pytest.approx([1.5, 0.0])
    # Uncorrelated: the others stay as they are.
    assert within_bounds([1.0, -1.0], [[1.0, 0.0], [0.0, 1.0]]) == pytest.approx([1.0, 0.0])
    # Fixing one can make another negative: it is fixed too.
    assert within_bounds(
        [0.1, -1.0, 2.0], [[1.0, -0.9, 0.0], [-0.9, 1.0, 0.0], [0.0, 0.0, 1.0]]
    ) == (pytest.approx([0.0, 0.0, 2.0]))


def test_a_weight_below_its_bound_is_held_there_and_the_others_give_up_its_share() -> None:
    # The second weight's bound is 0.5, its fit 0.2: held at 0.5, the first,
    # correlated with it, moves by cov / var times the difference.
    assert within_bounds([1.0, 0.2], [[1.0, 0.5], [0.5, 1.0]], [0.0, 0.5]) == pytest.approx(
        [1.15, 0.5]
    )
    # Bounds of 0 are the plain non-negativity.
    assert within_bounds([1.0, -1.0], [[1.0, 0.5], [0.5, 1.0]], [0.0, 0.0]) == pytest.approx(
        [1.5, 0.0]
    )


def _one_length(rng: random.Random) -> tuple[TtftFeatures, float]:
    """Independent prompts all of about one length (1,856 or 1,920 tokens), each
    pod idle: the TTFT does not tell the fixed cost from the cost per token, and
    its noise here runs against the length."""
    uncached = rng.choice((1856, 1920))
    ttft = 0.047 - (uncached - 1856) * 2e-6 + rng.uniform(-0.002, 0.002)
    return TtftFeatures(0.0, uncached, attention_pairs(uncached, 0), 0), ttft


@pytest.mark.parametrize("bound", [None, 0.015])
def test_prompts_of_one_length_keep_the_prefill_weight_at_its_bound(bound: float | None) -> None:
    rng = random.Random(5)
    lower = None
    if bound is not None:
        lower = [0.0] * len(FEATURES)
        lower[FEATURES.index("prefill")] = bound
    model = OnlineTtftModel(lower=lower)
    for _ in range(1000):
        features, ttft = _one_length(rng)
        model.observe(features.vector(), ttft)
    prefill = model.describe()["prefill"]
    if bound is None:
        # The premise: left to itself, the fit says a prompt's tokens cost nothing
        # (so a request's own prefill, what the ledger charges, is predicted 0).
        assert prefill < 0.002
    else:
        assert prefill == pytest.approx(bound)
        # The fixed cost gave up what the prefill weight is held at, for the
        # prompts' mean length (1,888 tokens).
        assert model.describe()["fixed"] == pytest.approx(0.047 - bound * 1.888, abs=0.002)
    errors = []
    for _ in range(200):
        features, ttft = _one_length(rng)
        errors.append(abs(model.predict(features.vector()) / ttft - 1.0))
    assert sorted(errors)[len(errors) // 2] < 0.05


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="lower"):
        OnlineTtftModel(lower=[0.0])
    with pytest.raises(ValueError, match="lower"):
        OnlineTtftModel(lower=[-1.0] + [0.0] * (len(FEATURES) - 1))
    with pytest.raises(ValueError, match="lower"):
        OnlineTtftModel(lower=[float("nan")] + [0.0] * (len(FEATURES) - 1))


def test_predictions_stay_unbiased_when_the_fit_wants_a_negative_weight() -> None:
    """Prompts alike (the same cached prefix, uncached tokens in a narrow range): the
    attention pairs move with the uncached tokens, and a fleet whose cost grows
    less than linearly makes least squares give attention a negative weight.
    Predictions with that weight merely clamped would be too high by its share;
    the constrained weights keep them right on average."""
    rng = random.Random(11)

    def request() -> tuple[TtftFeatures, float]:
        cached = rng.choice((3800, 4000, 4200))
        uncached = rng.randint(300, 700)
        pairs = attention_pairs(uncached, cached)
        ttft = 0.012 + 0.045e-3 * uncached - 4e-3 * pairs / 1e6
        return TtftFeatures(0.0, uncached, pairs, 0), ttft * rng.uniform(0.9, 1.1)

    model = OnlineTtftModel()
    for _ in range(800):
        features, ttft = request()
        model.observe(features.vector(), ttft)
    assert model._fit[FEATURES.index("attention")] < 0.0  # the premise
    assert model.describe()["attention"] == 0.0
    errors = []
    for _ in range(400):
        features, ttft = request()
        errors.append(model.predict(features.vector()) / ttft - 1.0)
    assert abs(sum(errors) / len(errors)) < 0.03


def _long_prompts(rng: random.Random) -> tuple[TtftFeatures, float]:
    """Long-prompt traffic like the Mooncake trace's: uncached prompts from a few
    hundred to 60,000 tokens after up to 30,000 cached ones (up to billions of
    attention pairs), queues, busy batches and the odd waiting request."""
    cached = rng.choice((0, 0, 512, 4096, 16384, 30000))
    uncached = min(int(rng.lognormvariate(7.5, 1.2)), 60000)
    features = TtftFeatures(
        queued_s=rng.choice((0.0, 0.0, 0.0, rng.uniform(0.0, 0.8))),
        prefill_tokens=uncached,
        attention_pairs=attention_pairs(uncached, cached),
        decoding=rng.randint(5, 40),
        waiting=rng.choice((0,) * 12 + (1, 2)),
    )
    ttft = (
        0.01
        + features.queued_s
        + 0.02e-3 * uncached
        + 0.25e-3 * features.attention_pairs / 1e6
        + 0.001 * features.decoding
        + 0.3 * features.waiting
    )
    return features, ttft * rng.uniform(0.8, 1.25)


def test_the_fit_stays_stable_over_long_runs_of_long_prompts() -> None:
    """Features whose scales differ by many orders wear the covariance down with
    rounding; without care it turned indefinite and the fit exploded after about
    5,500 observations of this traffic (predictions of 1e3 s and on to 1e35)."""
    rng = random.Random(0)
    model = OnlineTtftModel()
    _train(model, _long_prompts, rng, 8000)
    errors = _errors(model, _long_prompts, rng, 500)
    assert errors[len(errors) // 2] < 0.15  # the noise alone is ±12%
    assert errors[-1] < 1.0
    weights = model.describe()
    assert weights["prefill"] == pytest.approx(0.02, rel=0.3)
    assert weights["queued"] == pytest.approx(1.0, rel=0.1)


def test_a_covariance_gone_indefinite_starts_again_from_the_prior() -> None:
    rng = random.Random(1)
    model = OnlineTtftModel()
    _train(model, _fleet, rng, 200)
    before = model.describe()
    # What rounding can do over a long run: a variance below zero.
    model._p[2][2] = -1.0
    features, ttft = _fleet(rng)
    model.observe(features.vector(), ttft)
    assert model.covariance_resets == 1
    assert all(model._p[i][i] > 0.0 for i in range(len(FEATURES)))
    assert model.describe()["prefill"] == pytest.approx(before["prefill"], rel=0.2)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="forgetting"):
        OnlineTtftModel(forgetting=1.5)
    with pytest.raises(ValueError, match=f"{len(FEATURES)} weights"):
        OnlineTtftModel(prior=(0.0,))


def test_it_follows_a_fleet_that_slows_down() -> None:
    """Every pod half as fast again (a busier fleet, a larger model loaded): within
    600 observations (the forgetting's memory is about 200) the fit has followed."""
    rng = random.Random(9)
    model = OnlineTtftModel()
    _train(model, _fleet, rng, 600)

    def slower(rng: random.Random) -> tuple[TtftFeatures, float]:
        features, ttft = _fleet(rng)
        return features, 1.5 * (ttft - features.queued_s) + features.queued_s

    _train(model, slower, rng, 600)
    assert model.describe()["prefill"] == pytest.approx(0.075, rel=0.1)
    errors = _errors(model, slower, rng, 200)
    assert errors[len(errors) // 2] < 0.05


def _idle(rng: random.Random) -> tuple[TtftFeatures, float]:
    """A request on a pod with nothing queued: `_fleet`'s truth, ±5%."""
    uncached = rng.randint(64, 4096)
    features = TtftFeatures(0.0, uncached, attention_pairs(uncached, 0), rng.randint(0, 40))
    ttft = 0.008 + 50e-6 * uncached + 0.5e-3 * features.decoding
    return features, ttft * rng.uniform(0.95, 1.05)


def _behind(rng: random.Random) -> tuple[TtftFeatures, float]:
    """A request queued seconds behind a pod in overload, its wait half or 1.6
    times what the queue says (a KV cache that frees blocks as requests end)."""
    features, ttft = _idle(rng)
    queued = rng.uniform(1.0, 5.0)
    features = TtftFeatures(
        queued, features.prefill_tokens, features.attention_pairs, features.decoding
    )
    return features, (ttft + queued) * rng.choice((0.5, 1.0, 1.6))


def _overload(rng: random.Random) -> tuple[TtftFeatures, float]:
    return _behind(rng) if rng.random() < 0.3 else _idle(rng)


@pytest.mark.parametrize("floor_s", [RELATIVE_FLOOR_S, 0.3])
def test_a_relative_fit_keeps_short_predictions_right_beside_long_noisy_waits(
    floor_s: float,
) -> None:
    """Three requests in ten wait seconds, with an error of a second either way that
    no feature explains. Weighted by the inverse of their prediction, those waits
    do not pull the weights the idle pods' requests are predicted with: their p90
    error stays at their own noise on every seed; unweighted, the fixed cost
    follows the waits' noise and on one seed in eight the p90 error is several
    times it. The same with the floor at 300 ms, above every idle pod's TTFT
    here (11-213 ms), so that those weigh alike: the waits of seconds still
    weigh a tenth of them or less."""
    worst = {}
    for relative in (False, True):
        p90s = []
        for seed in range(8):
            rng = random.Random(seed)
            model = OnlineTtftModel(relative=relative, relative_floor_s=floor_s)
            _train(model, _overload, rng, 600)
            errors = _errors(model, _idle, rng, 300)
            p90s.append(errors[int(0.9 * len(errors))])
            if relative:
                # Weighted alike, the idle requests' noise moves it a little more.
                rel = 0.1 if floor_s == RELATIVE_FLOOR_S else 0.15
                assert model.describe()["fixed"] == pytest.approx(0.008, rel=rel)
        worst[relative] = max(p90s)
    assert worst[True] < 0.05
    assert worst[False] > 0.1


def _symmetric_noise(rng: random.Random) -> tuple[TtftFeatures, float, float]:
    """A request, its true TTFT, and an observation up to 50% either side of it."""
    uncached = rng.randint(64, 4096)
    queued = rng.choice((0.0, rng.uniform(0.0, 0.5)))
    features = TtftFeatures(queued, uncached, attention_pairs(uncached, 0), rng.randint(0, 40))
    ttft = 0.008 + queued + 50e-6 * uncached + 0.5e-3 * features.decoding
    return features, ttft, ttft * rng.uniform(0.5, 1.5)


@pytest.mark.parametrize("floor_s", [RELATIVE_FLOOR_S, 0.3])
@pytest.mark.parametrize("seed", range(5))
def test_a_relative_fit_weighs_by_the_prediction_and_stays_unbiased(
    seed: int, floor_s: float
) -> None:
    """The weight comes from the prediction, not the observation: weighted by the
    observed TTFT, the observations that came out short would count more and
    predictions would run about 10% low on this noise (measured when written)."""
    rng = random.Random(seed)
    model = OnlineTtftModel(relative=True, relative_floor_s=floor_s)
    for _ in range(800):
        features, _, observed = _symmetric_noise(rng)
        model.observe(features.vector(), observed)
    ratios = []
    for _ in range(300):
        features, ttft, _ = _symmetric_noise(rng)
        ratios.append(model.predict(features.vector()) / ttft)
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("floor_s", [0.0, -0.1, float("nan"), float("inf")])
def test_a_relative_floor_that_is_not_a_positive_time_is_refused(floor_s: float) -> None:
    with pytest.raises(ValueError, match="relative_floor_s"):
        OnlineTtftModel(relative=True, relative_floor_s=floor_s)


def _jump_after_a_short_surprise(floor_s: float) -> float:
    """How far one observation twice its idle pod's true TTFT (a short prompt,
    about 11 ms) moves its own prediction, for a fit trained on idle pods' TTFTs
    of 11-213 ms with the relative floor at `floor_s`."""
    rng = random.Random(7)
    model = OnlineTtftModel(relative=True, relative_floor_s=floor_s)
    _train(model, _idle, rng, 400)
    features = TtftFeatures(0.0, 64, attention_pairs(64, 0), 0)
    x = features.vector()
    before = model.predict(x)
    model.observe(x, 2.0 * (0.008 + 50e-6 * 64))
    return model.predict(x) - before


def test_the_relative_floor_sets_how_far_short_ttfts_are_weighted_up() -> None:
    """At 10 ms a prediction of 11 ms weighs about twenty times one of 200 ms, so a
    surprise on it moves the fit far; with the floor at 300 ms, above every TTFT
    here, it weighs as much as any of them and moves the fit less; a floor above
    300 ms weighs every TTFT here alike as well, so it moves it as little."""
    at_10ms = _jump_after_a_short_surprise(0.01)
    at_300ms = _jump_after_a_short_surprise(0.3)
    at_1s = _jump_after_a_short_surprise(1.0)
    assert at_300ms > 0.0
    assert at_10ms > 1.5 * at_300ms  # 2.3 times when written
    assert at_1s == pytest.approx(at_300ms, rel=0.1)
