"""probes.profile.evidence: the device description and the recommendation read for the text."""

import json

import torch

from probes.profile.evidence import device_description, read_recommendation


def test_cpu_description_names_the_cpu_and_its_threads():
    described = device_description(torch.device("cpu"))
    assert described["type"] == "cpu" and described["name"]
    assert described["threads"] == torch.get_num_threads() and described["capability"] is None


def test_recommendation_keeps_scalars_only(tmp_path):
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps({"status": "ok", "shape": {"rows": 2}, "rows": [{"x": 1}]}))
    assert read_recommendation(path) == {"status": "ok", "shape": {"rows": 2}}
    (tmp_path / "bad.json").write_text("{not json")
    assert read_recommendation(tmp_path / "bad.json") is None
    assert read_recommendation(tmp_path / "missing.json") is None
