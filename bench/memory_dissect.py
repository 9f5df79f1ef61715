"""What the memory prediction holds at its peak, storage by storage: the op that made each live
tensor, its shape and dtype, grouped and summed (the issue-45 reconciliation with the seed's
measured figure). Fake tensors only: no weights, no GPU.

Traces a reduced model (`--layers`, default one full-attention layer: the layer checkpointing
recomputes first) of the given config.json at `--rows` x `--length` through the reference harness
(LoRA, chunked loss; `--checkpointing`), and prints the live activations at the peak by op and
shape, largest first, plus the categories. Numbers only (shapes, bytes), never data.

    python bench/memory_dissect.py config/models/gemma-4-26b-a4b-like/config.json \
        --rows 2 --length 16384 --checkpointing --layers full_attention
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--layers", default="full_attention", help="comma-separated layer types")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)

    from probes.mask.trace import config_from_dict, read_config_json
    from probes.memory.layers import reduced_config
    from probes.memory.predict import (
        Shape,
        build_fake_step,
        fake_errors,
        functions_of,
        make_batch,
        traced_step,
    )
    from probes.memory.tracker import StepTracker
    from probes.step import reference_harness

    reference_harness.configure({"gradient_checkpointing": args.checkpointing})
    config = config_from_dict(read_config_json(args.config), source=args.config)
    config = reduced_config(config, args.layers.split(","))
    step = build_fake_step(config, functions_of(reference_harness), "bfloat16", 1, 512)
    shape = Shape("dissect", args.rows, args.length)
    tracker = StepTracker(round_to=512, true_count=shape.loss_positions())
    tracker.keep_shapes = True
    with fake_errors(shape), step.mode:
        fields = traced_step(step.model, step.optimizer, reference_harness.compute_loss,
                             make_batch(shape), tracker)  # fmt: skip
    print(f"peak {fields['peak_bytes'] / GIB:.3f} GiB in {fields['phase']} at {fields['op']}")
    for category, nbytes in fields["by_category"].items():
        print(f"  {category:<16} {nbytes / GIB:8.3f} GiB")
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for item in tracker.live_at_peak():
        if not item["shape"] and item["op"] == "before the step":
            continue
        key = (item["op"], item["shape"], item["dtype"])
        groups[key][0] += item["bytes"]
        groups[key][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    print(f"largest live storages at the peak (of {len(ranked)} groups):")
    for (op, shp, dtype), (nbytes, count) in ranked[: args.top]:
        print(f"  {nbytes / GIB:8.3f} GiB  x{count:<3} {op:<40} {list(shp)} {dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
