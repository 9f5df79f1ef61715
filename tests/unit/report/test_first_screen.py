"""The report's first screen (probes.report.sections.verdicts), the three verdict words wherever
realize is reported, and the rendered markdown checked as markdown (probes.report.lint)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from probes.contracts import table_columns
from probes.report import lint
from probes.report.sections.apply import caveat_clauses, share_caveats
from probes.report.sections.verdicts import (
    beside_view,
    decision_word,
    memory_check,
    next_action,
    not_timed_word,
    timed_step,
    verdicts_section,
)
from probes.report.stage import DEFAULT_TEMPLATE

from .renders import EXTRA_CHANGES

# the fixture reports are rendered once (conftest.report_run, per process): every test that
# reads them on one worker, test_report.py's too
pytestmark = pytest.mark.xdist_group("report_renders")

VERDICT_HEADER = "| # | change | measured saving [95%] | decision | realized | memory |"
SEPARATOR = "|---|---|---|---|---|---|"
RUNS = (
    "default",
    "profile not run",
    "cpu",
    "disagrees",
    "undecided",
    "none faster",
    "many changes",
)


@pytest.fixture(scope="module")
def reports(report_run) -> dict[str, tuple[str, dict]]:
    """Each kind of run's markdown and recommendations.json (conftest.report_run renders)."""
    out = {}
    for name in RUNS:
        markdown, path = report_run(name)
        out[name] = (markdown, json.loads((path.parent / "recommendations.json").read_text()))
    return out


def _first_screen(markdown: str) -> str:
    """From the top down to the first "## " heading after the Summary's."""
    top, _, rest = markdown.partition("\n## Summary\n")
    return top + "\n## Summary\n" + rest.split("\n## ")[0] + "\n"


def _verdict_rows(markdown: str) -> list[list[str]]:
    """The first screen's table rows (rank, change, saving, decision, realized, memory)."""
    screen = _first_screen(markdown)
    assert VERDICT_HEADER in screen
    rows = [line for line in screen.splitlines() if re.match(r"^\| (\d|—)", line)]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in rows]


def _row(markdown: str, title: str) -> list[str]:
    (row,) = [r for r in _verdict_rows(markdown) if r[1].startswith(f"**{title}")]
    return row


# ------------------------------------------------------------------------------------------
# The first screen
# ------------------------------------------------------------------------------------------


def test_the_first_screen_is_one_table_of_every_change_in_40_lines(reports):
    markdown, document = reports["default"]
    screen = _first_screen(markdown)
    assert len(screen.splitlines()) <= 40 and screen.count(VERDICT_HEADER) == 1
    # one table: no other table, and at most five lines under it
    assert [line for line in screen.splitlines() if line.startswith("|---")] == [SEPARATOR]
    under = screen.split(VERDICT_HEADER)[1].split("\n\n", 2)[2]
    assert len([line for line in under.splitlines() if line.strip()]) <= 5
    rows = _verdict_rows(markdown)
    # every strategy the replay's table holds, the baseline among them, then the CE chunking
    assert len(rows) == 8 and rows[-1][1] == "**Chunk the cross-entropy: 819 tokens a chunk**"
    rank, title, saving, decision, realized, memory = rows[0]
    assert rank == "1" and title == "**Pack whole examples into 4,096-token rows**"
    assert re.fullmatch(r"\d+\.\d% \[\d+\.\d%, \d+\.\d%\]", saving)
    assert decision == "faster" and memory == "not predicted"
    assert re.fullmatch(r"agrees: \d+\.\d% \[\d+\.\d%, \d+\.\d%\]", realized)
    # a tie shares one rank, its rows side by side; the baseline is ranked among them
    ranks = [r[0] for r in rows if r[0] != "—"]
    assert ranks == sorted(ranks, key=int) and len(set(ranks)) < len(ranks)
    baseline = _row(markdown, "Random batches (the baseline)")
    assert baseline[3] == "baseline" and baseline[0] in ranks
    assert _row(markdown, "Pad each batch")[3] == "faster than padding to max_seq_len"
    assert rows[-1][3] == "not timed here (saves loss memory, 20.00 GiB, not time)"
    recommended = [c["title"] for c in document["changes"] if c["recommended"]]
    # every change recommended is one the table decides faster
    assert 1 <= len(recommended) <= sum(r[3].startswith("faster") for r in rows)
    assert "Measured on **NVIDIA H200**" in screen and "- Mask gate: **passed**" in screen
    assert "(#how-these-numbers-were-measured)" in screen and "(#promised-vs-realized)" in screen
    assert "not run: **data_parallel** (world_size 1)" in screen
    # nothing on it needs the method: the estimator is explained at the end
    assert "GREG" not in screen and "GREG" in markdown.split("## How these numbers were")[1]


