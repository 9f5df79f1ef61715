"""Promised vs realized: the verdict and what differed."""

import pytest

from probes.realize.steps import phase_durations
from probes.realize.verdict import (
    AGREES,
    DISAGREES,
    Phases,
    phase_shares,
    promised_phases,
    verdict,
    what_differed,
)


def test_agrees_only_inside_the_interval_and_within_5_pp():
    assert verdict(0.20, 0.22, 0.15, 0.30) == AGREES
    assert verdict(0.14, 0.16, 0.15, 0.30) == DISAGREES  # outside the interval
    assert verdict(0.20, 0.28, 0.10, 0.40) == DISAGREES  # inside, but 8 pp off
    assert verdict(float("nan"), 0.2, 0.1, 0.3) == DISAGREES


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
