"""Padding probe: how long the examples really are, how much of each batch is padding, and how
the cross-entropy over the vocabulary must be chunked to fit.

Tokenizes the training data as training would (chat template + the model's tokenizer, batched
through the Rust tokenizer), then writes lengths, waste summary, length distribution and CE chunk
sizing tables, and a positive control. Only ids, counts and numbers are ever logged or written.

Run by Snakemake (rule `padding`) or standalone:
    python scripts/step2_padding.py --configfile config/config.yaml --outdir results/padding
"""

# No `from __future__` import: Snakemake prepends its own preamble to scripts it runs.
import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

# Snakemake runs a copy of this file from .snakemake/scripts; __real_file__ is the original.
sys.path.insert(0, str(Path(globals().get("__real_file__", __file__)).resolve().parent))

DEFAULT_PADDING = {
    "ce_memory_budget_gib": 2.0,
    "waste_seeds": 8,
    "histogram_bins": 40,
    "histogram_max_sources": 50,
    "tokenize_batch_size": 1024,
    "reference_check_examples": 64,
}
DEFAULT_TRAINING = {
    "micro_batch_size": 2,
    "grad_accum": 8,
    "max_seq_len": 4096,
    "loss_on": "assistant",
}
OUTPUT_NAMES = ("lengths", "summary", "distribution", "ce_chunks", "control")
MAX_LOGGED_LOCATIONS = 50


class ControlFailed(RuntimeError):
    """A positive control did not reproduce its known value: no output is trustworthy."""


