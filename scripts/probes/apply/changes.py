"""Each change the bucket stage's recommendation supports, as settings for the user's trainer.

The run as configured (``Baseline``) and one builder per change: length-grouped batching at the
recommended bucket size and transformers' built-in ``group_by_length`` at its fixed bucket
(``length_grouped_changes``), ``batch_rebalance``, dropping examples with no loss token, the
replay's step-level changes; TRL packing has its own module (``probes.apply.packing``). Each change
carries its ``TrainingArguments``/``SFTConfig`` kwargs, snippets, tokens per update, the sweep's
estimate and its caveat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from probes.apply.libraries import (
    HF_BATCH_REBALANCE,
    HF_GROUP_BY_LENGTH,
    sampling_kwargs,
    sft_checkpointing,
)
from probes.apply.snippets import call_text, config_snippets, snippet
from probes.batching import orders
from probes.contracts import BATCH_REBALANCE
from probes.step import padding_free

IGNORE_INDEX = -100
# the trainer line of a change that is settings alone (no sampler or wrapper of its own)
PLAIN_TRAINER_LINES = {
    "transformers": "trainer = Trainer(model=model, args=args, "
    "train_dataset=train_dataset, data_collator=data_collator)",
    "trl": "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
}


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The user's run as configured: the numbers every change is compared with."""

    micro_batch_size: int
    grad_accum: int
    max_seq_len: int
    n_examples: int
    real_tokens: int
    longest: int  # longest example (tokens): the padded length of HF's first micro-batch
    # the run's own gradient checkpointing (run_checkpointing); None: the probes did not see it
    gradient_checkpointing: bool | None = None

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
        # SFTConfig's max_length defaults to 1024: state the run's own, or TRL truncates; and
        # the run's checkpointing, or TRL's default turns recomputation on (sft_checkpointing)
        return {
            **self.training_arguments(),
            "max_length": self.max_seq_len,
            **sft_checkpointing(self.gradient_checkpointing),
        }


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
        gradient_checkpointing=training.get("gradient_checkpointing"),
    )


def run_checkpointing(
    step_changes: list[Mapping[str, Any]] | None, recorded: Mapping[str, Any] | None = None
) -> bool | None:
    """The user's run's own gradient checkpointing: the trainer's step as the padding stage
    recorded it (probes.step.changes.config_record), else the state the replay's checkpointing
    change flipped (gradient_checkpointing_on: the run had it off); None where neither ran."""
    from probes.step.changes import GC_OFF, GC_ON

    if recorded and recorded.get("gradient_checkpointing") is not None:
        return bool(recorded["gradient_checkpointing"])
    flipped = {str(c.get("strategy")) for c in step_changes or []}
    if GC_ON in flipped:
        return False
    return True if GC_OFF in flipped else None


def tokens_per_update_entry(before: float, after: float, how: str) -> dict[str, Any]:
    return {
        "before": float(before),
        "after": float(after),
        "ratio": float(after / before) if before > 0 else None,
        "how": how,
    }


def sweep_estimate(point: Mapping[str, Any], random: Mapping[str, Any]) -> dict[str, Any]:
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


@dataclasses.dataclass(frozen=True)
class _BuiltinBucket:
    """transformers' own group_by_length on this run: its kwargs (None where the installed
    version has none), its fixed bucket in micro-batches, and how it is built, in words."""

    kwargs: dict[str, Any] | None
    size: int  # micro-batches
    mega_batch_mult: int | None  # None where the bucket holds the whole dataset
    fact: str


