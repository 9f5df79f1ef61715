"""The LM head + cross-entropy variants of one step, timed on the step's own hidden states:
all positions vs loss positions, whole vs chunked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pandas as pd
import torch

from probes.step import batches as bt
from probes.step.ce import full_logits_cross_entropy, loss_positions_cross_entropy
from probes.step.harness import Harness, qualified_name
from probes.step.runner import Settings, model_text_config
from probes.step.timing import OK, SKIPPED, Timing, release_memory, time_repeats

LOG = logging.getLogger("probes.profile")


def _free_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        return float("inf")


@dataclass(frozen=True)
class HeadVariant:
    """One way of running the LM head + loss on the hidden states of a step."""

    loss: Callable[[torch.Tensor], torch.Tensor]
    positions: str  # "all" | "loss": which positions' logits it computes
    n_positions: int
    chunk_tokens: int | None  # None: the logits of all its positions at once
    source: str  # the loss function timed


def _time_head_variants(
    variants: Mapping[str, HeadVariant], hidden: torch.Tensor, settings: Settings, vocab: int
) -> list[tuple[str, Timing]]:
    """Forward + backward of each head + loss variant from a fresh leaf of the hidden states."""
    results = []
    for name, variant in variants.items():
        # an unchunked variant holds its logits: bf16, an fp32 copy, log-softmax, gradient
        need = float(variant.n_positions * vocab * 14) if variant.chunk_tokens is None else 0.0
        if need > 0.9 * _free_bytes(settings.device):
            timing = Timing(SKIPPED, error=f"needs ~{need / 2**30:.1f} GiB for its logits")
        else:

            def once(fn=variant.loss) -> None:
                fn(hidden.detach().requires_grad_(True)).backward()

            timing = time_repeats(once, settings.device, settings.warmup, settings.repeats)
        LOG.info("ce %s: %s %.4f s", name, timing.status, timing.time_s)
        results.append((name, timing))
    return results


def head_variants(
    model: torch.nn.Module,
    harness: Harness | None,
    labels: torch.Tensor,
    chunk_tokens: int,
) -> dict[str, HeadVariant]:
    """All positions unchunked (the stock loss), loss positions unchunked (position selection
    alone), loss positions chunked (the harness's own loss_from_hidden, else the reference's):
    consecutive rows differ in one change each."""
    from probes.step import reference_harness

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    softcap = model_text_config(model).get("final_logit_softcapping")
    n_loss = bt.loss_position_count(labels)
    chunked_fn = harness.hook("loss_from_hidden") if harness is not None else None
    if chunked_fn is not None:
        chunked_source = f"harness.loss_from_hidden ({qualified_name(chunked_fn)})"
    else:
        chunked_fn = reference_harness.loss_from_hidden
        chunked_source = (
            "probes.step.reference_harness.loss_from_hidden (harness has none): chunked fused "
            "linear cross-entropy"
        )
    return {
        "all_positions_unchunked": HeadVariant(
            lambda h: full_logits_cross_entropy(h, head, labels, softcap),
            "all",
            int(labels.numel()),
            None,
            "probes.step.ce.full_logits_cross_entropy (stock causal-LM loss: every "
            "position's logits)",
        ),
        "loss_positions_unchunked": HeadVariant(
            lambda h: loss_positions_cross_entropy(h, head, labels, softcap),
            "loss",
            n_loss,
            None,
            "probes.step.ce.loss_positions_cross_entropy (stock loss on the loss "
            "positions' logits)",
        ),
        "loss_positions_chunked": HeadVariant(
            lambda h: chunked_fn(model, h, labels), "loss", n_loss, chunk_tokens, chunked_source
        ),
    }


def run_ce(
    model: torch.nn.Module,
    harness: Harness | None,
    settings: Settings,
    length: int,
    step_time_s: float,
    loss_share: float,
    vocab_size: int,
    chunk_tokens: int,
    step_source: str = "measured",
) -> pd.DataFrame:
    """Head + CE forward and backward on the real hidden states of a step at `length`, in the
    three variants of head_variants, beside the step they belong to."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    generator = torch.Generator().manual_seed(settings.seed + 2)
    batch = bt.to_device(
        bt.uniform_batch(settings.micro_batch, length, loss_share, vocab_size, generator),
        settings.device,
    )
    with torch.no_grad():
        hidden = base.get_decoder()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        )[0]
    labels = batch["labels"]
    variants = head_variants(model, harness, labels, chunk_tokens)
    timed = _time_head_variants(variants, hidden, settings, vocab_size)
    n_loss = bt.loss_position_count(labels)
    del hidden, batch, labels
    release_memory(settings.device)

    common = {"seq_len": length, "batch": settings.micro_batch, "loss_tokens": n_loss}
    rows = [
        {
            "variant": "train_step",
            "status": OK,
            "time_s": step_time_s,
            "step_share": 1.0,
            **common,
            "positions": None,
            "n_positions": None,
            "chunk_tokens": None,
            "peak_mem_bytes": float("nan"),
            "source": (
                f"step time at this length ({step_source}): "
                + ("harness.compute_loss" if harness is not None else "trainer.training_step")
                + " + backward + optimizer step"
            ),
        }
    ]
    for name, timing in timed:
        variant = variants[name]
        rows.append(
            {
                "variant": name,
                "status": timing.status,
                "time_s": timing.time_s,
                "step_share": timing.time_s / step_time_s if timing.status == OK else float("nan"),
                **common,
                "positions": variant.positions,
                "n_positions": variant.n_positions,
                "chunk_tokens": variant.chunk_tokens,
                "peak_mem_bytes": timing.peak_mem_bytes,
                "source": variant.source + (f"; {timing.error}" if timing.error else ""),
            }
        )
    frame = pd.DataFrame(rows)
    frame["chunk_tokens"] = frame["chunk_tokens"].astype("Int64")
    frame["n_positions"] = frame["n_positions"].astype("Int64")
    return frame