def test_the_table_lists_whatever_changes_the_replay_holds(reports):
    """New rows of the replay's table (timed, slower, left out by the budget) each get a row
    with their decision; the screen still fits in 40 lines and lints clean."""
    markdown, _ = reports["many changes"]
    screen = _first_screen(markdown)
    assert len(screen.splitlines()) <= 40 and lint.problems(markdown) == []
    decisions = {r[1].strip("*"): r[3] for r in _verdict_rows(markdown)}
    assert len(decisions) == 8 + len(EXTRA_CHANGES)
    assert decisions["knob_fast"] == "faster; check it: raise `realize.max_changes`"
    assert decisions["knob_tie"] == "tie"
    assert decisions["knob_slow"] == "slower"
    assert decisions["knob_over_budget"] == (
        "not timed here (the budget: about 3.83 min more would decide it)"
    )
    assert decisions["knob_below_resolution"] == (
        "not timed here (exact token saving 0.4%, below the ±5% timing resolves)"
    )
    faster = [
        r for r in _verdict_rows(markdown) if r[3].startswith("faster") and "than" not in r[3]
    ]
    timed = [r for r in _verdict_rows(markdown) if r[0] != "—" and r[3] != "baseline"]
    assert f"{len(faster)} of the {len(timed)} changes timed are measured faster" in screen


def test_the_decision_words():
    entry = {"baseline": False, "versus": "random batches"}
    assert decision_word({**entry, "verdict": "faster"}) == "faster"
    assert decision_word({**entry, "verdict": "slower: not recommended"}) == "slower"
    tie = "not distinguishable from the baseline: its interval includes 0"
    assert decision_word({**entry, "verdict": tie}) == "tie"
    other = {**entry, "versus": "padding to max_seq_len"}
    assert decision_word({**other, "verdict": tie}) == "tie with padding to max_seq_len"
    assert decision_word({**other, "verdict": "faster"}) == "faster than padding to max_seq_len"
    assert decision_word({"baseline": True, "verdict": "baseline"}) == "baseline"


def test_a_reason_the_replay_did_not_time_a_change_is_said_briefly():
    assert not_timed_word(None) == "not timed here (no reason recorded)"
    assert not_timed_word("not timed: the card was busy; more text") == (
        "not timed here (the card was busy)"
    )
    long = "gate.json: the mask gate's packed scenario has 3 violation(s)"
    assert not_timed_word(long) == "not valid here (gate.json)"
    assert len(not_timed_word("not timed: " + "x" * 200)) < 80


def test_cpu_only_says_so_in_one_line(reports):
    screen = _first_screen(reports["cpu"][0])
    lines = [line for line in screen.splitlines() if "CPU only" in line]
    assert len(lines) == 1 and "do not transfer to a GPU" in lines[0]
    assert "rerun `replay` and `realize` on the training GPU" in lines[0]


def test_undecided_names_the_next_action(reports):
    markdown, _ = reports["undecided"]
    row = _row(markdown, "Pack whole examples")
    assert row[4].startswith("**undecided**: ")
    assert re.fullmatch(
        r"faster; raise `realize.sample_steps` \(more real steps: about \d+ a configuration "
        r"would decide it, \d+ now\)",
        row[3],
    ), row[3]