def _builtin_bucket(base: Baseline, transformers_info: Mapping[str, Any]) -> _BuiltinBucket:
    m_all = orders.all_bucket_size(base.n_examples, base.micro_batch_size)
    m_hf = min(
        orders.hf_trainer_mega_batch_mult(base.n_examples, base.micro_batch_size, base.grad_accum),
        m_all,
    )
    builtin = sampling_kwargs(HF_GROUP_BY_LENGTH, transformers_info)
    fact = (
        f"transformers {transformers_info.get('version')}: "
        f"{call_text('TrainingArguments', builtin) if builtin else 'no group_by_length option'}"
        " builds LengthGroupedSampler with batch = micro × grad_accum = "
        f"{base.micro_batch_size * base.grad_accum} and mega_batch_mult = min(n // (4 × batch), "
        f"{orders.HF_MAX_MEGA_BATCH_MULT}), a bucket of {m_hf} micro-batches for n = "
        f"{base.n_examples}; it cannot be set"
    )
    mega_batch_mult = m_hf // base.grad_accum if m_hf < m_all else None
    return _BuiltinBucket(builtin, m_hf, mega_batch_mult, fact)


def _same_examples(base: Baseline) -> dict[str, Any]:
    return tokens_per_update_entry(
        base.tokens_per_update,
        base.tokens_per_update,
        "unchanged: the same micro_batch_size × grad_accum examples per step, reordered",
    )


def _grouping_caveat(recommended: Mapping[str, Any]) -> str:
    step_cv = recommended.get("step_real_tokens_cv")
    return (
        f"source diversity per step {recommended.get('diversity_rel_random', float('nan')):.2f}× "
        "of random; neighbouring steps hold similar lengths (real tokens per step vary more: "
        f"CV {step_cv if step_cv is None else round(float(step_cv), 3)}); the loss is still "
        "normalised per token by the Trainer (num_items_in_batch)"
    )


def _builtin_settings(base: Baseline, bucket: _BuiltinBucket) -> dict[str, Any]:
    """The recommended size is the built-in one: a TrainingArguments setting."""
    ta = {**base.training_arguments(), **(bucket.kwargs or {})}
    sft = {**base.sft_config(), **(bucket.kwargs or {})}
    return {
        "how": f"built in: {bucket.fact} — which equals the recommended size",
        "training_arguments": ta,
        "sft_config": sft,
        "sampler": None,
        "snippets": config_snippets(ta, sft, PLAIN_TRAINER_LINES),
    }


def _drop_in_settings(base: Baseline, bucket: _BuiltinBucket, m: int) -> dict[str, Any]:
    """Another size than the built-in one: the drop-in sampler at the recommended size."""
    ta, sft = base.training_arguments(), base.sft_config()
    trainer_lines = {
        "transformers": "trainer = length_grouped_trainer(Trainer)(model=model, args=args, "
        "train_dataset=train_dataset, data_collator=data_collator, "
        f"bucket_size_batches={m})",
        "trl": "trainer = length_grouped_trainer(SFTTrainer)(model=model, args=args, "
        f"train_dataset=train_dataset, bucket_size_batches={m})",
    }
    return {
        "how": (
            f"not expressible in the Trainer's settings ({bucket.fact}); the drop-in "
            f"probes.sampler.LengthGroupedSampler reproduces the measured ordering at {m}"
        ),
        "training_arguments": ta,
        "sft_config": sft,
        "sampler": {
            "class": "probes.sampler.LengthGroupedSampler",
            "kwargs": {
                "micro_batch_size": base.micro_batch_size,
                "bucket_size_batches": m,
                "seed": "args.data_seed or args.seed",
            },
            "trainer_factory": "probes.sampler.length_grouped_trainer",
        },
        "snippets": config_snippets(
            ta,
            sft,
            trainer_lines,
            extra_imports=["from probes.sampler import length_grouped_trainer"],
        ),
    }


def _recommended_grouping(
    recommendation: Mapping[str, Any], base: Baseline, bucket: _BuiltinBucket, m: int
) -> dict[str, Any]:
    """Length grouping at the recommended bucket size: built in where it equals the Trainer's
    fixed bucket, else the drop-in sampler."""
    recommended = recommendation.get("recommended") or {}
    expressible = bucket.kwargs is not None and m == bucket.size
    settings = (
        _builtin_settings(base, bucket) if expressible else _drop_in_settings(base, bucket, m)
    )
    return {
        "id": "length_grouped",
        "applies": True,
        "title": f"Group batches by length: buckets of {m} micro-batches",
        "bucket_size_batches": m,
        "bucket_size_examples": min(m * base.micro_batch_size, base.n_examples),
        "expressible_in_training_arguments": expressible,
        "how": settings["how"],
        "training_arguments": settings["training_arguments"],
        "sft_config": settings["sft_config"],
        "sampler": settings["sampler"],
        "snippets": settings["snippets"],
        "tokens_per_update": _same_examples(base),
        "estimate": sweep_estimate(recommended, recommendation.get("random") or {}),
        "caveat": _grouping_caveat(recommended),
    }


