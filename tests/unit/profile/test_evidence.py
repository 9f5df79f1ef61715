"""probes.profile.evidence: the device description, the recommendation read for the text, and
the evidence text itself."""

import json

import pandas as pd
import torch

from probes.profile.evidence import device_description, evidence_text, read_recommendation
from probes.step.fit import fit_step_time


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


def test_evidence_text_is_its_sections_in_order_with_example_ids_only():
    provenance = {
        "device": {"name": "test cpu", "type": "cpu"},
        "cpu_only": True,
        "harness": {"spec": "probes.reference_harness", "functions": {}},
        "dtype": "bfloat16",
        "attn_implementation": "sdpa",
        "micro_batch_size": 2,
        "params": {"active_params": 1000},
        "trainable_params": 10,
        "run": {"date": "today", "git_commit": "abc"},
    }
    penalty = pd.DataFrame(
        [
            {
                "padded_time_s": 0.6,
                "variant": "one_by_one",
                "unpadded_time_s": 0.4,
                "measured_penalty": 0.5,
                "measured_penalty_min": 0.4,
                "measured_penalty_max": 0.6,
                "n_batches": 1,
                "predicted_penalty": 0.45,
                "longest": 64,
                "padding_waste": 0.3,
                "pick": "the median batch",
                "batch_example_ids": [["00000000000000a1", "00000000000000a2"]],
                "batch_example_lengths": [[60, 64]],
            }
        ]
    )
    lengths = [32, 64, 128]
    fit = fit_step_time(lengths, [1e-6 * t * t + 1e-4 * t + 0.01 for t in lengths])
    controls = [{"name": "a_control", "passed": False}]
    text = evidence_text(
        provenance, pd.DataFrame(), fit, penalty, pd.DataFrame(), pd.DataFrame(), "RAW", controls
    )
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings[0] == "# probes profile: raw evidence"
    assert [h.split(" (")[0].split(" t(T)")[0] for h in headings[1:]] == [
        "## scaling",
        "## fit",
        "## padding penalty",
        "## LM head + cross-entropy",
        "## kernel categories",
        "## controls",
    ]
    assert "device: test cpu (cpu) CPU-ONLY RUN" in text
    assert "  batch: example ids ['00000000000000a1', '00000000000000a2'], lengths [60, 64]" in text
    assert "  a_control: FAILED" in text
    assert "\n\n## controls\n" in text and text.endswith("\n\nRAW\n")
