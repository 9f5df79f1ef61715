"""bench/realized_vs_promised.py's data, model and settings: the seeded subset of the real
lengths, the small random-init Llama (or an architecture's own), what every timed epoch sets
(the model's own dtype, no autocast, one epoch, no logging), and its command line."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

from trainer_harness import LEARNING_RATE  # noqa: E402

from probes.batching import plans as pl  # noqa: E402
from probes.contracts import TRAINING_STATUSES  # noqa: E402

IGNORE_INDEX = -100
VOCAB = 512


def load_subset(path: Path, n: int, cap: int, seed: int) -> pl.PlanExamples:
    """A seeded subset of the training examples, lengths (and loss tokens) capped at `cap`."""
    frame = pd.read_parquet(path, columns=["example_id", "status", "n_tokens", "n_loss_tokens"])
    used = frame.loc[frame["status"].astype(str).isin(TRAINING_STATUSES)].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(len(used), size=min(n, len(used)), replace=False))
    part = used.iloc[picked]
    lengths = np.minimum(part["n_tokens"].to_numpy(np.int64), cap)
    loss = pd.to_numeric(part["n_loss_tokens"], errors="coerce").fillna(0).to_numpy(np.int64)
    return pl.PlanExamples(
        part["example_id"].astype(str).to_numpy(object), lengths, np.clip(loss, 0, lengths)
    )


def build_model(
    max_len: int, hidden: int, architecture: Path | None = None, dtype: Any = None
) -> Any:
    """A small Llama, random init (seed 0): real architecture, seconds per CPU epoch. With
    `architecture` (a model directory's config.json, e.g. the default Gemma on a GPU) that
    architecture instead, random init too: step time depends on shapes, not weight values."""
    import torch
    import transformers

    torch.manual_seed(0)
    if architecture is not None:
        config = transformers.AutoConfig.from_pretrained(architecture)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
        model.config.use_cache = False
        return model
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(max_len, 64),
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(dtype or torch.float32)
    model.config.use_cache = False
    return model


def model_words(args: argparse.Namespace) -> str:
    if args.architecture is None:
        return f"small random-init Llama (hidden {args.hidden}, 4 layers, vocab {VOCAB})"
    return f"random-init {args.architecture.name} architecture"


def vocab_size(args: argparse.Namespace) -> int:
    """Token ids are drawn below this: the small Llama's VOCAB, or the architecture's own."""
    if args.architecture is None:
        return VOCAB
    import transformers

    config = transformers.AutoConfig.from_pretrained(args.architecture)
    return int(getattr(config, "get_text_config", lambda: config)().vocab_size)


def precision(args: argparse.Namespace) -> dict[str, Any]:
    """The trainers' device and precision: the model's own dtype, no autocast (build_model puts
    it in float32 on CPU, where bf16 is emulated without bf16 units, and in bfloat16 on CUDA),
    so the trainers run the step the replay runs (profile.dtype the same)."""
    return {"use_cpu": args.device != "cuda", "bf16": False}


def epoch_arguments(out: str, args: argparse.Namespace) -> dict[str, Any]:
    """What every timed epoch sets, in TrainingArguments and SFTConfig alike: one epoch, no
    logging, saving or progress bar in the timing, the data in the main process."""
    return {
        "output_dir": out,
        "num_train_epochs": 1,
        "learning_rate": LEARNING_RATE,
        "seed": args.seed,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **precision(args),
    }


def model_dtype(args: argparse.Namespace) -> Any:
    import torch

    return torch.bfloat16 if args.device == "cuda" else torch.float32


def subset_recommendation(rec: dict[str, Any], examples: pl.PlanExamples) -> dict[str, Any]:
    """The bucket stage's recommendation with its input counts those of the subset (the
    recommended bucket size and sweep points are the full data's)."""
    out = copy.deepcopy(rec)
    out["input"] = {
        **(out.get("input") or {}),
        "examples_used": int(examples.lengths.size),
        "real_tokens": int(examples.lengths.sum()),
    }
    out["batch_shapes"] = {
        **(out.get("batch_shapes") or {}),
        "padded_length_max": int(examples.lengths.max()),
    }
    return out


def training_section(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "micro_batch_size": args.micro_batch_size,
        "grad_accum": args.grad_accum,
        "max_seq_len": args.cap,
        "loss_on": "assistant",
        "world_size": 1,
    }


class Examples:
    """Tokenised examples: random ids, the real lengths; labels on the last `loss` tokens (the
    assistant turn), -100 on the prompt."""

    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    @classmethod
    def from_plan(cls, examples: pl.PlanExamples, seed: int, vocab: int = VOCAB) -> Examples:
        rng = np.random.default_rng(seed)
        rows = []
        for n, loss in zip(examples.lengths, examples.loss_tokens, strict=True):
            ids = rng.integers(1, vocab, size=int(n)).tolist()
            labels = [IGNORE_INDEX] * (int(n) - int(loss)) + ids[int(n) - int(loss) :]
            rows.append({"input_ids": ids, "labels": labels})
        return cls(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]

    def filter(self, keep: Any) -> Examples:
        return Examples([row for row in self.rows if keep(row)])


def parse_args(description: str) -> argparse.Namespace:
    """bench/realized_vs_promised.py's command line (`--quick`: fewer examples and rounds)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--lengths", type=Path, default=Path("results/padding/lengths.parquet"))
    parser.add_argument(
        "--recommendation", type=Path, default=Path("results/bucket/recommendation.json")
    )
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--cap", type=int, default=256, help="every length capped here (tokens)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds (lockstep on CPU: a realized interval of 2-5 pp)",
    )
    parser.add_argument(
        "--extra-rounds",
        type=int,
        default=3,
        help="with --trainer sft on CPU: up to this many more rounds of the baseline and the "
        "changes whose realized interval is still wider than 10 pp",
    )
    parser.add_argument("--budget-s", type=float, default=90.0, help="the replay's time budget")
    parser.add_argument(
        "--reference-every",
        type=int,
        default=2,
        help="the replay's replay.reference_every (each unit priced against a reference "
        "micro-batch timed beside it, so the machine's drift over the bench's minutes cancels; "
        "0: off, the workflow's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="200 examples, 2 rounds (no extra), 30 s replay: the changes two rounds cannot "
        "decide are undecided",
    )
    parser.add_argument("--out", type=Path, help="also write the table as markdown here")
    parser.add_argument(
        "--changes",
        help="comma-separated change ids to realize (default: every change the run prices, the "
        "optim alternatives included with --trainer sft); naming torch_compile or "
        "torch_compile_pad_to_multiple_of_64 turns on the replay's compile pricing "
        "(replay.compile): cold CPU compiles take minutes a graph, so it is off by default",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--trainer",
        choices=["harness", "sft"],
        default="harness",
        help="sft: the promise is the replay through a trl.SFTTrainer factory "
        "(bench/sft_factory.py), its step-level changes included, and every configuration is "
        "realized by that factory's trainer with the change's settings",
    )
    parser.add_argument(
        "--architecture",
        type=Path,
        help="a model directory whose config.json to train (random init), e.g. the default "
        "Gemma on a GPU; default: the small Llama",
    )
    args = parser.parse_args()
    if args.quick:
        args.examples, args.repeats, args.budget_s, args.extra_rounds = 200, 2, 30.0, 0
    return args
