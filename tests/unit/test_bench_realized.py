"""bench/realized_vs_promised.py judges each change by the stage's three-way rule, with a
realized interval from its rounds; no epoch is run here."""

import importlib.util
import sys

import numpy as np

from conftest import REPO


def bench_module():
    sys.path.insert(0, str(REPO / "bench"))
    path = REPO / "bench" / "realized_vs_promised.py"
    spec = importlib.util.spec_from_file_location("realized_vs_promised", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_change_gets_the_three_way_verdict_with_its_realized_interval():
    bench = bench_module()
    base = np.array([10.0, 10.4, 10.1, 9.9])
    document = {
        "changes": [
            {"id": "close", "measured_saving": 0.1, "saving_ci_low": 0.07, "saving_ci_high": 0.13},
            {"id": "far", "measured_saving": 0.3, "saving_ci_low": 0.25, "saving_ci_high": 0.35},
        ]
    }
    rounds = {
        "random": base,
        "close": base * np.array([0.9, 0.905, 0.895, 0.9]),
        "far": base * np.array([0.9, 0.91, 0.89, 0.9]),
    }
    runs = {
        name: [{"train_runtime": float(t), "optimizer_steps": 10} for t in times]
        for name, times in rounds.items()
    }
    import pandas as pd

    estimates = pd.DataFrame({"strategy": ["random"], "estimated_time_s": [10.0]})
    rows = {r["change"]: r for r in bench.table_rows(document, estimates, runs)}
    assert rows["close"]["verdict"] == "agrees"
    assert rows["close"]["realized_low"] < 0.1 < rows["close"]["realized_high"]
    assert rows["far"]["verdict"] == "disagrees"  # realized 10%, its interval excludes 30%
    two = {n: r[:2] for n, r in runs.items()}
    factors = (1.0, 1.3)
    wide = {
        n: [{**r, "train_runtime": r["train_runtime"] * f} for r, f in zip(v, factors, strict=True)]
        for n, v in two.items()
        if n != "random"
    }
    wide["random"] = two["random"]
    rows = {r["change"]: r for r in bench.table_rows(document, estimates, wide)}
    assert rows["close"]["verdict"] == "undecided"  # two rounds that disagree: too wide to tell
    text = bench.markdown(list(rows.values()), "header")
    assert "0 agree, 0 disagree, 2 undecided of 2. Undecided: close (2 rounds), far (2" in text


def test_extra_rounds_pair_with_the_baseline_of_the_same_round():
    bench = bench_module()
    import realized_table as rt

    def run(times, rounds):
        return [
            {"train_runtime": t, "optimizer_steps": 10, "round": r}
            for t, r in zip(times, rounds, strict=True)
        ]

    # the baseline ran rounds 0-5; "wide" had extra rounds 4 and 5, "done" only rounds 0-3
    base = [10.0, 12.0, 10.0, 12.0, 20.0, 10.0]
    runs = {
        "random": run(base, range(6)),
        "done": run([9.0, 10.8, 9.0, 10.8], range(4)),
        "wide": run([9.0, 9.0, 11.0, 11.0, 18.0, 9.0], range(6)),
    }
    times, base_times = rt.paired_times(runs["done"], runs["random"])
    assert list(base_times) == base[:4]  # not the extra rounds' baseline epochs
    low, high = rt.realized_interval(times, base_times)
    assert abs(low - 0.1) < 1e-9 and abs(high - 0.1) < 1e-9  # the same 10% every round
    assert rt.too_wide_changes(runs) == ["wide"]
    document = {"changes": [{"id": "done", "measured_saving": 0.1, "saving_ci_low": 0.08,
                             "saving_ci_high": 0.12}]}  # fmt: skip
    import pandas as pd

    estimates = pd.DataFrame({"strategy": ["random"], "estimated_time_s": [10.0]})
    rows = {r["change"]: r for r in bench.table_rows(document, estimates, runs)}
    assert abs(rows["done"]["realized"] - 0.1) < 1e-9


def test_the_mask_gate_runs_in_a_child_and_leaves_this_process_allocator_alone(
    tmp_path, monkeypatch
):
    """The gate's heap setting fixes glibc's thresholds for the rest of the process it runs in
    (probes.mask.memory). Run in the bench's own process, the replay and the trainers forked
    from it paid page faults on every large block: micro_batch_size_4 promised at -17% where
    it costs -2%. The gate still answers."""
    import contextlib
    import os

    from probes.mask import verdict

    bench = bench_module()
    entered = tmp_path / "heap_setting_pid"
    real = verdict.reuse_freed_memory

    @contextlib.contextmanager
    def recording(enabled=True):
        entered.write_text(str(os.getpid()))
        with real(enabled) as applied:
            yield applied

    monkeypatch.setattr(verdict, "reuse_freed_memory", recording)
    model_dir = tmp_path / "model"
    bench.build_model(64, 32).save_pretrained(model_dir)
    monkeypatch.setattr(sys, "argv", ["realized_vs_promised.py", "--trainer", "sft", "--cap", "64"])
    bench.write_gate(tmp_path, model_dir, bench.parse_args("the bench"))
    assert int(entered.read_text()) != os.getpid(), "the gate's heap setting ran in this process"
    assert (tmp_path / "gate.json").is_file()
