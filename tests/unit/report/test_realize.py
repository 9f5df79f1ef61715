"""The report's promised vs realized (probes.report.sections.realize), on the fixture results."""

from __future__ import annotations

import pytest
from stage_fixtures import NOT_RUN_REASON, write_results

from probes.report import load
from probes.report.sections.realize import realize_section


def _section(tmp_path, **kwargs):
    inputs = load.load_inputs(write_results(tmp_path, **kwargs))
    return realize_section(inputs["tables"], inputs["json"], inputs["not_run"])


def test_baseline_first_then_the_checked_change_with_its_verdict(tmp_path):
    realize = _section(tmp_path)
    assert realize["status"] == "ok" and realize["checked"] == 1
    base, change = realize["rows"]
    assert base["baseline"] and base["strategy"] == "random"
    assert change["strategy"] == "packing" and change["verdict"] == "agrees"
    assert change["promised_saving_ci_low"] <= change["realized_saving"]
    assert change["realized_saving"] <= change["promised_saving_ci_high"]
    assert realize["disagrees"] == [] and realize["undecided"] == []
    assert realize["agrees"] == [change["title"]]
    assert realize["by_strategy"]["packing"]["verdict"] == "agrees"
    inside = change["realized_saving_ci_low"] <= change["promised_saving"]
    inside &= change["promised_saving"] <= change["realized_saving_ci_high"]
    assert change["promise_in_realized_interval"] is bool(inside)


def test_a_disagreement_is_listed_with_what_differed(tmp_path):
    realize = _section(tmp_path, failed=("realize_verdict",))
    assert realize["disagrees_strategies"] == ["packing"]
    # the fixture's realized optimizer is 10x slower; its sign against the baseline's share
    # follows the plans' step counts (packing keeps tokens per update: about random's steps)
    assert realize["rows"][1]["differed"].startswith("optimizer time ")


def test_not_run_carries_the_reason(tmp_path):
    assert _section(tmp_path, profile="not_run") == {"status": "not_run", "reason": NOT_RUN_REASON}


def test_an_epoch_time_outside_the_promise_is_said_beside_agreeing_savings():
    from probes.report.sections.realize import epoch_disagreement

    base = {
        "realized_time_s": 120.0,
        "realized_ci_low_s": 115.0,
        "realized_ci_high_s": 125.0,
        "promised_time_s": 100.0,
        "promised_ci_low_s": 97.0,
        "promised_ci_high_s": 103.0,
    }
    assert epoch_disagreement(base) == {"ratio": 1.2}
    assert epoch_disagreement({**base, "realized_ci_low_s": 102.0}) is None  # they overlap
    assert epoch_disagreement(None) is None


def test_an_agreement_on_a_wide_realized_interval_says_it_is_no_tight_check():
    from probes.report.sections.realize import wide_interval_pp

    change = {"baseline": False, "realized_saving_ci_low": 0.10, "realized_saving_ci_high": 0.34}
    assert wide_interval_pp(change, 0.05) == pytest.approx(24.0)
    assert wide_interval_pp({**change, "realized_saving_ci_high": 0.18}, 0.05) is None
    assert wide_interval_pp({**change, "baseline": True}, 0.05) is None


def test_a_realized_interval_that_holds_the_promise_but_is_too_wide_is_undecided(tmp_path):
    """The old "disagrees (but the realized interval holds the promise)" reads undecided, with
    the setting that buys more steps, whatever two-way word the stage wrote."""
    import pandas as pd

    paths = write_results(tmp_path)
    frame = pd.read_parquet(paths["realize_realized"])
    change = frame["role"] == "change"
    promised = float(frame.loc[change, "promised_saving"].iloc[0])
    frame.loc[change, "realized_saving"] = promised - 0.12
    frame.loc[change, "realized_saving_ci_low"] = promised - 0.30
    frame.loc[change, "realized_saving_ci_high"] = promised + 0.06
    frame.loc[change, "verdict"] = "disagrees"
    frame.to_parquet(paths["realize_realized"])
    inputs = load.load_inputs(paths)
    realize = realize_section(inputs["tables"], inputs["json"], inputs["not_run"])
    assert realize["undecided"] and not realize["disagrees"]
    check = realize["by_strategy"]["packing"]
    assert check["verdict"] == "undecided"
    assert "realize.sample_steps" in check["next_action"]


def test_a_promise_too_wide_to_check_asks_for_replay_timing_not_real_steps():
    """A realized interval 4 pp wide, 8 pp off a promise 40 pp wide that holds it: more real
    steps cannot decide it, a narrower promise can."""
    from probes.report.sections.realize import realized_check

    row = {
        "verdict": "undecided",
        "realized_saving": 0.20,
        "realized_saving_ci_low": 0.18,
        "realized_saving_ci_high": 0.22,
        "sampled_steps": 8,
    }
    assert "replay.cpu.budget_s" in realized_check(row, cpu_only=True)["next_action"]
    wide = {**row, "realized_saving_ci_low": 0.05, "realized_saving_ci_high": 0.35}
    assert "realize.cpu_budget_s" in realized_check(wide, cpu_only=True)["next_action"]
    # the configured tolerance: at ±15 pp a 30 pp realized interval is narrow enough
    assert "replay.budget_s" in realized_check(wide, False, agree_within=0.15)["next_action"]
