"""probes.apply.document and its parts (apply_changes, apply_libraries, apply_snippets): every
recommended
change as settings that paste into the installed libraries."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from probes.apply import changes as apply_changes
from probes.apply import document as apply
from probes.apply import libraries as apply_libraries
from probes.apply import packing as apply_packing
from probes.apply import snippets as apply_snippets
from probes.batching import orders
from probes.bucket import control as bucket_controls
from probes.bucket import sweep as bucket
from probes.contracts import TRAINING_STATUSES
from probes.lengths import lengths_from_frame

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

TRAINING = {"micro_batch_size": 2, "grad_accum": 8, "max_seq_len": 4096}


def bucket_recommendation(n: int = 3000, seed: int = 0) -> dict[str, Any]:
    """What the bucket stage writes (recommendation.json), from synthetic heavy-tailed lengths."""
    frame = bucket_controls.synthetic_lengths_frame(
        n, seed=seed, max_seq_len=TRAINING["max_seq_len"]
    )
    data = lengths_from_frame(frame, TRAINING["max_seq_len"])
    sweep = bucket.sweep_bucket_sizes(
        data, TRAINING["micro_batch_size"], TRAINING["grad_accum"], TRAINING["max_seq_len"], [0, 1]
    )
    recommendation = bucket.recommend(sweep, gain_share=0.9, min_diversity_share=0.8)
    recommendation["input"] = {
        "examples_used": int(data.lengths.size),
        "real_tokens": int(data.lengths.sum()),
    }
    return recommendation


@pytest.fixture(scope="module")
def recommendation() -> dict[str, Any]:
    return bucket_recommendation()


@pytest.fixture(scope="module")
def document(recommendation) -> dict[str, Any]:
    return apply.recommendations_document(
        recommendation, TRAINING, apply_libraries.installed_libraries(), no_loss_examples=12
    )


def changes_by_id(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {change["id"]: change for change in document["changes"]}


def build(cls: type, kwargs: dict[str, Any]) -> Any:
    """Construct a config the way the user would, on this machine (no GPU: use_cpu)."""
    return cls(output_dir="unused", use_cpu=True, **kwargs)


def test_installed_libraries_are_read_from_the_classes():
    libraries = apply_libraries.installed_libraries()
    assert libraries["transformers"]["version"] == transformers.__version__
    assert libraries["trl"]["version"] == trl.__version__
    fields = {f.name for f in __import__("dataclasses").fields(transformers.TrainingArguments)}
    if "train_sampling_strategy" in fields:  # transformers 5
        assert "group_by_length" not in fields
        assert libraries["transformers"]["sampling_field"] == "train_sampling_strategy"
        assert {"group_by_length", "batch_rebalance"} <= set(
            libraries["transformers"]["sampling_strategies"]
        )
    assert "bfd" in libraries["trl"]["packing_strategies"]


def test_every_applicable_change_is_verified_against_the_real_classes(document):
    applicable = [c for c in document["changes"] if c["applies"]]
    assert {c["id"] for c in applicable} >= {"length_grouped", "packing", "drop_no_loss_examples"}
    for change in applicable:
        assert change["verified"] is True, (change["id"], change["verification"])
        if change["training_arguments"] is not None:
            args = build(transformers.TrainingArguments, change["training_arguments"])
            for key, value in change["training_arguments"].items():
                assert getattr(args, key) == value
        config = build(trl.SFTConfig, change["sft_config"])
        for key, value in change["sft_config"].items():
            assert getattr(config, key) == value
        # The snippet holds the very kwargs, and its text compiles.
        for library, snippet in change["snippets"].items():
            compile(snippet["text"], f"<{change['id']} {library}>", "exec")
            kwargs = change["training_arguments" if library == "transformers" else "sft_config"]
            for key, value in kwargs.items():
                assert f"{key}={value!r}" in snippet["args"]


def test_document_is_strict_json(document):
    text = apply.dumps(document)
    assert json.loads(text)["schema_version"] == apply.SCHEMA_VERSION


def test_recommended_size_not_expressible_points_to_the_drop_in_sampler(recommendation, document):
    m = recommendation["recommended"]["bucket_size_batches"]
    n = recommendation["input"]["examples_used"]
    m_hf = orders.hf_trainer_mega_batch_mult(
        n, TRAINING["micro_batch_size"], TRAINING["grad_accum"]
    )
    assert m != m_hf  # this data recommends a size the Trainer cannot set
    change = changes_by_id(document)["length_grouped"]
    assert change["expressible_in_training_arguments"] is False
    assert change["sampler"]["class"] == "probes.sampler.LengthGroupedSampler"
    assert f"bucket_size_batches={m}" in change["snippets"]["transformers"]["text"]
    assert "train_sampling_strategy" not in change["training_arguments"]
    assert "cannot be set" in change["how"]
    builtin = changes_by_id(document)["group_by_length_builtin"]
    assert builtin["bucket_size_batches"] == m_hf
    assert builtin["training_arguments"]["train_sampling_strategy"] == "group_by_length"
    assert builtin["estimate"]["token_efficiency"] == pytest.approx(
        recommendation["hf_trainer_default"]["token_efficiency"]
    )


def test_recommended_size_equal_to_hf_default_uses_the_builtin_setting(recommendation):
    n = recommendation["input"]["examples_used"]
    m_hf = orders.hf_trainer_mega_batch_mult(
        n, TRAINING["micro_batch_size"], TRAINING["grad_accum"]
    )
    same = {
        **recommendation,
        "recommended": {**recommendation["recommended"], "bucket_size_batches": m_hf},
    }
    document = apply.recommendations_document(same, TRAINING, apply_libraries.installed_libraries())
    by_id = changes_by_id(document)
    change = by_id["length_grouped"]
    assert change["expressible_in_training_arguments"] is True
    assert change["sampler"] is None
    assert change["training_arguments"]["train_sampling_strategy"] == "group_by_length"
    assert change["verified"] is True
    assert "group_by_length_builtin" not in by_id


def test_legacy_transformers_gets_the_boolean_flag():
    legacy = {"version": "4.56.0", "sampling_field": "group_by_length"}
    legacy["sampling_strategies"] = ["random", "group_by_length"]
    assert apply_libraries.sampling_kwargs("group_by_length", legacy) == {"group_by_length": True}
    assert apply_libraries.sampling_kwargs("batch_rebalance", legacy) is None


def test_batch_rebalance_needs_the_strategy_and_the_sweep_row(recommendation):
    libraries = apply_libraries.installed_libraries()
    legacy = {
        **libraries,
        "transformers": {
            "version": "4.56.0",
            "sampling_field": "group_by_length",
            "sampling_strategies": ["random", "group_by_length"],
        },
    }
    document = apply.recommendations_document(recommendation, TRAINING, legacy, verify=False)
    change = changes_by_id(document)["batch_rebalance"]
    assert change["applies"] is False and "batch_rebalance" in change["reason"]
    current = changes_by_id(
        apply.recommendations_document(recommendation, TRAINING, libraries, verify=False)
    )["batch_rebalance"]
    assert current["applies"] is True
    assert current["training_arguments"]["train_sampling_strategy"] == "batch_rebalance"
    assert current["tokens_per_update"]["ratio"] == 1.0
    assert current["beside_recommended"]["batch_rebalance_token_efficiency"] == pytest.approx(
        recommendation["batch_rebalance"]["token_efficiency"]
    )


def test_packing_keeps_tokens_per_update_comparable(recommendation, document):
    change = changes_by_id(document)["packing"]
    config = change["sft_config"]
    assert config["packing"] is True and config["packing_strategy"] == "bfd"
    assert config["max_length"] == TRAINING["max_seq_len"]
    assert change["training_arguments"] is None  # the plain Trainer has no packing setting
    tokens = change["tokens_per_update"]
    real = recommendation["input"]["real_tokens"]
    n = recommendation["input"]["examples_used"]
    assert tokens["before"] == pytest.approx(2 * 8 * real / n)
    n_bins = recommendation["packing"]["packing_bfd"]["n_bins"]
    rows = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
    assert tokens["after"] == pytest.approx(rows * real / n_bins)
    # The nearest whole number of packed rows: within half a row of the baseline.
    assert abs(tokens["after"] - tokens["before"]) <= 0.5 * real / n_bins + 1e-9


@pytest.mark.parametrize(
    ("micro", "grad_accum", "mean", "longest", "max_seq_len", "fill", "rows", "accum"),
    [
        (2, 8, 470, 4096, 4096, 4091, 2, 1),  # short chat data: ~1.8 rows per step
        (8, 16, 1000, 4096, 4096, 4000, 8, 4),  # 32 rows per step, 8 fit per micro-batch
        (1, 1, 100, 300, 4096, 4000, 1, 1),  # less than one row per step: one row
    ],
)
def test_packing_plan(micro, grad_accum, mean, longest, max_seq_len, fill, rows, accum):
    base = apply_changes.Baseline(micro, grad_accum, max_seq_len, 1000, mean * 1000, longest)
    plan = apply_packing.packing_plan(base, n_bins=round(mean * 1000 / fill))
    assert (plan["per_device_train_batch_size"], plan["gradient_accumulation_steps"]) == (
        rows,
        accum,
    )
    # A packed micro-batch never holds more tokens than the baseline's longest micro-batch.
    assert rows * max_seq_len <= max(micro * longest, max_seq_len)


def test_no_loss_filter_keeps_examples_with_a_loss_token(document):
    change = changes_by_id(document)["drop_no_loss_examples"]
    line = next(
        line
        for line in change["snippets"]["transformers"]["text"].splitlines()
        if ".filter(" in line
    )
    keep = eval(line.split(".filter(", 1)[1][:-1])
    assert keep({"labels": [-100, -100, 7]}) is True
    assert keep({"labels": [-100, -100]}) is False
    empty = apply.recommendations_document(
        bucket_recommendation(600), TRAINING, apply_libraries.installed_libraries(), 0, verify=False
    )
    assert changes_by_id(empty)["drop_no_loss_examples"]["applies"] is False


def test_packing_says_sftconfig_defaults_are_not_the_trainers(document):
    caveat = changes_by_id(document)["packing"]["caveat"]
    assert "activation_checkpointing" in caveat and "bf16=True" in caveat
    assert "entropy and token accuracy" in caveat  # TRL's own step cost, not promised


def test_grouped_changes_say_what_no_loss_micro_batches_do_to_the_logged_loss(document):
    grouped = [c for c in document["changes"] if c["id"] in apply.GROUPED and c.get("applies")]
    assert grouped
    for change in grouped:
        assert "12 examples that carry no loss token" in change["caveat"]
        assert "drop_no_loss_examples" in change["caveat"]
    others = [c for c in document["changes"] if c["id"] not in apply.GROUPED and c.get("caveat")]
    assert all("NaN" not in c["caveat"] for c in others)
    none = apply.recommendations_document(
        bucket_recommendation(), TRAINING, apply_libraries.installed_libraries(), 0, verify=False
    )
    assert all("NaN" not in (c.get("caveat") or "") for c in none["changes"])


def test_count_no_loss_examples_counts_training_rows_only():
    frame = bucket_controls.synthetic_lengths_frame(400, seed=3)
    frame.loc[:9, "n_loss_tokens"] = 0
    trains = frame["status"].isin(TRAINING_STATUSES)
    expected = int((trains & (frame["n_loss_tokens"] == 0)).sum())
    assert apply.count_no_loss_examples(frame) == expected > 0


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"train_sampling_strategy": "bogus"}, "not one of"),  # accepted silently by the class
        ({"group_by_length": True}, "TypeError"),  # the 4.x flag, gone in 5.x
    ],
)
def test_verification_catches_what_the_library_would_reject_or_ignore(kwargs, reason):
    fields = {f.name for f in __import__("dataclasses").fields(transformers.TrainingArguments)}
    if "train_sampling_strategy" not in fields:
        pytest.skip("transformers 4.x: no train_sampling_strategy")
    snippet = {
        "imports": ["from transformers import TrainingArguments"],
        "args": "args = " + apply_snippets.call_text("TrainingArguments", kwargs),
    }
    result = apply_libraries.verify_snippet(snippet, kwargs)
    assert result["verified"] is False
    assert reason in result["reason"]


def test_nothing_to_gain_is_said_not_invented(recommendation):
    flat = {**recommendation, "status": "nothing_to_gain"}
    flat["recommended"] = {**recommendation["recommended"], "bucket_size_batches": 1}
    document = apply.recommendations_document(
        flat, TRAINING, apply_libraries.installed_libraries(), 0, False
    )
    change = changes_by_id(document)["length_grouped"]
    assert change["applies"] is False and "nothing to gain" in change["reason"]


def test_missing_inputs_are_named():
    with pytest.raises(KeyError, match="examples_used"):
        apply.recommendations_document({"recommended": {}}, TRAINING, {}, verify=False)
    with pytest.raises(KeyError, match="training.grad_accum"):
        apply_changes.baseline_from(
            {"input": {"examples_used": 1, "real_tokens": 1}}, {"micro_batch_size": 1}
        )


def test_tokens_per_update_is_the_mean_step():
    base = apply_changes.Baseline(2, 8, 4096, 4, 400, 200)
    assert base.tokens_per_update == pytest.approx(16 * 100)
    assert np.isclose(base.mean_length, 100)


def test_order_changes_ranks_by_measured_saving_with_ties_and_decisions():
    from probes.apply.document import RECOMMENDED, SLOWER, TIES_WITH_RANDOM, order_changes

    document = {
        "changes": [
            {"id": "a", "applies": True},
            {"id": "b", "applies": True},
            {"id": "c", "applies": True},
            {"id": "d", "applies": True},
            {"id": "e", "applies": False},
        ]
    }
    measured = {
        0: {"saving": -0.2, "saving_low": -0.3, "saving_high": -0.1, "valid": True},
        1: {"saving": 0.3, "saving_low": 0.2, "saving_high": 0.4, "valid": True},
        2: {"saving": 0.25, "saving_low": -0.01, "saving_high": 0.5, "valid": True},
        3: None,
    }
    ordered = order_changes(document, measured)["changes"]
    assert [c["id"] for c in ordered] == ["b", "c", "a", "d", "e"]
    assert [c["rank"] for c in ordered] == [1, 1, 3, None, None]  # b and c overlap: a tie
    assert ordered[0]["tied"] and ordered[1]["tied"] and not ordered[2]["tied"]
    assert [c["decision"] for c in ordered[:3]] == [RECOMMENDED, TIES_WITH_RANDOM, SLOWER]
    assert [c["recommended"] for c in ordered] == [True, False, False, False, False]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_every_pasted_sftconfig_keeps_the_runs_own_checkpointing(checkpointing):
    """TRL's SFTConfig defaults to checkpointing on: a snippet that stated TRL's default turned
    recomputation on for a run without it (the bench realized packing at -21.7% against +0.2%
    promised). Each change's SFTConfig states the run's value, the checkpointing change alone
    its flip."""
    from probes.apply.libraries import CHECKPOINTING, sft_checkpointing

    if not sft_checkpointing():
        pytest.skip("the installed TRL sets no checkpointing default")
    training = {**TRAINING, "gradient_checkpointing": checkpointing}
    document = apply.recommendations_document(
        bucket_recommendation(),
        training,
        apply_libraries.installed_libraries(),
        verify=False,
    )
    assert document["baseline"]["sft_config"][CHECKPOINTING] is checkpointing
    sft_changes = [c for c in document["changes"] if c.get("applies") and c.get("sft_config")]
    assert "packing" in {c["id"] for c in sft_changes}
    for change in sft_changes:
        assert change["sft_config"][CHECKPOINTING] is checkpointing, change["id"]
