"""Wall time of the mask gate on a large real architecture (the issue's "< 15 s" figure).

One run measures, on the shipped Gemma 3 27B config (62 layers, 52 sliding : 10 full, the
multimodal wrapper, so the token_type_ids scenario runs too):
  1. the entry script end to end in fresh interpreters at the training shape 2 x 4,096 and at
     2 x 16,384, this checkout against the named peer: the same entry script from git ref
     --baseline-ref (default: the commit before the issue-13 speed-up), run alternately in the
     same session so both see the same load; wall, CPU (user + system) and the ratio;
  2. in-process at 2 x 16,384, where the time goes per scenario: tracing the model's forward,
     of which building masks inside transformers (its mask interface), and band extraction;
  3. in-process, the training-shape trace with and without the meta-output replay of the
     decoder submodules (the ablation that explains the tracing time).

The machine is shared, so absolute times move with the load: the load average is printed with
every run, and the comparison is the ratio against the peer measured in the same run.

    python bench/mask_large.py [--config ...] [--repeat 1] [--baseline-ref c73b433] [--quick]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

BUDGET_S = 15.0
BASELINE_REF = "c73b433"  # main before the issue-13 mask speed-up (dense scans, mmapped masks)
SHAPES = ((2, 4096), (2, 16384))


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _command(scripts_dir: Path, config: Path, batch: int, seq_len: int, outdir: str) -> tuple:
    """The entry script's command line and where it writes gate.json and layers.parquet: the
    stage entry (default config, --set, --results) or, for an older checkout, its own flags."""
    script = scripts_dir / "run_mask.py"
    if "--configfile" in script.read_text() or "probes.stage" in script.read_text():
        command = [
            sys.executable,
            str(script),
            "--set",
            f"model.config_path={config}",
            "--set",
            f"training.micro_batch_size={batch}",
            "--set",
            f"training.max_seq_len={seq_len}",
            "--results",
            outdir,
        ]
        return command, Path(outdir, "mask", "gate.json"), Path(outdir, "mask", "layers.parquet")
    command = [
        sys.executable,
        str(script),
        "--model-config",
        str(config),
        "--outdir",
        outdir,
        "--micro-batch-size",
        str(batch),
        "--max-seq-len",
        str(seq_len),
    ]
    return command, Path(outdir, "gate.json"), Path(outdir, "layers.parquet")


def end_to_end(scripts_dir: Path, config: Path, batch: int, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as outdir:
        command, gate_path, layers_path = _command(scripts_dir, config, batch, seq_len, outdir)
        # each checkout imports its own probes package, not the one installed in the venv
        env = {**os.environ, "PYTHONPATH": str(scripts_dir)}
        load_before = _load()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO, env=env)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        gate = json.loads(gate_path.read_text())
        layers_bytes = layers_path.read_bytes()
    return {
        "wall_s": round(wall, 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "system_s": round(after.ru_stime - before.ru_stime, 2),
        "gate_s": gate["wall_seconds"],
        "passed": gate["passed"],
        "layers": gate["model"]["num_layers"],
        "scenarios": len(gate["scenarios"]),
        "load_1m": [load_before, _load()],
        "_layers_parquet": layers_bytes,
    }


# columns of the SDPA backend prediction, which issue 14.5 changed on purpose (torch-release
# priority order); everything else in layers.parquet must be identical to the peer's
BACKEND_COLUMNS = ["backend", "excluded_by", "local_predicted_backend", "confirmed_backend"]


def _compare_tables(a: bytes, b: bytes) -> dict:
    import io

    import pandas as pd

    new, old = pd.read_parquet(io.BytesIO(a)), pd.read_parquet(io.BytesIO(b))
    band = [c for c in new.columns if c not in BACKEND_COLUMNS and c in old.columns]
    changed = new["backend"].astype(str) != old["backend"].astype(str)
    return {
        "band_columns_identical": bool(new[band].equals(old[band])),
        "rows": int(len(new)),
        "rows_with_another_predicted_backend": int(changed.sum()),
    }


def baseline_scripts(ref: str, into: Path) -> Path:
    """The entry script and package as they were at `ref` (git archive of scripts/)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "scripts"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "scripts"


