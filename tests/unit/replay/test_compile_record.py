"""torch_compile in the replay (probes.replay.step_changes): listed with the key that turns it
on where it is off; where on, each configuration (as it is, and the collator's
pad_to_multiple_of) measured on its own plan's shapes and priced over the trainer's run."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.replay import step_changes as rs
from probes.step import cold
from probes.step import compile as cp


def test_off_it_is_listed_with_the_key_that_turns_it_on():
    off = rs.compile_off(SimpleNamespace(compile=False), cpu_only=True)
    assert set(off) == {cp.COMPILE_STRATEGY, f"{cp.PAD_MULTIPLE_PREFIX}{rs.PAD_MULTIPLE}"}
    assert all(cp.ENABLE_KEY in why for why in off.values())
    assert rs.compile_off(SimpleNamespace(compile=True), cpu_only=True) == {}
    assert rs.compile_record(None, pd.DataFrame(), None, SimpleNamespace(compile=False)) == {}


class Collator:
    pad_to_multiple_of = None


def _plans(lengths: list[int]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "strategy": pl.BASELINE,
            "micro_batch_index": range(len(lengths)),
            "layout": pl.PADDED,
            "rows": 2,
            "padded_length": lengths,
            "computed_tokens": [2 * n for n in lengths],
        }
    )


def test_each_configuration_is_measured_on_its_own_shapes_over_the_trainers_run(monkeypatch):
    collator = Collator()
    seen: list[tuple[str, object]] = []  # (batch shape, the collator's multiple then)
    trainer = SimpleNamespace(args=SimpleNamespace(num_train_epochs=3, max_steps=-1))
    step = SimpleNamespace(trainer=trainer, collator=collator)
    runner = SimpleNamespace(runner=step, device_batch=lambda row: (row.rows, row.padded_length))

    def functions(s):
        def call(batch):
            seen.append((batch, collator.pad_to_multiple_of))

        return call, call

    monkeypatch.setattr(cp, "step_functions", functions)
    first = cold.FirstCompile(12.0, 8.0, 16.0, "measured (known)")
    monkeypatch.setattr(cold, "first_compile", lambda: first)
    plans = _plans([37, 50, 70, 37, 90, 100, 120, 130])  # 7 shapes; 3 padded to 64
    training = SimpleNamespace(grad_accum=2)
    # the table's baseline epoch estimate (micro-batches + optimizer steps) and its interval
    table = pd.DataFrame(
        {
            "strategy": [pl.BASELINE, "sorted"],
            "estimated_time_s": [40.0, 30.0],
            "ci_low_s": [36.0, 27.0],
            "ci_high_s": [48.0, 33.0],
        }
    )
    on = SimpleNamespace(compile=True)
    record = rs.compile_record(runner, plans, training, on, table)
    plain, padded = record[cp.COMPILE_STRATEGY], record[f"{cp.PAD_MULTIPLE_PREFIX}64"]
    assert plain["baseline_run_s"] == 3 * 40.0 and plain["baseline_run_s_high"] == 3 * 48.0
    assert plain["saving"] == pytest.approx(plain["saving_s"] / 120.0)
    assert plain["first_compile_s"] == 12.0 and padded["first_compile_s"] == 12.0
    # the fake compiles in no time: a second cold compile of the first shape was timed
    assert ": a second cold compile of the first shape" in plain["compile_spread_from"]
    no_table = rs.compile_record(runner, plans, training, on)[cp.COMPILE_STRATEGY]
    assert no_table["baseline_from"].startswith("eager")
    assert plain["shapes"] == 7 and plain["shapes_measured"] == rs.COMPILE_SHAPES
    assert padded["shapes"] == 3 and padded["shapes_measured"] == 3
    assert plain["run_micro_batches"] == 3 * len(plans)  # num_train_epochs of the trainer
    assert plain["memory"] == rs.COMPILE_MEMORY
    assert {m for b, m in seen if b[1] % 64} == {None} and {m for b, m in seen if b[1] == 128} == {
        64
    }
    assert collator.pad_to_multiple_of is None  # set back


def test_a_collator_without_pad_to_multiple_of_says_so():
    with rs.collator_padding(SimpleNamespace(collator=object()), 64) as why:
        assert "has no pad_to_multiple_of" in why
    with rs.collator_padding(SimpleNamespace(collator=None), 64) as why:
        assert why is None  # the harness path: its batches follow the rounded plan


def test_the_trainers_optim_alternatives_are_priced_beside_the_table(monkeypatch):
    from probes.step import optim

    picked = []
    trainer = SimpleNamespace(args=SimpleNamespace(optim="adamw_torch_fused"))
    runner = SimpleNamespace(
        runner=SimpleNamespace(trainer=trainer),
        device_batch=lambda row: picked.append(int(row.padded_length)) or row,
    )

    def turns(step, batch, names, pairs):
        assert names == ["adamw_torch"] and pairs == rs.OPTIM_TURNS
        own = [0.010, 0.011, 0.010, 0.012, 0.010]
        return {"micro_batch_s": [0.1] * 10, "adamw_torch_fused": own, "adamw_torch": [0.02] * 5}

    monkeypatch.setattr(optim, "installed_optims", lambda: ["adamw_torch", "adamw_torch_fused"])
    monkeypatch.setattr(optim, "time_optimizers", turns)
    cfg = SimpleNamespace(step_changes=True, compile=False)
    beside = rs.priced_beside(runner, _plans([37, 50, 70]), SimpleNamespace(grad_accum=2), cfg)
    assert beside["compile"] == {} and picked == [50]  # the median micro-batch
    priced = beside["optim"]["optim_adamw_torch"]
    assert priced["step_saving_s"] == pytest.approx(-0.01) and priced["saving_high"] < 0
    harness = SimpleNamespace(runner=SimpleNamespace(), device_batch=None)
    assert rs.optim_record(harness, _plans([37]), None, cfg) == {}

    def fails(step, batch, names, pairs):
        raise ValueError("this optimizer needs a package the run does not have")

    # an alternative the trainer cannot build or step is not priced, and the replay goes on
    monkeypatch.setattr(optim, "time_optimizers", fails)
    failed = rs.optim_record(runner, _plans([37]), SimpleNamespace(grad_accum=2), cfg)
    assert failed["optim_adamw_torch"]["saving"] is None
    assert failed["optim_adamw_torch"]["memory"].startswith("not priced: ValueError")
