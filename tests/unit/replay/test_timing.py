"""Replay's timing loop: units priced in the reference's seconds, so the machine's drift and
bursts of load cancel (probes.replay.reference)."""

import numpy as np
import pandas as pd
import pytest
import torch

from probes.replay.reference import Reference, in_reference_seconds, reference_factors
from probes.replay.timing import ReplaySettings, run_sample


def test_reference_factors_take_the_timings_just_before_and_after():
    marks = [(0, 1.0), (2, 2.0), (4, 4.0)]
    factors = reference_factors([0, 1, 2, 3, 4], marks, mean_s=1.0)
    assert factors.tolist() == pytest.approx([1 / 1.5, 1 / 1.5, 1 / 3.0, 1 / 3.0, 1 / 4.0])
    # a reference that failed (NaN) is skipped; none at all leaves the timings as they are
    assert reference_factors([1], [(0, np.nan), (2, 2.0)], 1.0).tolist() == [0.5]
    assert reference_factors([1], [], 1.0).tolist() == [1.0]
    assert in_reference_seconds([[3.0]], [[1]], marks, None) == [[3.0]]
    assert in_reference_seconds([[3.0], [2.0, 4.0]], [[1], [2, 3]], marks,
                                Reference(None, 2.0, 2)) == [[4.0], [4 / 3, 8 / 3]]  # fmt: skip


class DriftingRunner:
    """What run_sample needs of a ReplayRunner: each micro-batch costs its padded length in
    seconds times the machine's speed, which drifts (x1 to x1.6 over the run) and has a burst
    (x3 for a few timings); the reference costs 10 s at the same speed."""

    device = torch.device("cpu")
    repeats = 1
    reduce = staticmethod(np.median)

    def __init__(self, every: int) -> None:
        self.calls = 0
        self.reference = Reference(None, 10.0, every) if every else None

    def speed(self) -> float:
        self.calls += 1
        return (1.0 + 0.01 * self.calls) * (3.0 if 21 <= self.calls < 26 else 1.0)

    def warm_up(self, row) -> None:
        pass

    def warm_new_shapes(self, sample) -> int:
        return 0

    def time_reference(self) -> float:
        return 10.0 * self.speed()

    def time_micro_batch(self, row, busy=False):
        seconds = float(row.padded_length) * self.speed()
        return {"status": "OK", "time_s": seconds, "times_s": [seconds], "gpu_busy_share": np.nan}

    def time_optimizer_step(self) -> float:
        return 0.0


def test_units_in_reference_seconds_cancel_drift_and_bursts():
    sample = pd.DataFrame(
        {
            "strategy": "random",
            "stratum": 0,
            "padded_length": np.tile([4, 8, 16], 20),
            "computed_tokens": np.tile([8, 16, 32], 20),
        }
    )
    settings = ReplaySettings(1, 1, 10, grad_accum=4, warmup=0, busy_samples_per_stratum=0)
    exact = sample["padded_length"].to_numpy(float)
    raw, _ = run_sample(DriftingRunner(every=0), sample, settings)
    priced, _ = run_sample(DriftingRunner(every=1), sample, settings)
    raw_error = np.abs(raw["time_s"].to_numpy() / exact - 1)
    priced_error = np.abs(priced["time_s"].to_numpy() / exact - 1)
    assert raw_error.max() > 0.5  # drift and the burst, as timed
    # in the reference's seconds: the unit's own cost, but for the units at the burst's two
    # edges, whose references straddle it
    assert np.sort(priced_error)[-3] < 0.02 and priced_error.max() < 1.0
    assert priced["raw_times_s"].map(len).eq(1).all()
    wall = priced["raw_times_s"].map(lambda t: t[0]).to_numpy() / exact  # kept as timed
    assert wall[-1] / wall[0] > 1.5


def test_one_preempted_instrument_timing_is_left_out_of_its_cv():
    """The instrument's five timings from a quiet default run: one preempted (0.50 s against
    0.33 s) made its CV 20%; left out, 0.6%. A loaded machine's even spread (12%) and a busy
    one's (83%) keep every timing."""
    from probes.replay.timing import without_one_outlier

    quiet = np.array([0.3286, 0.3305, 0.3333, 0.3323, 0.4962])
    kept, left_out = without_one_outlier(quiet)
    assert left_out == pytest.approx(0.4962) and kept.size == 4
    assert kept.std(ddof=1) / kept.mean() < 0.01 < 0.2 < quiet.std(ddof=1) / quiet.mean()
    for even in ([0.452, 0.472, 0.551, 0.563, 0.6], [4.605, 9.903, 1.664, 2.973, 15.673]):
        kept, left_out = without_one_outlier(np.array(even))
        assert left_out is None and kept.size == 5
    assert without_one_outlier(np.array([0.3, 0.9]))[1] is None  # too few to tell