def _builtin_alternative(
    recommendation: Mapping[str, Any], base: Baseline, bucket: _BuiltinBucket, m: int
) -> dict[str, Any]:
    """transformers' built-in group_by_length at its own fixed bucket (not the recommended)."""
    ta = {**base.training_arguments(), **(bucket.kwargs or {})}
    sft = {**base.sft_config(), **(bucket.kwargs or {})}
    return {
        "id": "group_by_length_builtin",
        "applies": True,
        "title": (
            f"Built-in alternative: group_by_length (its fixed bucket of {bucket.size} "
            "micro-batches)"
        ),
        "bucket_size_batches": bucket.size,
        "mega_batch_mult": bucket.mega_batch_mult,
        "expressible_in_training_arguments": True,
        "how": bucket.fact,
        "training_arguments": ta,
        "sft_config": sft,
        "sampler": None,
        "snippets": config_snippets(ta, sft, PLAIN_TRAINER_LINES),
        "tokens_per_update": _same_examples(base),
        "estimate": sweep_estimate(
            recommendation["hf_trainer_default"], recommendation.get("random") or {}
        ),
        "caveat": (
            f"not the recommended size ({m}); its shuffle draws from the global torch "
            "RNG (the Trainer passes no generator), seeded by args.seed at Trainer init"
        ),
    }


