"""The report: rendered from small fixture tables built here, in the layout the stages write."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from stage_fixtures import (
    NOT_RUN_REASON,
    mask_layers,
    padding_lengths,
    padding_tables,
    write_results,
)

from conftest import CANARY, REPO
from probes.contracts import STAGES, TABLES, TRAINER_DATASET_FILE, TRAINING_STATUSES, table_columns
from probes.io import read_json, write_json, write_parquet
from probes.profile.flops import MFU_CONVENTION
from probes.report import findings, load
from probes.report import format as fmt
from probes.report import render as rep
from probes.report.lint import problems
from probes.report.sections import bucket as bucket_sections
from probes.report.sections import ce as ce_sections
from probes.report.sections import controls as controls_sections
from probes.report.sections import mask as mask_sections
from probes.report.sections import padding as padding_sections

from .renders import run_report

# the fixture reports are rendered once (conftest.report_run, per process): every test that
# reads them on one worker, test_first_screen.py's too
pytestmark = pytest.mark.xdist_group("report_renders")
SCRIPT = REPO / "scripts" / "run_report.py"
# the stage fixtures write no memory stage outputs: a standalone render is told it did not run
NO_MEMORY = ("--set", "memory.enabled=false")


def render(tmp_path: Path, **kwargs) -> tuple[str, Path]:
    paths = write_results(tmp_path / "results", **kwargs)
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    run_report(paths, out)
    return out.read_text(), out


@pytest.fixture(scope="module")
def rendered(report_run) -> tuple[str, Path]:
    return report_run("default")


@pytest.fixture(scope="module")
def rendered_not_run(report_run) -> tuple[str, Path]:
    return report_run("profile not run")


def section(markdown: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"section {title} missing"
    return match.group(1)


# ------------------------------------------------------------------------------------------
# The rendered report
# ------------------------------------------------------------------------------------------


def test_all_sections_present_in_order(rendered):
    markdown, _ = rendered
    titles = re.findall(r"^## (.+)$", markdown, re.M)
    assert titles == list(rep.SECTION_TITLES)


def test_every_linked_figure_exists(rendered):
    markdown, out = rendered
    links = rep.linked_figures(markdown)
    assert sorted(Path(link).name for link in links) == [
        "bucket.png",
        "dp.png",
        "kernels.png",
        "lengths.png",
        "replay_epoch.png",
        "replay_fit.png",
        "scaling.png",
    ]
    for link in links:
        assert not Path(link).is_absolute()
        figure = out.parent / link
        assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_directory_is_as_readable_as_any_other(rendered):
    _, out = rendered
    umask = os.umask(0)
    os.umask(umask)
    assert (out.parent / "figures").stat().st_mode & 0o777 == 0o777 & ~umask


def test_numbers_carry_units(rendered):
    markdown, _ = rendered
    scaling = section(markdown, "Scaling")
    assert "| 1,024 tokens | 2 | OK | 154 ms |" in scaling  # 2e-9·1024² + 1e-4·1024 + 0.05 s
    assert "| 1.12 GiB |" in scaling  # 1.2e9 bytes
    assert "condition number 17 (column-scaled" in scaling
    assert "residual RMS" not in scaling  # an exact fit has none
    assert "| random | 42.0% | 1.0% | 61.0% | 1.0% |" in section(markdown, "Padding")
    ce = section(markdown, "Cross-entropy")
    assert (
        "| max_seq_len (4,096) | 8,192 tokens | 262,144 (tokenizer) | 4.00 GiB | 8.00 GiB "
        "| 20.00 GiB | 819 tokens | 11 | 32 tokens |"
    ) in ce
    assert (
        "| loss_positions_chunked | OK | loss | 3,358 | 69 ms | 17.7% | 1,024 tokens | 1.96 GiB |"
    ) in ce
    assert "| train_step | OK | — | — | 390 ms | 100.0% | — | — |" in ce
    assert not re.search(r"\b(nan|NaN|None|inf)\b", markdown)  # python reprs, not numbers


def summary_rows(markdown: str) -> list[list[str]]:
    """The Measured savings table's rows, split into cells (rank, change, saving, versus, fit,
    steps)."""
    summary = section(markdown, "Measured savings")
    rows = [line for line in summary.splitlines() if re.match(r"^\| (\d|—)", line)]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]


def plant_replay(paths, **columns_by_strategy) -> None:
    """Overwrite columns of replay.parquet per strategy: plant_replay(p, packing={...})."""
    table = pd.read_parquet(paths["replay_estimates"])
    for strategy, values in columns_by_strategy.items():
        for column, value in values.items():
            table.loc[table["strategy"] == strategy, column] = value
    write_parquet(table, paths["replay_estimates"], {})


def render_planted(tmp_path: Path, **columns_by_strategy) -> str:
    paths = write_results(tmp_path / "results")
    plant_replay(paths, **columns_by_strategy)
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    run_report(paths, out)
    return out.read_text()


def test_summary_ranks_changes_by_measured_saving(tmp_path):
    """The order follows the measured savings planted in replay.parquet (three distinct groups,
    listed in the file in the opposite order), not the fit or the token counts."""
    markdown = render_planted(
        tmp_path,
        packing={"saving_vs_random": 0.10, "saving_ci_low": 0.08, "saving_ci_high": 0.12}
        | {"rank": 3, "tie_group": 3},
        global_sort={"saving_vs_random": 0.50, "saving_ci_low": 0.45, "saving_ci_high": 0.55}
        | {"rank": 1, "tie_group": 1},
        length_grouped={"saving_vs_random": 0.30, "saving_ci_low": 0.25, "saving_ci_high": 0.35}
        | {"rank": 2, "tie_group": 2},
        group_by_length_builtin={
            "saving_vs_random": 0.05,
            "saving_ci_low": 0.03,
            "saving_ci_high": 0.07,
        }
        | {"rank": 4, "tie_group": 4},
        batch_rebalance={"saving_vs_random": 0.015, "saving_ci_low": 0.01, "saving_ci_high": 0.02}
        | {"rank": 5, "tie_group": 5},
        random={"rank": 6, "tie_group": 6},
    )
    rows = summary_rows(markdown)
    # the bold title of each change (a note such as "not checked by real training steps" follows)
    assert [re.match(r"\*\*[^*]+\*\*", r[1]).group(0) for r in rows] == [
        "**Sort the whole dataset by length (one bucket)**",
        "**Group batches by length: buckets of 4 micro-batches**",
        "**Pack whole examples into 4,096-token rows**",
        "**transformers' built-in group_by_length**",
        "**transformers' batch_rebalance sampler (variable micro-batch size)**",
        "**Random batches (the baseline)**",
        "**Pad each batch to its longest member, not to max_seq_len**",
    ]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6", "—"]
    assert rows[0][2] == "50.0% [45.0%, 55.0%]" and rows[0][3] == "random batches"
    assert rows[-1][3] == "padding to max_seq_len"
    summary = section(markdown, "Measured savings")
    assert "Best measured change: **Sort the whole dataset by length (one bucket)**" in summary
    assert "**Tie:**" not in summary
    assert "No time model" not in summary and "(linear) to" not in summary
    assert "figures/replay_epoch.png" in summary


def test_overlapping_intervals_are_reported_as_a_tie(tmp_path):
    markdown = render_planted(
        tmp_path,
        packing={"saving_vs_random": 0.40, "saving_ci_low": 0.30, "saving_ci_high": 0.50}
        | {"rank": 1, "tie_group": 1},
        global_sort={"saving_vs_random": 0.35, "saving_ci_low": 0.32, "saving_ci_high": 0.38}
        | {"rank": 1, "tie_group": 1},
        length_grouped={"saving_vs_random": 0.10, "saving_ci_low": 0.05, "saving_ci_high": 0.15}
        | {"rank": 3, "tie_group": 2},
        group_by_length_builtin={
            "saving_vs_random": 0.01,
            "saving_ci_low": 0.005,
            "saving_ci_high": 0.02,
        }
        | {"rank": 4, "tie_group": 3},
        batch_rebalance={"saving_vs_random": 0.0, "saving_ci_low": -0.004, "saving_ci_high": 0.004}
        | {"rank": 5, "tie_group": 4},
        random={"rank": 6, "tie_group": 5},
    )
    rows = summary_rows(markdown)
    assert [r[0] for r in rows[:3]] == ["1 (tie)", "1 (tie)", "3"]
    assert (
        "**Tie:** Pack whole examples into 4,096-token rows and Sort the whole dataset by length "
        "(one bucket): their 95% intervals overlap"
    ) in section(markdown, "Measured savings")
    measured = section(markdown, "Measured savings")
    assert (
        "Highest measured saving: **Pack whole examples into 4,096-token rows**, 40.0%" in measured
    )
    assert "versus random batches, tied with others (below)" in measured
    # its own line
    assert re.search(r"^- \*\*Tie:\*\*", section(markdown, "Measured savings"), re.M)


def test_bucket_figure_labels_bucket_sizes_without_collisions():
    from probes.report.figures import spaced_ticks

    sizes = np.array([1, 2, 4, 8, 16, 32, 50, 64, 128, 256, 400, 512, 1024, 2048, 3584])
    ticks = spaced_ticks(sizes, keep=32)
    assert 32 in ticks and ticks[0] == 1 and ticks[-1] == 3584
    assert all(np.log10(b / a) >= 0.15 for a, b in zip(ticks, ticks[1:], strict=False))
    assert spaced_ticks(np.array([1, 2, 4, 8, 24, 117]), keep=4) == [1, 2, 4, 8, 24, 117]


def test_fit_disagreement_and_unpriced_fit_are_stated(tmp_path):
    markdown = render_planted(
        tmp_path,
        global_sort={"fit_predicted_saving": 0.31, "fit_agrees": False},
        length_grouped={"fit_predicted_saving": float("nan"), "fit_agrees": None}
        | {"fit_reason": "padded lengths 38..4096 reach outside the fit's measured range"},
    )
    rows = {r[1]: r for r in summary_rows(markdown)}
    sort = next(r for title, r in rows.items() if "Sort the whole dataset" in title)
    assert sort[4] == "31.0%: **disagrees** with the measurement beyond its interval"
    grouped = next(r for title, r in rows.items() if "Group batches by length" in title)
    assert grouped[4].startswith("cannot price: padded lengths 38..4096 reach outside")
    summary = section(markdown, "Measured savings")
    assert "**The fit and the measurement disagree** for Sort the whole dataset" in summary
    # why the fit cannot price a change is said once, in its row's fit column
    assert "The fit cannot price: " not in summary


def test_invalid_packing_is_never_recommended(tmp_path):
    reason = "gate.json: the mask gate's packed scenario has 3 violation(s)"
    markdown = render_planted(
        tmp_path,
        packing={"valid": False, "invalid_reason": reason, "rank": None, "tie_group": None},
    )
    rows = summary_rows(markdown)
    assert not any("Pack whole examples" in r[1] for r in rows)
    summary = section(markdown, "Measured savings")
    assert (
        f"**Not recommended: Pack whole examples into 4,096-token rows** (`packing`) is invalid "
        f"here: {reason}"
    ) in summary
    assert "Best measured change: **Pack" not in summary
    applied = section(markdown, "Apply it")
    packing = applied.split("Pack whole examples into 4096-token rows")[1]
    assert "**invalid here, do not apply**" in packing.split("###")[0]


def test_a_change_the_budget_did_not_time_says_so_not_invalid(tmp_path):
    reason = (
        "not timed: deciding it at ±10% would take about 18 s of timing on this device (19 units "
        "at a CV of 10.9%)"
    )
    nan = float("nan")
    markdown = render_planted(
        tmp_path,
        packing={
            "valid": False, "invalid_reason": reason, "rank": None, "tie_group": None,
            "saving_vs_random": nan, "saving_ci_low": nan, "saving_ci_high": nan,
        },
    )  # fmt: skip
    packing = section(markdown, "Apply it").split("Pack whole examples into 4096-token rows")[1]
    first = packing.split("###")[0]
    assert f"**{reason}**" in first and "invalid here" not in first
    measured = " ".join(section(markdown, "Measured savings").split())
    assert "**Not timed: Pack whole examples into" in measured and "invalid here" not in measured
    assert "(`packing`): deciding it at ±10% would take about 18 s" in measured
    assert "(`packing`): deciding" in markdown  # one space after the colon, as written


def test_changed_optimizer_steps_are_said_next_to_the_saving(rendered):
    packing = next(r for r in summary_rows(rendered[0]) if "Pack whole" in r[1])
    # packing is planned at its pasted shape (tokens per update kept): 18 steps of ~0.8×
    assert packing[5].startswith("optimizer steps 15 → 18 (")
    assert "a hyperparameter change" in packing[5]
    assert "grad_accum 1 instead of 8 keeps tokens per update comparable" in packing[5]


def test_cuda_replay_states_host_bound_share_and_what_c_is(rendered):
    summary = section(rendered[0], "Measured savings")
    # a column of the table, one share a change, not a sentence listing them all
    assert "| optimizer steps | host-bound |" in summary
    packing = next(r for r in summary_rows(rendered[0]) if "Pack whole" in r[1])
    assert re.fullmatch(r"\d+%", packing[6])
    assert (
        "Host-bound: the share of a change's sampled micro-batches with the GPU busy under 70%"
        in summary
    )
    scaling = section(rendered[0], "Scaling")
    assert "not a per-micro-batch cost that packing" in scaling
    assert re.search(r"\| a \(s/token²\) \| \S+ \| \S+ … \S+ \|", scaling)
    assert "Measured range: 32 tokens to 4,096 tokens" in scaling
    assert "figures/replay_fit.png" in scaling


def test_kernel_table_sums_device_rows_only(rendered):
    kernels = section(rendered[0], "Kernels")
    assert kernels.count("| GEMM |") == 1  # the CPU twin of the GEMM row is dropped
    assert "| **total** | 480 ms | 100.0% |" in kernels
    assert "1 other row(s) left out" in kernels
    assert "double-counts" in kernels


def test_mask_section_counts_fast_path_per_scenario(rendered):
    mask = section(rendered[0], "Mask gate")
    assert "gate **passed**: 1 of 6 decoder layers keep SDPA's is_causal fast path" in mask
    assert (
        "| training | 2 × 4,096 | none | no | 1 of 6 | 0 | efficient ×5, flash ×1 | 6/6 calls "
        "| flash: attn_mask present ×5; cudnn: attn_mask present ×5 |"
    ) in mask
    assert "| short | 2 × 256 | none | no | 6 of 6 | 0 | flash ×6 | — | — |" in mask
    assert "| training | sliding_attention | 5 | 0 | 511 | 0 |" in mask
    assert "| short | full_attention | 1 | 1 | none | none |" in mask


def test_mask_violations_are_listed():
    layers = mask_layers()
    layers.loc[2, "violation"] = "training layer 2: band 600 != window 512"
    gate = {"passed": False, "violations_total": 1, "violations": [layers.loc[2, "violation"]]}
    mask = mask_sections.mask_section({"mask_layers": layers}, {}, {"mask_gate": gate})
    assert not mask["passed"] and mask["violations"] == [layers.loc[2, "violation"]]
    assert [s["n_violations"] for s in mask["scenarios"]] == [1, 0, 0, 0]


def test_padding_counts_every_bucket(rendered):
    padding = section(rendered[0], "Padding")
    assert "230 OK, 4 TRUNCATED, 3 EMPTY, 3 ERROR" in padding
    assert "EMPTY `no_content` ×3" in padding
    assert "ERROR `other_reason` ×1" in padding  # a reason that is not a code is hidden
    assert "lost to truncation" in padding
    assert re.search(r"^\| \*\*all\*\* \| 234 \| 144,610 \|", padding, re.M)


def test_controls_and_provenance(rendered):
    markdown, _ = rendered
    controls = section(markdown, "Controls")
    for stage in STAGES:
        assert re.search(rf"^\| {stage} \| .* \| passed \|$", controls, re.M)
    provenance = section(markdown, "How these numbers were measured").split("### Provenance")[1]
    for what in ("config hash", "git commit", "command line", "transformers", "NVIDIA H200"):
        assert what in provenance
    assert "job_id=1234" in provenance and "gpus" not in provenance
    assert "probes.reference_harness" in provenance
    assert "| | ↳ check 2 | | 2 | 2 | passed |" in controls
    assert "different configs" not in provenance


def test_canary_never_rendered(rendered):
    markdown, out = rendered
    assert CANARY not in markdown
    for figure in (out.parent / "figures").iterdir():
        assert CANARY.encode() not in figure.read_bytes()


def test_profile_not_run_renders_not_run(rendered_not_run):
    markdown, out = rendered_not_run
    assert re.findall(r"^## (.+)$", markdown, re.M) == list(rep.SECTION_TITLES)
    for title in ("Scaling", "Kernels", "Promised vs realized"):
        assert f"**Not run.** {NOT_RUN_REASON}" in section(markdown, title)
    assert f"Wall clock: **Not run.** {NOT_RUN_REASON}" in section(markdown, "Cross-entropy")
    assert re.search(r"^\| profile \| profile_controls \| .* \| not run \|$", markdown, re.M)
    summary = section(markdown, "Summary")
    assert f"**No measured savings:** the replay did not run ({NOT_RUN_REASON})" in summary
    assert "(linear) to" not in summary and not re.search(r"% \[", summary)
    # what the stages found, listed unpriced
    assert "| # | change | basis |" in section(markdown, "Measured savings")
    assert sorted(Path(link).name for link in rep.linked_figures(markdown)) == [
        "bucket.png",
        "dp.png",
        "lengths.png",
    ]
    assert not (out.parent / "figures" / "scaling.png").exists()


def test_cpu_fit_is_flagged(tmp_path):
    markdown, _ = render(tmp_path, profile="cpu")
    summary = section(markdown, "Measured savings")
    assert (
        "**CPU-only replay** (a rehearsal of the data's shape: every length scaled down to at "
        "most 4,096 tokens" in summary
    )
    assert "**not comparable with a GPU**" in summary
    assert "Host-bound" not in summary
    assert "**CPU-only run**" in section(markdown, "Scaling")
    assert "self CPU time of leaf ops" in section(markdown, "Kernels")
    assert "| CPU time |" in section(markdown, "Kernels")


def test_failed_control_is_shouted(tmp_path):
    markdown, _ = render(tmp_path, failed=("bucket",))
    assert "**Failed controls:** bucket/bucket_control" in section(markdown, "Summary")
    assert "| **FAILED** |" in section(markdown, "Controls")


def test_failed_check_inside_a_control_is_shown(tmp_path):
    markdown, _ = render(tmp_path, failed=("padding",))
    controls = section(markdown, "Controls")
    assert "| 2 of 3 pass | **FAILED** |" in controls
    assert "| | ↳ check 2 | | 2 | 2 | **FAILED** |" in controls


def test_many_sources_show_top_n_and_other(tmp_path):
    from probes.report import figures

    lengths = padding_lengths(n=600, n_sources=30)
    distribution = padding_tables(lengths)["distribution"]
    drawn = figures.length_histogram(distribution, 30, tmp_path / "lengths.png", top_n=5, dpi=30)
    assert len(drawn) == 6 and drawn[-1] == "other (25 sources)"
    rows, more = padding_sections.distribution_rows(distribution, top_sources=5)
    assert rows[0]["scope"] == "overall" and len(rows) == 6 and more == 25
    padding = padding_sections.padding_section(
        {"padding_lengths": lengths, "padding_summary": padding_tables(lengths)["summary"]}
        | {"padding_distribution": distribution},
        {},
        top_sources=5,
    )
    assert len(padding["status_by_source"]) == 5 and padding["more_sources"] == 25


# ------------------------------------------------------------------------------------------
# Loading: a renamed column fails clearly
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TABLES))
def test_missing_column_fails_naming_file_and_column(tmp_path, name):
    from stage_fixtures import write_data_parallel

    paths = {**write_results(tmp_path), **write_data_parallel(tmp_path)}
    if name not in paths:  # an optional stage the fixtures do not write yet (memory)
        pytest.skip(f"tests/stage_fixtures.py writes no {TABLES[name].stage} outputs")
    frame = pd.read_parquet(paths[name])
    dropped = TABLES[name].required[-1]
    write_parquet(frame.drop(columns=[dropped]), paths[name], {})
    with pytest.raises(load.ReportInputError) as err:
        load.load_inputs(paths)
    message = str(err.value)
    assert str(paths[name]) in message and f"'{dropped}'" in message
    assert TABLES[name].section in message


def test_missing_json_key_and_bad_json_fail_clearly(tmp_path):
    paths = write_results(tmp_path)
    write_json({"status": "ok", "thresholds": {}}, paths["bucket_recommendation"])
    match = r"recommendation.json: key\(s\) \['recommended'\]"
    with pytest.raises(load.ReportInputError, match=match):
        load.load_inputs(paths)
    paths["bucket_recommendation"].write_text("{not json")
    with pytest.raises(load.ReportInputError, match="not valid JSON"):
        load.load_inputs(paths)


def test_control_without_its_keys_fails(tmp_path):
    paths = write_results(tmp_path)
    write_json({"name": "c", "passed": True}, paths["mask_control"])
    with pytest.raises(load.ReportInputError, match=r"mask/control.json: key\(s\) \['descr"):
        load.load_inputs(paths)


def test_failed_render_leaves_no_output(tmp_path):
    paths = write_results(tmp_path / "results")
    paths["mask_gate"].unlink()
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    with pytest.raises(load.ReportInputError, match="gate.json: not found"):
        run_report(paths, out)
    assert not out.exists() and not (out.parent / "figures").exists()
    assert list(out.parent.iterdir()) == [] if out.parent.exists() else True


# ------------------------------------------------------------------------------------------
# Pure functions: formatting and the time model
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("func", "value", "expected"),
    [
        (fmt.fmt_seconds, 0.0123, "12.3 ms"),
        (fmt.fmt_seconds, 4.2e-5, "42 µs"),
        (fmt.fmt_seconds, 1.5, "1.5 s"),
        (fmt.fmt_seconds, 600, "10 min"),
        (fmt.fmt_seconds, 160_800, "44.7 h"),
        (fmt.fmt_seconds, float("nan"), "—"),
        (fmt.fmt_bytes, 1.5 * 2**30, "1.50 GiB"),
        (fmt.fmt_bytes, 512, "512 B"),
        (fmt.fmt_bytes, None, "—"),
        (fmt.fmt_pct, 0.1234, "12.3%"),
        (fmt.fmt_count, 7168, "7,168"),
        (fmt.fmt_tokens, 4096.0, "4,096 tokens"),
        (fmt.fmt_ratio, 0.5, "0.50×"),
        (fmt.fmt_signed_pct, -0.04, "-4.0%"),
        (fmt.fmt_number, 1.7e3, "1.7e+03"),
        (fmt.fmt_value, {"a": 1}, '{"a": 1}'),
        (fmt.fmt_value, True, "true"),
        (fmt.cell, "a|b\nc", "a\\|b c"),
        (fmt.reason_code, "invalid_json", "invalid_json"),
        (fmt.reason_code, "line 3: 'hello there'", "other_reason"),
    ],
)
def test_formatters(func, value, expected):
    assert func(value) == expected


def test_label_is_short_and_table_safe():
    assert fmt.label("x" * 100) == "x" * 39 + "…"
    assert fmt.label("a|b\tc") == "a\\|b c"


def test_fit_with_a_negative_coefficient_is_flagged(tmp_path):
    paths = write_results(tmp_path)
    fit = pd.read_parquet(paths["profile_fit"]).assign(b=-0.4)
    write_parquet(fit, paths["profile_fit"], {})
    inputs = load.load_inputs(paths)
    assert "negative coefficient (b = -0.4)" in findings.fit_problem(inputs["tables"], {})


def test_examples_without_loss_tokens_are_a_recommendation(tmp_path):
    paths = write_results(tmp_path)
    lengths = pd.read_parquet(paths["padding_lengths"])
    idle = lengths.index[lengths["status"] == "OK"][:46]  # 46 of 234 examples that train
    lengths.loc[idle, "n_loss_tokens"] = 0
    write_parquet(lengths, paths["padding_lengths"], {})
    inputs = load.load_inputs(paths)
    recs = findings.recommendations(inputs["tables"], inputs["json"], {}, limit=10)
    drop = next(r for r in recs if r["title"].startswith("Drop the 46 examples"))
    assert "19.7% of the examples that train" in drop["detail"]
    trains = lengths.loc[lengths["status"].isin(TRAINING_STATUSES), "n_tokens"]
    share = trains.loc[idle].sum() / trains.sum()
    assert f"{100 * share:.1f}% of their tokens" in drop["detail"]
    assert "saving" not in drop  # a finding, not a price: only the replay measures time


def test_no_pad_to_longest_finding_for_a_users_trainer(tmp_path):
    """A trainer's collator already pads to the longest member (the padding stage checked it):
    "pad to the longest member, if you pad to max_seq_len today" does not apply to it."""
    pad = "Pad each batch to its longest member, not to max_seq_len"
    paths = write_results(tmp_path)
    inputs = load.load_inputs(paths)
    assert pad in [
        r["title"] for r in findings.recommendations(inputs["tables"], inputs["json"], {}, 10)
    ]
    lengths = pd.read_parquet(paths["padding_lengths"]).assign(file=TRAINER_DATASET_FILE)
    write_parquet(lengths, paths["padding_lengths"], {})
    inputs = load.load_inputs(paths)
    assert pad not in [
        r["title"] for r in findings.recommendations(inputs["tables"], inputs["json"], {}, 10)
    ]


def test_insufficient_fit_renders_no_fit(tmp_path):
    paths = write_results(tmp_path / "results")
    fit = pd.read_parquet(paths["profile_fit"])
    fit = fit.assign(a=np.nan, b=np.nan, c=np.nan, n_points=2, method="insufficient_points")
    fit["message"] = "only 2 distinct length(s) with a measured time"
    write_parquet(fit, paths["profile_fit"], {})
    out = tmp_path / "results/report/playbook-evidence.md"
    run_report(paths, out, dpi=30)
    scaling = section(out.read_text(), "Scaling")
    assert "**No fit:** fewer than 3 usable points" in scaling
    assert "only 2 distinct length(s)" in scaling
    assert "Fit diagnostic: the scaling fit has fewer than 3" in scaling
    assert "(linear) to" not in section(out.read_text(), "Summary")


def test_fit_with_fewer_than_three_points_is_not_used(tmp_path):
    paths = write_results(tmp_path)
    fit = pd.read_parquet(paths["profile_fit"]).assign(n_points=2)
    write_parquet(fit, paths["profile_fit"], {})
    inputs = load.load_inputs(paths)
    assert "fewer than 3 usable points" in findings.fit_problem(inputs["tables"], {})


def test_bucket_numbers_come_from_the_stage_summary_not_the_sweep(tmp_path):
    """The report renders bucket/summary.parquet as the stage wrote it: a value planted there
    shows in the bucketing table, the figure and the summary; the sweep is not re-averaged."""
    paths = write_results(tmp_path / "results")
    summary = pd.read_parquet(paths["bucket_summary"])
    assert summary["strategy"].iloc[0] == "random"
    assert summary["strategy"].iloc[-1] == "batch_rebalance"
    random = summary["strategy"] == "random"
    planted = summary.assign(token_efficiency=summary["token_efficiency"].mask(random, 0.123))
    write_parquet(planted, paths["bucket_summary"], {})
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    run_report(paths, out)
    bucketing = section(out.read_text(), "Bucketing")
    random_row = next(line for line in bucketing.splitlines() if line.startswith("| random |"))
    assert "| 12.3% |" in random_row


def test_bucket_section_rows_carry_only_contract_columns(tmp_path):
    paths = write_results(tmp_path)
    summary = pd.read_parquet(paths["bucket_summary"]).assign(planted=CANARY)
    write_parquet(summary, paths["bucket_summary"], {})
    inputs = load.load_inputs(paths)
    built = bucket_sections.bucket_section(inputs["tables"], inputs["not_run"], inputs["json"])
    assert all(set(row) == set(table_columns("bucket_summary")) for row in built["rows"])
    assert built["n_seeds"] == 3 and built["level"] == "optimizer step"
    assert [row["strategy"] for row in built["packing"]] == ["packing_bfd", "packing_ffd"]


# ------------------------------------------------------------------------------------------
# The entry script, standalone
# ------------------------------------------------------------------------------------------


def test_script_help_and_standalone_render(tmp_path):
    assert (
        "--results"
        in subprocess.run(
            [sys.executable, SCRIPT, "--help"], capture_output=True, text=True, check=True
        ).stdout
    )
    write_results(tmp_path / "results", profile="not_run")
    log = tmp_path / "report.log"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--results", tmp_path / "results", "--log", log, *NO_MEMORY],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "results/report/figures/lengths.png").is_file()
    # data_parallel: world_size 1 (the default)
    assert (
        "stages not run: ['data_parallel', 'memory', 'profile', 'realize', 'replay']"
        in log.read_text()
    )
    assert CANARY not in done.stdout + done.stderr + log.read_text()


def test_script_bad_input_exits_nonzero_with_message(tmp_path):
    paths = write_results(tmp_path / "results")
    frame = pd.read_parquet(paths["bucket_sweep"]).drop(columns=["order_length_spearman"])
    write_parquet(frame, paths["bucket_sweep"], {})
    done = subprocess.run(
        [sys.executable, SCRIPT, "--results", tmp_path / "results", *NO_MEMORY],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "sweep.parquet: column(s) ['order_length_spearman'] missing" in done.stderr
    assert not (tmp_path / "results/report/playbook-evidence.md").exists()


def test_not_run_json_convention_round_trips(tmp_path):
    paths = write_results(tmp_path, profile="not_run")
    assert load.not_run_reason(read_json(paths["profile_provenance"])) == NOT_RUN_REASON
    assert json.loads(paths["profile_control"].read_text())["status"] == load.NOT_RUN


# ------------------------------------------------------------------------------------------
# What issues 13-15 added: dtype, MFU convention, CE variants, penalty spread, FLOP check, Apply it
# ------------------------------------------------------------------------------------------


def test_scaling_header_states_dtype_and_mfu_convention(rendered, tmp_path):
    scaling = section(rendered[0], "Scaling")
    assert "Dtype: **bfloat16** (auto: CUDA computes bfloat16 natively)." in scaling
    assert f"MFU convention: {MFU_CONVENTION}" in scaling
    # the LoRA-convention MFU, then the old 6·N reading beside it, labelled
    assert "| MFU | MFU, old 6·N reading |" in scaling
    assert "| 12.0% | 31.0% |" in scaling
    # the fit's split of a step into terms is a model, not a measurement: not in the table
    assert "quadratic share" not in scaling and "32.4%" not in scaling
    cpu = section(render(tmp_path, profile="cpu")[0], "Scaling")
    assert "Dtype: **float32** (auto: this CPU emulates bfloat16" in cpu


def test_unverified_mfu_is_marked_with_its_reason(tmp_path):
    paths = write_results(tmp_path / "results")
    provenance = read_json(paths["profile_provenance"])
    provenance["mfu_unverified_reason"] = "FlopCounterMode counted no matmul FLOPs"
    write_json(provenance, paths["profile_provenance"])
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    run_report(paths, out)
    scaling = section(out.read_text(), "Scaling")
    assert "**MFU unverified**: FlopCounterMode counted no matmul FLOPs." in scaling


def test_provenance_without_the_mfu_convention_fails(tmp_path):
    paths = write_results(tmp_path)
    provenance = read_json(paths["profile_provenance"])
    del provenance["mfu_convention"]
    write_json(provenance, paths["profile_provenance"])
    with pytest.raises(load.ReportInputError, match=r"key\(s\) \['mfu_convention'\] missing"):
        load.load_inputs(paths)


def test_ce_section_separates_position_selection_from_chunking(rendered):
    ce = section(rendered[0], "Cross-entropy")
    # 177 ms all positions → 83 ms loss positions (unchunked) → 69 ms chunked (fixture times)
    assert "| all_positions_unchunked | OK | all | 8,192 | 177 ms | 45.4% | — | 5.87 GiB |" in ce
    assert (
        "Position selection (logits for the loss positions only, both unchunked): 177 ms → "
        "83 ms, 94 ms saved (0.47× the time)"
    ) in ce
    assert "unchunked → chunked): 83 ms → 69 ms, 14 ms saved (0.83× the time)" in ce
    assert (
        "- loss_positions_chunked: harness.loss_from_hidden "
        "(probes.step.reference_harness.loss_from_hidden)"
    ) in ce


def test_ce_effect_of_a_failed_variant_is_not_invented():
    rows = [
        {"variant": "all_positions_unchunked", "status": "OOM", "time_s": None},
        {"variant": "loss_positions_unchunked", "status": "OK", "time_s": 0.2},
        {"variant": "loss_positions_chunked", "status": "OK", "time_s": 0.05},
    ]
    effects = ce_sections.ce_effects(rows)
    assert effects["position_selection"] is None
    assert effects["chunking"] == pytest.approx(
        {"before_s": 0.2, "after_s": 0.05, "saved_s": 0.15, "ratio": 0.25}
    )


def test_padding_penalty_shows_spread_and_prediction(rendered):
    scaling = section(rendered[0], "Scaling")
    assert (
        "| one_by_one | OK | 5 | 610 ms | 400 ms | +52.5% | +31.0% … +66.0% | +48.0% |" in scaling
    )
    assert "| packed | OK | 5 | 610 ms | 420 ms | +45.2% | +22.0% … +58.0% | — |" in scaling
    assert "- packed: none: a 5000-token row is beyond the longest fitted length 4096" in scaling


def test_a_penalty_not_timed_says_why_instead_of_a_table(tmp_path):
    """A trainer's profile leaves the penalty to the replay (probes.profile.stage
    PRICED_BY_REPLAY): one line naming where it is priced, not a table of skipped rows."""
    from probes.profile.penalty import skipped_penalty

    paths = write_results(tmp_path / "results")
    write_parquet(skipped_penalty("priced elsewhere"), paths["profile_padding_penalty"], {})
    out = tmp_path / "results/report/playbook-evidence.md"
    run_report(paths, out, dpi=30)
    scaling = section(out.read_text(), "Scaling")
    assert "Padding penalty: not timed here: priced elsewhere." in scaling
    assert "| unpadded as |" not in scaling


def test_flop_counter_check_renders_its_numbers_not_its_json(rendered):
    controls = section(rendered[0], "Controls")
    assert (
        "| | ↳ analytic_flops_match_flop_counter | | analytic_over_counted 1; tolerance 0.15 "
        "| analytic_over_counted 1.04 | passed |"
    ) in controls
    assert "counted_by_op" not in controls


def test_check_values_fall_back_and_carry_the_hint():
    expected, observed = controls_sections.check_values(
        {"kernel_sum_s_max": 1.1, "tolerance": 0.1},
        {"kernel_sum_s": 0.9, "wall_s": 1.0, "share": 0.9, "extra": 5, "hint": "rerun it"},
    )
    assert expected == "kernel_sum_s_max 1.1; tolerance 0.1"
    assert observed == "kernel_sum_s 0.9; wall_s 1; share 0.9; hint: rerun it"
    assert controls_sections.check_values(2, 3) == ("2", "3")


def test_recommendations_json_is_written_beside_the_report(rendered):
    _, out = rendered
    document = json.loads((out.parent / "recommendations.json").read_text())
    applies = [c for c in document["changes"] if c["applies"]]
    assert {c["id"] for c in applies} == {
        "length_grouped",
        "group_by_length_builtin",
        "batch_rebalance",
        "packing",
    }
    # the report's order: measured changes by measured saving (with rank), then unmeasured ones
    measured = [c for c in applies if c["measured_saving"] is not None]
    # transformers' built-in group_by_length and batch_rebalance are replayed too (each its own
    # plan: the Trainer's sampler)
    assert [c["id"] for c in measured] == [
        "packing",
        "group_by_length_builtin",
        "batch_rebalance",
        "length_grouped",
    ]
    # the sweep's token model beside the replay's measurement, three-way
    checks = {c["id"]: c.get("model_check") for c in measured}
    assert [k["versus"] for k in checks["batch_rebalance"]][0] == "random batches"
    assert {k["verdict"] for k in checks["batch_rebalance"]} <= {"agrees", "disagrees", "undecided"}
    savings = [c["measured_saving"] for c in measured]
    assert savings == sorted(savings, reverse=True)
    ranks = [c["rank"] for c in measured]
    assert ranks == sorted(ranks) and ranks[0] == 1 and "measured saving" in document["order"]
    assert applies[: len(measured)] == measured
    assert all(c["rank"] is None for c in applies[len(measured) :])
    assert document["baseline"]["micro_batch_size"] == 2
    assert all(c["verified"] for c in document["changes"] if c["applies"])


def test_apply_section_lists_each_change_with_snippets_and_savings(rendered):
    markdown, out = rendered
    applied = section(markdown, "Apply it")
    titles = re.findall(r"^### \d+\. (.+)$", applied, re.M)
    assert titles == [
        "Pack whole examples into 4096-token rows (TRL, best-fit decreasing)",
        "Built-in alternative: group_by_length (its fixed bucket of 24 micro-batches)",
        "transformers' batch_rebalance sampler (variable micro-batch size)",
        "Group batches by length: buckets of 4 micro-batches",
    ]
    assert "train_sampling_strategy='batch_rebalance')" in applied
    assert "SFTConfig(packing=True, packing_strategy='bfd'" in applied
    assert applied.count("```python") == 7  # packing has no plain-Trainer setting
    assert "Tokens per update: 9,888 tokens → 9,888 tokens" in applied
    assert "`drop_no_loss_examples` (no example without a loss token)" in applied
    # every batching change's saving is the Summary's, measured by the replay: the built-in
    # group_by_length's and batch_rebalance's too (each its own plan); no estimated price
    for title, number in (
        ("Group batches by length", "4"),
        ("built-in group_by_length", "2"),
        ("batch_rebalance sampler", "3"),
    ):
        row = next(r for r in summary_rows(markdown) if title in r[1])
        part = applied.split(f"### {number}.")[1].split("###")[0]
        assert f"Saving of training time: **measured** {row[2]} versus random batches" in part
    assert "Saving of training time: not measured" not in applied
    assert "Saving of training time: **estimated**" not in applied
    # batch_rebalance has its own row in the bucketing table
    assert re.search(r"^\| batch_rebalance \| — \| 80\.2% \|", section(markdown, "Bucketing"), re.M)


def test_apply_section_without_a_replay_prices_nothing(rendered_not_run):
    applied = section(rendered_not_run[0], "Apply it")
    assert "Saving of training time: not measured: no replay ran" in applied
    assert "estimated" not in applied.split("### 1.")[1]  # no estimate stands in for it


def test_examples_without_loss_tokens_get_a_filter_snippet(tmp_path):
    paths = write_results(tmp_path / "results")
    lengths = pd.read_parquet(paths["padding_lengths"])
    lengths.loc[lengths.index[lengths["status"] == "OK"][:10], "n_loss_tokens"] = 0
    write_parquet(lengths, paths["padding_lengths"], {})
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    run_report(paths, out)
    applied = section(out.read_text(), "Apply it")
    # ordered by its measured saving (random_no_idle is replayed), among the five changes
    assert re.search(r"^### [1-5]\. Drop the 10 examples that carry no loss token$", applied, re.M)
    assert "train_dataset.filter(lambda example: any(label != -100" in applied


def test_mask_section_states_the_prediction_target_and_its_confirmation(rendered):
    mask = section(rendered[0], "Mask gate")
    assert "torch 2.11.0+cu130" in mask and "cudnn > flash > efficient > math" in mask
    assert "Confirmed on a GPU: **agreed** (6/6 SDPA calls ran the predicted backend)" in mask
    train = next(line for line in mask.splitlines() if line.startswith("| training |"))
    assert "| 6/6 calls |" in train
    other = next(line for line in mask.splitlines() if line.startswith("| packed |"))
    assert "| — |" in other  # not confirmed for that scenario: no number invented


def test_bucketing_shows_the_data_parallel_table_and_figure(rendered):
    markdown, out = rendered
    bucketing = section(markdown, "Bucketing")
    assert "### Data parallel: every step waits for the slowest rank" in bucketing
    assert "| strategy | W = 1 | W = 2 | W = 4 | W = 8 |" in bucketing
    # W = 1 has no straggler: every row's first cell is 0.0% overhead
    rows = re.findall(
        r"^\| (random|global_sort|batch_rebalance|packing_\w+) \| (\S+) /", bucketing, re.M
    )
    assert rows and all(first == "0.0%" for _, first in rows)
    assert (out.parent / "figures" / "dp.png").is_file()


def test_summary_and_apply_agree_and_a_slower_change_is_never_recommended(tmp_path):
    markdown = render_planted(
        tmp_path,
        packing={"saving_vs_random": 0.02, "saving_ci_low": -0.03, "saving_ci_high": 0.07}
        | {"rank": 1, "tie_group": 1},
        length_grouped={"saving_vs_random": -0.2, "saving_ci_low": -0.3, "saving_ci_high": -0.1}
        | {"rank": 3, "tie_group": 2},
        group_by_length_builtin={
            "saving_vs_random": -0.25,
            "saving_ci_low": -0.35,
            "saving_ci_high": -0.15,
        }
        | {"rank": 4, "tie_group": 3},
        batch_rebalance={"saving_vs_random": -0.3, "saving_ci_low": -0.4, "saving_ci_high": -0.2}
        | {"rank": 5, "tie_group": 4},
    )
    applied = section(markdown, "Apply it")
    titles = re.findall(r"^### \d+\. (.+)$", applied, re.M)
    assert titles[0].startswith("Pack") and titles[1].startswith("Group batches by length")
    summary_order = [r[1] for r in summary_rows(markdown)]
    pack = next(i for i, t in enumerate(summary_order) if "Pack" in t)
    group = next(i for i, t in enumerate(summary_order) if "Group batches" in t)
    assert pack < group  # the same order in both sections
    first, second = applied.split("### 2.")[0], applied.split("### 2.")[1].split("### 3.")[0]
    assert "ties with random batches" in first
    assert "not recommended: measured slower" in second
    document = json.loads((tmp_path / "results" / "report" / "recommendations.json").read_text())
    by_id = {c["id"]: c for c in document["changes"]}
    assert not by_id["length_grouped"]["recommended"] and not by_id["packing"]["recommended"]
    assert by_id["length_grouped"]["saving_ci_high"] == -0.1
    assert not any(c["recommended"] for c in document["changes"] if (c["saving_ci_high"] or 0) < 0)


# the default trainer's first round on this CPU: sized at 2 of 3 strata, predicted past the
# budget, and it took two thirds of the prediction (its shapes repeat: not every one is warmed)
FIRST_ROUND = {
    "stopped_by": "budget",
    "rounds": 1,
    "timed_micro_batches": 48,
    "elapsed_s": 98.2,
    "first_round_s": 98.2,
    "budget_s": 90.0,
    "retimed_micro_batches": 0,
    "first_round": {
        "strata": 2,
        "strata_configured": 3,
        "first_round_predicted_s": 142.0,
        "unit_s": 2.96,
    },
}


def test_the_first_round_as_sized_and_as_measured():
    from probes.report.sections.replay import first_round_view

    view = first_round_view(FIRST_ROUND)
    assert view["cut"] and view["floor"] and view["disagrees"]
    assert (view["predicted_s"], view["measured_s"]) == (142.0, 98.2)
    within = {**FIRST_ROUND, "first_round_s": 130.0, "budget_s": 200.0}
    assert not first_round_view(within)["disagrees"] and not first_round_view(within)["floor"]
    older = {k: v for k, v in FIRST_ROUND.items() if k != "first_round_s"}  # before it was kept
    assert not first_round_view(older)["disagrees"]
    assert first_round_view({"stopped_by": "census"}) is None


def test_the_report_says_when_the_sizing_model_and_the_first_round_disagree(tmp_path):
    paths = write_results(tmp_path / "results")
    control = read_json(paths["replay_control"])
    write_json({**control, "stopping": FIRST_ROUND}, paths["replay_control"])
    out = tmp_path / "report.md"
    run_report(paths, out)
    text = " ".join(out.read_text().split())
    assert "2 of the 3 configured strata per strategy, the fewest its coverage control" in text
    assert "The sizing model and the measurement disagree" in text
    assert "predicted the first round at 2.37 min" in text and "it took 98.2 s" in text


def test_the_first_screen_states_the_power_line_once(tmp_path):
    """Undecided changes: one line on the first screen with the timing that would decide them
    at the target width and the key that buys it; when everything was decided, that it was."""
    paths = write_results(tmp_path / "results")
    control = read_json(paths["replay_control"])
    power = {
        "undecided": ["attention_eager", "packing"],
        "seconds_to_decide": 540.0,
        "target_half_width": 0.05,
        "key": "replay.cpu.budget_s",
        "configured_budget_s": 120.0,  # the stage's; the rounds had what the rest left
    }
    write_json({**control, "stopping": {**FIRST_ROUND, "power": power}}, paths["replay_control"])
    out = tmp_path / "report.md"
    run_report(paths, out)
    summary = " ".join(section(out.read_text(), "Summary").split())
    assert summary.count("**Power:**") == 1
    assert (
        "2 changes undecided at this budget; deciding them (an interval that excludes 0, or lies "
        "within ±5 pp) would take about 9 min" in summary
    )
    assert "more on this device (raise `replay.cpu.budget_s`, now 2 min)" in summary
    write_json({**control, "stopping": {**FIRST_ROUND, "power": {**power, "undecided": []}}},
               paths["replay_control"])  # fmt: skip
    run_report(paths, out)
    summary = " ".join(section(out.read_text(), "Summary").split())
    assert summary.count("**Power:**") == 1
    assert (
        "every change timed is decided at this budget (an interval that excludes 0, or lies "
        "within ±5 pp): `replay.cpu.budget_s`, 2 min." in summary
    )


def test_more_budget_is_named_only_when_the_budget_stopped_the_timing():
    from probes.report.sections.replay import more_budget_key

    assert more_budget_key({"stopping": FIRST_ROUND}, cpu_only=True) == "replay.cpu.budget_s"
    assert more_budget_key({"stopping": FIRST_ROUND}, cpu_only=False) == "replay.budget_s"
    decided = {"stopping": {**FIRST_ROUND, "stopped_by": "decision"}}
    assert more_budget_key(decided, cpu_only=True) is None
    assert more_budget_key({}, cpu_only=True) is None and more_budget_key(None, True) is None


def test_the_report_says_whether_the_combined_configuration_was_timed_and_why_not(tmp_path):
    from probes.report.sections.replay import combined_view

    why = "no batching change and no step-level change that both measurably save time"
    assert combined_view({"measured": False, "why": why}) == {"measured": False, "why": why}
    timed = {"measured": True, "strategy": "length_grouped+attention_eager"}
    assert combined_view(timed) == timed
    assert combined_view(None) is None and combined_view({}) is None
    paths = write_results(tmp_path / "results")
    control = read_json(paths["replay_control"])
    combined = {"measured": False, "why": why}
    write_json({**control, "stopping": FIRST_ROUND, "combined": combined}, paths["replay_control"])
    out = tmp_path / "report.md"
    run_report(paths, out)
    assert f"Combined configuration: not measured: {why}." in " ".join(out.read_text().split())
    assert problems(out.read_text()) == []  # its own statement, not glued to the stopping note


def test_replay_notes_read_the_instrument_coverage_and_stopping():
    from probes.report.sections.replay import replay_measurement_notes, tokens_not_time

    control = {
        "instrument": {"cv": 0.04, "repeats": 5, "done": {"warmup": 1, "threads": 1}},
        "coverage": {
            "expected": {"replications": 400},
            "observed": {"min_coverage": 0.93, "coverage": {"packing": 0.93}},
            "passed": True,
        },
        "stopping": {"stopped_by": "budget", "rounds": 3},
    }
    notes = replay_measurement_notes(control)
    assert notes["instrument"]["cv"] == 0.04 and "1 thread(s)" in notes["instrument"]["done"]
    assert notes["coverage"]["min"] == 0.93 and notes["coverage"]["passed"]
    assert notes["stopping"]["stopped_by"] == "budget"
    assert replay_measurement_notes({}) == {
        "instrument": None,
        "coverage": None,
        "stopping": None,
        "first_round": None,
        "combined": None,
    }
    tie = "ties with random batches: its 95% interval includes 0"
    assert "20.0% of the tokens" in tokens_not_time({"computed_token_saving": 0.2}, tie)
    assert tokens_not_time({"computed_token_saving": 0.2}, "recommended: faster") is None
    assert tokens_not_time({"computed_token_saving": 0.0}, tie) is None


@pytest.fixture(scope="module")
def rendered_disagreement(report_run):
    return report_run("disagrees")[0]


def test_the_report_shows_the_disagreement_in_the_same_word_everywhere(rendered_disagreement):
    # promised vs realized (probes.report.sections.realize; its rows: test_realize.py)
    text = section(rendered_disagreement, "Promised vs realized")
    row = next(line for line in text.splitlines() if line.startswith("| **Pack"))
    assert "| **disagrees** | optimizer time " in row  # its sign: the fixture's step counts
    assert "**Disagrees:** Pack" in text
    summary = section(rendered_disagreement, "Summary")
    first = next(line for line in summary.splitlines() if line.startswith("| 1 |"))
    assert "| faster; do not rely on the promise: see what differed | **disagrees**: " in first
    # and where the change is listed in the measured table, whether or not it is the best
    rows = [line for line in section(rendered_disagreement, "Measured savings").splitlines()]
    listed = next(line for line in rows if line.startswith("| ") and "**Pack" in line)
    assert "(realized: **disagrees**)" in listed
    # a change realize did not run is said to be unchecked, never passed off as confirmed
    unchecked = [r for r in rows if "**Group batches" in r or "**Sort the whole" in r]
    assert unchecked and all("(not checked by real training steps)" in r for r in unchecked)
    assert "not confirmed" not in rendered_disagreement.lower()


def test_data_parallel_at_world_size_1_is_a_not_run_line(rendered):
    bucketing = section(rendered[0], "Bucketing")
    assert "### Data parallel, measured under torchrun" in bucketing
    assert "**Not run.** world_size 1" in bucketing


def test_data_parallel_measured_table_and_where_ranks_ran(tmp_path):
    from stage_fixtures import write_data_parallel

    paths = {**write_results(tmp_path / "results"), **write_data_parallel(tmp_path / "results")}
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    run_report(paths, out)
    bucketing = section(out.read_text(), "Bucketing")
    assert "W = 2 ranks\n(gloo, CPU, lengths capped at 64 tokens" in bucketing
    rows = [line for line in bucketing.splitlines() if line.startswith("| DDP |")]
    assert rows[-2].startswith("| DDP | random | 1 s | 960 ms | 1.042 | 500 ms | 150 ms | 50 ms |")
    assert rows[-1].startswith("| DDP | length_grouped | 600 ms | 960 ms | 0.625 (outside) |")
    assert "rank 1 (local 1) on node1, cpu, SLURM job 7" in bucketing


def test_a_coverage_control_with_no_change_timed_says_so(tmp_path):
    """Under load the replay's budget can end before any change is timed: the coverage control
    had nothing to cover (no widths, no coverage) and the report says that instead of failing
    on the missing width."""
    paths = write_results(tmp_path / "results")
    control = read_json(paths["replay_control"])
    coverage = {
        "verdict": "uninformative",
        "passed": False,
        "expected": {"replications": 200, "max_width_pp": 20.0},
        "observed": {"coverage": {}, "min_coverage": float("nan"), "mean_width_pp": {}},
    }
    write_json({**control, "coverage": coverage}, paths["replay_control"])
    out = tmp_path / "report.md"
    run_report(paths, out)
    text = " ".join(out.read_text().split())
    assert "**uninformative**: no change was timed, so there was nothing to cover" in text


def test_the_first_screen_warns_when_the_machine_was_busy_while_timing(tmp_path):
    """An instrument CV of 83% at a load of 4.6 on 2 cores (a fresh-clone run beside other
    jobs: the budget went to the fit and nothing was timed) is said on the first screen, with
    what to do; an idle machine's 3% says nothing."""
    paths = write_results(tmp_path / "results")
    control = read_json(paths["replay_control"])
    instrument = {**(control.get("instrument") or {}), "cv": 0.831,
                  "load_average": [4.63, 3.88, 4.5], "done": {"cpu_affinity_cores": 2}}  # fmt: skip
    write_json({**control, "instrument": instrument}, paths["replay_control"])
    out = tmp_path / "report.md"
    run_report(paths, out)
    summary = " ".join(section(out.read_text(), "Summary").split())
    assert "**Busy machine:** the same micro-batch timed back to back varied by 83%" in summary
    assert "at a load average of 4.6 on 2 cores" in summary and "rerun `replay` when" in summary
    write_json({**control, "instrument": {**instrument, "cv": 0.03}}, paths["replay_control"])
    run_report(paths, out)
    assert "Busy machine" not in out.read_text()


