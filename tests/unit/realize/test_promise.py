"""The per-step promise (probes.realize.promise): the replay's working model refitted on its
timed micro-batches, summed per optimizer step."""

import numpy as np
import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.realize.promise import step_promises
from probes.replay.timing import MICRO_BATCH


def plan(loss_tokens: list[int]) -> pd.DataFrame:
    n = len(loss_tokens)
    return pd.DataFrame(
        {
            "strategy": "random",
            "micro_batch_index": np.arange(n),
            "optimizer_step_index": np.arange(n) // 2,
            "layout": pl.PADDED,
            "rows": 2,
            "padded_length": np.arange(n) + 4,
            "computed_tokens": 2 * (np.arange(n) + 4),
            "loss_tokens": loss_tokens,
        }
    )


def test_a_column_the_timings_never_varied_is_read_at_their_value():
    # every timed micro-batch trains (has_loss 1, like the intercept): a micro-batch without a
    # loss token is promised the same fixed cost, not half of it
    timed = plan([3] * 8)
    units = timed.assign(kind=MICRO_BATCH, status="OK", time_s=0.0)
    units["time_s"] = 0.01 + 1e-3 * units["padded_length"]
    plans = plan([3, 0, 0, 0])
    promises = step_promises(plans, units)
    expected = 0.01 * 2 + 1e-3 * np.array([4 + 5, 6 + 7])
    assert promises.to_numpy() == pytest.approx(expected, rel=1e-6)


def test_without_timed_micro_batches_there_is_no_promise():
    units = plan([1, 1]).assign(kind=MICRO_BATCH, status="OOM", time_s=np.nan)
    assert step_promises(plan([1, 1]), units) is None