def reference_sample(lengths: Any, n: int) -> list[int]:
    """Row positions to check against the per-example reference: the longest half (truncation,
    many turns) and an even spread over the rest. Deterministic."""
    import numpy as np

    usable = np.flatnonzero(lengths["status"].isin(("OK", "TRUNCATED")).to_numpy())
    if n <= 0 or len(usable) == 0:
        return []
    by_length = usable[np.argsort(-lengths["n_tokens_full"].to_numpy()[usable], kind="stable")]
    longest = list(by_length[: n // 2])
    spread = list(usable[np.linspace(0, len(usable) - 1, n - len(longest)).astype(int)])
    return sorted(set(int(i) for i in longest + spread))


def reference_check(examples, lengths, tokenizer, template, training, n) -> dict[str, Any]:
    """The batched path must give the very numbers training's own per-example call gives."""
    from probes.tokenize import reference_counts

    mismatches = []
    checked = reference_sample(lengths, n)
    for i in checked:
        n_full, n_loss = reference_counts(
            examples[i], tokenizer, template, training["max_seq_len"], training["loss_on"]
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


def run(
    model_path: str,
    model_config_path: str,
    chat_template: str | None,
    data: dict[str, Any],
    padding: dict[str, Any],
    training: dict[str, Any],
    outputs: dict[str, str],
    config_for_provenance: dict[str, Any],
    log_path: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The whole stage. Raises on bad input or a failed control, before writing anything."""
    from probes.data import error_locations, load_examples, status_counts
    from probes.io import run_metadata, write_json, write_parquet
    from probes.logs import setup_logging
    from probes.padding import (
        ce_chunk_rows,
        ce_shapes,
        distribution_table,
        model_dims,
        no_usable_files,
        summary_table,
        synthetic_control,
    )
    from probes.tokenize import (
        LENGTH_COLUMNS,
        load_tokenizer,
        resolve_chat_template,
        tokenize_examples,
    )

    log = setup_logging(log_path, "padding")
    padding = {**DEFAULT_PADDING, **(padding or {})}
    training = {**DEFAULT_TRAINING, **(training or {})}
    seeds = list(range(int(padding["waste_seeds"])))

    # 1. Positive control first: the waste/distribution/CE arithmetic on a hand-worked set.
    checks = synthetic_control(seeds=seeds[:3] or [0])
    failed = [c["name"] for c in checks if not c["passed"]]
    log.info("synthetic control: %d checks, %d failed", len(checks), len(failed))
    if failed:
        raise ControlFailed(f"padding synthetic control failed: {failed}")

    # 2. Data, every row accounted for.
    examples = load_examples(data["files"])
    log.info("loaded %d rows: %s", len(examples), status_counts(examples))
    locations = error_locations(examples)
    for location in locations[:MAX_LOGGED_LOCATIONS]:
        log.info("  %(status)s %(file)s:%(row)d %(reason)s", location)
    if len(locations) > MAX_LOGGED_LOCATIONS:
        log.info("  ... %d more EMPTY/ERROR rows (see lengths.parquet)", len(locations) - 50)

    # 3. Tokenize as training does.
    tokenizer = load_tokenizer(model_path)
    template = resolve_chat_template(tokenizer, chat_template)
    log.info(
        "tokenizer: %d tokens (len); chat template from %s; loss_on=%s; max_seq_len=%d",
        len(tokenizer),
        chat_template or "the tokenizer",
        training["loss_on"],
        training["max_seq_len"],
    )
    start = time.perf_counter()
    lengths = tokenize_examples(
        examples,
        tokenizer,
        template,
        max_seq_len=int(training["max_seq_len"]),
        loss_on=training["loss_on"],
        batch_size=int(padding["tokenize_batch_size"]),
        progress=progress,
    )
    seconds = time.perf_counter() - start
    total_tokens = int(lengths["n_tokens_full"].sum())
    log.info(
        "tokenized %d rows, %d tokens in %.2f s (%.0f tokens/s, rendering included)",
        len(lengths),
        total_tokens,
        seconds,
        total_tokens / seconds if seconds else float("nan"),
    )
    log.info(
        "loss tokens: %d examples counted from full offsets (boundary lookup undecided)",
        lengths.attrs.get("n_offset_fallback", 0),
    )
    template_errors = lengths[lengths["reason"] == "chat_template_error"]
    for record in template_errors.head(MAX_LOGGED_LOCATIONS).itertuples(index=False):
        log.info("  ERROR %s:%d chat_template_error", record.file, record.row)
    bad_files = no_usable_files(lengths)
    if bad_files:
        from probes.data import DataError

        raise DataError(
            f"no usable example left after tokenization in: {bad_files}; "
            "see the per-row reasons in the log (file:row reason)."
        )

    # 4. The batched path against training's own per-example call.
    checks.append(
        reference_check(
            examples,
            lengths,
            tokenizer,
            template,
            training,
            int(padding["reference_check_examples"]),
        )
    )
    log.info("reference check: %s", checks[-1]["observed"])

    # 5. Tables.
    batch = int(training["micro_batch_size"])
    max_seq_len = int(training["max_seq_len"])
    summary = summary_table(lengths, batch, max_seq_len, seeds)
    distribution = distribution_table(
        lengths, int(padding["histogram_bins"]), int(padding["histogram_max_sources"])
    )
    hidden, config_vocab = model_dims(json.loads(Path(model_config_path).read_text()))
    vocab_sizes = {"tokenizer": len(tokenizer)}
    if config_vocab is not None and config_vocab != len(tokenizer):
        vocab_sizes["config"] = config_vocab
        log.info(
            "vocab sizes differ: tokenizer %d, config %d (the lm_head produces the config's)",
            len(tokenizer),
            config_vocab,
        )
    ce_chunks = ce_chunk_rows(
        ce_shapes(lengths, max_seq_len),
        batch,
        vocab_sizes,
        hidden,
        float(padding["ce_memory_budget_gib"]),
    )
    for row in summary[summary["section"] == "waste"].itertuples(index=False):
        log.info(
            "waste %-18s %-15s %.4f (std %.4f, expected %.4f)",
            row.strategy,
            row.metric,
            row.value,
            row.std,
            row.expected,
        )

    control = {
        "name": "padding",
        "description": (
            "A synthetic set with hand-worked lengths, statuses, percentiles, padded slots "
            "for every strategy (random: exact expectation, also checked by enumerating every "
            "order) and CE chunk sizes is reproduced exactly; and the batched tokenization "
            "gives the same token and loss-token counts as apply_chat_template on a sample of "
            "the real data."
        ),
        "expected": {c["name"]: c["expected"] for c in checks},
        "observed": {c["name"]: c["observed"] for c in checks},
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
    }
    if not control["passed"]:
        failed = [c["name"] for c in checks if not c["passed"]]
        log.error("control failed: %s", json.dumps(control["observed"], default=str)[:2000])
        raise ControlFailed(f"padding control failed: {failed}")

    # 6. Outputs, only once everything succeeded.
    provenance = run_metadata(config_for_provenance)
    provenance["tokenize_seconds"] = round(seconds, 3)
    columns = list(LENGTH_COLUMNS) + [c for c in lengths.columns if c not in LENGTH_COLUMNS]
    tables = {
        "lengths": lengths[columns],
        "summary": summary,
        "distribution": distribution,
        "ce_chunks": ce_chunks,
    }
    try:
        for name, table in tables.items():
            write_parquet(table, outputs[name], provenance=provenance)
        write_json(control, outputs["control"])
    except BaseException:
        # Each file is written atomically; a failure part-way removes the ones already written.
        for name in OUTPUT_NAMES:
            Path(outputs[name]).unlink(missing_ok=True)
        raise
    log.info("wrote %s", ", ".join(str(outputs[name]) for name in OUTPUT_NAMES))
    return control


def _fail(error: Exception) -> int:
    # run() configured logging (file + stderr) first thing; without handlers this still reaches
    # stderr through logging's last-resort handler. Messages name files/rows/keys, never text.
    logging.getLogger("padding").error("padding: %s: %s", type(error).__name__, error)
    return 1


def _expected_errors() -> tuple[type[Exception], ...]:
    from probes.data import DataError
    from probes.tokenize import TokenizeError

    return (DataError, TokenizeError, ControlFailed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configfile", default="config/config.yaml", help="workflow config YAML")
    parser.add_argument("--outdir", default="results/padding", help="output directory")
    parser.add_argument("--log", default=None, help="log file (default: stderr only)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)

    from probes.config import ConfigError, load_config

    try:
        config = load_config(args.configfile)  # validated and default-filled by the schema
    except ConfigError as error:
        print(f"padding: {error}", file=sys.stderr)
        return 2
    outdir = Path(args.outdir)
    outputs = {
        "lengths": outdir / "lengths.parquet",
        "summary": outdir / "summary.parquet",
        "distribution": outdir / "distribution.parquet",
        "ce_chunks": outdir / "ce_chunks.parquet",
        "control": outdir / "control.json",
    }
    model = config["model"]
    try:
        run(
            model_path=model["path"],
            model_config_path=model.get("config_path") or str(Path(model["path"]) / "config.json"),
            chat_template=model.get("chat_template"),
            data=config["data"],
            padding=config.get("padding", {}),
            training=config.get("training", {}),
            outputs={k: str(v) for k, v in outputs.items()},
            config_for_provenance=config,
            log_path=args.log,
            progress=not args.no_progress,
        )
    except _expected_errors() as error:
        return _fail(error)
    return 0


def snakemake_main(smk: Any) -> None:
    # The Rust tokenizer sizes its thread pool once, at first use: honour the rule's threads.
    os.environ.setdefault("RAYON_NUM_THREADS", str(smk.threads))
    try:
        run(
            model_path=smk.params.model_path,
            model_config_path=smk.input.model_config,
            chat_template=smk.params.chat_template,
            data=smk.params.data,
            padding=smk.params.padding,
            training=smk.params.training,
            outputs={name: smk.output[name] for name in OUTPUT_NAMES},
            config_for_provenance=smk.config,
            log_path=smk.log[0] if smk.log else None,
        )
    except _expected_errors() as error:
        sys.exit(_fail(error))


if "snakemake" in globals():
    snakemake_main(snakemake)  # noqa: F821 - injected by Snakemake
elif __name__ == "__main__":
    sys.exit(main())
