"""Realize's estimate: SRS of optimizer steps scaled to the epoch, and the saving's interval."""

import numpy as np
import pytest

from probes.realize.sample import (
    epoch_estimate,
    pooled_residual,
    sample_steps,
    saving_estimate,
)


def test_sample_is_without_replacement_in_epoch_order_and_all_when_small():
    picked = sample_steps(50, 10, np.random.default_rng(0))
    assert len(set(picked)) == 10 and list(picked) == sorted(picked)
    assert list(sample_steps(4, 10, np.random.default_rng(0))) == [0, 1, 2, 3]


def test_all_steps_sampled_is_the_exact_epoch_time():
    estimate = epoch_estimate([1.0, 2.0, 3.0], 3)
    assert estimate.total_s == 6.0 and estimate.low_s == estimate.high_s == 6.0


def test_interval_uses_finite_population_correction_and_t():
    times = [1.0, 2.0, 3.0, 4.0]
    estimate = epoch_estimate(times, 8)
    se = 8 * np.sqrt((1 - 4 / 8) * np.var(times, ddof=1) / 4)
    assert estimate.total_s == pytest.approx(20.0)
    # on the log scale: total × exp(±t·se/total), t with n − 1 = 3 df
    half = 3.182 * se / 20.0
    assert estimate.high_s == pytest.approx(20.0 * np.exp(half), rel=1e-3)
    assert estimate.low_s == pytest.approx(20.0 * np.exp(-half), rel=1e-3)


def test_an_epoch_interval_from_two_steps_never_reaches_zero():
    """Two steps 10x apart: a linear t interval (t = 12.7) reaches far below 0, so it was cut at
    0 s ('104 min [0 s, 3.99 h]' on the command-script run); an epoch takes a positive time."""
    estimate = epoch_estimate([1.0, 10.0], 100)
    assert estimate.total_s - 12.706 * estimate.se_s < 0  # where the linear one would be
    assert 0 < estimate.low_s < estimate.total_s < estimate.high_s


def test_srs_interval_covers_the_epoch_total_about_95_percent_of_the_time():
    rng = np.random.default_rng(3)
    population = rng.gamma(2.0, 1.0, size=200)
    truth = population.sum()
    covered = 0
    for _ in range(400):
        idx = sample_steps(200, 20, rng)
        estimate = epoch_estimate(population[idx], 200)
        covered += estimate.low_s <= truth <= estimate.high_s
    assert 0.90 <= covered / 400 <= 0.99


def test_saving_of_exact_estimates_is_exact_and_sampled_ones_have_an_interval():
    exact = saving_estimate(epoch_estimate([1.0, 1.0], 2), epoch_estimate([2.0, 2.0], 2))
    assert exact == (0.5, 0.5, 0.5)
    saving, low, high = saving_estimate(
        epoch_estimate([1.0, 1.2, 0.8], 10), epoch_estimate([2.0, 2.2, 1.8], 10)
    )
    assert low < saving < high and saving == pytest.approx(0.5)


def test_intervals_stay_inside_what_a_time_and_a_saving_can_be():
    wild = epoch_estimate([0.1, 10.0], 100)
    assert 0.0 < wild.low_s < wild.total_s < wild.high_s
    _, low, high = saving_estimate(wild, epoch_estimate([5.0, 5.1], 100))
    assert low < high < 1.0


def promised_epochs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per strategy, every step's promise: a random order (sizes alike), a sorted one (tiny to
    full, 10x apart), a packed one (all full)."""
    return {
        "random": rng.uniform(4.0, 7.0, 120),
        "sorted": np.linspace(0.7, 7.0, 120),
        "packed": np.full(70, 6.5) + rng.uniform(-0.2, 0.2, 70),
    }


def coverage_of_pooled_ratio(steps: int, noise: dict[str, float], seed: int = 0):
    """Share of 95% intervals (epoch time per strategy; saving of `sorted`) that cover the
    truth, and the saving interval's median width, when each step's time is its promise × a
    realization factor (0.9: the promise 10% slow) × (1 + noise·z)."""
    rng = np.random.default_rng(seed)
    promise = promised_epochs(rng)
    hits = dict.fromkeys([*promise, "saving"], 0)
    widths, replications = [], 400
    for _ in range(replications):
        times = {
            k: 0.9 * p * (1 + noise[k] * rng.standard_normal(p.size)) for k, p in promise.items()
        }
        picked = {k: sample_steps(p.size, steps, rng) for k, p in promise.items()}
        samples = {k: (times[k][picked[k]], promise[k][picked[k]]) for k in promise}
        pooled = pooled_residual(samples.values())
        est = {
            k: epoch_estimate(samples[k][0], promise[k].size, samples[k][1], promise[k], pooled)
            for k in promise
        }
        for k in promise:
            hits[k] += est[k].low_s <= times[k].sum() <= est[k].high_s
        _, low, high = saving_estimate(est["sorted"], est["random"])
        hits["saving"] += low <= 1 - times["sorted"].sum() / times["random"].sum() <= high
        widths.append(high - low)
    return {k: v / replications for k, v in hits.items()}, float(np.median(widths))


def test_two_steps_against_the_promise_give_a_narrow_interval_that_covers():
    # 2% per-step noise, the default CPU run's realized/promised spread
    coverage, width = coverage_of_pooled_ratio(
        2, dict.fromkeys(["random", "sorted", "packed"], 0.02)
    )
    assert all(0.9 <= c <= 0.995 for c in coverage.values()), coverage
    assert width < 0.15  # the step-size ratio with its own 1 df: ~0.6 (64 pp on the default run)


def test_a_strategy_noisier_than_the_pool_keeps_its_own_spread():
    noise = {"random": 0.01, "sorted": 0.06, "packed": 0.01}
    coverage, _ = coverage_of_pooled_ratio(6, noise)
    assert coverage["sorted"] >= 0.9, coverage


def test_the_pooled_residual_needs_a_degree_of_freedom():
    assert pooled_residual([([1.0], [1.0]), ([2.0], [2.0])]) is None
    pooled = pooled_residual([([1.0, 1.1], [1.0, 1.0]), ([2.0, 2.0], [2.0, 2.0])])
    assert pooled.df == 2 and pooled.variance > 0


def test_a_phase_that_takes_no_time_has_no_spread():
    pooled = pooled_residual([([0.0, 0.0], [1.0, 1.0]), ([1.0, 1.2], [1.0, 1.0])])
    assert pooled.df == 2 and np.isfinite(pooled.variance)
    none = epoch_estimate([0.0, 0.0], 10, [1.0, 1.0], np.ones(10), pooled)
    assert none.total_s == 0.0 and np.isfinite(none.high_s)
