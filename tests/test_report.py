"""The report: rendered from small fixture tables built here, in the layout the stages write."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from probes import report as rep
from probes.io import read_json, run_metadata, write_json, write_parquet

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "workflow" / "templates" / "playbook-evidence.md.j2"
SCRIPT = REPO / "scripts" / "render_report.py"
CANARY = "CANARY-7f3a9c-DO-NOT-LEAK"
NOT_RUN_REASON = "no GPU and profile.cpu_fallback is false"
FIT = {"a": 2e-9, "b": 1e-4, "c": 0.05}  # seconds per micro-batch of 2 rows
BATCH = 2


# ------------------------------------------------------------------------------------------
# Fixture tables: the columns of probes.report.TABLES, plus planted extras that must never show
# ------------------------------------------------------------------------------------------


def mask_layers() -> pd.DataFrame:
    rows = []
    scenarios = [
        ("training", 2, 4096, "none", False),
        ("right_padded", 2, 4096, "right", False),
        ("packed", 1, 8192, "none", True),
        ("short", 2, 256, "none", False),
    ]
    for scenario, batch, seq_len, padding, packed in scenarios:
        for layer in range(6):
            sliding = layer % 6 != 5
            masked = padding != "none" or packed or (sliding and seq_len > 512)
            rows.append(
                {
                    "scenario": scenario,
                    "batch": batch,
                    "seq_len": seq_len,
                    "padding": padding,
                    "packed": packed,
                    "layer_idx": layer,
                    "layer_type": "sliding_attention" if sliding else "full_attention",
                    "head_dim": 256,
                    "mask_present": masked,
                    "is_causal": not masked,
                    "band_lower": (511 if sliding else seq_len - 1) if masked else np.nan,
                    "band_upper": 0 if masked else np.nan,
                    "backend": "efficient" if masked else "flash",
                    "excluded_by": "mask_present" if masked else None,
                }
            )
    return pd.DataFrame(rows)


def padding_lengths(n: int = 240) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    sources = np.array(["chitchat", "support", "code"])[rng.integers(0, 3, n)]
    tokens = np.minimum(np.exp(rng.normal(6.0, 1.0, n)).astype(int) + 20, 4096)
    status = np.where(tokens >= 4096, "TRUNCATED", "OK").astype(object)
    status[:3] = "EMPTY"
    status[3:6] = "ERROR"
    tokens = np.where(np.isin(status, ["EMPTY", "ERROR"]), 0, tokens)
    reason = np.array([""] * n, dtype=object)
    reason[:3] = "no_content"
    reason[3:5] = "invalid_json"
    reason[5] = f"parse failed near '{CANARY}'"  # must be hidden: not a code
    return pd.DataFrame(
        {
            "example_id": [f"{i:016x}" for i in range(n)],
            "file": "data.jsonl",
            "row": np.arange(1, n + 1),
            "source": sources,
            "status": status,
            "reason": reason,
            "n_tokens": tokens,
            "n_tokens_full": tokens + np.where(status == "TRUNCATED", 900, 0),
            "n_loss_tokens": tokens // 2,
            "n_turns": 4,
            "n_truncated_tokens": np.where(status == "TRUNCATED", 900, 0),
            "text": CANARY,  # a column the report must never render
        }
    )


def padding_tables(lengths: pd.DataFrame) -> dict[str, pd.DataFrame]:
    trains = lengths[lengths["status"].isin(["OK", "TRUNCATED"])]
    dist = []
    for source, group in [("all", trains), *trains.groupby("source")]:
        t = group["n_tokens"]
        dist.append(
            {
                "source": source,
                "n_examples": len(t),
                "total_tokens": int(t.sum()),
                "p50": t.quantile(0.5),
                "p90": t.quantile(0.9),
                "p99": t.quantile(0.99),
                "max": t.max(),
            }
        )
    summary = pd.DataFrame(
        {
            "strategy": ["random", "pad_to_max", "pad_to_longest"],
            "token_waste": [0.42, 0.91, 0.80],
            "attention_waste": [0.61, 0.99, 0.95],
            "token_waste_std": [0.01, 0.0, 0.0],
            "attention_waste_std": [0.02, 0.0, 0.0],
        }
    )
    ce = pd.DataFrame(
        {
            "shape": ["training", "p50", "p99"],
            "n_tokens": [8192, 900, 6000],
            "logits_bf16_bytes": [8192 * 262144 * 2, 900 * 262144 * 2, 6000 * 262144 * 2],
            "logits_fp32_bytes": [8192 * 262144 * 4, 900 * 262144 * 4, 6000 * 262144 * 4],
            "stock_loss_bytes": [8192 * 262144 * 12, 900 * 262144 * 12, 6000 * 262144 * 12],
            "max_chunk_tokens": [2048, 2048, 2048],
            "liger_chunk_tokens": [64, 8, 64],
        }
    )
    return {"summary": summary, "distribution": pd.DataFrame(dist), "ce_chunks": ce}


def bucket_sweep() -> pd.DataFrame:
    rows = []
    sizes = [1, 2, 4, 8, 16, 60]
    for seed in range(3):
        jitter = 0.002 * seed
        rows.append(("random", 1, seed, 0.58 + jitter, 0.39, 120, 1.0, 1.0, 0.0))
        for i, m in enumerate(sizes):
            token = 0.58 + 0.07 * i + jitter
            rows.append(
                ("length_grouped", m, seed, token, 0.39 + 0.1 * i, 120, 1 - 0.1 * i, 1 - 0.12 * i)
                + (0.15 * i,)
            )
        rows.append(("packing", np.nan, seed, 0.97, 0.9, 40, 1.0, 1.0, 0.0))
    columns = list(rep.TABLES["bucket_sweep"].required)
    return pd.DataFrame(rows, columns=columns)


def profile_tables() -> dict[str, pd.DataFrame]:
    lengths = [1024, 2048, 4096, 8192]
    rows = []
    for t in lengths:
        time_s = FIT["a"] * t * t + FIT["b"] * t + FIT["c"]
        oom = t == 8192
        rows.append(
            {
                "seq_len": t,
                "batch": BATCH,
                "status": "OOM" if oom else "OK",
                "time_s": np.nan if oom else time_s,
                "time_std_s": np.nan if oom else 0.002,
                "peak_mem_bytes": np.nan if oom else 1.2e9 * t / 1024,
                "quadratic_share": np.nan if oom else FIT["a"] * t * t / time_s,
                "mfu": np.nan if oom else 0.31,
            }
        )
    fit = pd.DataFrame([{**FIT, "n_points": 3, "condition_number": 1.7e3}])
    penalty = pd.DataFrame(
        [
            {
                "padded_time_s": 0.61,
                "unpadded_time_s": 0.40,
                "measured_penalty": 0.525,
                "predicted_penalty": 0.48,
            }
        ]
    )
    ce = pd.DataFrame(
        {
            "variant": ["chunked", "unchunked"],
            "time_s": [0.081, 0.074],
            "step_share": [0.21, 0.19],
            "peak_mem_bytes": [2.1e9, 9.4e9],
        }
    )
    kernels = pd.DataFrame(
        {
            "category": ["GEMM", "attention", "elementwise", "GEMM"],
            "device_time_s": [0.31, 0.12, 0.05, 0.31],
            "share": [0.646, 0.25, 0.104, 0.646],
            "n_kernels": [120, 36, 400, 120],
            "device_type": ["CUDA", "CUDA", "CUDA", "CPU"],  # the ATen twin must be dropped
        }
    )
    return {
        "scaling": pd.DataFrame(rows),
        "fit": fit,
        "padding_penalty": penalty,
        "ce": ce,
        "kernels": kernels,
    }


def control(name: str, passed: bool = True) -> dict:
    return {
        "name": name,
        "description": f"{name} recovers a known answer",
        "expected": {"value": 1.0},
        "observed": {"value": 1.0 if passed else 0.5},
        "passed": passed,
    }


def write_stage(
    stage: str,
    paths: dict[str, Path],
    profile: str = "gpu",  # gpu | cpu | not_run
    failed: tuple[str, ...] = (),
) -> None:
    """Write one stage's outputs (keys as in probes.report.INPUT_FILES) the way the stage would."""
    meta = run_metadata({"fixture": True})
    if stage == "mask":
        write_parquet(mask_layers(), paths["mask_layers"], meta)
        gate = {"passed": True, "counts": {"fast_path_layers_at_training_shape": 1, "n_layers": 6}}
        write_json(gate, paths["mask_gate"])
    elif stage == "padding":
        lengths = padding_lengths()
        write_parquet(lengths, paths["padding_lengths"], meta)
        for name, frame in padding_tables(lengths).items():
            write_parquet(frame, paths[f"padding_{name}"], meta)
    elif stage == "bucket":
        write_parquet(bucket_sweep(), paths["bucket_sweep"], meta)
        rec = {"bucket_size": 4, "reason": "smallest size within 90% of the best gain"}
        write_json(rec, paths["bucket_recommendation"])
    elif profile == "not_run":
        for name in ("scaling", "fit", "padding_penalty", "ce", "kernels"):
            write_parquet(pd.DataFrame(), paths[f"profile_{name}"], meta)
        note = {"status": "not_run", "reason": NOT_RUN_REASON}
        write_json(note, paths["profile_provenance"])
        write_json({**note, "name": "fit_control"}, paths["profile_control"])
        return
    else:
        for name, frame in profile_tables().items():
            write_parquet(frame, paths[f"profile_{name}"], meta)
        provenance = {
            "device": "cpu" if profile == "cpu" else "cuda:0 NVIDIA H200",
            "cpu_only": profile == "cpu",
            "harness": "probes.harness",
            "slurm": {"job_id": "1234"},
        }
        write_json(provenance, paths["profile_provenance"])
    name = "fit_control" if stage == "profile" else f"{stage}_control"
    write_json(control(name, stage not in failed), paths[f"{stage}_control"])


