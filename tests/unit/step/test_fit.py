"""The scaling fit t(T) = aT^2 + bT + c and its positive control."""

import math

import pytest

from probes.step.fit import fit_control, fit_step_time, term_shares


def times(a, b, c, lengths):
    return [a * t * t + b * t + c for t in lengths]


def test_three_points_are_fitted_exactly():
    lengths = [4096, 8192, 16384]
    fit = fit_step_time(lengths, times(3e-9, 2e-5, 0.04, lengths))
    assert fit.method == "exact"
    assert fit.a == pytest.approx(3e-9, rel=1e-9)
    assert fit.b == pytest.approx(2e-5, rel=1e-9)
    assert fit.c == pytest.approx(0.04, rel=1e-9)
    assert math.isnan(fit.residual_rms_s)  # three points leave nothing to judge the model by
    assert 1 < fit.condition_number < 1e3  # column scaling keeps it readable


def test_more_points_use_least_squares_and_report_residuals():
    lengths = [1024, 2048, 4096, 8192, 16384]
    noisy = [t * (1 + (-1) ** i * 0.02) for i, t in enumerate(times(3e-9, 2e-5, 0.04, lengths))]
    fit = fit_step_time(lengths, noisy)
    assert fit.method == "least_squares"
    assert fit.residual_rms_s > 0 and len(fit.residuals_s) == 5
    assert 0 < fit.max_rel_residual < 0.1
    assert fit.a == pytest.approx(3e-9, rel=0.2)


@pytest.mark.parametrize("lengths", [[], [512], [512, 1024], [512, 512, 1024]])
def test_fewer_than_three_lengths_are_refused_not_fitted(lengths):
    fit = fit_step_time(lengths, [1.0] * len(lengths))
    assert fit.method == "insufficient_points"
    assert not fit.usable
    assert math.isnan(fit.a)
    assert "needs >= 3" in fit.message


def test_term_shares_add_up_for_an_exact_fit():
    lengths = [128, 256, 512]
    measured = times(1e-6, 1e-4, 0.01, lengths)
    fit = fit_step_time(lengths, measured)
    shares = term_shares(fit, 512, measured[-1])
    total = shares["quadratic_share"] + shares["linear_share"] + shares["fixed_share"]
    assert total == pytest.approx(1.0)
    assert shares["quadratic_share"] == pytest.approx(1e-6 * 512**2 / measured[-1])


@pytest.mark.parametrize("lengths", [[128, 256, 512], [4096, 8192, 16384], [16, 24, 32]])
def test_fit_control_recovers_known_coefficients(lengths):
    control = fit_control(lengths)
    assert control["passed"] is True
    assert set(control) >= {"name", "description", "expected", "observed", "passed"}
    assert control["observed"]["exact"]["rel_error"] < 1e-6