def compare(config: Path, ref: str, repeat: int, shapes: tuple) -> list[dict]:
    """This checkout against `ref` at each shape, alternating so both see the same load."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        old_scripts = baseline_scripts(ref, Path(tmp))
        for batch, seq_len in shapes:
            new_runs, old_runs = [], []
            for _ in range(repeat):
                new_runs.append(end_to_end(REPO / "scripts", config, batch, seq_len))
                old_runs.append(end_to_end(old_scripts, config, batch, seq_len))
            best_new = min(new_runs, key=lambda run: run["wall_s"])
            best_old = min(old_runs, key=lambda run: run["wall_s"])
            tables = _compare_tables(best_new["_layers_parquet"], best_old["_layers_parquet"])
            for run in new_runs + old_runs:
                run.pop("_layers_parquet")
            results.append(
                {
                    "shape": f"{batch}x{seq_len}",
                    "this_checkout": new_runs,
                    f"baseline_{ref}": old_runs,
                    "wall_ratio_new_over_baseline": round(
                        best_new["wall_s"] / best_old["wall_s"], 2
                    ),
                    "cpu_ratio_new_over_baseline": round(
                        (best_new["user_s"] + best_new["system_s"])
                        / (best_old["user_s"] + best_old["system_s"]),
                        2,
                    ),
                    "layers_table": tables,
                    "ratio_to_budget": round(best_new["wall_s"] / BUDGET_S, 2),
                }
            )
    return results


def breakdown(config: Path, batch: int, seq_len: int) -> dict:
    """Per scenario: trace (model forward), of which mask building, and band extraction."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from probes.mask import band as mask_band
    from probes.mask import layers as mask_layers
    from probes.mask import verdict as mask_gate
    from probes.mask.trace import read_config_json

    spent: dict[str, float] = {}

    def timed(label: str, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

        return wrapper

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    originals = dict(mapping), mask_band.row_intervals, mask_layers.trace_attention
    for name in ("sdpa", "eager"):
        mapping[name] = timed("build_masks_s", mapping[name])
    mask_band.row_intervals = timed("band_s", mask_band.row_intervals)
    mask_layers.trace_attention = timed("trace_s", mask_layers.trace_attention)
    per_scenario = {}
    original_run_scenario = mask_gate.run_scenario

    def run_scenario(probe, scenario, specs, settings):
        spent.clear()
        start = time.perf_counter()
        rows = original_run_scenario(probe, scenario, specs, settings)
        total = time.perf_counter() - start
        entry = {key: round(value, 2) for key, value in spent.items()}
        entry["total_s"] = round(total, 2)
        entry["rest_s"] = round(total - spent.get("trace_s", 0) - spent.get("band_s", 0), 2)
        entry["shape"] = f"{scenario.batch}x{scenario.seq_len}"
        per_scenario[scenario.name] = entry
        return rows

    mask_gate.run_scenario = run_scenario
    try:
        start = time.perf_counter()
        _, gate = mask_gate.evaluate(
            read_config_json(config),
            mask_gate.merged_mask_config({"confirm_on_cuda": False}),
            {"micro_batch_size": batch, "max_seq_len": seq_len},
            progress=False,
        )
        total = time.perf_counter() - start
    finally:
        mapping.clear()
        mapping.update(originals[0])
        mask_band.row_intervals, mask_layers.trace_attention = originals[1], originals[2]
        mask_gate.run_scenario = original_run_scenario
    return {
        "shape": f"{batch}x{seq_len}",
        "evaluate_s": round(total, 2),
        "scenarios": per_scenario,
        "passed": gate["passed"],
        "load_1m": _load(),
    }


def trace_ablation(config: Path, batch: int, seq_len: int) -> dict:
    import torch

    from probes.mask import trace as mask_trace
    from probes.mask.scenarios import Scenario, _single_doc

    inputs = Scenario("train", "", _single_doc(batch, seq_len)).inputs()
    timings = {}
    for label, memoise in (("with_replay", True), ("without_replay", False)):
        original = mask_trace.memoise_decoder_submodules
        if not memoise:
            mask_trace.memoise_decoder_submodules = lambda layers: mask_trace._MetaMemo()
        try:
            probe = mask_trace.build_probe_model(
                mask_trace.read_config_json(config), torch.bfloat16
            )
            mask_trace.trace_attention(probe, inputs)  # warm: first-call meta kernels, imports
            start = time.perf_counter()
            records = mask_trace.trace_attention(probe, inputs)
            timings[label] = round(time.perf_counter() - start, 3)
        finally:
            mask_trace.memoise_decoder_submodules = original
    timings["calls"] = len(records)
    timings["speedup"] = round(timings["without_replay"] / timings["with_replay"], 2)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "config/models/gemma-3-27b-it/config.json"))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the breakdown at 2 x 16,384 (no peer, no ablation)",
    )
    args = parser.parse_args()
    config = Path(args.config)
    result: dict = {"config": str(config), "cpus": os.cpu_count(), "budget_s": BUDGET_S}
    result["breakdown"] = breakdown(config, *SHAPES[-1])
    if not args.quick:
        result["end_to_end"] = compare(config, args.baseline_ref, args.repeat, SHAPES)
        result["train_trace_s_2x4096"] = trace_ablation(config, *SHAPES[0])
    result["load_average_1m_at_end"] = _load()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
