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

Facts about the installed versions are read from the classes themselves (dataclass fields and
their ``choices``), never assumed from a version number: transformers 5 replaced
``group_by_length=True`` with ``train_sampling_strategy="group_by_length"`` and does not validate
that field's choices on construction, so verification checks them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from probes import orders
from probes.contracts import BATCH_REBALANCE, TRAINING_STATUSES

SCHEMA_VERSION = 1
BASELINE = "random batches, micro_batch_size × grad_accum examples per optimizer step"
SAMPLING_FIELD = "train_sampling_strategy"  # transformers ≥ 5
LEGACY_GROUP_FLAG = "group_by_length"  # transformers 4.x boolean
# Values of TrainingArguments.train_sampling_strategy (transformers' names, not the sweep's).
HF_GROUP_BY_LENGTH = "group_by_length"
HF_BATCH_REBALANCE = "batch_rebalance"
HF_RANDOM = "random"
TRL_PACKING_STRATEGY = "bfd"  # TRL's best-fit decreasing; the sweep's packing_bfd mirrors it
SWEEP_PACKING_ROW = "packing_bfd"
IGNORE_INDEX = -100

# --------------------------------------------------------------------------------------------
# What the installed libraries accept
# --------------------------------------------------------------------------------------------


def _field_choices(cls: type) -> dict[str, list[str] | None]:
    """Every dataclass field of ``cls`` → its declared choices (None when unconstrained)."""
    out: dict[str, list[str] | None] = {}
    for f in dataclasses.fields(cls):
        choices = f.metadata.get("choices") if f.metadata else None
        out[f.name] = [str(c) for c in choices] if choices is not None else None
    return out


def installed_libraries() -> dict[str, Any]:
    """Versions and the relevant fields of TrainingArguments and SFTConfig, read from the classes.

    ``{"transformers": {"version", "sampling_field", "sampling_strategies"} | {"version": None,
    "reason"}, "trl": {"version", "packing_strategies", "padding_free"} | {"version": None,
    "reason"}}``.
    """
    libraries: dict[str, Any] = {}
    try:
        import transformers
        from transformers import TrainingArguments
    except ImportError as error:
        libraries["transformers"] = {"version": None, "reason": f"not importable: {error}"}
    else:
        fields = _field_choices(TrainingArguments)
        if SAMPLING_FIELD in fields:
            sampling_field, strategies = SAMPLING_FIELD, fields[SAMPLING_FIELD]
        elif LEGACY_GROUP_FLAG in fields:
            sampling_field, strategies = LEGACY_GROUP_FLAG, [HF_RANDOM, HF_GROUP_BY_LENGTH]
        else:
            sampling_field, strategies = None, []
        libraries["transformers"] = {
            "version": transformers.__version__,
            "sampling_field": sampling_field,
            "sampling_strategies": strategies or [],
        }
    try:
        import trl
        from trl import SFTConfig
    except ImportError as error:
        libraries["trl"] = {"version": None, "reason": f"not importable: {error}"}
    else:
        fields = _field_choices(SFTConfig)
        libraries["trl"] = {
            "version": trl.__version__,
            "packing": "packing" in fields,
            "packing_strategies": fields.get("packing_strategy") or [],
            "padding_free": "padding_free" in fields,
        }
    return libraries


def sampling_kwargs(strategy: str, transformers_info: Mapping[str, Any]) -> dict[str, Any] | None:
    """TrainingArguments kwargs selecting a sampling strategy; None where the version lacks it."""
    field = transformers_info.get("sampling_field")
    if strategy not in (transformers_info.get("sampling_strategies") or []):
        return None
    if field == SAMPLING_FIELD:
        return {SAMPLING_FIELD: strategy}
    if field == LEGACY_GROUP_FLAG:
        return {LEGACY_GROUP_FLAG: strategy == HF_GROUP_BY_LENGTH}
    return None


# --------------------------------------------------------------------------------------------
# Snippets
# --------------------------------------------------------------------------------------------