def test_the_pasted_settings_keep_the_checkpointing_the_stages_saw():
    """recommendations.json's training section: the trainer's step as the padding stage recorded
    it, else the replay's checkpointing change; unknown where neither ran."""
    from types import SimpleNamespace

    from probes.report.stage import run_training

    cfg = SimpleNamespace(
        training=SimpleNamespace(micro_batch_size=2, grad_accum=8, max_seq_len=64)
    )
    replay = {"replay": {"step_changes": [{"strategy": "gradient_checkpointing_on"}]}}
    trainer = {"padding": {"trainer": {"step_config": {"gradient_checkpointing": True}}}}
    assert run_training(cfg, replay)["gradient_checkpointing"] is False
    assert run_training(cfg, {**replay, **trainer})["gradient_checkpointing"] is True
    assert run_training(cfg, {})["gradient_checkpointing"] is None
    assert run_training(cfg, {})["max_seq_len"] == 64


def test_every_pasted_step_level_snippet_is_verified_against_the_installed_libraries(tmp_path):
    """The step-level changes join recommendations.json after the batching ones were verified:
    they are constructed against the installed transformers / TRL too, never left "not
    checked"."""
    pytest.importorskip("trl")
    from probes.report.stage import recommendations_document
    from probes.step.changes import StepConfig, step_changes

    loaded = load.load_inputs(write_results(tmp_path / "results"))
    priced = step_changes(StepConfig(False, "sdpa", "nll", 0), 2, 8)
    loaded["provenance"]["replay"] = {
        "step_changes": [
            {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
        ]
    }
    document = recommendations_document(loaded, TRAINING_SECTION)
    step_level = [c for c in document["changes"] if c.get("step_level")]
    assert {c["id"] for c in step_level} >= {"gradient_checkpointing_on", "loss_dft"}
    for change in step_level:
        assert change["verified"] is True, (change["id"], change.get("verification"))
    unverified = [c["id"] for c in document["changes"] if c["applies"] and "verification" not in c]
    assert unverified == []


TRAINING_SECTION = {"micro_batch_size": 2, "grad_accum": 8, "max_seq_len": 4096}
