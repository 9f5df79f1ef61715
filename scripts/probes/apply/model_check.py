"""The bucket sweep's token model beside the replay's measured time, per change (three-way).

A change's price is the replay's measurement (``probes.apply.document.order_changes``); the
sweep's token counts (its ``estimate``) are a model of it. Where the two say different things the
report says so, with both numbers, instead of showing one: the model's claim is the sign of the
padded tokens it saves against random batches, and for ``batch_rebalance`` also its order against
the recommended length grouping (``beside_recommended``); the replay's claim is its 95% interval
(against random), or the two changes' intervals (against each other). An interval that includes
0, or two that overlap, decides nothing: undecided.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probes.contracts import BATCH_REBALANCE

AGREES, DISAGREES, UNDECIDED = "agrees", "disagrees", "undecided"
# Below half a percent of padded tokens the model claims nothing (as the report's "saves padded
# tokens but not time" note).
MODEL_MARGIN = 0.005
LENGTH_GROUPED_ID = "length_grouped"


def _sign(value: Any, margin: float = 0.0) -> int:
    if not isinstance(value, int | float) or value != value:
        return 0
    return 1 if value > margin else -1 if value < -margin else 0


def _interval_sign(low: Any, high: Any) -> int:
    """+1 when the interval lies above 0, -1 below, 0 when it includes 0 or is missing."""
    if low is None or high is None:
        return 0
    return 1 if low > 0 else -1 if high < 0 else 0


def _verdict(model: int, replay: int) -> str:
    if model == 0 or replay == 0:
        return UNDECIDED
    return AGREES if model == replay else DISAGREES


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _measured(change: Mapping[str, Any]) -> str:
    return (
        f"{_pct(change['measured_saving'])} [{_pct(change['saving_ci_low'])}, "
        f"{_pct(change['saving_ci_high'])}]"
    )


def against_random(change: Mapping[str, Any]) -> dict[str, Any] | None:
    """The sweep's padded-token saving against the replay's time saving, both vs random."""
    tokens = (change.get("estimate") or {}).get("padded_tokens_saved_vs_random")
    if tokens is None or change.get("measured_saving") is None:
        return None
    model = _sign(tokens, MODEL_MARGIN)
    replay = _interval_sign(change.get("saving_ci_low"), change.get("saving_ci_high"))
    return {
        "versus": "random batches",
        "model_padded_tokens_saved": float(tokens),
        "verdict": _verdict(model, replay),
        "text": (
            f"the bucket sweep's token model counts {_pct(tokens)} padded tokens saved against "
            f"random batches, the replay measured {_measured(change)} of training time"
        ),
    }


def against_length_grouping(
    change: Mapping[str, Any], grouping: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """batch_rebalance against the recommended length grouping: which is ahead by the sweep's
    token efficiency, and by the replay's two intervals."""
    beside = change.get("beside_recommended") or {}
    ours = beside.get("batch_rebalance_token_efficiency")
    theirs = beside.get("recommended_token_efficiency")
    if grouping is None or ours is None or theirs is None:
        return None
    if change.get("measured_saving") is None or grouping.get("measured_saving") is None:
        return None
    model = _sign(float(ours) - float(theirs))
    low, high = change.get("saving_ci_low"), change.get("saving_ci_high")
    other_low, other_high = grouping.get("saving_ci_low"), grouping.get("saving_ci_high")
    replay = 0
    if None not in (low, high, other_low, other_high):
        replay = 1 if low > other_high else -1 if high < other_low else 0
    return {
        "versus": str(grouping.get("title") or LENGTH_GROUPED_ID),
        "model_token_efficiency": [float(ours), float(theirs)],
        "verdict": _verdict(model, replay),
        "text": (
            f"the bucket sweep's token model puts it {'ahead of' if model > 0 else 'behind'} "
            f"{grouping.get('title') or LENGTH_GROUPED_ID} (token efficiency {float(ours):.3f} "
            f"against {float(theirs):.3f}), the replay measured {_measured(change)} against "
            f"{_measured(grouping)}"
        ),
    }


def with_model_checks(changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured change with its ``model_check`` (the comparisons above); a disagreement
    is said in its caveat, with both numbers and the check that settles it."""
    grouping = next(
        (c for c in changes if c.get("id") == LENGTH_GROUPED_ID and c.get("applies")), None
    )
    out = []
    for change in changes:
        checks = [against_random(change)]
        if change.get("id") == BATCH_REBALANCE:
            checks.append(against_length_grouping(change, grouping))
        checks = [c for c in checks if c is not None]
        if not checks or not change.get("applies"):
            out.append(change)
            continue
        entry = {**change, "model_check": checks}
        disagree = [c["text"] for c in checks if c["verdict"] == DISAGREES]
        if disagree:
            note = (
                "the sweep's model and the replay disagree: "
                + "; ".join(disagree)
                + " (real training steps, the realize stage's check, settle which holds)"
            )
            caveat = change.get("caveat")
            entry["caveat"] = f"{caveat}; {note}" if caveat else note
        out.append(entry)
    return out
