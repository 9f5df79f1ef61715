"""Benchmark: what ``torch.compile`` costs and saves per shape on this machine.

A causal LM's forward + backward (its own loss over every position, random token ids), eager and
under ``torch.compile`` (inductor; on CPU it builds C++ kernels with the system compiler), at
``--rows`` rows x each of ``--lengths`` tokens, in the order given (the order a run meets its
shapes: the first pays the cold compile, the second usually a recompile with dynamic shapes,
later ones often none). Measured by probes.step.compile.measure: per shape the compiled step's
first call against its steady time (the compile), torch's own graph counter, and ``--repeats``
paired eager / compiled calls; then priced by probes.step.compile.price over a run of
``--run-micro-batches`` micro-batches of those shapes (numbers only).

    python bench/compile_cost.py --tiny                      # a 4-layer random Gemma 3
    python bench/compile_cost.py --lengths 64 --repeats 3    # the default Gemma 3 270M

Needs the materialised default model for the second (``resources/model/gemma-3-270m``).
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.step import compile as cp  # noqa: E402


class PlainStep:
    """The model's own loss, forward + backward: the step measure() times (no trainer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = torch.device("cpu")

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> None:
        self.model(**batch).loss.backward()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def load_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    if args.tiny:
        config = Gemma3TextConfig(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        if not (args.model / "config.json").exists():
            sys.exit(f"{args.model}: no config.json; materialise the default model or use --tiny")
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    return model.to(dtype).train()


def batches(vocab: int, rows: int, lengths: list[int]) -> list[tuple[tuple[int, int], dict]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (rows, n), generator=generator)
        out.append(((rows, n), {"input_ids": ids, "labels": ids.clone()}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 4-layer random Gemma 3")
    parser.add_argument("--model", type=Path, default=REPO / "resources/model/gemma-3-270m")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 96, 128, 160])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--run-micro-batches", type=int, default=16_000)
    parser.add_argument("--grad-accum", type=int, default=8)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load_model(args, dtype)
    step = PlainStep(model)
    eager, compiled = cp.step_functions(step)
    vocab = int(model.config.vocab_size)
    begin = time.perf_counter()
    run = cp.measure(eager, compiled, batches(vocab, args.rows, args.lengths), args.repeats)
    facts = {
        "cpu": platform.processor() or platform.machine(),
        "bf16_units": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch": torch.__version__,
        "model": "tiny gemma3 (4 layers)" if args.tiny else args.model.name,
        "dtype": args.dtype,
        "wall_s": round(time.perf_counter() - begin, 1),
    }
    print(json.dumps(facts))
    for shape in run.shapes:
        print(json.dumps({
            "shape": shape.shape, "first_s": round(shape.first_s, 3),
            "compile_s": round(shape.compile_s, 3), "graphs_built": shape.graphs,
            "compiled_steady_s": round(shape.steady_s, 4),
        }))  # fmt: skip
    n = len(args.lengths)
    priced = cp.price(run, n, args.run_micro_batches, args.grad_accum) if run.shapes else {}
    eager_mean = sum(run.eager_s) / len(run.eager_s) if run.eager_s else float("nan")
    print(json.dumps({"eager_mean_s": eager_mean, "error": run.error, **priced}, default=str))


if __name__ == "__main__":
    main()
