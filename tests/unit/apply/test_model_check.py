"""The bucket sweep's token model beside the replay's measurement (probes.apply.model_check):
three-way per change, a disagreement said in the caveat with both numbers, never resolved."""

from __future__ import annotations

from probes.apply.document import order_changes
from probes.apply.model_check import AGREES, DISAGREES, UNDECIDED, with_model_checks


def _change(change_id, tokens_saved, saving, low, high, **extra):
    return {
        "id": change_id,
        "applies": True,
        "title": change_id,
        "estimate": {"padded_tokens_saved_vs_random": tokens_saved},
        "caveat": "its own caveat",
        "measured_saving": saving,
        "saving_ci_low": low,
        "saving_ci_high": high,
        **extra,
    }


def _rebalance(saving, low, high, efficiency=0.9, recommended=0.8):
    beside = {
        "batch_rebalance_token_efficiency": efficiency,
        "recommended_token_efficiency": recommended,
    }
    return _change("batch_rebalance", 0.3, saving, low, high, beside_recommended=beside)


def test_the_model_against_random_is_three_way():
    faster = _change("length_grouped", 0.2, 0.1, 0.05, 0.15)
    slower = _change("length_grouped", 0.2, -0.1, -0.15, -0.05)
    tie = _change("length_grouped", 0.2, 0.01, -0.02, 0.04)
    verdicts = [
        with_model_checks([c])[0]["model_check"][0]["verdict"] for c in (faster, slower, tie)
    ]
    assert verdicts == [AGREES, DISAGREES, UNDECIDED]
    # below half a percent of padded tokens the model claims nothing
    flat = _change("length_grouped", 0.001, -0.1, -0.15, -0.05)
    assert with_model_checks([flat])[0]["model_check"][0]["verdict"] == UNDECIDED


def test_a_disagreement_is_said_with_both_numbers_and_the_price_stays_the_replays():
    grouping = _change("length_grouped", 0.2, 0.20, 0.15, 0.25)
    # the model puts batch_rebalance ahead (more tokens saved); the replay: behind, and slower
    rebalance = _rebalance(-0.05, -0.08, -0.02)
    checked = {c["id"]: c for c in with_model_checks([grouping, rebalance])}
    versus = {k["versus"]: k["verdict"] for k in checked["batch_rebalance"]["model_check"]}
    assert versus == {"random batches": DISAGREES, "length_grouped": DISAGREES}
    caveat = checked["batch_rebalance"]["caveat"]
    assert caveat.startswith("its own caveat; the sweep's model and the replay disagree")
    assert "+30.0% padded tokens saved" in caveat and "-5.0% [-8.0%, -2.0%]" in caveat
    assert "token efficiency 0.900 against 0.800" in caveat and "+20.0% [+15.0%, +25.0%]" in caveat
    assert checked["batch_rebalance"]["measured_saving"] == -0.05  # the price: the replay's
    assert checked["length_grouped"]["caveat"] == "its own caveat"  # it agrees: nothing said


def test_overlapping_intervals_leave_the_order_undecided():
    grouping = _change("length_grouped", 0.2, 0.10, 0.05, 0.15)
    rebalance = _rebalance(0.12, 0.08, 0.16)
    checks = with_model_checks([grouping, rebalance])[1]["model_check"]
    assert [k["verdict"] for k in checks] == [AGREES, UNDECIDED]
    assert "disagree" not in with_model_checks([grouping, rebalance])[1]["caveat"]


def test_unmeasured_and_inapplicable_changes_carry_no_check():
    unmeasured = _change("batch_rebalance", 0.3, None, None, None)
    not_applied = {"id": "packing", "applies": False, "reason": "no trl"}
    assert with_model_checks([unmeasured, not_applied]) == [unmeasured, not_applied]


def test_order_changes_carries_the_checks_into_recommendations_json():
    document = {
        "changes": [
            {k: v for k, v in _rebalance(0, 0, 0).items() if not k.startswith(("meas", "sav"))},
            {"id": "length_grouped", "applies": True, "estimate": {}, "caveat": None},
        ]
    }
    measured = {
        0: {"saving": -0.05, "saving_low": -0.08, "saving_high": -0.02, "valid": True},
        1: {"saving": 0.2, "saving_low": 0.15, "saving_high": 0.25, "valid": True},
    }
    ordered = {c["id"]: c for c in order_changes(document, measured)["changes"]}
    assert ordered["batch_rebalance"]["model_check"][0]["verdict"] == DISAGREES
    assert "the sweep's model and the replay disagree" in ordered["batch_rebalance"]["caveat"]
    assert "model_check" not in ordered["length_grouped"]  # no token model to compare