def write_results(root: Path, **kwargs) -> dict[str, Path]:
    """Write every stage output the report reads under root/ (the workflow's results layout)."""
    paths = rep.default_input_paths(root)
    for stage in rep.STAGES:
        write_stage(stage, paths, **kwargs)
    return paths


def render(tmp_path: Path, **kwargs) -> tuple[str, Path]:
    sys.path.insert(0, str(REPO / "scripts"))
    from render_report import render_report

    paths = write_results(tmp_path / "results", **kwargs)
    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    figures = out.parent / "figures"
    render_report(paths, TEMPLATE, out, figures, {"report": {"figure_dpi": 40}})
    return out.read_text(), out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[str, Path]:
    return render(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def rendered_not_run(tmp_path_factory) -> tuple[str, Path]:
    return render(tmp_path_factory.mktemp("report-not-run"), profile="not_run")


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
        "kernels.png",
        "lengths.png",
        "scaling.png",
    ]
    for link in links:
        assert not Path(link).is_absolute()
        figure = out.parent / link
        assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_numbers_carry_units(rendered):
    markdown, _ = rendered
    scaling = section(markdown, "Scaling")
    assert "| 1,024 tokens | 2 | OK | 154 ms |" in scaling  # 2e-9·1024² + 1e-4·1024 + 0.05 s
    assert "| 1.12 GiB |" in scaling  # 1.2e9 bytes
    assert "condition number 1.7e+03" in scaling
    assert re.search(r"\d+\.\d% \|", section(markdown, "Padding"))
    ce = section(markdown, "Cross-entropy")
    assert "| training | 8,192 tokens | 4.00 GiB | 8.00 GiB | 24.00 GiB | 2,048 tokens |" in ce
    assert "| chunked | 81 ms | 21.0% | 1.96 GiB |" in ce
    assert not re.search(r"\b(nan|NaN|None|inf)\b", markdown)  # python reprs, not numbers


