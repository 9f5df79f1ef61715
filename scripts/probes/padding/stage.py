"""The padding stage: tokenize as training does, then lengths, waste, distribution and CE sizing.

Steps: the synthetic control; the data with every row accounted for; tokenization through the
chat template and the model's tokenizer; the batched path checked against training's own
per-example call; the tables; all outputs written together. Only ids, counts and numbers are
ever logged or written.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from probes.contracts import LENGTH_COLUMNS, TRAINING_STATUSES
from probes.errors import ControlFailedError
from probes.io import run_metadata
from probes.padding import trainer_rows as tr
from probes.padding.control import synthetic_control
from probes.padding.data import DataError, error_locations, load_examples, status_counts
from probes.padding.tokenize import reference_counts, tokenize_examples
from probes.padding.tokenizer import load_tokenizer, resolve_chat_template
from probes.padding.waste import (
    ce_chunk_rows,
    ce_shapes,
    distribution_table,
    model_dims,
    no_usable_files,
    summary_table,
)
from probes.settings import WorkflowConfig, as_dict
from probes.stage import all_or_nothing
from probes.step.load import factory_of

LOG = logging.getLogger("probes.padding.waste")
MAX_LOGGED_LOCATIONS = 50
CONTROL_DESCRIPTION = (
    "A synthetic set with hand-worked lengths, statuses, percentiles, padded slots for every "
    "strategy (random: exact expectation, also checked by enumerating every order) and CE chunk "
    "sizes is reproduced exactly; and the batched tokenization gives the same token and "
    "loss-token counts as apply_chat_template on a sample of the real data."
)


def run(
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str],
    cfg: WorkflowConfig,
    progress: bool = True,
) -> None:
    """Raises on bad input or a failed control before anything is written."""
    seeds = list(range(cfg.padding.waste_seeds))
    checks = synthetic_control(seeds=seeds[:3] or [0])
    failed = [c["name"] for c in checks if not c["passed"]]
    LOG.info("synthetic control: %d checks, %d failed", len(checks), len(failed))
    if failed:
        raise ControlFailedError(f"padding synthetic control failed: {failed}")

    if factory_of(cfg.trainer):
        lengths, tokenizer, check, source = trainer_lengths(cfg)
    else:
        lengths, tokenizer, check, source = data_lengths(inputs, cfg, progress)
    checks.append(check)
    LOG.info("%s: %s", check["name"], check["observed"])
    control = control_record(checks)
    if not control["passed"]:
        failed = [c["name"] for c in checks if not c["passed"]]
        LOG.error("control failed: %s", json.dumps(control["observed"], default=str)[:2000])
        raise ControlFailedError(f"padding control failed: {failed}")

    tables = build_tables(lengths, tokenizer, inputs["model_config"], cfg, seeds)
    provenance = {**run_metadata(dict(cfg.raw)), **source}
    with all_or_nothing(outputs) as out:
        for name, table in tables.items():
            out.parquet(name, table, provenance)
        out.json("control", control)
    LOG.info("wrote %s", ", ".join(str(path) for path in outputs.values()))


def data_lengths(
    inputs: Mapping[str, Any], cfg: WorkflowConfig, progress: bool
) -> tuple[pd.DataFrame, Any, dict[str, Any], dict[str, Any]]:
    """The config's data files tokenized as training does, checked against training's own
    per-example call: (lengths, tokenizer, the check, provenance)."""
    examples = load_examples([as_dict(f) for f in cfg.data.files])
    log_examples(examples)
    model_dir = Path(inputs["tokenizer"][0]).parent
    tokenizer = load_tokenizer(model_dir)
    template = resolve_chat_template(tokenizer, cfg.model.chat_template)
    lengths, seconds = tokenize(examples, tokenizer, template, cfg, progress)
    check = reference_check(
        examples, lengths, tokenizer, template, cfg, cfg.padding.reference_check_examples
    )
    return lengths, tokenizer, check, {"tokenize_seconds": round(seconds, 3)}


def trainer_lengths(
    cfg: WorkflowConfig,
) -> tuple[pd.DataFrame, Any, dict[str, Any], dict[str, Any]]:
    """The user's trainer, built once by its source (factory or command): its prepared train
    dataset's lengths, checked against its own collator: (lengths, tokenizer, the check,
    provenance)."""
    import torch

    from probes.step import changes as sc
    from probes.step.factory import tokenizer_of
    from probes.step.source import output_dir, trainer_source
    from probes.step.trainer import probe_settings

    source = trainer_source(cfg.trainer)
    start = time.perf_counter()
    settings = probe_settings(output_dir(), torch.device("cpu"), torch.float32, None, 0)
    trainer = source.build(settings)
    tr.check_settings(trainer.args, cfg.training, source.spec, source.key)
    lengths = tr.lengths_table(
        trainer.train_dataset, cfg.training.max_seq_len, cfg.training.loss_on == "all"
    )
    seconds = time.perf_counter() - start
    LOG.info(
        "trainer %s: %d prepared rows, %d tokens (built in %.1f s)",
        type(trainer).__name__,
        len(lengths),
        int(lengths["n_tokens"].sum()),
        seconds,
    )
    check = tr.collator_check(trainer, lengths, cfg.padding.reference_check_examples)
    provenance = {
        "trainer": {
            source.kind: source.describe(),
            "trainer": type(trainer).__name__,
            "collator": type(trainer.data_collator).__name__,
            "rows": len(lengths),
            "build_seconds": round(seconds, 3),
            # its step as built (checkpointing, attention): the memory stage's base, so it
            # names the step-level changes the replay's StepSwitch names
            sc.RECORD_KEY: sc.config_record(trainer.model, trainer.args),
        }
    }
    return lengths, tokenizer_of(trainer), check, provenance


def log_examples(examples: list) -> None:
    LOG.info("loaded %d rows: %s", len(examples), status_counts(examples))
    locations = error_locations(examples)
    for location in locations[:MAX_LOGGED_LOCATIONS]:
        LOG.info("  %(status)s %(file)s:%(row)d %(reason)s", location)
    if len(locations) > MAX_LOGGED_LOCATIONS:
        LOG.info("  ... %d more EMPTY/ERROR rows (see lengths.parquet)", len(locations) - 50)


def tokenize(
    examples: list, tokenizer: Any, template: Any, cfg: WorkflowConfig, progress: bool
) -> tuple[pd.DataFrame, float]:
    """The lengths table (LENGTH_COLUMNS first) and the seconds tokenization took."""
    training = cfg.training
    LOG.info(
        "tokenizer: %d tokens (len); chat template from %s; loss_on=%s; max_seq_len=%d",
        len(tokenizer),
        cfg.model.chat_template or "the tokenizer",
        training.loss_on,
        training.max_seq_len,
    )
    start = time.perf_counter()
    lengths = tokenize_examples(
        examples,
        tokenizer,
        template,
        max_seq_len=training.max_seq_len,
        loss_on=training.loss_on,
        batch_size=cfg.padding.tokenize_batch_size,
        progress=progress,
    )
    seconds = time.perf_counter() - start
    total_tokens = int(lengths["n_tokens_full"].sum())
    LOG.info(
        "tokenized %d rows, %d tokens in %.2f s (%.0f tokens/s, rendering included)",
        len(lengths),
        total_tokens,
        seconds,
        total_tokens / seconds if seconds else float("nan"),
    )
    LOG.info(
        "loss tokens: %d examples counted from full offsets (boundary lookup undecided)",
        lengths.attrs.get("n_offset_fallback", 0),
    )
    template_errors = lengths[lengths["reason"] == "chat_template_error"]
    for record in template_errors.head(MAX_LOGGED_LOCATIONS).itertuples(index=False):
        LOG.info("  ERROR %s:%d chat_template_error", record.file, record.row)
    bad_files = no_usable_files(lengths)
    if bad_files:
        raise DataError(
            f"no usable example left after tokenization in: {bad_files}; "
            "see the per-row reasons in the log (file:row reason)."
        )
    problem = no_loss_problem(
        lengths, cfg.padding.min_loss_fraction, training.loss_on, training.max_seq_len
    )
    if problem is not None:
        if not cfg.padding.allow_no_loss:
            raise DataError(
                f"{problem} Fix the cause, or set padding.allow_no_loss: true to measure anyway."
            )
        LOG.warning("%s (padding.allow_no_loss: measured anyway)", problem)
    columns = list(LENGTH_COLUMNS) + [c for c in lengths.columns if c not in LENGTH_COLUMNS]
    return lengths[columns], seconds


def no_loss_problem(
    lengths: pd.DataFrame, min_loss_fraction: float, loss_on: str, max_seq_len: int
) -> str | None:
    """Why this data would train (almost) nothing, with the likely cause; None when it trains.

    Over the usable (OK/TRUNCATED) examples: refused when no example has a loss token, or when
    fewer than ``min_loss_fraction`` of the kept tokens carry loss."""
    usable = lengths[lengths["status"].isin(TRAINING_STATUSES)]
    tokens = int(usable["n_tokens"].sum())
    loss = int(usable["n_loss_tokens"].sum())
    if usable.empty or tokens == 0:
        return None  # no usable example at all: no_usable_files reports that
    fraction = loss / tokens
    if loss > 0 and fraction >= min_loss_fraction:
        return None
    without = int((usable["n_loss_tokens"] == 0).sum())
    cut = int(((usable["n_loss_tokens"] == 0) & (usable["n_loss_tokens_full"] > 0)).sum())
    never = int((usable["n_loss_tokens_full"] == 0).sum())
    causes = []
    if cut:
        causes.append(
            f"{cut} example(s) lost every loss token to truncation: training.max_seq_len="
            f"{max_seq_len} is too short for where their assistant turns start"
        )
    if never:
        causes.append(
            f"{never} example(s) have no loss token at all: with training.loss_on={loss_on} check "
            "that the data has assistant turns and that the chat template marks them with "
            "{% generation %} tags"
            if loss_on == "assistant"
            else f"{never} example(s) have no loss token at all (training.loss_on={loss_on})"
        )
    if not causes:
        causes.append(
            "the assistant turns are a tiny share of each example (training.loss_on="
            f"{loss_on}; training.max_seq_len={max_seq_len} may cut them short)"
        )
    return (
        f"the data trains (almost) nothing: {loss} of {tokens} kept tokens in {len(usable)} "
        f"usable example(s) carry loss ({100 * fraction:.2f}%, padding.min_loss_fraction is "
        f"{100 * min_loss_fraction:g}%); {without} example(s) have none. Likely cause: "
        + "; ".join(causes)
        + "."
    )


def reference_sample(lengths: pd.DataFrame, n: int) -> list[int]:
    """Row positions to check against the per-example reference: the longest half (truncation,
    many turns) and an even spread over the rest. Deterministic."""
    usable = np.flatnonzero(lengths["status"].isin(TRAINING_STATUSES).to_numpy())
    if n <= 0 or len(usable) == 0:
        return []
    by_length = usable[np.argsort(-lengths["n_tokens_full"].to_numpy()[usable], kind="stable")]
    longest = list(by_length[: n // 2])
    spread = list(usable[np.linspace(0, len(usable) - 1, n - len(longest)).astype(int)])
    return sorted(set(int(i) for i in longest + spread))


def reference_check(
    examples: list,
    lengths: pd.DataFrame,
    tokenizer: Any,
    template: Any,
    cfg: WorkflowConfig,
    n: int,
) -> dict[str, Any]:
    """The batched path must give the very numbers training's own per-example call gives."""
    mismatches = []
    checked = reference_sample(lengths, n)
    for i in checked:
        n_full, n_loss = reference_counts(
            examples[i], tokenizer, template, cfg.training.max_seq_len, cfg.training.loss_on
        )
        row = lengths.iloc[i]
        if (n_full, n_loss) != (int(row["n_tokens_full"]), int(row["n_loss_tokens"])):
            mismatches.append(
                {
                    "example_id": row["example_id"],
                    "reference": [n_full, n_loss],
                    "batched": [int(row["n_tokens_full"]), int(row["n_loss_tokens"])],
                }
            )
    return {
        "name": "batched tokenization == apply_chat_template per example",
        "expected": {"n_checked": len(checked), "mismatches": 0},
        "observed": {"n_checked": len(checked), "mismatches": len(mismatches)},
        "mismatched_examples": mismatches[:10],
        "passed": not mismatches and len(checked) > 0,
    }


