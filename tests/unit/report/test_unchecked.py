"""A faster change that realize never checks (probes.realize.scope: the dataloader workers)
says why on the first screen, instead of asking to raise realize's change count, which would
not check it either; a change it can check still gets that advice."""

from __future__ import annotations

from probes.realize.scope import never_checked
from probes.report.sections.verdicts import verdicts_section


def _entry(strategy: str, baseline: bool = False) -> dict:
    return {
        "strategy": strategy,
        "baseline": baseline,
        "rank": 1,
        "title": strategy,
        "verdict": "baseline" if baseline else "faster",
        "versus": "random batches",
        "saving": None if baseline else 0.2,
        "saving_low": None if baseline else 0.1,
        "saving_high": None if baseline else 0.3,
    }


def test_a_change_realize_never_checks_says_why_and_names_no_setting():
    measured = {
        "rows": [_entry("random", True), _entry("dataloader_workers_2"), _entry("packing")],
        "not_recommended": [],
    }
    realize = {"status": "ok", "cpu_only": True, "by_strategy": {}}
    rows = {r["strategy"]: r for r in verdicts_section(measured, realize, None)["rows"]}
    workers = rows["dataloader_workers_2"]["decision"]
    assert workers == f"faster; {never_checked('dataloader_workers_2')}"
    assert "data-loading" in workers and "cpu_max_changes" not in workers
    assert rows["packing"]["decision"] == "faster; check it: raise `realize.cpu_max_changes`"
    assert never_checked("packing") is None
