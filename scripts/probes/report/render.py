"""The playbook-evidence report: render the template from the context the sections build.

A number in the report is traceable in three hops: the template names a column
(``{{ row.time_s | seconds }}``), the column comes from one table listed in
``probes.contracts.TABLES`` (which stage and file), and the derived numbers come from one function.
The report is split by responsibility:

- ``probes.report.load``: read and check every stage output (``load_inputs``);
- ``probes.report.findings``: the stages' findings as counts (never a price), the fit check;
- ``probes.report.sections``: one module per section of the template (``summary``,
  ``realize``, ``scaling``, ``padding``, ``ce``, ``kernels``, ``bucket``, ``apply``, ``mask``,
  ``controls``, ``provenance``), ``replay`` for the measured savings that Summary and Apply it
  share, and ``shared`` for what every section uses;
- ``probes.report.format``: the template's filters (numbers, codes, labels);
- this module: assemble every section (``build_context``), render the markdown
  (``render_markdown``) and list the figures it links.

Never surface the data: the report shows only source labels, ids, counts and numbers. No column
outside ``TABLES`` is ever rendered, reason codes are filtered to code-like strings, and source
labels are shortened and escaped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probes.report.format import FILTERS
from probes.report.sections.apply import apply_section
from probes.report.sections.bucket import bucket_section
from probes.report.sections.ce import ce_section
from probes.report.sections.controls import controls_section
from probes.report.sections.data_parallel import data_parallel_section
from probes.report.sections.data_parallel_measured import data_parallel_measured_section
from probes.report.sections.kernels import kernels_section
from probes.report.sections.mask import mask_section
from probes.report.sections.memory import memory_report_section
from probes.report.sections.padding import padding_section
from probes.report.sections.provenance import provenance_section
from probes.report.sections.realize import realize_section
from probes.report.sections.replay import host_bound_overall, replay_fit
from probes.report.sections.scaling import scaling_section
from probes.report.sections.sharding import sharding_section
from probes.report.sections.summary import summary_section
from probes.report.sections.verdicts import (
    beside_view,
    device_line,
    memory_table,
    memory_target,
    timed_step,
    verdicts_section,
)


def build_context(
    inputs: Mapping[str, Any],
    figures: Mapping[str, str | None],
    report_meta: Mapping[str, Any],
    top_sources: int = 8,
    max_recommendations: int = 4,
    recommendations_document: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the template renders, as plain dicts and lists.

    ``recommendations_document``: what the report stage writes as recommendations.json
    (probes.apply.document.recommendations_document), for the "Apply it" section."""
    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    scaling = scaling_section(tables, not_run, jsons)
    mask = mask_section(tables, not_run, jsons)
    summary = summary_section(inputs, scaling, mask, max_recommendations)
    # promised (replay) vs realized (real training steps) for the baseline and top changes
    realize = realize_section(tables, jsons, not_run)
    memory = memory_table(inputs)
    return {
        # the first screen: one row per change the replay's table holds, the device under it
        "device": device_line(scaling, summary["measured"], realize, timed_step(inputs)),
        "verdicts": {
            **verdicts_section(summary["measured"], realize, memory, summary["memory"]),
            "memory_target": memory_target(jsons, not_run),
        },
        "summary": summary,
        "realize": realize,
        "scaling": scaling,
        # the replay's fit and host-bound share, shown in Scaling whether or not the profile ran
        "replay": {
            "fit": replay_fit(tables, not_run),
            "host_bound": host_bound_overall(tables, not_run, jsons),
            "not_run": not_run.get("replay"),
            "beside": beside_view(inputs["provenance"].get("replay")),
        },
        "padding": padding_section(tables, not_run, top_sources),
        "ce": ce_section(tables, not_run),
        "kernels": kernels_section(tables, not_run, jsons),
        "bucket": bucket_section(tables, not_run, jsons),
        "data_parallel": data_parallel_section(tables, not_run, jsons),
        "data_parallel_measured": data_parallel_measured_section(tables, not_run, jsons),
        "apply": apply_section(recommendations_document, tables, not_run),
        "mask": mask,
        "memory_report": memory_report_section(tables, jsons, not_run),
        "memory_sharding": sharding_section(tables, jsons, not_run),
        "controls": controls_section(jsons, not_run),
        "provenance": provenance_section(inputs["provenance"], jsons, not_run, report_meta),
        "figures": dict(figures),
    }


# the report's order: the answer (first screen), how to apply it, the evidence (each section
# opens with its finding), the method last (its provenance inside it)
SECTION_TITLES = (
    "Summary",
    "Apply it",
    "Promised vs realized",
    "Measured savings",
    "Scaling",
    "Padding",
    "Cross-entropy",
    "Kernels",
    "Bucketing",
    "Mask gate",
    "Memory",
    "Controls",
    "How these numbers were measured",
)


def render_markdown(context: Mapping[str, Any], template_path: str | Path) -> str:
    """Render the template; an undefined name fails instead of rendering as empty."""
    import jinja2

    path = Path(template_path)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(path.parent),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # markdown, not HTML; cells are escaped by the `cell`/`label` filters
    )
    env.filters.update(FILTERS)
    return env.get_template(path.name).render(**context)


def linked_figures(markdown: str) -> list[str]:
    """Relative paths of every image the markdown links to."""
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown)