def control_record(checks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "padding",
        "description": CONTROL_DESCRIPTION,
        "expected": {c["name"]: c["expected"] for c in checks},
        "observed": {c["name"]: c["observed"] for c in checks},
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
    }


def build_tables(
    lengths: pd.DataFrame,
    tokenizer: Any,
    model_config_path: str | Path,
    cfg: WorkflowConfig,
    seeds: list[int],
) -> dict[str, pd.DataFrame]:
    """lengths, summary, distribution and ce_chunks, keyed as the stage's outputs."""
    batch, max_seq_len = cfg.training.micro_batch_size, cfg.training.max_seq_len
    summary = summary_table(lengths, batch, max_seq_len, seeds)
    distribution = distribution_table(
        lengths, cfg.padding.histogram_bins, cfg.padding.histogram_max_sources
    )
    hidden, config_vocab = model_dims(json.loads(Path(model_config_path).read_text()))
    vocab_sizes = {"tokenizer": len(tokenizer)}
    if config_vocab is not None and config_vocab != len(tokenizer):
        vocab_sizes["config"] = config_vocab
        LOG.info(
            "vocab sizes differ: tokenizer %d, config %d (the lm_head produces the config's)",
            len(tokenizer),
            config_vocab,
        )
    ce_chunks = ce_chunk_rows(
        ce_shapes(lengths, max_seq_len),
        batch,
        vocab_sizes,
        hidden,
        float(cfg.padding.ce_memory_budget_gib),
    )
    for row in summary[summary["section"] == "waste"].itertuples(index=False):
        LOG.info(
            "waste %-18s %-15s %.4f (std %.4f, expected %.4f)",
            row.strategy,
            row.metric,
            row.value,
            row.std,
            row.expected,
        )
    return {
        "lengths": lengths,
        "summary": summary,
        "distribution": distribution,
        "ce_chunks": ce_chunks,
    }
