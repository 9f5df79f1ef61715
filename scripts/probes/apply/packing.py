"""TRL packing as a change: whole examples packed into ``max_seq_len`` rows by best-fit
decreasing, with the batch adjusted to keep real tokens per update (``packing_plan``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probes.apply.changes import Baseline, sweep_estimate, tokens_per_update_entry
from probes.apply.snippets import config_snippets
from probes.batching.packing import packed_batch_shape

TRL_PACKING_STRATEGY = "bfd"  # TRL's best-fit decreasing; the sweep's packing_bfd mirrors it
SWEEP_PACKING_ROW = "packing_bfd"


def packing_plan(base: Baseline, n_bins: int) -> dict[str, Any]:
    """Packed rows per micro-batch and grad_accum keeping real tokens per update comparable
    (probes.batching.packing.packed_batch_shape: the plan the replay times is this shape)."""
    rows, accum = packed_batch_shape(
        base.micro_batch_size, base.grad_accum, base.max_seq_len, base.n_examples,
        base.real_tokens, base.longest, n_bins,
    )  # fmt: skip
    fill = base.real_tokens / n_bins
    return {
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": accum,
        "real_tokens_per_row": float(fill),
        "rows_per_update_target": float(base.tokens_per_update / fill),
        "tokens_per_update_after": float(rows * accum * fill),
    }


# SFTConfig's defaults are not TrainingArguments' (TRL 1.16: gradient_checkpointing=True,
# bf16=True). Pasted over a Trainer run they change more than the batching: measured with
# bench/realized_vs_promised.py --trainer sft on CPU (float32), packing pasted with TRL's
# checkpointing default realized -21.7% against +0.2% promised (checkpointing alone: -21.5%).
# The snippets state the run's own checkpointing where the probes saw it (Baseline).
SFT_DEFAULTS_CAVEAT = (
    "SFTConfig defaults to checkpointing on and bf16=True (TRL 1.16), unlike "
    "TrainingArguments: the snippet states your run's checkpointing as activation_checkpointing "
    "where the probes saw it (TRL's default where they did not) and leaves bf16 to your run's "
    "value, which you keep, or the step changes more than the packing (with TRL's checkpointing "
    "default, packing realized -21.7% against +0.2% promised: bench/realized_vs_promised.py, a "
    "small Llama on CPU)"
)
# TRL 1.16's SFTTrainer computes per-token entropy and top-1 accuracy in its loss and logs them
# with a .item() each micro-batch, a cost no setting turns off and the replay (the user's
# harness, not TRL's step) does not time: measured with bench/realized_vs_promised.py on two
# CPUs (float32), +0.19 and +0.22 s per optimizer step beyond the Trainer's, which put packing's
# realized saving 5.5 and 9.7 pp under its promise.
SFT_STEP_CAVEAT = (
    "SFTTrainer's step also computes entropy and token accuracy metrics per micro-batch, which "
    "the replay of your harness does not time: on bench/realized_vs_promised.py (small Llama, "
    "CPU) that put the realized saving 5.5-9.7 pp under the promise"
)


# TRL 1.16 drops the examples left with no loss token only when it truncates (packing off,
# max_length set); packed (or padding-free without max_length) it keeps them, so the run
# trains on more examples than the baseline the replay priced. Measured with
# bench/realized_vs_promised.py --trainer sft (400 chitchat examples, 183 without a loss
# token): the padding-free epoch ran 25 optimizer steps against the baseline's 14.
KEEPS_NO_LOSS = (
    "TRL keeps the examples that carry no loss token when it packs (and with max_length unset); "
    "it drops them only when it truncates: filter them before the trainer as "
    "drop_no_loss_examples does, or the run trains on more examples than the baseline (a bench "
    "epoch: 25 optimizer steps against 14)"
)


PACKING_CAVEAT = "; ".join(
    (
        "needs attention that keeps the packed documents apart: flash-attention varlen kernels "
        "read position_ids; SDPA/eager get a block-diagonal mask from transformers (dense cost, "
        "no is_causal fast path; see the mask gate's packed scenario); examples per step now vary",
        SFT_DEFAULTS_CAVEAT,
        SFT_STEP_CAVEAT,
        KEEPS_NO_LOSS,
    )
)


def packing_change(
    recommendation: Mapping[str, Any], base: Baseline, trl_info: Mapping[str, Any]
) -> dict[str, Any]:
    """TRL packing (best-fit decreasing into max_seq_len rows), batch adjusted for tokens/update."""
    point = (recommendation.get("packing") or {}).get(SWEEP_PACKING_ROW)
    if not point:
        return {
            "id": "packing",
            "applies": False,
            "reason": f"the bucket sweep has no {SWEEP_PACKING_ROW} row (bucket.packing)",
        }
    if trl_info.get("version") is None or TRL_PACKING_STRATEGY not in (
        trl_info.get("packing_strategies") or []
    ):
        return {
            "id": "packing",
            "applies": False,
            "reason": (
                "trl is not installed: packing is an SFTConfig setting (pip install trl)"
                if trl_info.get("version") is None
                else f"trl {trl_info.get('version')} has no packing_strategy "
                f"{TRL_PACKING_STRATEGY!r}"
            ),
        }
    plan = packing_plan(base, int(point["n_bins"]))
    sft = {
        "packing": True,
        "packing_strategy": TRL_PACKING_STRATEGY,
        **base.sft_config(),  # the run's max_length and checkpointing, not TRL's defaults
        "per_device_train_batch_size": plan["per_device_train_batch_size"],
        "gradient_accumulation_steps": plan["gradient_accumulation_steps"],
    }
    random = recommendation.get("random") or {}
    return {
        "id": "packing",
        "applies": True,
        "title": (
            f"Pack whole examples into {base.max_seq_len}-token rows (TRL, best-fit decreasing)"
        ),
        "expressible_in_training_arguments": False,
        "how": (
            f"trl {trl_info.get('version')} SFTConfig(packing=True, packing_strategy="
            f"{TRL_PACKING_STRATEGY!r}) packs by best-fit decreasing and turns padding_free on "
            "(documents kept apart by position_ids); the plain Trainer has no packing setting"
        ),
        "training_arguments": None,
        "sft_config": sft,
        "sampler": None,
        "snippets": config_snippets(
            None,
            sft,
            {
                "trl": "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
            },
        ),
        "tokens_per_update": {
            **tokens_per_update_entry(
                base.tokens_per_update,
                plan["tokens_per_update_after"],
                f"{plan['per_device_train_batch_size']} packed row(s) of ~"
                f"{plan['real_tokens_per_row']:.0f} real tokens × "
                f"{plan['gradient_accumulation_steps']} accumulation step(s), instead of "
                f"{base.micro_batch_size} × {base.grad_accum} examples of "
                f"{base.mean_length:.0f} tokens on average",
            ),
            "plan": plan,
        },
        "estimate": {
            **sweep_estimate(point, random),
            "n_bins": int(point["n_bins"]),
            "strategy": SWEEP_PACKING_ROW,
        },
        "caveat": PACKING_CAVEAT,
        # the replay priced the baseline's examples: filter the others as the baseline's did
        "drop_no_loss_examples": True,
    }
