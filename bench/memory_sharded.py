"""Each rank's predicted peak under FSDP2 at W = 1, 2, 4, 8 for a config.json, and the seconds
each world size takes (issue 45: <= 60 s per W on a 2-core CPU). Fake tensors and a fake process
group (probes.memory.fsdp): no weights, no GPU. Numbers only.

    python bench/memory_sharded.py config/models/gemma-3-27b-it/config.json --full-finetune
    python bench/memory_sharded.py config/models/gemma-4-26b-a4b-like/config.json   # LoRA r 16

Measured on this repo's 2-core Xeon (2026-12-05), checkpointing on, bf16, 2 x 16,384:
Gemma 3 27B full fine-tuning 226.2 / 126.9 / 85.5 / 66.3 GiB, 20-25 s each; Gemma-4 26B-A4B-like
LoRA 77.9 / 55.9 / 44.1 / 38.2 GiB, 18-23 s each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--world-sizes", default="1,2,4,8")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--full-finetune", action="store_true", help="every weight trains")
    args = parser.parse_args(argv)

    from probes.mask.trace import config_from_dict, read_config_json
    from probes.memory.fsdp import Sharding, predict_sharded_scaled
    from probes.memory.predict import Shape, functions_of
    from probes.step import reference_harness

    if args.full_finetune:
        from unit.memory import full_finetune_harness as harness
    else:
        harness = reference_harness
    harness.configure({"gradient_checkpointing": not args.no_checkpointing})
    config = config_from_dict(read_config_json(args.config), source=args.config)
    shape = Shape("bench", args.rows, args.length)
    for world in (int(w) for w in args.world_sizes.split(",")):
        sharding = Sharding(world, not args.no_reshard)
        found = predict_sharded_scaled(config, functions_of(harness), "bfloat16", shape, sharding)
        print(f"W={world}: {found.peak_bytes / GIB:8.2f} GiB per rank  {found.seconds:6.1f} s  "
              f"({found.notes[0]})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
