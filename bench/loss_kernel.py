"""Benchmark: the loss kernel (stock vs chunked) on the embedded default through the harness.

The reference harness on the default Gemma 3 270M, in the dtype the replay picks (bf16 where
the CPU computes it), one forward + backward per timing at the profile's CPU shapes
(``training.micro_batch_size`` rows × each of ``profile.cpu.lengths`` tokens, the data's loss
share of each row). The loss kernel is flipped between timings by the replay's own StepSwitch
(the harness's ``configure`` with ``loss_kernel`` changed), the two kernels interleaved and
their order alternated so drift of the machine falls on both. Prints, per shape, the median
of each kernel, the change's saving (``loss_stock`` against the chunked baseline, as the
replay prices it) with a bootstrap 95% interval over the paired repeats, and the two losses'
relative difference on the same batch (numbers only).

    python bench/loss_kernel.py [--repeats 7] [--model resources/model/gemma-3-270m]

Needs the materialised default model (``snakemake --cores 2 resources/model/gemma-3-270m/
config.json``) and, for the loss share, ``results/padding/lengths.parquet`` (else --loss-share).
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.config import load_config  # noqa: E402
from probes.replay.prepare import replay_dtype  # noqa: E402
from probes.settings import WorkflowConfig  # noqa: E402
from probes.step import batches as bt  # noqa: E402
from probes.step import changes as sc  # noqa: E402
from probes.step.load import load_step  # noqa: E402
from probes.step.timing import wall_time  # noqa: E402

STOCK = "loss_stock"


def loss_share(path: Path, given: float | None) -> float:
    if given is not None:
        return given
    if not path.exists():
        sys.exit(f"{path}: missing; run `snakemake --cores 2 padding` or pass --loss-share")
    lengths = pd.read_parquet(path)
    ok = lengths[lengths["status"] == "OK"]
    return float(ok["n_loss_tokens"].sum()) / float(ok["n_tokens"].sum())


def time_pair(runner, switch, batch, order) -> dict[str, float]:
    out = {}
    for strategy in order:
        switch.set(strategy)
        out[strategy] = wall_time(lambda: runner.forward_backward(batch), runner.device)
        runner.zero_grad()
    return out


def saving_interval(base: np.ndarray, change: np.ndarray, seed: int = 0) -> tuple[float, ...]:
    """1 − mean(change)/mean(base) and its percentile bootstrap 95% interval (paired)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(base), size=(2000, len(base)))
    boot = 1.0 - change[picks].mean(axis=1) / base[picks].mean(axis=1)
    return 1.0 - change.mean() / base.mean(), *np.percentile(boot, [2.5, 97.5])


def same_loss(runner, switch, batch) -> float:
    values = {}
    with torch.no_grad():
        for strategy in ("random", STOCK):
            switch.set(strategy)
            values[strategy] = float(runner.harness.compute_loss(runner.model, batch))
    return abs(values[STOCK] / values["random"] - 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", type=Path, default=REPO / "resources/model/gemma-3-270m")
    parser.add_argument("--lengths", type=Path, default=REPO / "results/padding/lengths.parquet")
    parser.add_argument("--loss-share", type=float, default=None)
    args = parser.parse_args()
    config = load_config()
    torch.set_num_threads(int(config["replay"]["cpu"]["threads"]))
    device = torch.device("cpu")
    dtype, reason = replay_dtype(config["profile"]["dtype"], device)
    share = loss_share(args.lengths, args.loss_share)
    runner, vocab, _, _ = load_step(
        WorkflowConfig.from_dict(config), args.model, device, dtype, None
    )
    switch = sc.StepSwitch(runner)
    changes = {c.strategy: c for c in sc.step_changes(switch.base, 2, 2)}
    switch.configs = {STOCK: changes[STOCK].config}
    rows = int(config["training"]["micro_batch_size"])
    print(f"dtype {dtype} ({reason}); base {switch.base}; loss share {share:.3f}; {rows} rows")
    print(f"{'shape':>9} {'chunked s':>10} {'stock s':>9} {'saving':>8} {'95% interval':>18} "
          f"{'loss diff':>10}")  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for length in config["profile"]["cpu"]["lengths"]:
        batch = bt.uniform_batch(rows, int(length), share, vocab, generator)
        time_pair(runner, switch, batch, ("random", STOCK))  # warm-up, both kernels
        times = [
            time_pair(runner, switch, batch, ("random", STOCK)[:: 1 if r % 2 else -1])
            for r in range(args.repeats)
        ]
        base = np.array([t["random"] for t in times])
        stock = np.array([t[STOCK] for t in times])
        saving, low, high = saving_interval(base, stock)
        print(
            f"{rows}x{length:<6} {np.median(base):>10.3f} {np.median(stock):>9.3f} "
            f"{100 * saving:>+7.1f}% [{100 * low:>+6.1f}, {100 * high:>+6.1f}]% "
            f"{same_loss(runner, switch, batch):>10.1e}"
        )


if __name__ == "__main__":
    main()