def test_summary_ranks_recommendations_with_fitted_savings(rendered):
    summary = section(rendered[0], "Summary")
    lines = [line for line in summary.splitlines() if re.match(r"^\| \d ", line)]
    assert [line.split("|")[2].strip() for line in lines] == [
        "**Pad each batch to its longest member, not to max_seq_len**",
        "**Pack whole examples into max_seq_len rows**",
        "**Group batches by length, buckets of 4 micro-batches**",
        "**Chunk the cross-entropy at ≤ 2,048 tokens per chunk**",
    ]
    assert "measured on cuda:0 NVIDIA H200" in summary
    assert "memory, not time" in lines[-1]
    assert re.search(r"\| \d+\.\d% \| random batches", lines[1])


def test_kernel_table_sums_device_rows_only(rendered):
    kernels = section(rendered[0], "Kernels")
    assert kernels.count("| GEMM |") == 1  # the CPU twin of the GEMM row is dropped
    assert "| **total** | 480 ms | 100.0% |" in kernels
    assert "double-counts" in kernels


def test_mask_section_counts_fast_path_per_scenario(rendered):
    mask = section(rendered[0], "Mask gate")
    assert "| training | 2 × 4,096 | none | no | 1 of 6 |" in mask
    assert "| short | 2 × 256 | none | no | 6 of 6 | flash ×6 | — |" in mask
    assert "| training | sliding_attention | 5 | 0 | 511 | 0 |" in mask
    assert "| short | full_attention | 1 | 1 | none | none |" in mask


