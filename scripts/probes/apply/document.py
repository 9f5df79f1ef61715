"""Each recommended change as settings the user's trainer accepts, checked against the real classes.

For every change the bucket stage's recommendation supports (length-grouped batching at the
recommended bucket size, transformers' built-in ``group_by_length`` at its fixed bucket,
``batch_rebalance``, TRL packing, dropping examples with no loss token) this module writes:

- ``training_arguments``: kwargs for ``transformers.TrainingArguments`` (None where the plain
  Trainer cannot express the change);
- ``sft_config``: kwargs for ``trl.SFTConfig`` (a TrainingArguments subclass);
- ``model_kwargs``: ``from_pretrained`` kwargs where a step-level change sets the model's own
  (its attention implementation), else None;
- ``snippet``: Python that pastes (imports, the arguments, the trainer line);
- ``tokens_per_update``: real tokens per optimizer step before and after, with batch size and
  ``gradient_accumulation_steps`` adjusted where the change alters them (packing);
- ``estimate``: the bucket sweep's token counts for the change (an estimate until the profile's
  replay measures time);
- ``verification``: the snippet's argument lines executed against the installed libraries and
  every kwarg read back from the constructed object (``verify_document``).

The changes are built in ``probes.apply.changes`` and ``probes.apply.packing`` (their snippets in
``probes.apply.snippets``) and checked against the installed classes in
``probes.apply.libraries``; this module assembles them into ``recommendations.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from probes.apply.changes import (
    baseline_from,
    batch_rebalance_change,
    drop_no_loss_change,
    length_grouped_changes,
)
from probes.apply.libraries import installed_libraries, verify_document
from probes.apply.model_check import with_model_checks
from probes.apply.packing import packing_change
from probes.apply.snippets import call_text
from probes.contracts import TRAINING_STATUSES
from probes.memory.verdict import DOES_NOT_FIT

SCHEMA_VERSION = 1
BASELINE = "random batches, micro_batch_size × grad_accum examples per optimizer step"


def recommendations_document(
    recommendation: Mapping[str, Any],
    training: Mapping[str, Any],
    versions: Mapping[str, Any] | None = None,
    no_loss_examples: int | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """``recommendations.json``: every change as settings for the installed libraries.

    ``recommendation``: the bucket stage's recommendation.json; ``training``: the config's
    training section (micro_batch_size, grad_accum, max_seq_len); ``versions``:
    ``installed_libraries()`` (read here when None); ``no_loss_examples``: OK/TRUNCATED examples
    with ``n_loss_tokens == 0`` (the padding stage's lengths), None when unknown. ``verify``
    constructs the real objects from each snippet (skipped per library when not importable).
    """
    libraries = dict(versions) if versions is not None else installed_libraries()
    transformers_info = libraries.get("transformers") or {"version": None}
    trl_info = libraries.get("trl") or {"version": None}
    base = baseline_from(recommendation, training)
    changes = [
        *length_grouped_changes(recommendation, base, transformers_info),
        batch_rebalance_change(recommendation, base, transformers_info),
        packing_change(recommendation, base, trl_info),
        drop_no_loss_change(no_loss_examples, base),
    ]
    if no_loss_examples:
        changes = [with_no_loss_caveat(c, int(no_loss_examples)) for c in changes]
    document = {
        "schema_version": SCHEMA_VERSION,
        "libraries": libraries,
        "baseline": {
            "description": BASELINE,
            **dataclasses.asdict(base),
            "mean_length": base.mean_length,
            "tokens_per_update": base.tokens_per_update,
            "training_arguments": base.training_arguments(),
            "sft_config": base.sft_config(),
        },
        "bucket_status": recommendation.get("status"),
        "config_hash": recommendation.get("config_hash"),
        "changes": changes,
    }
    if verify:
        verify_document(document)
    return _json_clean(document)


# Length grouping puts the short no-loss examples together, so whole micro-batches carry no
# loss token: the model's loss is 0/0 = NaN there (its gradients are 0, the weights unharmed) and
# transformers.Trainer's logging_nan_inf_filter adds the running mean loss in its place. Measured
# with bench/realized_vs_promised.py's Trainer (transformers 5.24, 200 chitchat lengths): logged
# train_loss 52.1 length-grouped, 55.3 group_by_length, 6.25 random; no NaN weight.
GROUPED = ("length_grouped", "group_by_length_builtin")


def with_no_loss_caveat(change: dict[str, Any], no_loss_examples: int) -> dict[str, Any]:
    """A length-grouped change, on data with examples that carry no loss token, says what the
    Trainer's logged loss will do and that drop_no_loss_examples goes with it."""
    if change.get("id") not in GROUPED or not change.get("applies"):
        return change
    note = (
        f"with the {no_loss_examples} examples that carry no loss token left in, grouping puts "
        "them together, so whole micro-batches have no loss token: their loss is NaN (0/0, "
        "zero gradients) and the Trainer's logged train_loss is inflated by its NaN filter "
        "(bench/realized_vs_promised.py, 200 chitchat examples: 52 vs 6.3 random); apply "
        "drop_no_loss_examples with it"
    )
    caveat = change.get("caveat")
    return {**change, "caveat": f"{caveat}; {note}" if caveat else note}


def _json_clean(value: Any) -> Any:
    """NaN → None so the document is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_clean(v) for v in value]
    return value


def dumps(document: Mapping[str, Any]) -> str:
    """The document as strict JSON text."""
    return json.dumps(document, indent=2, sort_keys=False, allow_nan=False) + "\n"


def count_no_loss_examples(lengths: Any) -> int:
    """Examples that train (OK/TRUNCATED) yet carry no loss token, from the padding stage's
    lengths table (a DataFrame with ``status`` and ``n_loss_tokens``)."""
    trains = lengths.loc[lengths["status"].isin(TRAINING_STATUSES)]
    return int((trains["n_loss_tokens"] == 0).sum())


# The decision each change carries, in the report's words (recommendations.json "decision")
RECOMMENDED = "recommended: measured faster than random batches"
TIES_WITH_RANDOM = "ties with random batches: its 95% interval includes 0, so not shown faster"
SLOWER = "not recommended: measured slower than random batches (interval entirely below 0)"
INVALID = "not recommended: invalid here"
NOT_MEASURED = "not measured: the replay did not time this change"
NOT_FITTING = (
    "not recommended as it is: its largest micro-batch does not fit the target GPU (the memory "
    "stage says what would make it fit)"
)
ORDER = (
    "applicable changes by the replay's measured saving versus random batches, best first; a "
    "change whose 95% interval overlaps the interval of its group's best shares that rank (a "
    "tie); changes the replay did not measure follow, unranked, then those that do not apply"
)


def decision(measured: Mapping[str, Any] | None) -> str:
    """What a change's measurement decides (a measured-slower change is never recommended)."""
    if not measured or measured.get("saving") is None:
        return NOT_MEASURED
    if not measured.get("valid", True):
        return INVALID
    low, high = measured.get("saving_low"), measured.get("saving_high")
    if low is not None and low > 0:
        return RECOMMENDED
    if high is not None and high < 0:
        return SLOWER
    return TIES_WITH_RANDOM


def order_changes(
    document: Mapping[str, Any], measurements: Mapping[int, Mapping[str, Any] | None]
) -> dict[str, Any]:
    """recommendations.json with each change's measured saving, interval, rank and decision, and
    its changes in the report's order (ORDER). `measurements`: change position → the replay's
    measurement (saving, saving_low, saving_high, valid) or None."""
    changes = list(document.get("changes") or [])
    annotated = []
    for position, change in enumerate(changes):
        measured = measurements.get(position)
        entry = dict(change)
        entry["measured_saving"] = measured.get("saving") if measured else None
        entry["saving_ci_low"] = measured.get("saving_low") if measured else None
        entry["saving_ci_high"] = measured.get("saving_high") if measured else None
        entry["decision"] = decision(measured) if change.get("applies") else "does not apply"
        entry["recommended"] = entry["decision"] == RECOMMENDED
        entry["rank"] = None
        entry["tied"] = False
        annotated.append(entry)
    # the sweep's token model beside the measurement: a disagreement is said, not resolved
    annotated = with_model_checks(annotated)
    ranked = sorted(
        (
            c
            for c in annotated
            if c.get("applies") and c["measured_saving"] is not None and c["decision"] != INVALID
        ),
        key=lambda c: -c["measured_saving"],
    )
    leader, leader_rank = None, 0
    for position, change in enumerate(ranked, 1):
        low_leader = leader["saving_ci_low"] if leader else None
        high = change["saving_ci_high"]
        if leader is None or (high is not None and low_leader is not None and high < low_leader):
            leader, leader_rank = change, position
        else:
            change["tied"] = leader["tied"] = True
        change["rank"] = leader_rank
    rest = [c for c in annotated if c not in ranked]
    rest.sort(key=lambda c: not c.get("applies"))  # stable: unmeasured, then not applicable
    return {**document, "order": ORDER, "changes": ranked + rest}


# the trainer line of a snippet: `trainer = <callee>(model=..., <extra kwargs>)`
TRAINER_LINE = re.compile(r"^trainer = (?P<callee>.+?)\((?P<kwargs>model=.*)\)$")
# the arguments every trainer line passes; the rest (bucket_size_batches=4) is the change's own
STANDARD_TRAINER_KWARGS = {"model", "args", "train_dataset", "data_collator", "processing_class"}
PLAIN_TRAINERS = {"Trainer", "SFTTrainer"}


def settings_line(change: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    """One change's settings in one line, as it differs from the run as configured: the
    TrainingArguments (else SFTConfig) kwargs that change, a trainer wrapper with its own kwargs,
    and a data line (a filter) where the change has one; "the same settings" when none differs."""
    if change.get("training_arguments") is not None:
        name, kwargs = "TrainingArguments", change["training_arguments"]
        base = baseline.get("training_arguments") or {}
    else:
        name, kwargs = "SFTConfig", change.get("sft_config") or {}
        base = baseline.get("sft_config") or {}
    parts = []
    changed = {k: v for k, v in kwargs.items() if base.get(k) != v}
    if changed:
        parts.append(call_text(name, changed))
    snippets = change.get("snippets") or {}
    chosen = snippets.get("transformers") or snippets.get("trl") or {}
    for line in str(chosen.get("text") or "").splitlines():
        line = line.strip()
        if not line or line.startswith(("from ", "import ", "args = ", "#")):
            continue
        match = TRAINER_LINE.match(line)
        if not match:
            parts.append(line)
            continue
        callee = match["callee"]
        # a standard argument is the change's own when it passes something else
        # (data_collator=DataCollatorWithFlattening() for padding-free)
        own = [
            kw
            for kw in match["kwargs"].split(", ")
            if (pair := kw.partition("="))[0] not in STANDARD_TRAINER_KWARGS or pair[2] != pair[0]
        ]
        if callee not in PLAIN_TRAINERS or own:
            parts.append(f"{callee}(…{', ' + ', '.join(own) if own else ''})")
    return "; ".join(f"`{p}`" for p in parts) if parts else "the same settings"


NOT_CHECKED = "not checked by real training steps"


def with_checks(
    document: Mapping[str, Any],
    strategy_of: Mapping[str, str],
    realized: Mapping[str, Mapping[str, Any]] | None,
    rule: str | None,
    memory: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """recommendations.json with each change's settings line, its realize check in the report's
    three words (agrees / disagrees / undecided, the rule stated once at the top) and its memory
    verdict. `strategy_of`: change id -> the replayed strategy; `realized`: strategy -> the
    report's realized check (None: the realize stage did not run); `memory`: strategy -> the
    memory verdict (None: not predicted)."""
    baseline = document.get("baseline") or {}
    changes = []
    for change in document.get("changes") or []:
        entry = dict(change)
        strategy = strategy_of.get(str(change.get("id")))
        entry["settings_line"] = settings_line(change, baseline) if change.get("applies") else None
        check = (realized or {}).get(strategy) if strategy else None
        if realized is None:
            entry["realized"] = {"verdict": None, "status": "the realize stage did not run"}
        elif check is None:
            entry["realized"] = {"verdict": None, "status": NOT_CHECKED}
        else:
            keys = (
                "verdict",
                "realized_saving",
                "realized_saving_ci_low",
                "realized_saving_ci_high",
            )
            entry["realized"] = {k: check.get(k) for k in keys}
            entry["realized"]["next_action"] = check.get("next_action")
        mem = (memory or {}).get(strategy) if strategy else None
        keys = ("verdict", "peak_gib", "headroom_gib", "text")
        entry["memory"] = {k: mem.get(k) for k in keys} if mem else {"verdict": "not predicted"}
        if entry["memory"]["verdict"] == DOES_NOT_FIT:  # never recommended as it is (issue 28)
            entry["recommended"], entry["not_recommended_because"] = False, NOT_FITTING
        changes.append(entry)
    out = {**document, "changes": changes}
    if rule:
        out["realized_rule"] = rule.replace("**", "")
    return _json_clean(out)