def call_text(name: str, kwargs: Mapping[str, Any]) -> str:
    """``name(k=v, ...)`` with Python literals (the text a user pastes)."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


def _snippet(imports: list[str], args_line: str | None, trainer_lines: list[str]) -> dict[str, Any]:
    lines = [*imports, ""]
    if args_line:
        lines.append(args_line)
    lines += trainer_lines
    return {"imports": imports, "args": args_line, "text": "\n".join(lines).strip() + "\n"}


def _config_snippets(
    training_arguments: Mapping[str, Any] | None,
    sft_config: Mapping[str, Any] | None,
    trainer_expr: Mapping[str, str],
    extra_imports: list[str] | None = None,
    data_lines: list[str] | None = None,
) -> dict[str, Any]:
    """Snippets for the plain Trainer and for TRL's SFTTrainer."""
    out: dict[str, Any] = {}
    extra = extra_imports or []
    data = data_lines or []
    if training_arguments is not None:
        out["transformers"] = _snippet(
            ["from transformers import Trainer, TrainingArguments", *extra],
            "args = " + call_text("TrainingArguments", training_arguments),
            [*data, trainer_expr["transformers"]],
        )
    if sft_config is not None:
        out["trl"] = _snippet(
            ["from trl import SFTConfig, SFTTrainer", *extra],
            "args = " + call_text("SFTConfig", sft_config),
            [*data, trainer_expr["trl"]],
        )
    return out


# --------------------------------------------------------------------------------------------
# Changes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The user's run as configured: the numbers every change is compared with."""

    micro_batch_size: int
    grad_accum: int
    max_seq_len: int
    n_examples: int
    real_tokens: int
    longest: int  # longest example (tokens): the padded length of HF's first micro-batch

    @property
    def mean_length(self) -> float:
        return self.real_tokens / self.n_examples

    @property
    def tokens_per_update(self) -> float:
        """Real tokens per optimizer step (mean): examples per step × mean length."""
        return self.micro_batch_size * self.grad_accum * self.mean_length

    def training_arguments(self) -> dict[str, Any]:
        return {
            "per_device_train_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
        }

    def sft_config(self) -> dict[str, Any]:
        # SFTConfig's max_length defaults to 1024: state the run's own, or TRL truncates.
        return {**self.training_arguments(), "max_length": self.max_seq_len}


def baseline_from(recommendation: Mapping[str, Any], training: Mapping[str, Any]) -> Baseline:
    """The baseline from the bucket recommendation's input counts and the training section."""
    used = recommendation.get("input") or {}
    missing = [k for k in ("examples_used", "real_tokens") if k not in used]
    for key in ("micro_batch_size", "grad_accum", "max_seq_len"):
        if key not in training:
            missing.append(f"training.{key}")
    if missing:
        raise KeyError(
            f"recommendation/training lacks {missing}: pass results/bucket/recommendation.json "
            "(written by the bucket_sweep rule) and the config's training section"
        )
    shapes = recommendation.get("batch_shapes") or {}
    max_seq_len = int(training["max_seq_len"])
    return Baseline(
        micro_batch_size=int(training["micro_batch_size"]),
        grad_accum=int(training["grad_accum"]),
        max_seq_len=max_seq_len,
        n_examples=int(used["examples_used"]),
        real_tokens=int(used["real_tokens"]),
        longest=int(shapes.get("padded_length_max") or max_seq_len),
    )


def _tokens_per_update(before: float, after: float, how: str) -> dict[str, Any]:
    return {
        "before": float(before),
        "after": float(after),
        "ratio": float(after / before) if before > 0 else None,
        "how": how,
    }


