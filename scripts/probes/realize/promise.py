"""What the replay promised for every optimizer step: the auxiliary realize scales its sample by.

The replay's working model (probes.replay.estimate: 1, rows·T, rows·T², loss tokens, has a loss
token), refitted on the replay's own timed micro-batches (its ``steps`` output, exactly the units
its estimator fitted), predicts every micro-batch of every plan; a step's promise is the sum over
its ``grad_accum`` micro-batches (the rest of a step, its optimizer above all, is the same every
step: realize estimates it by its mean). It is known for every step
of the epoch, sampled or not, and follows what a step costs far more closely than its token count
(a micro-batch's fixed cost, the quadratic term, the LM head skipped where nothing is labelled):
on the default CPU run a step's realized time was within 2% of its promise, against a spread of
tens of percent across steps.
"""

from __future__ import annotations

import pandas as pd

from probes.replay.greg import auxiliaries, fit_working_model
from probes.replay.timing import MICRO_BATCH
from probes.step.timing import OK

STEP_KEY = ["strategy", "optimizer_step_index"]


def step_promises(plans: pd.DataFrame, units: pd.DataFrame) -> pd.Series | None:
    """The promised seconds of every optimizer step's micro-batches, indexed by (strategy,
    optimizer_step_index), from the replay's timed `units`; None when the replay timed no
    micro-batch (nothing to fit)."""
    micro = units[(units["status"] == OK) & (units["kind"] == MICRO_BATCH)]
    if micro.empty:
        return None
    timed = auxiliaries(micro)
    model, _ = fit_working_model(timed, micro["time_s"].to_numpy(float))
    every = auxiliaries(plans)
    # a column the timed micro-batches never vary (each of them trains: has_loss is 1 like the
    # intercept) is not identified: the minimum-norm fit splits the intercept over the two, so a
    # micro-batch without a loss token would be promised half of it. Such a column is read at
    # the one value the timings saw.
    fixed = timed.min(axis=0) == timed.max(axis=0)
    every[:, fixed] = timed[0, fixed]
    per_micro_batch = pd.Series(model.predict(every), index=plans.index)
    return per_micro_batch.groupby([plans[k] for k in STEP_KEY]).sum()