def test_without_a_replay_the_first_screen_says_why(reports):
    screen = _first_screen(reports["profile not run"][0])
    assert "**No measured savings:** the replay did not run" in screen
    assert VERDICT_HEADER not in screen


def test_the_device_line_says_what_was_timed():
    trainer = {"kind": "trainer", "trainer": "SFTTrainer", "factory": {"spec": "my.py:build"}}
    harness = {"kind": "harness", "spec": "probes.reference_harness"}
    assert timed_step({"json": {"realize_summary": {"harness": trainer}}}) == (
        "your `SFTTrainer` from `my.py:build`"
    )
    trainer["settings"] = {"per_device_train_batch_size": 2, "max_length": None, "optim": "adamw"}
    assert timed_step({"json": {"realize_summary": {"harness": trainer}}}) == (
        "your `SFTTrainer` from `my.py:build` at `per_device_train_batch_size=2`, `optim=adamw`"
    )
    from_replay = {"json": {}, "provenance": {"replay": {"harness": harness}}}
    assert timed_step(from_replay) == "the harness `probes.reference_harness`"
    assert timed_step({"json": {}, "provenance": {}}) is None


def test_when_nothing_is_faster_the_first_screen_says_so(reports):
    markdown, document = reports["none faster"]
    screen = _first_screen(markdown)
    assert "No change is measurably faster than random batching here." in screen
    # it stopped on its budget: the screen names the key that buys narrower intervals
    assert "stopped on its budget after 44 micro-batches (59.5 s of 60 s)" in screen
    assert "raise `replay.budget_s` for narrower intervals" in screen
    # the table still lists every change, each a tie
    assert VERDICT_HEADER in screen and "Measured, not recommended" not in screen
    assert {r[3] for r in _verdict_rows(markdown) if r[0] == "1"} == {"tie"}
    assert not any(c["recommended"] for c in document["changes"])


def test_memory_column_reads_the_memory_stage_when_it_ran():
    frame = pd.DataFrame(
        {
            "strategy": ["packing", "length_grouped", "global_sort"],
            "predicted_peak_gib": [30.0, 150.0, 20.0],
            "headroom_gib": [109.0, -11.0, None],
            "verdict": ["fits", "does not fit", "unknown"],
            "reason": ["", "", "no shape"],
        }
    )
    assert memory_check(frame, "packing")["text"] == "fits, 109.0 GiB headroom"
    assert memory_check(frame, "length_grouped")["text"] == "**does not fit** (peak 150.0 GiB)"
    assert memory_check(frame, "global_sort")["text"] == "unknown: no shape"
    assert memory_check(frame, "random_no_idle")["text"] == "not predicted"
    assert memory_check(None, "packing")["text"] == "not predicted"


def test_a_combined_change_is_judged_by_its_parts_memory():
    """The memory stage predicts each change alone, before the replay chooses the combination:
    a part that does not fit keeps the combination from being applied as it is; parts that fit
    leave it not predicted, with the largest part's peak."""
    frame = pd.DataFrame(
        {
            "strategy": ["packing", "attention_eager", "micro_batch_size_4", "global_sort"],
            "predicted_peak_gib": [13.9, 24.2, 150.0, 20.0],
            "headroom_gib": [125.1, 114.8, -11.0, None],
            "verdict": ["fits", "fits", "does not fit", "unknown"],
            "reason": ["", "", "", "no shape"],
        }
    )
    both_fit = memory_check(frame, "packing+attention_eager")
    assert both_fit["verdict"] == "not predicted"
    assert both_fit["text"] == "not predicted together; each part fits (largest peak 24.2 GiB)"
    one_does_not = memory_check(frame, "packing+micro_batch_size_4")
    assert one_does_not["verdict"] == "does not fit"
    assert "its part micro_batch_size_4 does not" in one_does_not["text"]
    assert next_action(None, one_does_not, True).startswith("do not apply")
    assert memory_check(frame, "global_sort+attention_eager")["text"] == "not predicted"
    assert memory_check(frame, "padding_free_sdpa+attention_eager")["text"] == "not predicted"