def _estimate(point: Mapping[str, Any], random: Mapping[str, Any]) -> dict[str, Any]:
    keys = (
        "token_efficiency",
        "attention_efficiency",
        "padded_tokens_saved_vs_random",
        "attention_cost_saved_vs_random",
        "n_micro_batches",
        "diversity_rel_random",
        "micro_batch_padded_tokens_max",
    )
    return {
        "basis": "bucket sweep token counts (mean over seeds); estimated until the profile's "
        "replay measures time",
        **{k: point[k] for k in keys if point.get(k) is not None},
        "random_token_efficiency": random.get("token_efficiency"),
        "random_micro_batch_padded_tokens_max": random.get("micro_batch_padded_tokens_max"),
    }


def length_grouped_changes(
    recommendation: Mapping[str, Any], base: Baseline, transformers_info: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The recommended bucket size (drop-in sampler unless HF's fixed bucket equals it) and, when
    they differ, transformers' built-in group_by_length at its own bucket size."""
    recommended = recommendation.get("recommended") or {}
    random = recommendation.get("random") or {}
    m = int(recommended.get("bucket_size_batches", 1))
    m_all = orders.all_bucket_size(base.n_examples, base.micro_batch_size)
    m_hf = min(
        orders.hf_trainer_mega_batch_mult(base.n_examples, base.micro_batch_size, base.grad_accum),
        m_all,
    )
    mega_batch_mult = m_hf // base.grad_accum if m_hf < m_all else None
    builtin = sampling_kwargs(HF_GROUP_BY_LENGTH, transformers_info)
    hf_fact = (
        f"transformers {transformers_info.get('version')}: "
        f"{call_text('TrainingArguments', builtin) if builtin else 'no group_by_length option'}"
        " builds LengthGroupedSampler with batch = micro × grad_accum = "
        f"{base.micro_batch_size * base.grad_accum} and mega_batch_mult = min(n // (4 × batch), "
        f"{orders.HF_MAX_MEGA_BATCH_MULT}), a bucket of {m_hf} micro-batches for n = "
        f"{base.n_examples}; it cannot be set"
    )
    same_examples = _tokens_per_update(
        base.tokens_per_update,
        base.tokens_per_update,
        "unchanged: the same micro_batch_size × grad_accum examples per step, reordered",
    )
    changes: list[dict[str, Any]] = []
    status = recommendation.get("status")
    if m <= 1 or status == "nothing_to_gain":
        changes.append(
            {
                "id": "length_grouped",
                "applies": False,
                "reason": f"bucket sweep status {status!r}, bucket size {m}: nothing to gain",
            }
        )
        return changes
    expressible = builtin is not None and m == m_hf
    step_cv = recommended.get("step_real_tokens_cv")
    caveat = (
        f"source diversity per step {recommended.get('diversity_rel_random', float('nan')):.2f}× "
        "of random; neighbouring steps hold similar lengths (real tokens per step vary more: "
        f"CV {step_cv if step_cv is None else round(float(step_cv), 3)}); the loss is still "
        "normalised per token by the Trainer (num_items_in_batch)"
    )
    if expressible:
        ta = {**base.training_arguments(), **builtin}
        sft = {**base.sft_config(), **builtin}
        snippets = _config_snippets(
            ta,
            sft,
            {
                "transformers": "trainer = Trainer(model=model, args=args, "
                "train_dataset=train_dataset, data_collator=data_collator)",
                "trl": "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
            },
        )
        how = f"built in: {hf_fact} — which equals the recommended size"
        sampler = None
    else:
        ta = base.training_arguments()
        sft = base.sft_config()
        snippets = _config_snippets(
            ta,
            sft,
            {
                "transformers": "trainer = length_grouped_trainer(Trainer)(model=model, args=args, "
                "train_dataset=train_dataset, data_collator=data_collator, "
                f"bucket_size_batches={m})",
                "trl": "trainer = length_grouped_trainer(SFTTrainer)(model=model, args=args, "
                f"train_dataset=train_dataset, bucket_size_batches={m})",
            },
            extra_imports=["from probes.sampler import length_grouped_trainer"],
        )
        how = (
            f"not expressible in the Trainer's settings ({hf_fact}); the drop-in "
            f"probes.sampler.LengthGroupedSampler reproduces the measured ordering at {m}"
        )
        sampler = {
            "class": "probes.sampler.LengthGroupedSampler",
            "kwargs": {
                "micro_batch_size": base.micro_batch_size,
                "bucket_size_batches": m,
                "seed": "args.data_seed or args.seed",
            },
            "trainer_factory": "probes.sampler.length_grouped_trainer",
        }
    changes.append(
        {
            "id": "length_grouped",
            "applies": True,
            "title": f"Group batches by length: buckets of {m} micro-batches",
            "bucket_size_batches": m,
            "bucket_size_examples": min(m * base.micro_batch_size, base.n_examples),
            "expressible_in_training_arguments": expressible,
            "how": how,
            "training_arguments": ta,
            "sft_config": sft,
            "sampler": sampler,
            "snippets": snippets,
            "tokens_per_update": same_examples,
            "estimate": _estimate(recommended, random),
            "caveat": caveat,
        }
    )
    hf_point = recommendation.get("hf_trainer_default")
    if builtin is not None and not expressible and hf_point:
        changes.append(
            {
                "id": "group_by_length_builtin",
                "applies": True,
                "title": (
                    f"Built-in alternative: group_by_length (its fixed bucket of {m_hf} "
                    "micro-batches)"
                ),
                "bucket_size_batches": m_hf,
                "mega_batch_mult": mega_batch_mult,
                "expressible_in_training_arguments": True,
                "how": hf_fact,
                "training_arguments": {**base.training_arguments(), **builtin},
                "sft_config": {**base.sft_config(), **builtin},
                "sampler": None,
                "snippets": _config_snippets(
                    {**base.training_arguments(), **builtin},
                    {**base.sft_config(), **builtin},
                    {
                        "transformers": "trainer = Trainer(model=model, args=args, "
                        "train_dataset=train_dataset, data_collator=data_collator)",
                        "trl": "trainer = SFTTrainer(model=model, args=args, "
                        "train_dataset=train_dataset)",
                    },
                ),
                "tokens_per_update": same_examples,
                "estimate": _estimate(hf_point, random),
                "caveat": (
                    f"not the recommended size ({m}); its shuffle draws from the global torch "
                    "RNG (the Trainer passes no generator), seeded by args.seed at Trainer init"
                ),
            }
        )
    return changes


def batch_rebalance_change(
    recommendation: Mapping[str, Any], base: Baseline, transformers_info: Mapping[str, Any]
) -> dict[str, Any]:
    """transformers' batch_rebalance sampler, priced by the sweep's batch_rebalance row."""
    point = recommendation.get(BATCH_REBALANCE)
    kwargs = sampling_kwargs(HF_BATCH_REBALANCE, transformers_info)
    if kwargs is None or not point:
        return {
            "id": BATCH_REBALANCE,
            "applies": False,
            "reason": (
                f"transformers {transformers_info.get('version')} has no "
                "train_sampling_strategy='batch_rebalance'"
                if kwargs is None
                else "the bucket sweep has no batch_rebalance row"
            ),
        }
    random = recommendation.get("random") or {}
    ta = {**base.training_arguments(), **kwargs}
    sft = {**base.sft_config(), **kwargs}
    recommended = recommendation.get("recommended") or {}
    rows_max = int(point.get("micro_batch_rows_max", base.micro_batch_size))
    return {
        "id": BATCH_REBALANCE,
        "applies": True,
        "title": "transformers' batch_rebalance sampler (variable micro-batch size)",
        "expressible_in_training_arguments": True,
        "how": (
            f"{call_text('TrainingArguments', kwargs)}: per step, micro × grad_accum shuffled "
            "examples sorted by length and split into grad_accum micro-batches of varying size "
            "that balance bs·max_len + 0.001·bs·max_len²"
        ),
        "training_arguments": ta,
        "sft_config": sft,
        "sampler": None,
        "snippets": _config_snippets(
            ta,
            sft,
            {
                "transformers": "trainer = Trainer(model=model, args=args, "
                "train_dataset=train_dataset, data_collator=data_collator)",
                "trl": "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
            },
        ),
        "tokens_per_update": _tokens_per_update(
            base.tokens_per_update,
            base.tokens_per_update,
            "unchanged: the effective batch (micro × grad_accum × world size) is fixed",
        ),
        "estimate": _estimate(point, random),
        "beside_recommended": {
            "recommended_bucket_size_batches": recommended.get("bucket_size_batches"),
            "recommended_token_efficiency": recommended.get("token_efficiency"),
            "recommended_attention_efficiency": recommended.get("attention_efficiency"),
            "batch_rebalance_token_efficiency": point.get("token_efficiency"),
            "batch_rebalance_attention_efficiency": point.get("attention_efficiency"),
        },
        "caveat": (
            f"micro-batches hold 1 to {rows_max} examples (configured {base.micro_batch_size}): "
            "peak memory follows the largest micro-batch's padded tokens, not the batch size; "
            "the Trainer seeds its shuffle with the class default 42 (+ epoch), not args.seed; "
            "data-parallel only"
        ),
    }


def packing_plan(base: Baseline, n_bins: int) -> dict[str, Any]:
    """Packed rows per micro-batch and grad_accum keeping real tokens per update comparable.

    The micro-batch holds at most what the baseline's first micro-batch held (micro × longest
    padded tokens, which already fits: HF puts the longest example first), at least one row;
    grad_accum then brings the step's real tokens nearest the baseline's.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be ≥ 1, got {n_bins}")
    fill = base.real_tokens / n_bins  # real tokens per packed row
    target_rows = base.tokens_per_update / fill
    rows = max(1, (base.micro_batch_size * base.longest) // base.max_seq_len)
    if rows > target_rows:
        rows = max(1, round(target_rows))
    accum = max(1, round(target_rows / rows))
    return {
        "per_device_train_batch_size": int(rows),
        "gradient_accumulation_steps": int(accum),
        "real_tokens_per_row": float(fill),
        "rows_per_update_target": float(target_rows),
        "tokens_per_update_after": float(rows * accum * fill),
    }


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
        "max_length": base.max_seq_len,
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
        "snippets": _config_snippets(
            None,
            sft,
            {
                "trl": "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
            },
        ),
        "tokens_per_update": {
            **_tokens_per_update(
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
            **_estimate(point, random),
            "n_bins": int(point["n_bins"]),
            "strategy": SWEEP_PACKING_ROW,
        },
        "caveat": (
            "needs attention that keeps the packed documents apart: flash-attention varlen kernels "
            "read position_ids; SDPA/eager get a block-diagonal mask from transformers (dense "
            "cost, no is_causal fast path; see the mask gate's packed scenario); examples per "
            "step now vary"
        ),
    }


def drop_no_loss_change(no_loss_examples: int | None, base: Baseline) -> dict[str, Any]:
    """Filter out examples whose labels are all ignored: a data change, no trainer setting."""
    if not no_loss_examples:
        return {
            "id": "drop_no_loss_examples",
            "applies": False,
            "reason": "no example without a loss token"
            if no_loss_examples == 0
            else "not counted (needs the padding stage's lengths)",
        }
    keep = f"lambda example: any(label != {IGNORE_INDEX} for label in example['labels'])"
    return {
        "id": "drop_no_loss_examples",
        "applies": True,
        "title": f"Drop the {int(no_loss_examples)} examples that carry no loss token",
        "expressible_in_training_arguments": False,
        "how": "filter the tokenised training set on its labels before training",
        "training_arguments": base.training_arguments(),
        "sft_config": base.sft_config(),
        "sampler": None,
        "snippets": {
            "transformers": _snippet(
                ["from transformers import Trainer, TrainingArguments"],
                "args = " + call_text("TrainingArguments", base.training_arguments()),
                [
                    f"train_dataset = train_dataset.filter({keep})",
                    "trainer = Trainer(model=model, args=args, train_dataset=train_dataset, "
                    "data_collator=data_collator)",
                ],
            ),
            "trl": _snippet(
                ["from trl import SFTConfig, SFTTrainer"],
                "args = " + call_text("SFTConfig", base.sft_config()),
                [
                    "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
                    f"trainer.train_dataset = trainer.train_dataset.filter({keep})",
                ],
            ),
        },
        "tokens_per_update": _tokens_per_update(
            base.tokens_per_update,
            base.tokens_per_update,
            "examples per step unchanged; fewer steps",
        ),
        "estimate": None,
        "caveat": (
            "TRL's SFTTrainer (1.16) already drops examples left fully masked by truncation when "
            "it truncates (packing off), so its filter line is a guard there; with "
            "assistant_only_loss=True it raises on an example with no assistant token at all; "
            "with packing on it keeps them: filter the data before the trainer"
        ),
    }


# --------------------------------------------------------------------------------------------
# Verification against the installed classes
# --------------------------------------------------------------------------------------------


def _cuda_bf16() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def verify_snippet(snippet: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Execute the snippet's imports and its ``args = ...`` line; read every kwarg back.

    Checks what construction alone does not: a value outside a field's declared ``choices``
    (TrainingArguments accepts ``train_sampling_strategy="bogus"`` silently). Without a CUDA
    bf16 device, SFTConfig's default ``bf16=True`` refuses to construct, so the classes get
    ``use_cpu=True`` added (said in the reason).
    """
    namespace: dict[str, Any] = {}
    note = ""
    try:
        exec("\n".join(snippet["imports"]), namespace)
        if not _cuda_bf16():
            note = "; constructed with use_cpu=True added (no CUDA bf16 device here)"
            for name in ("TrainingArguments", "SFTConfig"):
                if name in namespace:
                    namespace[name] = _with_use_cpu(namespace[name])
        exec(snippet["args"], namespace)
    except Exception as error:  # any failure is the answer: report it, never crash the stage
        return {"verified": False, "reason": f"{type(error).__name__}: {error}"}
    args = namespace["args"]
    choices = _field_choices(type(args))
    problems = []
    for key, value in kwargs.items():
        if getattr(args, key, object()) != value:
            problems.append(f"{key}: set {value!r}, object has {getattr(args, key, None)!r}")
        allowed = choices.get(key)
        if allowed is not None and str(value) not in allowed:
            problems.append(f"{key}={value!r} is not one of {allowed}")
    if problems:
        return {"verified": False, "reason": "; ".join(problems)}
    return {
        "verified": True,
        "reason": f"constructed {type(args).__name__} from the snippet; every kwarg read back"
        + note,
    }


def _with_use_cpu(cls: type) -> Any:
    def build(*args: Any, **kwargs: Any) -> Any:
        return cls(*args, **{"use_cpu": True, **kwargs})

    return build


def verify_change(change: Mapping[str, Any]) -> dict[str, Any]:
    """Verification of every snippet of one change: {library: {verified, reason}}."""
    results: dict[str, Any] = {}
    for library, key in (("transformers", "training_arguments"), ("trl", "sft_config")):
        snippet = (change.get("snippets") or {}).get(library)
        kwargs = change.get(key)
        if snippet is None or kwargs is None:
            results[library] = {"verified": None, "reason": "no setting for this library"}
            continue
        module = "transformers" if library == "transformers" else "trl"
        try:
            __import__(module)
        except ImportError:
            results[library] = {"verified": False, "reason": f"{module} is not installed here"}
            continue
        results[library] = verify_snippet(snippet, kwargs)
    return results


def verify_document(document: dict[str, Any]) -> dict[str, Any]:
    """Adds ``verification`` and ``verified`` to every applicable change (in place; returned)."""
    for change in document["changes"]:
        if not change.get("applies"):
            continue
        results = verify_change(change)
        change["verification"] = results
        checked = [r["verified"] for r in results.values() if r["verified"] is not None]
        change["verified"] = bool(checked) and all(checked)
    return document


# --------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------


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
