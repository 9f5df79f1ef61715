"""The combined configuration: chosen from the priced table, measured as one strategy, and its
exact saving (the known-cost trainer's) inside its interval."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.io import write_parquet
from probes.step import changes as sc
from probes.step import combined as cb
from unit.replay.test_replay import ACCUM, MICRO
from unit.replay.test_trainer_replay import exact_epochs_s, known_cost_replay

BASE = sc.StepConfig(gradient_checkpointing=False, attn_implementation="sdpa")


def _table(
    savings: dict[str, float], invalid: tuple[str, ...] = (), half_width: float = 0.03
) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "strategy": list(savings),
            "saving_vs_random": list(savings.values()),
            "saving_ci_low": [v - half_width if v else 0.0 for v in savings.values()],
            "valid": [name not in invalid for name in savings],
        }
    )


def test_choose_takes_the_best_batching_and_the_best_change_per_setting():
    changes = sc.step_changes(BASE, MICRO, ACCUM)
    assert "padding_free_eager" in {c.strategy for c in changes}
    table = _table(
        {
            pl.BASELINE: 0.0,
            "length_grouped": 0.20,
            "packing": 0.30,  # invalid: the gate refused it
            "global_sort": 0.10,
            sc.GC_ON: -0.3,
            "attention_eager": 0.05,
            "micro_batch_size_4": 0.08,
            "padding_free_eager": 0.5,  # its own flattened plan: it cannot stack on another
        },
        invalid=("packing",),
    )
    chosen = cb.choose(table, BASE, changes)
    assert chosen == cb.Combination("length_grouped", ("micro_batch_size_4", "attention_eager"))
    assert chosen.name == "length_grouped+micro_batch_size_4+attention_eager"
    assert cb.parse(chosen.name) == chosen
    merged = cb.merged_config(BASE, [c for c in changes if c.strategy in chosen.steps])
    assert merged == sc.StepConfig(False, "eager")
    assert cb.micro_shape(changes, MICRO, ACCUM) == (2 * MICRO, ACCUM // 2)


def test_nothing_is_combined_without_a_saving_on_both_sides():
    changes = sc.step_changes(BASE, MICRO, ACCUM)
    assert cb.choose(_table({pl.BASELINE: 0.0, "length_grouped": 0.2}), BASE, changes) is None
    no_batching = _table({pl.BASELINE: 0.0, "length_grouped": -0.1, "attention_eager": 0.1})
    assert cb.choose(no_batching, BASE, changes) is None


def test_savings_whose_intervals_include_zero_are_not_combined():
    """A positive point estimate is not a measured saving: the report recommends neither."""
    changes = sc.step_changes(BASE, MICRO, ACCUM)
    savings = {pl.BASELINE: 0.0, "length_grouped": 0.2, "attention_eager": 0.05}
    assert cb.choose(_table(savings), BASE, changes) is not None
    assert cb.choose(_table(savings, half_width=0.1), BASE, changes) is None  # eager's includes 0
    wide = {**savings, "attention_eager": 0.5}
    assert cb.choose(_table(wide, half_width=0.3), BASE, changes) is None  # grouping's includes 0


@pytest.mark.slow
def test_the_combinations_exact_saving_lies_inside_its_interval(tmp_path, tiny_model_dir):
    # eager attention saves a known 5 ms per micro-batch here (it joins the best batching when
    # the replay measures that saving; the exact saving below follows what was chosen)
    eager_s = -0.005
    run = known_cost_replay(tmp_path, tiny_model_dir, eager_s=eager_s, combined_budget_s=4.0)
    plans, lengths, outputs = run.plans, run.lengths, run.outputs
    table = pd.read_parquet(outputs["estimates"]).set_index("strategy")
    combined = [name for name in table.index if cb.is_combined(name)]
    assert len(combined) == 1, table.index.tolist()
    parts = cb.parse(combined[0])
    micro, accum = (
        (2 * MICRO, ACCUM // 2) if any(s.startswith("micro_batch") for s in parts.steps)
        else (MICRO, ACCUM)
    )  # fmt: skip
    built = pl.build_plans(pl.read_examples(lengths, 128), micro, accum, 128, 4)
    # the known cost plus the trainer's own, measured (test_trainer_replay.trainer_own_cost)
    eager = eager_s if "attention_eager" in parts.steps else 0.0
    baseline_s = exact_epochs_s(run, plans, ACCUM)[pl.BASELINE]
    combined_s = exact_epochs_s(run, built, accum, extra_s=eager)[parts.batching]
    exact = 1.0 - combined_s / baseline_s
    row = table.loc[combined[0]]
    print(combined[0], exact, row["saving_ci_low"], row["saving_ci_high"])
    assert row["saving_ci_low"] - 0.02 <= exact <= row["saving_ci_high"] + 0.02
    control = json.loads(outputs["control"].read_text())
    assert control["combined"]["measured"] and control["combined"]["strategy"] == combined[0]
    steps = pd.read_parquet(outputs["steps"])
    assert (steps["strategy"] == combined[0]).sum() > 0
    # realize runs the combination as one: its plan and its step rebuilt from its name
    realized = realize_combined(tmp_path, run, combined[0])
    row = realized.set_index("strategy").loc[combined[0]]
    assert row["realized_saving_ci_low"] - 0.05 <= exact <= row["realized_saving_ci_high"] + 0.05
    # its micro-batches cost what the replay promised: the plan and the step were the same
    assert abs(row["diff_micro_batch_pp"]) < 15


def realize_combined(tmp_path, run, name: str) -> pd.DataFrame:
    """The realize stage on the replay's outputs, the combination the one change it checks."""
    from conftest import workflow_config
    from probes.realize import stage as rz

    estimates = pd.read_parquet(run.outputs["estimates"])
    estimates = estimates[estimates["strategy"].isin([pl.BASELINE, name])]
    only = tmp_path / "estimates_combined.parquet"
    write_parquet(estimates, only, {})
    sections = {k: run.config[k] for k in ("replay", "profile", "training", "trainer")}
    realize = {"cpu_max_changes": 1, "cpu_sample_steps": 2, "cpu_budget_s": 0}
    inputs = {
        "estimates": only, "units": run.outputs["steps"], "plans": run.inputs["plans"],
        "lengths": run.lengths, "recommendation": run.inputs["recommendation"],
    }  # fmt: skip
    outputs = {k: tmp_path / "realize" / k for k in rz.OUTPUT_KEYS}
    rz.run_realize(inputs, outputs, workflow_config(**sections, realize=realize), tmp_path)
    return pd.read_parquet(outputs["realized"])