def test_a_change_that_does_not_fit_is_not_to_be_applied():
    measured = {
        "rows": [
            {
                "strategy": "packing",
                "baseline": False,
                "versus": "random batches",
                "verdict": "faster",
                "rank": 1,
                "tied": False,
                "title": "Pack",
                "saving": 0.3,
                "saving_low": 0.2,
                "saving_high": 0.4,
            }
        ],
        "not_recommended": [],
    }
    memory = pd.DataFrame(
        {
            "strategy": ["packing"],
            "predicted_peak_gib": [150.0],
            "headroom_gib": [-11.0],
            "verdict": ["does not fit"],
            "reason": [""],
        }
    )
    realize = {"status": "ok", "by_strategy": {}}
    (row,) = verdicts_section(measured, realize, memory)["rows"]
    assert row["memory"] == "**does not fit** (peak 150.0 GiB)"
    assert row["decision"] == "faster; do not apply as it is: it does not fit the target GPU"
    assert row["realized"] == "not checked" and row["saving"] == "30.0% [20.0%, 40.0%]"


# ------------------------------------------------------------------------------------------
# Three words, everywhere realize is reported
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run,word", [("default", "agrees"), ("disagrees", "disagrees")])
def test_the_same_word_in_the_summary_the_evidence_and_the_json(reports, run, word):
    markdown, document = reports[run]
    packing = next(c for c in document["changes"] if c["id"] == "packing")
    assert packing["realized"]["verdict"] == word
    assert set(document["realized_rule"].split()) >= {"agrees:", "disagrees:", "undecided:"}
    row = _row(markdown, "Pack whole examples")
    assert row[4].strip("*").startswith(word)
    realized = markdown.split("## Promised vs realized")[1].split("\n## ")[0]
    assert f"| {word} |" in realized or f"| **{word}** |" in realized


def test_undecided_in_the_summary_the_evidence_and_the_json(reports):
    markdown, document = reports["undecided"]
    packing = next(c for c in document["changes"] if c["id"] == "packing")
    assert packing["realized"]["verdict"] == "undecided"
    assert "realize.sample_steps" in packing["realized"]["next_action"]
    realized = markdown.split("## Promised vs realized")[1].split("\n## ")[0]
    assert "| **undecided** (realized interval 36 pp wide: too few steps to tell) |" in realized
    assert "**Undecided:** Pack" in realized
    # the old binary verdict with an exception bolted on is gone
    assert "but the realized interval holds the promise" not in markdown


def test_the_rule_is_stated_once(reports):
    markdown, _ = reports["default"]
    assert markdown.count("**undecided**: anything else") == 1


def test_realize_words_are_only_the_three(reports):
    for name, (markdown, document) in reports.items():
        words = {c["realized"]["verdict"] for c in document["changes"]} - {None}
        assert words <= {"agrees", "disagrees", "undecided"}, name
        assert "not confirmed" not in markdown.lower(), name


def test_recommendations_json_says_when_realize_did_not_check_a_change(reports):
    _, document = reports["default"]
    grouped = next(c for c in document["changes"] if c["id"] == "length_grouped")
    assert grouped["realized"] == {"verdict": None, "status": "not checked by real training steps"}
    assert grouped["settings_line"] == "`length_grouped_trainer(Trainer)(…, bucket_size_batches=4)`"


# ------------------------------------------------------------------------------------------
# The rendered markdown, checked as markdown
# ------------------------------------------------------------------------------------------


def test_every_rendered_report_reads_cleanly(reports):
    for name, (markdown, _) in reports.items():
        assert lint.problems(markdown) == [], name


def test_every_section_keeps_its_table_in_the_new_order(reports):
    markdown, _ = reports["default"]
    headings = re.findall(r"^## (.+)$", markdown, re.M)
    assert headings[0] == "Summary" and headings[-1] == "How these numbers were measured"
    assert "### Provenance" in markdown.split("## How these numbers were measured")[1]
    for header in (
        "| rank | change | measured saving [95% interval] | versus | fit predicts |",
        "| change | promised saving [95%] | realized saving [95%] | verdict |",
        "| length | batch | status | step time |",
        "| batching | token waste |",
        "| category |",
        "| strategy | bucket size |",
        "| scenario | batch × length |",
        "| stage | control |",
        "| stage | status | config hash |",
    ):
        assert header in markdown, header


