"""The Memory section of the report: the section's context and the template's Memory block."""

from __future__ import annotations

import re

import jinja2
import pandas as pd

from conftest import REPO
from probes.report.format import FILTERS
from probes.report.sections.memory import memory_figure, memory_report_section

TEMPLATE = REPO / "workflow" / "templates" / "playbook-evidence.md.j2"


def shapes() -> pd.DataFrame:
    base = {"layout": "padded", "target_gib": 139.0, "parameters_gib": 51.5, "gradients_gib": 0.4,
            "optimizer_state_gib": 0.9, "assumptions": "boolean indexing answered with 9 loss "
            "positions; attention: fused SDPA"}  # fmt: skip
    return pd.DataFrame(
        [
            {**base, "shape": "training", "strategy": "", "rows": 2, "length": 16384,
             "activations_gib": 41.0, "predicted_peak_gib": 93.8, "headroom_gib": 45.2,
             "verdict": "fits", "reason": ""},
            {**base, "shape": "packing", "strategy": "packing", "rows": 1, "length": 65536,
             "activations_gib": 160.0, "predicted_peak_gib": 212.8, "headroom_gib": -73.8,
             "verdict": "does not fit", "reason": "at most 2 rows per micro-batch"},
        ]
    )  # fmt: skip


def memory_block() -> str:
    text = TEMPLATE.read_text()
    macros = text[: text.index("# Playbook evidence")]
    start = text.index("{# --- Memory (issue 28")
    end = text.index("{# --- end of Memory -#}")
    return macros + text[start:end]


def render(**context) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)  # fmt: skip
    env.filters.update(FILTERS)
    return env.from_string(memory_block()).render(**context)


def test_memory_block_renders_verdicts_by_category(tmp_path):
    fit = pd.DataFrame(
        [{"length_kind": "max_seq_len", "length": 16384, "max_micro_batch_size": 4,
          "grad_accum": 4, "predicted_peak_gib": 134.9, "rows_per_update": 16, "method": "affine"}]
    )  # fmt: skip
    control = {"passed": True, "checks": [{"name": "known_model", "passed": True}]}
    summary = {"target": "H200", "target_gib": 139, "dtype": "bfloat16",
               "gradient_checkpointing": True}  # fmt: skip
    section = memory_report_section(
        {"memory_shapes": shapes(), "memory_fit": fit},
        {"memory_summary": summary, "memory_control": control},
        {},
    )
    figure = memory_figure(shapes(), tmp_path / "memory.png", dpi=40)
    assert figure is not None and figure.stat().st_size > 0
    markdown = render(memory_report=section, figures={"memory": "figures/memory.png"})
    assert "**1 shape(s) do not fit** the H200 (139 GiB)" in markdown
    assert re.search(r"^\| packing \| 1 × 65,536 \| .* \| \*\*does not fit\*\* \|", markdown, re.M)
    assert "| max_seq_len | 4 × 16,384 | 4 | 4 |" in markdown
    assert "known_model passed" in markdown and "figures/memory.png" in markdown


def test_memory_block_is_silent_without_its_context_key_and_says_not_run():
    assert "## Memory" not in render(figures={})
    section = memory_report_section({}, {}, {"memory": "memory.enabled false"})
    assert "**Not run.** memory.enabled false" in render(memory_report=section, figures={})


def test_stub_outputs_follow_the_contract_and_load(tmp_path):
    from probes.contracts import check_table_columns, optional_report_inputs
    from probes.io import read_json, read_parquet
    from probes.report.load import check_keys

    from .stage_outputs import write_memory_stage

    paths = {
        k: tmp_path / v
        for k, v in optional_report_inputs({"training": {}, "memory": {"enabled": True}}).items()
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    write_memory_stage(paths)
    for name in ("memory_shapes", "memory_changes", "memory_fit"):
        check_table_columns(read_parquet(paths[name]).columns, name, paths[name])
    for name in ("memory_summary", "memory_control"):
        check_keys(read_json(paths[name]), name, paths[name])
