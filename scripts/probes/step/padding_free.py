"""Padding-free per attention implementation: a step-level change (probes.step.changes).

Its micro-batches are the baseline's examples, each micro-batch flattened into one row with
position ids restarting per document and no padding: what TRL's ``padding_free=True`` and
transformers' ``DataCollatorWithFlattening`` hand the model (the trainer path collates them with
the trainer's own collator in that form: probes.step.trainer.packed_collator). Its step is the
user's with the attention implementation set to the change's.

Documents must stay apart, and whether they do depends on the implementation: the mask gate
traces each one on the packed scenario (probes.mask.implementations). A change whose
implementation the gate failed, or did not check, is never priced nor recommended: the replay
marks it invalid with the gate's violation (``invalid_changes``). The step's own collator is
checked too (``collator_leak``): a packed row that carries a 2-D ``attention_mask`` beside its
position ids makes transformers skip packed-sequence detection, and documents attend to each
other (transformers#46634).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

PADDING_FREE_PREFIX = "padding_free_"
LEAK = (
    "the step's padding-free collator passes a 2-D attention_mask beside the restarting "
    "position_ids: transformers then skips packed-sequence detection and the documents attend "
    "to each other (transformers#46634); drop the attention_mask from packed micro-batches"
)


def padding_free_changes(base: Any, implementations: Sequence[str]) -> list[Any]:
    """One change per attention implementation: the baseline's micro-batches flattened, the
    step at that implementation (the base's, too: then only the layout changes)."""
    from probes.step.change_types import StepChange

    return [
        StepChange(
            PADDING_FREE_PREFIX + name,
            f"padding-free (one flattened row per micro-batch) with attention {name}",
            dataclasses.replace(base, attn_implementation=name),
            # SFTConfig's padding_free (TRL 1.16's SFTTrainer refuses it beside a max_length
            # unless packing: rows are taken as they come); from_pretrained's attn_implementation
            # and, as TRL then keeps them, the examples with no loss token filtered as the
            # baseline's truncation dropped them (probes.apply.packing.KEEPS_NO_LOSS)
            {
                "padding_free": True,
                "max_length": None,
                "drop_no_loss_examples": True,
                "attn_implementation": name,
            },
        )
        for name in implementations
    ]


def is_padding_free(name: str) -> bool:
    return str(name).startswith(PADDING_FREE_PREFIX)


def implementation_of(name: str) -> str:
    return str(name)[len(PADDING_FREE_PREFIX) :]


def title_of(name: str) -> str | None:
    """The change in the Summary's words (None for any other strategy)."""
    if not is_padding_free(name):
        return None
    return f"Go padding-free with the {implementation_of(name)} attention implementation"


def names(implementations: Sequence[str]) -> list[str]:
    return [PADDING_FREE_PREFIX + name for name in implementations]


def flattened(plans: pd.DataFrame) -> pd.DataFrame:
    """Each micro-batch of `plans` as one flattened row of its examples, in their order: no
    padding, every example a document (probes.batching.plans' packed layout)."""
    from probes.batching.plans import PACKED

    out = plans.copy()
    out["layout"] = PACKED
    out["rows"] = 1
    out["padded_length"] = out["real_tokens"]
    out["computed_tokens"] = out["real_tokens"]
    out["documents_per_row"] = [[int(n)] for n in out["n_examples"]]
    return out


def invalid_changes(gate: Mapping[str, Any], implementations: Sequence[str], origin: str) -> dict:
    """The padding-free changes the mask gate does not clear (`gate`: gate.json), each with the
    gate's violation or what it did not check."""
    from probes.mask.implementations import padding_free_verdict

    verdicts = gate.get("implementations")
    out = {}
    for name in implementations:
        reason = padding_free_verdict(verdicts, name)
        if reason:
            out[PADDING_FREE_PREFIX + name] = f"{origin}: {reason}"
    return out


def collator_leak(batch: Mapping[str, Any]) -> str | None:
    """Why a packed micro-batch lets its documents attend to each other, or None: a 2-D
    attention_mask beside position ids disables transformers' packed-sequence detection."""
    if batch.get("attention_mask") is not None and batch.get("position_ids") is not None:
        return LEAK
    return None


def pasted(
    enabled: bool, trainer_lines: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """What a padding-free change pastes beside the common settings (probes.apply): SFTConfig's
    ``padding_free``, a plain Trainer's ``DataCollatorWithFlattening`` and its import."""
    if not enabled:
        return {}, dict(trainer_lines), []
    plain = trainer_lines["transformers"].replace(
        "data_collator=data_collator", "data_collator=DataCollatorWithFlattening()"
    )
    return (
        {"padding_free": True},
        {**trainer_lines, "transformers": plain},
        ["from transformers import DataCollatorWithFlattening"],
    )