def test_lint_finds_statements_run_together():
    assert lint.problems("## A\n\nIt is best.**Not confirmed:** real steps.\n")
    assert lint.problems("## A\n\nAll passed.Each probe recovers a value.\n")
    # a dotted name or code is not two sentences
    assert not lint.problems("## A\n\nUse probes.sampler.LengthGroupedSampler now.\n")
    assert not lint.problems("## A\n\nSee `a.B` and [x](#a.B).\n")
    assert lint.problems("## A\n\nThe convention is stated..\n")  # a stop after a stop
    assert not lint.problems("## A\n\nLengths 38..4096 reach outside.\n")


def test_no_branch_of_the_template_glues_two_statements():
    # the rendered fixtures reach some branches; this reads every one in the template's source
    assert lint.glued_by_block_tags(DEFAULT_TEMPLATE.read_text()) == []
    glued = "{% if a %}\nIt stopped.{% if b %} Late.{% endif %}\n{% endif %}\n{% if c %}\nNext.\n"
    assert lint.glued_by_block_tags(glued) == ["line 2: its end is glued to line 5 ('Next.')"]
    assert lint.glued_by_block_tags(glued.replace("{% if c %}", "\n{% if c %}")) == []
    assert lint.glued_by_block_tags("Text {{ x }}\nMore.\n") == []  # an expression keeps it


def test_lint_finds_an_empty_cell_where_a_value_is_expected():
    table = "## A\n\nThe table.\n\n| a | b |\n|---|---|\n| 1 | {} |\n"
    assert lint.problems(table.format(""))
    assert lint.problems(table.format("None"))
    assert not lint.problems(table.format("2"))
    assert not lint.problems(table.format("—"))
    # a sub-row may leave cells empty
    assert not lint.problems("## A\n\nThe table.\n\n| a | b |\n|---|---|\n| | ↳ check |\n")


def test_lint_finds_a_heading_without_its_finding():
    assert lint.problems("## A\n\n| a |\n|---|\n| 1 |\n")
    assert lint.problems("## A\n\nSource: `x.parquet`.\n")
    assert lint.problems("## A\n\n- a list\n")
    assert not lint.problems("## A\n\n**Not run.** no GPU.\n")
    assert not lint.problems("## A\n\nPacking saves 10% of the time.\n")


def test_fixture_columns_cover_the_memory_table_when_the_contract_has_it():
    # the first screen reads these columns of results/memory/changes.parquet
    columns = set(table_columns("memory_changes"))
    assert {"strategy", "predicted_peak_gib", "headroom_gib", "verdict", "reason"} <= columns


def test_a_step_level_or_combined_change_shows_its_settings():
    from probes.apply.document import settings_line

    baseline = {"training_arguments": {"per_device_train_batch_size": 2}}
    single = {
        "id": "micro_batch_size_4",
        "step_level": True,
        "applies": True,
        "training_arguments": {"per_device_train_batch_size": 4},
    }
    combined = {
        "id": "length_grouped+micro_batch_size_4",
        "step_level": True,
        "combined_of": ["length_grouped", "micro_batch_size_4"],
        "applies": True,
        "training_arguments": {"per_device_train_batch_size": 4, "group_by_length": True},
    }
    assert "per_device_train_batch_size=4" in settings_line(single, baseline)
    assert "group_by_length=True" in settings_line(combined, baseline)


