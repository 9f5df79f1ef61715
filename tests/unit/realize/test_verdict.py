"""Promised vs realized: the verdict and what differed."""

import numpy as np
import pytest

from probes.realize.steps import phase_durations
from probes.realize.verdict import (
    AGREES,
    DISAGREES,
    UNDECIDED,
    Phases,
    phase_shares,
    promised_phases,
    rule_text,
    verdict,
    verdict_of,
    what_differed,
)


def test_agrees_only_inside_the_interval_and_within_5_pp():
    # without the realized interval: the point test alone (callers that lack the interval)
    assert verdict(0.20, 0.22, 0.15, 0.30) == AGREES
    assert verdict(0.14, 0.16, 0.15, 0.30) == DISAGREES  # outside the interval
    assert verdict(0.20, 0.28, 0.10, 0.40) == DISAGREES  # inside, but 8 pp off
    assert verdict(float("nan"), 0.2, 0.1, 0.3) == UNDECIDED  # a missing figure decides nothing


# promised 22% [15%, 30%]; the realized saving and its 95% interval vary
PROMISE = (0.22, 0.15, 0.30)


def _three_way(realized, low, high):
    return verdict(realized, *PROMISE, 0.05, realized_low=low, realized_high=high)


def test_agrees_on_a_narrow_realized_interval_near_the_promise():
    assert _three_way(0.20, 0.17, 0.23) == AGREES


def test_disagrees_when_the_realized_interval_excludes_the_promise():
    assert _three_way(0.05, 0.02, 0.08) == DISAGREES  # outside the promised interval
    assert _three_way(0.14, 0.13, 0.15) == DISAGREES  # outside it, and 8 pp off
    # 6 pp off but inside the promised interval: a promise 15 pp wide cannot be checked to 5 pp
    assert _three_way(0.16, 0.15, 0.17) == UNDECIDED


def test_a_promise_narrower_than_the_realized_spread_agrees_where_the_intervals_meet():
    # the bench's optimizer change: priced in alternating turns to a third of a point, realized
    # over whole epochs with a spread of a point or two (the realized point outside the promise)
    optim = (-0.005, -0.007, -0.004)
    assert verdict(-0.020, *optim, 0.05, realized_low=-0.038, realized_high=-0.001) == AGREES
    # the intervals apart: a real miss, however small
    assert verdict(0.010, *optim, 0.05, realized_low=0.002, realized_high=0.018) == DISAGREES
    # the intervals meet, but the realized saving is 6 pp off
    assert verdict(-0.065, *optim, 0.05, realized_low=-0.10, realized_high=0.0) == UNDECIDED


def test_disagrees_only_where_the_difference_is_outside_its_own_interval():
    # the trainer bench's padding-free eager: each interval rules out the other's point, but
    # 5.2 pp apart on half-widths of 4 and 5 pp is inside the difference's interval (6.4 pp)
    promise = (-0.200, -0.250, -0.150)
    assert verdict(-0.148, *promise, 0.05, realized_low=-0.188, realized_high=-0.108) == UNDECIDED
    assert verdict(-0.130, *promise, 0.05, realized_low=-0.170, realized_high=-0.090) == DISAGREES


def test_two_equal_savings_measured_equally_well_disagree_one_time_in_twenty():
    """Each side's interval ruling out the other's point called 17% of such pairs disagreeing."""
    rng = np.random.default_rng(0)
    half = 0.04  # both intervals +-4 pp: a standard error of 2.04 pp each
    se = half / 1.959964
    calls = [
        verdict(r, p, p - half, p + half, 0.05, realized_low=r - half, realized_high=r + half)
        for p, r in rng.normal(-0.15, se, size=(4000, 2))
    ]
    assert 0.035 < calls.count(DISAGREES) / len(calls) < 0.065


def test_undecided_when_the_realized_interval_holds_the_promise_but_is_too_wide():
    # the old "disagrees (but the realized interval holds the promise)": too few steps to tell
    assert _three_way(0.05, -0.10, 0.30) == UNDECIDED
    # near the promise, but on an interval 24 pp wide: consistent, not a check
    assert _three_way(0.21, 0.10, 0.34) == UNDECIDED


def test_verdict_of_reads_the_realize_table_columns():
    row = {
        "promised_saving": 0.22,
        "promised_saving_ci_low": 0.15,
        "promised_saving_ci_high": 0.30,
        "realized_saving": 0.05,
        "realized_saving_ci_low": -0.10,
        "realized_saving_ci_high": 0.30,
        "verdict": DISAGREES,  # the two-way reading a stage may still have written
        "note": "",
    }
    assert verdict_of(row) == UNDECIDED
    assert verdict_of({**row, "note": "1 sampled step(s) ran out of memory"}) == DISAGREES


def test_the_rule_names_each_word_once_with_the_tolerance():
    text = rule_text(0.05)
    assert all(text.count(f"**{w}**") == 1 for w in (AGREES, DISAGREES, UNDECIDED))
    assert "±5 pp" in text and "10 pp wide" in text


def test_promised_phases_split_the_replay_estimate():
    phases = promised_phases(10.0, 4, 0.5)
    assert (phases.micro_batch, phases.optimizer, phases.rest) == (8.0, 2.0, 0.0)
    assert promised_phases(10.0, 4, float("nan")).micro_batch == 10.0


def test_a_slower_optimizer_is_named_as_what_differed():
    promised_base, promised_change = Phases(8.0, 2.0, 0.0), Phases(6.0, 2.0, 0.0)
    realized_base, realized_change = Phases(8.0, 6.0, 0.1), Phases(6.0, 6.0, 0.1)
    shares = phase_shares(promised_change, promised_base, realized_change, realized_base)
    assert shares["optimizer"] < -5 and abs(shares["micro_batch"]) < 1e-9
    assert what_differed(shares).startswith("optimizer time -")
    assert "per-micro-batch" not in what_differed(shares)


def test_phase_durations_attribute_each_segment_to_the_mark_that_ends_it():
    marks = [("start", 0.0), ("built", 0.1), ("micro_batch", 1.1), ("built", 1.2)]
    marks += [("micro_batch", 2.2), ("optimizer", 2.7)]
    phases = phase_durations(marks)
    assert phases == pytest.approx({"micro_batch": 2.0, "optimizer": 0.5, "rest": 0.2})


def test_an_interval_with_a_bound_missing_is_too_wide_to_tell():
    from probes.realize.verdict import too_wide

    assert not too_wide(0.10, 0.18) and too_wide(0.10, 0.21)
    assert too_wide(float("nan"), 0.18) and too_wide(0.10, None) and too_wide(-np.inf, 0.0)
