"""tools/compare_results.py: two results directories at different paths compare as equal."""

import importlib.util
import json

from conftest import REPO

spec = importlib.util.spec_from_file_location("compare_results", REPO / "tools/compare_results.py")
compare_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_results)


def _results(root, lengths_path, m=4):
    (root / "bucket").mkdir(parents=True)
    recommendation = {"input": {"lengths": str(lengths_path)}, "recommended": {"m": m}}
    (root / "bucket" / "recommendation.json").write_text(json.dumps(recommendation))
    return root


def test_paths_inside_each_results_directory_do_not_count_as_a_difference(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # one absolute, one relative to the working directory
    old = _results(tmp_path / "old", tmp_path / "old" / "padding" / "lengths.parquet")
    new = _results(tmp_path / "elsewhere" / "new", "elsewhere/new/padding/lengths.parquet")
    assert compare_results.main(str(old), "elsewhere/new") == 0
    assert "same  bucket/recommendation.json" in capsys.readouterr().out
    changed = _results(tmp_path / "changed", tmp_path / "changed/padding/lengths.parquet", m=8)
    assert compare_results.main(str(old), str(changed)) == 1
    assert new.is_dir()


def test_timings_and_timing_led_outputs_are_not_differences(tmp_path, capsys):
    import pandas as pd

    for name, seconds, strategy in (("old", 1.0, "random"), ("new", 2.0, "packing")):
        root = tmp_path / name
        (root / "memory").mkdir(parents=True)
        (root / "realize").mkdir()
        shapes = pd.DataFrame({"shape": ["2x64"], "peak_gib": [1.5], "seconds": [seconds]})
        shapes.to_parquet(root / "memory" / "shapes.parquet")
        pd.DataFrame({"strategy": [strategy]}).to_parquet(root / "realize" / "steps.parquet")
    assert compare_results.main(str(tmp_path / "old"), str(tmp_path / "new")) == 0
    out = capsys.readouterr().out
    assert "same  memory/shapes.parquet" in out and "measured  realize/steps.parquet" in out
    changed = pd.DataFrame({"shape": ["2x64"], "peak_gib": [9.0], "seconds": [1.0]})
    changed.to_parquet(tmp_path / "new" / "memory" / "shapes.parquet")
    assert compare_results.main(str(tmp_path / "old"), str(tmp_path / "new")) == 1


def test_counts_whose_names_hold_an_s_are_still_compared(tmp_path, capsys):
    import pandas as pd

    for name, steps in (("old", 14), ("new", 25)):
        (tmp_path / name / "bucket").mkdir(parents=True)
        frame = pd.DataFrame({"n_steps": [steps], "micro_batch_size": [2], "wall_s": [1.0]})
        frame.to_parquet(tmp_path / name / "bucket" / "summary.parquet")
    assert compare_results.main(str(tmp_path / "old"), str(tmp_path / "new")) == 1
    assert "DIFF  bucket/summary.parquet" in capsys.readouterr().out