def test_a_sentence_listing_more_than_three_changes_fails_the_lint(reports):
    markdown, _ = reports["default"]
    assert lint.problems(markdown) == []
    titles = [
        "Sort the whole dataset by length (one bucket)",
        "transformers' built-in group_by_length",
        "Group batches by length: buckets of 4 micro-batches",
        "Pack whole examples into 4,096-token rows",
    ]
    planted = f"- Measured, not recommended: {'; '.join(titles)}.\n"
    crowded = markdown.replace("\n## Apply it\n", f"\n{planted}\n## Apply it\n")
    assert [p for p in lint.problems(crowded) if "lists 4 changes" in p]
    # three are allowed; a title inside a longer one counts once
    three = markdown.replace("\n## Apply it\n", f"\nOnly {', '.join(titles[:3])}.\n\n## Apply it\n")
    assert lint.problems(three) == []


def test_a_caveat_several_changes_share_is_written_once():
    step = "a step-level change: measured on the baseline's micro-batches"
    free = "TRL refuses padding_free=True beside a max_length (unless packing; see TRL)"
    changes = [
        {"caveat": "needs varlen attention (dense cost; see the mask gate); examples vary"},
        {"caveat": f"{step}; {free}"},
        {"caveat": step},
        {"caveat": f"{step}; {free}; drops no example"},
    ]
    assert caveat_clauses(changes[0]["caveat"]) == [
        "needs varlen attention (dense cost; see the mask gate)",
        "examples vary",
    ]
    share_caveats(changes)
    assert changes[0]["caveats"] == caveat_clauses(changes[0]["caveat"])
    assert changes[0]["shared_caveats"] == []
    first = changes[1]["shared_caveats"]
    assert [(c["label"], c["here"], c["others"]) for c in first] == [
        ("A", True, [3, 4]),
        ("B", True, [4]),
    ]
    assert changes[3]["caveats"] == ["drops no example"]
    assert [(c["label"], c["here"], c["first"]) for c in changes[3]["shared_caveats"]] == [
        ("A", False, 2),
        ("B", False, 2),
    ]


def test_the_provenance_names_the_timed_trainer_or_harness():
    from probes.report.sections.provenance import timed_name

    trainer = {"kind": "trainer", "trainer": "SFTTrainer", "factory": {"spec": "my.py:build"}}
    assert timed_name(trainer) == "SFTTrainer from my.py:build"
    assert timed_name({"kind": "harness", "spec": "probes.reference_harness"}) == (
        "probes.reference_harness"
    )
    assert timed_name(None) is None


def test_what_the_replay_priced_beside_its_table_is_listed():
    """The replay's provenance carries the optim alternatives (and torch_compile where
    replay.compile is on); each becomes one line with its interval and its note."""
    provenance = {
        "optim": {
            "optim_adamw_torch": {
                "optim": "adamw_torch", "against": "adamw_torch_fused", "saving": -0.0004,
                "saving_low": -0.0006, "saving_high": -0.0001, "memory": "same optimizer state",
            }
        },
        "compile": {
            "torch_compile": {"saving": None, "recommended": False, "why": "failed to compile: E"},
            "torch_compile+pad_to_multiple_of_64": {
                "saving": 0.12, "saving_low": 0.05, "saving_high": 0.2, "break_even_steps": 240.4,
            },
        },
    }  # fmt: skip
    provenance["compile"]["torch_compile+pad_to_multiple_of_64"]["memory"] = "not predicted: X"
    provenance["not_measured"] = {"optim_adamw_torch": "listed", "loss_liger": "GPU only: Y"}
    view = {b["name"]: b for b in beside_view(provenance)}
    assert view["torch_compile"]["note"] == "failed to compile: E"
    assert view["torch_compile+pad_to_multiple_of_64"]["note"] == (
        "break-even after 240 steps; memory not predicted: X"
    )
    # what the replay did not time says why, once (a priced one is not listed again)
    assert view["loss_liger"]["note"] == "GPU only: Y" and view["loss_liger"]["saving"] is None
    assert view["optim_adamw_torch"]["note"] == "same optimizer state"
    assert view["optim_adamw_torch"]["of"].endswith("`adamw_torch_fused`")
    assert view["optim_adamw_torch"]["low"] < view["optim_adamw_torch"]["high"] < 0
    assert beside_view(None) == [] and beside_view({"optim": {}}) == []
