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
