"""Benchmark: the trainer's optimizer against each installed ``optim`` alternative, on the
default trainer (examples/sft_trainer.py: Gemma 3 270M, LoRA, the chitchat data).

The trainer is built once by the factory, as the probes build it; each alternative is its own
``create_optimizer`` at the other ``optim`` (the same LoRA parameter groups), and the optimizers
step in alternating turns on the same collated micro-batch (probes.step.optim.time_optimizers:
forward + backward timed beside, then clip, ``step()``, zero the gradients). Prints each
alternative's saving per optimizer step and as a share of a step at the trainer's gradient
accumulation, with the sign test's 95% interval (probes.step.optim.price_optims; numbers only).

    python bench/optim_turns.py [--turns 9] [--rows 0 1] [--dtype float32]

Needs the materialised default model and data (``resources/``).
"""

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.step import optim  # noqa: E402
from probes.step.trainer import load_trainer_step, probe_settings  # noqa: E402

FACTORY = str(REPO / "examples/sft_trainer.py") + ":build_trainer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--rows", nargs="+", default=["0", "1"], help="trainer dataset rows")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-length", type=int, default=256)
    args = parser.parse_args()
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        settings = probe_settings(
            out, torch.device("cpu"), getattr(torch, args.dtype), args.max_length, 0
        )
        step = load_trainer_step(FACTORY, settings)
        own = optim.current_optim(step.trainer.args)
        names = [n for n in optim.installed_optims() if n != own]
        batch = step.collate(args.rows, False)
        built_s = time.perf_counter() - begin
        times = optim.time_optimizers(step, batch, names, args.turns)
    facts = {
        "cpu": platform.processor() or platform.machine(),
        "bf16_units": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": list(batch["input_ids"].shape),
        "own": own,
        "build_s": round(built_s, 1),
        "grad_accum": step.grad_accum,
    }
    print(json.dumps(facts))
    medians = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(json.dumps({"median_s": medians}))
    print(json.dumps(optim.price_optims(times, own, step.grad_accum)))


if __name__ == "__main__":
    main()