def test_padding_counts_every_bucket(rendered):
    padding = section(rendered[0], "Padding")
    assert "3 EMPTY, 3 ERROR" in padding
    assert "EMPTY `no_content` ×3" in padding
    assert "ERROR `other_reason` ×1" in padding  # a reason that is not a code is hidden


def test_controls_and_provenance(rendered):
    markdown, _ = rendered
    controls = section(markdown, "Controls")
    for stage in rep.STAGES:
        assert re.search(rf"^\| {stage} \| .* \| passed \|$", controls, re.M)
    provenance = section(markdown, "Provenance")
    for what in ("config hash", "git commit", "command line", "transformers", "cuda:0 NVIDIA H200"):
        assert what in provenance
    assert "job_id=1234" in provenance
    assert "different configs" not in provenance


def test_canary_never_rendered(rendered):
    markdown, out = rendered
    assert CANARY not in markdown
    for figure in (out.parent / "figures").iterdir():
        assert CANARY.encode() not in figure.read_bytes()


def test_profile_not_run_renders_not_run(rendered_not_run):
    markdown, out = rendered_not_run
    assert re.findall(r"^## (.+)$", markdown, re.M) == list(rep.SECTION_TITLES)
    for title in ("Scaling", "Kernels"):
        assert f"**Not run.** {NOT_RUN_REASON}" in section(markdown, title)
    assert f"Wall clock: **Not run.** {NOT_RUN_REASON}" in section(markdown, "Cross-entropy")
    assert re.search(r"^\| profile \| fit_control \| .* \| not run \|$", markdown, re.M)
    summary = section(markdown, "Summary")
    assert "The profile did not run" in summary
    assert re.search(r"\d+\.\d% \(linear\) to \d+\.\d% \(quadratic\)", summary)
    assert sorted(Path(link).name for link in rep.linked_figures(markdown)) == [
        "bucket.png",
        "lengths.png",
    ]
    assert not (out.parent / "figures" / "scaling.png").exists()


