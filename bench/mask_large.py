"""Wall time and peak memory of the mask rule on a large real architecture, against the SDPA-only
trace, in one run (issue 46: <= 15 s and <= 2 GiB at 2 x 16,384 on a 2-core CPU).

On the shipped Gemma 3 27B config (62 layers, 52 sliding (window 1024) : 10 full, the multimodal
wrapper, so the token_type_ids scenario runs too) at the training shape, alternately in fresh
interpreters so both see the same load:
  1. this checkout's entry script (what the `mask` rule runs): every scenario, SDPA, eager and
     flex attention, the positive control;
  2. the peer: the same entry script from git ref --peer-ref (default: the commit before the gate
     traced eager and flex, when it traced SDPA only, every scenario densely at the training
     shape);
each with wall, CPU (user + system), peak resident memory (the child's own ru_maxrss) and the
gate's own seconds. This checkout's verdicts are compared with the previous gate's, recorded in
tests/unit/mask/old_gate_verdicts.json (probes.mask.digest), when the shape has a record.

The machine is shared, so absolute times move with the load: the load average is printed with
every run, and CPU seconds beside wall.

    python bench/mask_large.py [--config ...] [--seq-len 16384] [--repeat 1] [--peer-ref 514e7b6]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

BUDGET_S = 15.0
BUDGET_RSS_GIB = 2.0
PEER_REF = "514e7b6"  # main just before 59aa545 (the gate per attention implementation)
OLD_VERDICTS = REPO / "tests" / "unit" / "mask" / "old_gate_verdicts.json"


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_entry(root: Path, config: Path, batch: int, seq_len: int) -> dict:
    """The entry script under `root` in a fresh interpreter: wall, CPU, peak RSS, gate.json."""
    with tempfile.TemporaryDirectory() as outdir:
        command = [
            sys.executable,
            str(root / "scripts" / "run_mask.py"),
            "--set",
            f"model.config_path={config}",
            "--set",
            f"training.micro_batch_size={batch}",
            "--set",
            f"training.max_seq_len={seq_len}",
            "--results",
            outdir,
        ]
        # each checkout imports its own probes package, not the one installed in the venv
        env = {**os.environ, "PYTHONPATH": str(root / "scripts")}
        load_before = _load()
        start = time.perf_counter()
        child = subprocess.Popen(
            command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{command} failed:\n{stderr[-2000:]}")
        gate = json.loads(Path(outdir, "mask", "gate.json").read_text())
        layers_bytes = Path(outdir, "mask", "layers.parquet").read_bytes()
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),  # Linux: kilobytes
        "gate_s": gate["wall_seconds"],
        "passed": gate["passed"],
        "load_1m": [load_before, _load()],
        "_gate": gate,
        "_layers": layers_bytes,
    }


def peer_checkout(ref: str, into: Path) -> Path:
    """The entry script, package, schema and default config as they were at `ref`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "scripts", "workflow/schemas", "config"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def verdicts_against_previous(run: dict, seq_len: int, batch: int) -> dict:
    """This gate's digest against the previous gate's record at the same shape, if any."""
    import io

    import pandas as pd

    from probes.mask.digest import digest

    key = f"gemma-3-27b-it@{batch}x{seq_len}"
    recorded = json.loads(OLD_VERDICTS.read_text())["real"].get(key)
    if recorded is None:
        return {"compared": False, "why": f"no record for {key} in {OLD_VERDICTS.name}"}
    mine = digest(pd.read_parquet(io.BytesIO(run["_layers"])), run["_gate"])
    differing = sorted(
        name
        for name in set(mine["scenarios"]) | set(recorded["scenarios"])
        if mine["scenarios"].get(name) != recorded["scenarios"].get(name)
    )
    return {
        "compared": True,
        "record": key,
        "equal": mine == recorded,
        "scenarios_differing": differing,
        "implementations_equal": mine["implementations"] == recorded["implementations"],
    }


def summary(runs: list[dict]) -> dict:
    best = min(runs, key=lambda run: run["wall_s"])
    return {
        "best_wall_s": best["wall_s"],
        "best_cpu_s": min(run["cpu_s"] for run in runs),
        "peak_rss_gib": max(run["peak_rss_gib"] for run in runs),
        "runs": [{k: v for k, v in run.items() if not k.startswith("_")} for run in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "config/models/gemma-3-27b-it/config.json"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--peer-ref", default=PEER_REF, help="'none': this checkout only")
    args = parser.parse_args()
    config = Path(args.config).resolve()
    mine, peer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        peer_root = None if args.peer_ref == "none" else peer_checkout(args.peer_ref, Path(tmp))
        for _ in range(args.repeat):
            mine.append(run_entry(REPO, config, args.batch, args.seq_len))
            if peer_root is not None:
                peer.append(run_entry(peer_root, config, args.batch, args.seq_len))
    result: dict = {
        "config": str(config),
        "shape": f"{args.batch}x{args.seq_len}",
        "cpus": os.cpu_count(),
        "budget": {"wall_s": BUDGET_S, "peak_rss_gib": BUDGET_RSS_GIB},
        "rule": summary(mine),
        "shapes": mine[0]["_gate"].get("shapes"),
        "verdicts": verdicts_against_previous(mine[0], args.seq_len, args.batch),
    }
    rule = result["rule"]
    result["within_budget"] = {
        "wall": rule["best_wall_s"] <= BUDGET_S,
        "peak_rss": rule["peak_rss_gib"] <= BUDGET_RSS_GIB,
    }
    if peer:
        result[f"sdpa_only_{args.peer_ref}"] = summary(peer)
        other = result[f"sdpa_only_{args.peer_ref}"]
        result["rule_over_sdpa_only"] = {
            "wall": round(rule["best_wall_s"] / other["best_wall_s"], 2),
            "cpu": round(rule["best_cpu_s"] / other["best_cpu_s"], 2),
            "peak_rss": round(rule["peak_rss_gib"] / other["peak_rss_gib"], 2),
        }
    result["load_average_1m_at_end"] = _load()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
