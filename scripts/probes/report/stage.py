"""The report stage: load every stage output, build recommendations.json, draw the figures, render
the markdown, write all three together."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probes.apply import changes as apply_changes
from probes.apply import document as apply
from probes.apply.libraries import verify_document
from probes.config import REPO_ROOT
from probes.io import run_metadata
from probes.report.load import ReportInputError, load_inputs, not_run_reason
from probes.report.render import build_context, linked_figures, render_markdown
from probes.report.sections.realize import realize_section
from probes.report.sections.replay import CHANGE_STRATEGY, change_measurement
from probes.report.sections.verdicts import memory_check, memory_table
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing

LOG = logging.getLogger("probes.report.render")
# The template ships with the workflow; standalone runs use it unless --input template=... says.
DEFAULT_TEMPLATE = REPO_ROOT / "workflow" / "templates" / "playbook-evidence.md.j2"


def recommendations_document(
    loaded: Mapping[str, Any],
    training: Mapping[str, Any],
    versions: Mapping[str, Any] | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """recommendations.json: the bucket stage's recommendation as settings for the installed
    libraries (probes.apply.document), with the padding stage's count of examples without a loss
    token.
    {"status": "not_run", "reason"} when the bucket stage did not run."""
    recommendation = loaded["json"]["bucket_recommendation"]
    reason = not_run_reason(recommendation) or loaded["not_run"].get("bucket")
    if reason:
        return {"status": "not_run", "reason": f"the bucket stage did not run ({reason})"}
    lengths = loaded["tables"]["padding_lengths"]
    no_loss = None if "padding" in loaded["not_run"] else apply.count_no_loss_examples(lengths)
    try:
        document = apply.recommendations_document(
            recommendation, training, versions, no_loss_examples=no_loss, verify=False
        )
    except KeyError as error:
        raise ReportInputError(
            f"bucket recommendation.json: {error.args[0]}; rerun the bucket_sweep rule"
        ) from error
    replay = loaded.get("provenance", {}).get("replay") or {}
    document["changes"] = [
        *document.get("changes", []),
        *apply_changes.step_level_changes(
            replay.get("step_changes"), apply_changes.baseline_from(recommendation, training)
        ),
    ]
    strategy_of = {
        **CHANGE_STRATEGY,
        **{c["id"]: c["id"] for c in document["changes"] if c.get("step_level")},
    }
    document["changes"] += combined_changes(loaded, document, strategy_of)
    if verify:  # every pasted snippet, the step-level and combined ones with the batching ones
        verify_document(document)
    strategy_of.update({c["id"]: c["id"] for c in document["changes"] if c.get("combined_of")})
    # the report's order: by the replay's measured saving (Summary and "Apply it" agree)
    measurements = {
        i: change_measurement(change, loaded["tables"], loaded["not_run"])
        for i, change in enumerate(document.get("changes") or [])
    }
    ordered = apply.order_changes(document, measurements)
    # the realize check in the report's three words, and the memory verdict, per change
    tables, jsons, not_run = loaded["tables"], loaded["json"], loaded["not_run"]
    realize = realize_section(tables, jsons, not_run)
    ok = realize["status"] == "ok"
    memory = memory_table(loaded)
    return apply.with_checks(
        ordered,
        strategy_of,
        realize["by_strategy"] if ok else None,
        realize["rule"] if ok else None,
        None if memory is None else {s: memory_check(memory, s) for s in strategy_of.values()},
    )


def combined_changes(
    loaded: Mapping[str, Any], document: Mapping[str, Any], strategy_of: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The combined configurations the replay measured (probes.replay.combined), each as the
    settings of its parts applied together (probes.apply.combined)."""
    from probes.apply.combined import combined_change
    from probes.step.combined import is_combined

    estimates = loaded["tables"].get("replay_estimates")
    if estimates is None or "replay" in loaded["not_run"] or estimates.empty:
        return []
    entries = [
        combined_change(name, document["changes"], strategy_of, document.get("baseline") or {})
        for name in estimates["strategy"]
        if is_combined(name)
    ]
    return [e for e in entries if e is not None]


def run_training(cfg: WorkflowConfig, provenance: Mapping[str, Any]) -> dict[str, Any]:
    """The config's training section with the run's own checkpointing, as the stages saw it
    (the pasted SFTConfig states it: TRL's default would turn recomputation on)."""
    from probes.step.changes import RECORD_KEY

    trainer = (provenance.get("padding") or {}).get("trainer") or {}
    replay = provenance.get("replay") or {}
    return {
        "micro_batch_size": cfg.training.micro_batch_size,
        "grad_accum": cfg.training.grad_accum,
        "max_seq_len": cfg.training.max_seq_len,
        "gradient_checkpointing": apply_changes.run_checkpointing(
            replay.get("step_changes"), trainer.get(RECORD_KEY)
        ),
    }


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """Load, draw, render; the figures directory and the markdown are written together or not."""
    from probes.report import (
        figures as figs,  # matplotlib is imported here, inside the timed render
    )

    start = time.perf_counter()
    paths = {key: path for key, path in inputs.items() if key != "template"}
    loaded = load_inputs(paths)
    markdown_out, figures_out = Path(outputs["markdown"]), Path(outputs["figures"])
    options = cfg.report
    document = recommendations_document(loaded, run_training(cfg, loaded["provenance"]))
    with all_or_nothing(outputs) as out:
        staging = out.directory("figures")
        drawn = figs.draw_all(loaded, staging, options.histogram_top_sources, options.figure_dpi)
        # links are relative to the markdown, so the report reads the same wherever it is copied
        prefix = Path(os.path.relpath(figures_out, markdown_out.parent))
        links = {name: (prefix / f).as_posix() if f else None for name, f in drawn.items()}
        context = build_context(
            loaded,
            links,
            run_metadata(dict(cfg.raw)),
            top_sources=options.histogram_top_sources,
            max_recommendations=options.max_recommendations,
            recommendations_document=document,
        )
        markdown = render_markdown(context, inputs.get("template", DEFAULT_TEMPLATE))
        for link in linked_figures(markdown):
            if not (staging / Path(link).relative_to(prefix)).is_file():
                raise ReportInputError(f"the report links {link} but no such figure was drawn")
        out.text("markdown", markdown)
        out.text("recommendations", apply.dumps(document))
    LOG.info(
        "rendered %s (%d chars) and %d figures in %.2f s; stages not run: %s",
        markdown_out,
        len(markdown),
        sum(1 for f in drawn.values() if f),
        time.perf_counter() - start,
        sorted(loaded["not_run"]) or "none",
    )