def test_cpu_fit_is_flagged(tmp_path):
    markdown, _ = render(tmp_path, profile="cpu")
    assert "came from the CPU" in section(markdown, "Summary")
    assert "**CPU-only run**" in section(markdown, "Scaling")
    assert "self CPU time of leaf ops" in section(markdown, "Kernels")
    assert "| CPU time |" in section(markdown, "Kernels")


def test_failed_control_is_shouted(tmp_path):
    markdown, _ = render(tmp_path, failed=("bucket",))
    assert "**Failed controls:** bucket/bucket_control" in section(markdown, "Summary")
    assert "| **FAILED** |" in section(markdown, "Controls")


# ------------------------------------------------------------------------------------------
# Loading: a renamed column fails clearly
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(rep.TABLES))
def test_missing_column_fails_naming_file_and_column(tmp_path, name):
    paths = write_results(tmp_path)
    frame = pd.read_parquet(paths[name])
    dropped = rep.TABLES[name].required[-1]
    write_parquet(frame.drop(columns=[dropped]), paths[name], {})
    with pytest.raises(rep.ReportInputError) as err:
        rep.load_inputs(paths)
    message = str(err.value)
    assert str(paths[name]) in message and f"'{dropped}'" in message
    assert rep.TABLES[name].section in message


def test_missing_json_key_and_bad_json_fail_clearly(tmp_path):
    paths = write_results(tmp_path)
    write_json({"reason": "x"}, paths["bucket_recommendation"])
    match = r"recommendation.json: key\(s\) \['bucket_size'"
    with pytest.raises(rep.ReportInputError, match=match):
        rep.load_inputs(paths)
    paths["bucket_recommendation"].write_text("{not json")
    with pytest.raises(rep.ReportInputError, match="not valid JSON"):
        rep.load_inputs(paths)


def test_control_without_its_keys_fails(tmp_path):
    paths = write_results(tmp_path)
    write_json({"name": "c", "passed": True}, paths["mask_control"])
    inputs = rep.load_inputs(paths)
    with pytest.raises(rep.ReportInputError, match=r"mask/control.json: key\(s\)"):
        rep.controls_section(inputs["json"], inputs["not_run"])


def test_failed_render_leaves_no_output(tmp_path):
    paths = write_results(tmp_path / "results")
    paths["mask_gate"].unlink()
    sys.path.insert(0, str(REPO / "scripts"))
    from render_report import render_report

    out = tmp_path / "results" / "report" / "playbook-evidence.md"
    with pytest.raises(rep.ReportInputError, match="gate.json: not found"):
        render_report(paths, TEMPLATE, out, out.parent / "figures", {})
    assert not out.exists() and not (out.parent / "figures").exists()
    assert list(out.parent.iterdir()) == [] if out.parent.exists() else True


# ------------------------------------------------------------------------------------------
# Pure functions: formatting and the time model
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("func", "value", "expected"),
    [
        (rep.fmt_seconds, 0.0123, "12.3 ms"),
        (rep.fmt_seconds, 4.2e-5, "42 µs"),
        (rep.fmt_seconds, 1.5, "1.5 s"),
        (rep.fmt_seconds, 600, "10 min"),
        (rep.fmt_seconds, float("nan"), "—"),
        (rep.fmt_bytes, 1.5 * 2**30, "1.50 GiB"),
        (rep.fmt_bytes, 512, "512 B"),
        (rep.fmt_bytes, None, "—"),
        (rep.fmt_pct, 0.1234, "12.3%"),
        (rep.fmt_count, 7168, "7,168"),
        (rep.fmt_tokens, 4096.0, "4,096 tokens"),
        (rep.fmt_ratio, 0.5, "0.50×"),
        (rep.fmt_signed_pct, -0.04, "-4.0%"),
        (rep.fmt_number, 1.7e3, "1.7e+03"),
        (rep.fmt_value, {"a": 1}, '{"a": 1}'),
        (rep.fmt_value, True, "true"),
        (rep.cell, "a|b\nc", "a\\|b c"),
        (rep.reason_code, "invalid_json", "invalid_json"),
        (rep.reason_code, "line 3: 'hello there'", "other_reason"),
    ],
)
def test_formatters(func, value, expected):
    assert func(value) == expected


