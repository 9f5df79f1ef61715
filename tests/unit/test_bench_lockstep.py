"""bench/realized_lockstep.py: real Trainers in forked processes take turns step by step; each
epoch's time is its own turns'; a configuration that fails is named."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import realized_lockstep as ls  # noqa: E402
from realized_epochs import collate  # noqa: E402
from realized_setup import build_model  # noqa: E402


def rows(n: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [3 + i % 7] * 8, "labels": [3 + i % 7] * 8} for i in range(n)]


def tiny_trainer(micro_batch: int, stack, workers: int = 0) -> transformers.Trainer:
    import tempfile

    out = stack.enter_context(tempfile.TemporaryDirectory())
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=micro_batch,
        num_train_epochs=1,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=workers,
    )
    return transformers.Trainer(
        model=build_model(16, 16), args=args, train_dataset=rows(8), data_collator=collate
    )


def test_the_turn_goes_to_the_configuration_furthest_behind():
    assert ls.next_turn({0: 0.5, 1: 0.2, 2: 0.2}) == 1
    assert ls.next_turn({3: 0.0}) == 3


def test_each_trainer_runs_its_whole_epoch_timed_by_its_own_turns():
    torch.set_num_threads(1)
    # one with a dataloader worker: a configuration's process may start its own
    runs = ls.lockstep_rounds(
        [("two", (2, 1)), ("four", (4, 0))],
        lambda _, what, stack: tiny_trainer(what[0], stack, workers=what[1]),
        repeats=2,
    )
    assert [r["optimizer_steps"] for r in runs["two"]] == [4, 4]
    assert [r["optimizer_steps"] for r in runs["four"]] == [2, 2]
    assert all(r["train_runtime"] > 0 for results in runs.values() for r in results)


def test_a_configuration_that_fails_is_named():
    def build(stack):
        raise ValueError("the factory refused")

    with pytest.raises(RuntimeError, match="refusing: failed before its epoch.*refused"):
        ls.lockstep_round([("fine", lambda stack: tiny_trainer(2, stack)), ("refusing", build)])


def test_extra_rounds_time_the_baseline_and_the_changes_still_too_wide():
    torch.set_num_threads(1)
    asked = []

    def too_wide(runs):
        asked.append({n: len(r) for n, r in runs.items()})
        return ["four"] if len(asked) == 1 else []

    runs = ls.rounds_until_narrow(
        [("base", 2), ("two", 2), ("four", 4)],
        lambda _, micro_batch, stack: tiny_trainer(micro_batch, stack),
        repeats=2,
        too_wide=too_wide,
        extra_rounds=3,
    )
    assert asked == [{"base": 2, "two": 2, "four": 2}, {"base": 3, "two": 2, "four": 3}]
    assert [r["round"] for r in runs["four"]] == [0, 1, 2]
    assert [r["round"] for r in runs["two"]] == [0, 1]
