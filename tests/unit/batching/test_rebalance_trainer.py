"""The batch_rebalance plan is what the user's own Trainer feeds under
``train_sampling_strategy="batch_rebalance"``: its ``get_train_dataloader()`` batch for batch."""

from __future__ import annotations

import pytest
import torch
from trainer_factories import write_factory

from conftest import chat_rows, write_jsonl
from probes.batching import plans as pl
from probes.batching import rebalance
from probes.contracts import BATCH_REBALANCE
from probes.padding import trainer_rows as tr
from probes.step.trainer import load_trainer_step, probe_settings

pytestmark = pytest.mark.skipif(
    rebalance.unavailable_reason() is not None, reason=str(rebalance.unavailable_reason())
)
# 26 rows in steps of 2 x 4: the last step holds 2 examples, fewer than grad_accum, so the
# sampler fills it with repeated ones
MICRO, ACCUM, ROWS = 2, 4, 26


@pytest.mark.parametrize("seed", [0, 5])  # the Trainer's args.seed does not move its shuffle
def test_the_batch_rebalance_plan_is_that_trainers_dataloader_batch_for_batch(
    tmp_path, tiny_model_dir, seed
):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(ROWS))
    spec = write_factory(tmp_path, tiny_model_dir, data, "sft", micro=MICRO, accum=ACCUM)
    extra = {"train_sampling_strategy": "batch_rebalance"}
    settings = probe_settings(
        str(tmp_path / "o"), torch.device("cpu"), torch.float32, None, seed, extra
    )
    step = load_trainer_step(spec, settings)
    loader = step.trainer.get_train_dataloader()
    theirs = [batch["input_ids"] for batch in loader]
    lengths = tr.lengths_table(step.trainer.train_dataset, None)
    examples = pl.PlanExamples(
        example_ids=lengths["example_id"].to_numpy(dtype=object),
        lengths=lengths["n_tokens"].to_numpy(),
        loss_tokens=lengths["n_loss_tokens"].to_numpy(),
    )
    plans = pl.build_plans(examples, MICRO, ACCUM, 128, 1, seed=seed)
    plan = plans[plans["strategy"] == BATCH_REBALANCE].sort_values("micro_batch_index")
    ours = [step.plan_batch(row)["input_ids"] for row in plan.itertuples()]
    assert len(ours) == len(theirs) == -(-ROWS // (MICRO * ACCUM)) * ACCUM
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert plan["rows"].max() > MICRO  # micro-batches of varying size, as the sampler makes them
    fed = [i for ids in plan["example_ids"] for i in ids]
    assert len(fed) == ROWS + ACCUM - ROWS % (MICRO * ACCUM)  # the tail's repeats
