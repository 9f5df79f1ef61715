"""Each recommended change as settings the user's trainer accepts, checked against the real classes.

For every change the bucket stage's recommendation supports (length-grouped batching at the
recommended bucket size, transformers' built-in ``group_by_length`` at its fixed bucket,
``batch_rebalance``, TRL packing, dropping examples with no loss token) this module writes:

- ``training_arguments``: kwargs for ``transformers.TrainingArguments`` (None where the plain
  Trainer cannot express the change);
- ``sft_config``: kwargs for ``trl.SFTConfig`` (a TrainingArguments subclass);
- ``snippet``: Python that pastes (imports, the arguments, the trainer line);
- ``tokens_per_update``: real tokens per optimizer step before and after, with batch size and
  ``gradient_accumulation_steps`` adjusted where the change alters them (packing);
- ``estimate``: the bucket sweep's token counts for the change (an estimate until the profile's
  replay measures time);
- ``verification``: the snippet's argument lines executed against the installed libraries and
  every kwarg read back from the constructed object (``verify_document``).

The changes are built in ``probes.apply.changes`` (their snippets in ``probes.apply.snippets``)
and checked against the installed classes in ``probes.apply.libraries``; this module assembles
them into ``recommendations.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from probes.apply.changes import (
    baseline_from,
    batch_rebalance_change,
    drop_no_loss_change,
    length_grouped_changes,
    packing_change,
)
from probes.apply.libraries import installed_libraries, verify_document
from probes.contracts import TRAINING_STATUSES

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
