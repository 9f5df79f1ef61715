"""One training step of the real model, always through the user's harness: the device, the model
loaded in the profiled dtype, the harness's adapters and optimizer, and the step runner the profile
and the replay both time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probes.errors import ProbeError
from probes.settings import ProfileConfig
from probes.step.harness import Harness
from probes.step.timing import OK, Timing, time_repeats


class ProfileError(ProbeError, RuntimeError):
    """The stage cannot run as configured, or one of its controls failed."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    device: torch.device
    cpu_only: bool
    dtype: torch.dtype
    dtype_reason: str  # why this dtype: probes.step.dtype.choose_dtype
    lengths: list[int]
    warmup: int
    repeats: int
    kernel_steps: int
    probe_length: int | None
    micro_batch: int
    max_seq_len: int
    seed: int


def resolve_device(requested: str, allow_cpu: bool) -> torch.device:
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise ProfileError(
            "profile.device is 'cuda' but torch sees no CUDA device; run on a GPU node or set "
            "profile.device: auto (CPU fallback needs profile.allow_cpu: true)."
        )
    if requested == "cuda" or (requested == "auto" and cuda):
        return torch.device("cuda", 0)
    if not allow_cpu:
        raise ProfileError(
            "no CUDA device and profile.allow_cpu is false; the profile needs a GPU here "
            "(set profile.allow_cpu: true to time small lengths on CPU and say so)."
        )
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The training step, always through the harness
# ---------------------------------------------------------------------------------------------


class StepRunner:
    """The harness's step: ``compute_loss`` for every micro-batch, backward, one optimizer step.

    The trainer's step (probes.step.trainer.TrainerStep) has the same small interface:
    ``forward_backward``, ``optimizer_step``, ``zero_grad``, ``plan_batch``, ``step``,
    ``describe``; profile, replay and realize time either through it.
    """

    # its micro-batches are the probe's own (random token ids), not the user's pipeline: their
    # building stays outside the timer (TrainerStep.collates_in_loop: the trainer's loop's is in)
    collates_in_loop = False

    def __init__(self, model: torch.nn.Module, harness: Harness, optimizer, device) -> None:
        self.model = model
        self.harness = harness
        self.optimizer = optimizer
        self.device = device
        self.described: dict[str, Any] = {}

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.harness.compute_loss(self.model, batch)
        loss.backward()
        return loss

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        """Drop partial gradients (a step cut short by an out-of-memory error)."""
        self.optimizer.zero_grad(set_to_none=True)

    def plan_batch(
        self, row: Any, vocab_size: int, generator: torch.Generator, pad_id: int = 0
    ) -> dict[str, torch.Tensor]:
        """A plan row's micro-batch on the device: the project's builders, random token ids."""
        from probes.step.batches import plan_batch, to_device

        return to_device(plan_batch(row, vocab_size, generator, pad_id), self.device)

    def describe(self) -> dict[str, Any]:
        return {"kind": "harness", **self.harness.describe(), **self.described}

    def step(
        self,
        micro_batches: Iterable[dict[str, torch.Tensor]],
        mark: Callable[[str], None] | None = None,
    ) -> None:
        """One optimizer step. `mark(phase)`, when given, is called after each micro-batch is
        at hand ("built"; a generator builds it then), after its backward ("micro_batch") and
        after the optimizer step and zero_grad ("optimizer"): the realize stage's phase clock."""
        for batch in micro_batches:
            if mark is not None:
                mark("built")
            self.forward_backward(batch)
            if mark is not None:
                mark("micro_batch")
        self.optimizer_step()
        if mark is not None:
            mark("optimizer")

    def timed(self, micro_batches, warmup: int, repeats: int) -> Timing:
        timing = time_repeats(lambda: self.step(micro_batches), self.device, warmup, repeats)
        if timing.status != OK:  # a step cut short may leave partial gradients behind
            self.zero_grad()
        return timing


def load_model(model_path: str | Path, settings: Settings, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": settings.dtype, "attn_implementation": attn_implementation}
    if settings.device.type == "cuda":
        kwargs["device_map"] = {"": settings.device.index or 0}
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    if settings.device.type != "cuda":
        model.to(settings.device)
    if model.dtype != settings.dtype:  # transformers < 4.56 names the argument torch_dtype
        model.to(settings.dtype)
    model.config.use_cache = False
    return model


def prepare_harness(
    model: torch.nn.Module, harness: Harness, options: dict[str, Any]
) -> tuple[torch.nn.Module, Any, list[str]]:
    """The harness's own target discovery, adapters and optimizer (reference ones as fallback)."""
    from probes.step import reference_harness

    configure = harness.hook("configure")
    if configure is not None:
        configure(options)
    targets = list(harness.discover_target_modules(model))
    if not targets:
        raise ProfileError(f"harness {harness.spec}: discover_target_modules returned no module")
    apply_adapters = harness.hook("apply_adapters") or reference_harness.apply_adapters
    model = apply_adapters(model, targets)
    model.train()
    build_optimizer = harness.hook("build_optimizer") or reference_harness.build_optimizer
    return model, build_optimizer(model), targets


def harness_section(profile: ProfileConfig) -> dict[str, Any]:
    """The profile section's keys `load_for_steps` reads, as the plain mapping the
    data-parallel worker also receives (its job is JSON)."""
    return {
        "harness": profile.harness,
        "harness_options": dict(profile.harness_options),
        "attn_implementation": profile.attn_implementation,
        "ce_chunk_tokens": profile.ce_chunk_tokens,
    }


def load_for_steps(
    model_path: str | Path,
    profile: Any,
    device: torch.device,
    dtype: torch.dtype,
    dtype_reason: str = "",
    seed: int | None = None,
) -> tuple[torch.nn.Module, Harness, Any, list[str], dict[str, Any]]:
    """The real model in `dtype` with the user's harness, its adapters and optimizer: what every
    stage that runs training steps outside the profile loads (replay, realize, data_parallel).
    `profile`: the profile section (harness, attn_implementation, ce_chunk_tokens,
    harness_options). `seed` seeds the adapters' init (every DDP rank the same).
    Returns (model, harness, optimizer, target modules, harness options)."""
    from probes.step.harness import load_harness

    settings = Settings(
        device=device,
        cpu_only=device.type != "cuda",
        dtype=dtype,
        dtype_reason=dtype_reason,
        lengths=[],
        warmup=0,
        repeats=1,
        kernel_steps=0,
        probe_length=None,
        micro_batch=1,
        max_seq_len=1,
        seed=seed or 0,
    )
    harness = load_harness(profile["harness"])
    model = load_model(model_path, settings, profile["attn_implementation"])
    options = {"ce_chunk_tokens": int(profile["ce_chunk_tokens"]), **profile["harness_options"]}
    if seed is not None:
        torch.manual_seed(seed)
    model, optimizer, targets = prepare_harness(model, harness, options)
    return model, harness, optimizer, targets, options


def model_text_config(model: torch.nn.Module) -> dict[str, Any]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.to_dict()
