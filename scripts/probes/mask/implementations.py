"""The gate per attention implementation: every implementation a step-level change proposes
(probes.step.changes: eager, sdpa, flex_attention, flash_attention_2) traced on the configured
packed, padded and window scenarios, each with its own mask code (the main gate's
implementation keeps its verdict over every scenario it traced). Each is checked at the scenario's
semantic shape (probes.mask.shapes: the smallest that puts the padded rows and packed documents on
every side of the window the training shape does), named per scenario in ``checked_at``.

Documents stay apart, padding is never attended and sliding windows are exact, or the
implementation fails with its first violation named; a padding-free change on it is then never
recommended (probes.step.padding_free). The packed scenario is laid out by a collator
(transformers' DataCollatorWithFlattening by default), so a collator that adds an all-ones 2-D
``attention_mask`` beside restarting ``position_ids`` is caught: transformers then skips its
packed-sequence detection and the documents attend to each other (transformers#46634).

Flash attention receives no mask at all (it separates documents by ``cu_seqlens`` computed from
the position ids inside its kernel call), so there is no tensor to measure: it is listed as not
checked, never passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from probes.mask.scenarios import Collate, CollatorError, flattening_collator
from probes.mask.trace import (
    ModelConfigError,
    ProbeModel,
    build_probe_model,
    implementation_of,
)

PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not_checked"
PACKED_SCENARIO = "packed"
# what each further implementation is traced on, among mask.scenarios: the packed and padded
# batches and the window's edges (the unpadded training shape adds nothing these do not check:
# eager and flex put a mask on every layer and choose no backend)
IMPLEMENTATION_SCENARIOS = (
    "below_window",
    "at_window",
    "above_window",
    "right_padded",
    "left_padded",
    PACKED_SCENARIO,
)
FLASH_PREFIX = "flash_attention"
FLASH_NOT_CHECKED = (
    "not checked: flash attention takes no mask (documents are kept apart by cu_seqlens from "
    "the position ids inside its kernel call), so the gate has no tensor to measure"
)

# gate.json's "implementations": per implementation its verdict and one entry per scenario with
# these keys (stable: the replay reads the verdict).
SCENARIO_KEYS = (
    "scenario",
    "padding",
    "packed",
    "status",  # passed | failed | not_checked
    "layers",
    "layers_checked",  # layers whose pattern the gate knows (band_ok not null)
    "violations",
    "first_violation",
    "checked_at",  # BxT the masks were measured at (probes.mask.shapes)
)


def proposed_implementations() -> tuple[str, ...]:
    """Every attention implementation a step-level change may propose (their one home)."""
    from probes.step.change_types import GPU_ONLY_ATTENTION, PORTABLE_ATTENTION

    return (*PORTABLE_ATTENTION, *GPU_ONLY_ATTENTION)


def with_all_ones_mask(collator: Collate) -> Collate:
    """`collator` plus an all-ones 2-D attention_mask: the layout that makes transformers skip
    packed-sequence detection (transformers#46634). What the gate must refuse."""
    import torch

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(collator(features))
        batch["attention_mask"] = torch.ones_like(torch.as_tensor(batch["input_ids"]))
        return batch

    return collate


def scenario_rows(table: pd.DataFrame) -> list[dict[str, Any]]:
    """One entry per scenario of one implementation's layers table (SCENARIO_KEYS)."""
    rows = []
    for scenario, part in table.groupby("scenario", sort=False):
        violations = part["violation"].dropna().astype(str).tolist()
        rows.append(
            {
                "scenario": str(scenario),
                "padding": str(part["padding"].iloc[0]),
                "packed": bool(part["packed"].iloc[0]),
                "status": FAILED if violations else PASSED,
                "layers": int(len(part)),
                "layers_checked": int(part["band_ok"].notna().sum()),
                "violations": len(violations),
                "first_violation": violations[0] if violations else None,
                "checked_at": str(
                    part["band_shape"].dropna().iloc[0]
                    if part["band_shape"].notna().any()
                    else f"{part['batch'].iloc[0]}x{part['seq_len'].iloc[0]}"
                ),
            }
        )
    return rows


def verdict_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """An implementation's verdict from its scenarios: failed when any has a violation (the
    first one named), passed otherwise; whether the packed scenario was among them."""
    failed = [row for row in rows if row["status"] == FAILED]
    return {
        "status": FAILED if failed else PASSED,
        "scenarios": [row["scenario"] for row in rows],
        "packed_checked": any(row["scenario"] == PACKED_SCENARIO for row in rows),
        "violations": sum(row["violations"] for row in rows),
        "violation": failed[0]["first_violation"] if failed else None,
        "reason": None,
        "per_scenario": rows,
    }


def not_checked(reason: str) -> dict[str, Any]:
    return {
        "status": NOT_CHECKED,
        "scenarios": [],
        "packed_checked": False,
        "violations": 0,
        "violation": None,
        "reason": reason,
        "per_scenario": [],
    }


def trace_implementation(
    implementation: str,
    config_dict: dict[str, Any],
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    source: str,
    packed_collator: Collate | None,
    probe: ProbeModel | None = None,
) -> dict[str, Any]:
    """The configured scenarios traced under `implementation` (on `probe`'s model where given)
    and its verdict; why not, where transformers refuses it for this architecture or machine."""
    from probes.mask.verdict import evaluate, model_dtype

    if implementation.startswith(FLASH_PREFIX):
        return not_checked(FLASH_NOT_CHECKED)
    scenarios = [name for name in mask_cfg["scenarios"] if name in IMPLEMENTATION_SCENARIOS]
    if not scenarios:
        return not_checked(
            f"none of mask.scenarios is among {list(IMPLEMENTATION_SCENARIOS)}; add 'packed'"
        )
    # the SDPA backend confirmation belongs to the main (SDPA) trace; the others have none
    cfg = {**mask_cfg, "scenarios": scenarios, "confirm_on_cuda": False}
    try:
        if probe is None:
            probe = build_probe_model(config_dict, model_dtype(cfg["dtype"]), source)
        with implementation_of(probe, implementation) as variant:
            table, _ = evaluate(
                config_dict,
                cfg,
                training_cfg,
                source,
                False,
                packed_collator=packed_collator,
                probe=variant,
            )
    except (CollatorError, ModelConfigError):
        raise  # not the implementation's doing: the user's config or the collator
    except (ImportError, ValueError, NotImplementedError) as error:
        first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        return not_checked(f"transformers refused it here: {first}")
    return verdict_of(scenario_rows(table))


def check_implementations(
    config_dict: dict[str, Any],
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    primary: tuple[str, pd.DataFrame] | None = None,
    source: str = "config.json",
    packed_collator: Collate | None = None,
    implementations: Sequence[str] | None = None,
    probe: ProbeModel | None = None,
) -> dict[str, dict[str, Any]]:
    """gate.json's ``implementations``: every implementation traced on the configured scenarios,
    its verdict (status, scenarios, packed_checked, violations, the first violation or why it
    was not checked) and its per-scenario entries. `primary`: the implementation the main gate
    traced and its layers table (reused, not traced again); `probe`: its model, switched to
    each further implementation rather than built again."""
    collator = packed_collator or flattening_collator()
    out: dict[str, dict[str, Any]] = {}
    for name in implementations or proposed_implementations():
        if primary is not None and name == primary[0]:
            out[name] = verdict_of(scenario_rows(primary[1]))
        else:
            out[name] = trace_implementation(
                name, config_dict, mask_cfg, training_cfg, source, collator, probe
            )
    return out


def padding_free_verdict(
    implementations: Mapping[str, Mapping[str, Any]] | None, implementation: str
) -> str | None:
    """None when `implementation` kept packed documents apart in the gate, else why a
    padding-free change on it must not be recommended (the violation, or what was not checked)."""
    verdict = (implementations or {}).get(implementation)
    if verdict is None:
        return (
            f"the mask gate did not check attention implementation {implementation}; rerun the "
            "mask stage (it checks every implementation a change proposes)"
        )
    if verdict.get("status") == FAILED:
        return f"the mask gate failed {implementation}: {verdict.get('violation')}"
    if verdict.get("status") != PASSED:
        return f"the mask gate did not check {implementation}: {verdict.get('reason')}"
    if not verdict.get("packed_checked"):
        return (
            f"the mask gate checked {implementation} without its packed scenario, so document "
            "separation is unchecked; add 'packed' to mask.scenarios"
        )
    return None