def test_a_race_that_spent_the_combined_budget_leaves_it_unmeasured():
    """The combined configuration's budget is inside the stage's: a race that ran past its own
    share by that much leaves it none (on a slowing host the rule took 149 s of its 120 s),
    and the record says which key buys it; a smaller overrun only shortens it."""
    from types import SimpleNamespace

    from conftest import workflow_config
    from probes.replay.combined import time_combined
    from probes.replay.prepare import stage_settings

    cfg = workflow_config()
    plan = SimpleNamespace(cpu_only=True, stage=stage_settings(cfg.replay, 2, 64, cpu_only=True))
    spent = cfg.replay.cpu.combined_budget_s + 0.5
    result = time_combined(None, plan, pd.DataFrame(), [], {}, cfg, None, (0.0, 1.0), (1.0, 1.0),
                           False, overrun_s=spent)  # fmt: skip
    assert result.record["measured"] is False
    assert "spent the replay's budget" in result.record["why"]
    assert "`replay.cpu.budget_s`" in result.record["why"]
    # within its budget the check passes on to the next (here: no runner to switch configs)
    short = time_combined(None, plan, pd.DataFrame(), [], {}, cfg, None, (0.0, 1.0), (1.0, 1.0),
                          False, overrun_s=1.0)  # fmt: skip
    assert short.record["why"] == "no step-level change was priced"