def length_grouped_changes(
    recommendation: Mapping[str, Any], base: Baseline, transformers_info: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The recommended bucket size (drop-in sampler unless HF's fixed bucket equals it) and, when
    they differ, transformers' built-in group_by_length at its own bucket size."""
    m = int((recommendation.get("recommended") or {}).get("bucket_size_batches", 1))
    status = recommendation.get("status")
    if m <= 1 or status == "nothing_to_gain":
        reason = f"bucket sweep status {status!r}, bucket size {m}: nothing to gain"
        return [{"id": "length_grouped", "applies": False, "reason": reason}]
    bucket = _builtin_bucket(base, transformers_info)
    changes = [_recommended_grouping(recommendation, base, bucket, m)]
    expressible = changes[0]["expressible_in_training_arguments"]
    if bucket.kwargs is not None and not expressible and recommendation.get("hf_trainer_default"):
        changes.append(_builtin_alternative(recommendation, base, bucket, m))
    return changes


def batch_rebalance_change(
    recommendation: Mapping[str, Any], base: Baseline, transformers_info: Mapping[str, Any]
) -> dict[str, Any]:
    """transformers' batch_rebalance sampler: priced by the replay of its own plan (the
    micro-batches its sampler yields, probes.batching.plans); the sweep's batch_rebalance row is
    its token model (``estimate``), shown beside the measurement (probes.apply.model_check)."""
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
                else recommendation.get("batch_rebalance_not_run")
                or "the bucket sweep has no batch_rebalance row"
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
        "snippets": config_snippets(
            ta,
            sft,
            PLAIN_TRAINER_LINES,
        ),
        "tokens_per_update": tokens_per_update_entry(
            base.tokens_per_update,
            base.tokens_per_update,
            "unchanged: the effective batch (micro × grad_accum × world size) is fixed",
        ),
        "estimate": sweep_estimate(point, random),
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
            "transformers": snippet(
                ["from transformers import Trainer, TrainingArguments"],
                "args = " + call_text("TrainingArguments", base.training_arguments()),
                [
                    f"train_dataset = train_dataset.filter({keep})",
                    "trainer = Trainer(model=model, args=args, train_dataset=train_dataset, "
                    "data_collator=data_collator)",
                ],
            ),
            "trl": snippet(
                ["from trl import SFTConfig, SFTTrainer"],
                "args = " + call_text("SFTConfig", base.sft_config()),
                [
                    "trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset)",
                    f"trainer.train_dataset = trainer.train_dataset.filter({keep})",
                ],
            ),
        },
        "tokens_per_update": tokens_per_update_entry(
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


# SFTConfig fields a step-level change may set that TrainingArguments lacks
SFT_ONLY_SETTINGS = ("max_length", "loss_type")
# ...of which these have no TrainingArguments counterpart at all (no Trainer snippet)
SFT_ONLY_CHANGES = ("loss_type",)
STEP_LEVEL_CAVEAT = (
    "a step-level change: measured on the baseline's micro-batches with the step set as the "
    "trainer sets it"
)
PADDING_FREE_CAVEAT = (
    "TRL 1.16's SFTTrainer refuses padding_free=True beside a max_length unless packing, so "
    "max_length is pasted unset: truncate examples longer than max_seq_len in your data first "
    "(the padding stage counts them as TRUNCATED), and filter the examples with no loss token as "
    "drop_no_loss_examples does (TRL drops them only when it truncates)"
)


def model_imports(attention: str | None) -> list[str]:
    """The import the pasted model line needs (where a change loads the model itself)."""
    return ["from transformers import AutoModelForCausalLM"] if attention else []


def step_level_changes(
    step_changes: list[Mapping[str, Any]] | None, base: Baseline
) -> list[dict[str, Any]]:
    """The replay's step-level changes (probes.step.changes, its provenance's ``step_changes``)
    as settings that paste: TrainingArguments / SFTConfig fields, or the model's
    ``attn_implementation`` (``model_kwargs``: ``from_pretrained``'s, the one home for both
    trainers; not SFTConfig's ``model_init_kwargs``, which SFTTrainer ignores, with a warning,
    for the loaded model the snippets pass; `trl sft` takes them as flags)."""
    out = []
    for change in step_changes or []:
        settings = dict(change.get("settings") or {})
        attention = settings.pop("attn_implementation", None)
        harness = settings.pop("harness_options", None)  # the harness's own (loss kernel)
        flat = settings.pop("padding_free", False)  # SFTConfig's only (probes.step.padding_free)
        drop = settings.pop("drop_no_loss_examples", False)  # a data step, not a field
        sft_flat, trainer_lines, flat_imports = padding_free.pasted(flat, PLAIN_TRAINER_LINES)
        sft_only = {k: settings.pop(k) for k in SFT_ONLY_SETTINGS if k in settings}
        ta = (
            None
            if set(sft_only) & set(SFT_ONLY_CHANGES)
            else {**base.training_arguments(), **settings}
        )
        sft = {**base.sft_config(), **settings, **sft_only, **sft_flat}
        model_line = [f"# profile.harness_options: {harness!r}"] if harness else []
        if attention:
            model_line = [
                "model = AutoModelForCausalLM.from_pretrained(model_dir, "
                f"attn_implementation={attention!r})"
            ]
        out.append(
            {
                "id": str(change["strategy"]),
                "applies": True,
                "step_level": True,
                "title": str(change.get("title") or change["strategy"]),
                "expressible_in_training_arguments": bool(ta)
                and not (attention or harness or flat),
                "how": str(change.get("title") or change["strategy"]),
                "training_arguments": ta,
                "sft_config": sft,
                "model_kwargs": {"attn_implementation": attention} if attention else None,
                "sampler": None,
                "snippets": config_snippets(
                    ta,
                    sft,
                    trainer_lines,
                    extra_imports=[*flat_imports, *model_imports(attention)],
                    data_lines=model_line,
                ),
                "tokens_per_update": tokens_per_update_entry(
                    base.tokens_per_update,
                    base.tokens_per_update,
                    "unchanged: micro-batch size × gradient accumulation is kept",
                ),
                "estimate": None,
                "caveat": "; ".join((STEP_LEVEL_CAVEAT, *([PADDING_FREE_CAVEAT] if flat else []))),
                "drop_no_loss_examples": bool(drop),
            }
        )
    return out