def test_label_is_short_and_table_safe():
    assert rep.label("x" * 100) == "x" * 39 + "…"
    assert rep.label("a|b\tc") == "a\\|b c"


def test_workload_time_of_uniform_batches_is_n_times_step_time():
    fit = rep.StepFit(**FIT, batch=BATCH)
    n, length = 10, 1000.0
    total = rep.workload_time(fit, n * BATCH * length, n * BATCH * length**2, 1.0, 1.0, n)
    assert total == pytest.approx(n * (FIT["a"] * length**2 + FIT["b"] * length + FIT["c"]))


def test_expected_saving_lies_between_its_limits():
    fit = rep.StepFit(**FIT, batch=BATCH)
    before, after = rep.Efficiency(0.5, 0.3, 100), rep.Efficiency(0.9, 0.8, 100)
    s1, s2 = 1e6, 2e9
    result = rep.expected_saving(before, after, fit, s1, s2)
    assert result["linear_limit"] == pytest.approx(1 - 0.5 / 0.9)
    assert result["quadratic_limit"] == pytest.approx(1 - 0.3 / 0.8)
    # a fixed per-batch cost c dilutes the saving below the linear limit's mix
    t_before = rep.workload_time(fit, s1, s2, 0.5, 0.3, 100)
    t_after = rep.workload_time(fit, s1, s2, 0.9, 0.8, 100)
    assert result["saving"] == pytest.approx(1 - t_after / t_before)
    assert 0 < result["saving"] < result["quadratic_limit"]
    assert rep.expected_saving(before, after, None, s1, s2)["saving"] is None


def test_fit_with_fewer_than_three_points_is_not_used(tmp_path):
    paths = write_results(tmp_path)
    fit = pd.read_parquet(paths["profile_fit"]).assign(n_points=2)
    write_parquet(fit, paths["profile_fit"], {})
    inputs = rep.load_inputs(paths)
    assert rep.usable_fit(inputs["tables"], inputs["not_run"]) is None
    recs = rep.recommendations(inputs["tables"], inputs["json"], inputs["not_run"])
    assert all(r["saving"] is None for r in recs)


def test_sweep_means_average_over_seeds():
    means = rep.sweep_means(bucket_sweep())
    random = means[means["strategy"] == "random"].iloc[0]
    assert random["token_efficiency"] == pytest.approx(0.582)
    assert random["n_seeds"] == 3
    assert math.isnan(means[means["strategy"] == "packing"].iloc[0]["bucket_size"])


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
        [sys.executable, SCRIPT, "--results", tmp_path / "results", "--log", log],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "results/report/figures/lengths.png").is_file()
    assert "stages not run: ['profile']" in log.read_text()
    assert CANARY not in done.stdout + done.stderr + log.read_text()


def test_script_bad_input_exits_nonzero_with_message(tmp_path):
    paths = write_results(tmp_path / "results")
    frame = pd.read_parquet(paths["bucket_sweep"]).drop(columns=["entropy_rel"])
    write_parquet(frame, paths["bucket_sweep"], {})
    done = subprocess.run(
        [sys.executable, SCRIPT, "--results", tmp_path / "results"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "sweep.parquet: column(s) ['entropy_rel'] missing" in done.stderr
    assert not (tmp_path / "results/report/playbook-evidence.md").exists()


def test_not_run_json_convention_round_trips(tmp_path):
    paths = write_results(tmp_path, profile="not_run")
    assert rep.not_run_reason(read_json(paths["profile_provenance"])) == NOT_RUN_REASON
    assert json.loads(paths["profile_control"].read_text())["status"] == rep.NOT_RUN
