"""Realize's estimate: SRS of optimizer steps scaled to the epoch, and the saving's interval."""

import numpy as np
import pytest

from probes.realize.sample import epoch_estimate, sample_steps, saving_estimate, t_quantile


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
    assert estimate.high_s - estimate.total_s == pytest.approx(t_quantile(3) * se)
    assert t_quantile(3) == pytest.approx(3.182) and t_quantile(500) == pytest.approx(1.96, 1e-3)


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
    assert wild.low_s == 0.0 < wild.total_s < wild.high_s
    _, _, high = saving_estimate(wild, epoch_estimate([5.0, 5.1], 100))
    assert high <= 1.0
