"""The profile stage: time real training steps of the real model through the user's trainer
(trainer.factory) or harness (profile.harness).

Order of work: fit control (cheap, fails fast) -> idle-card check -> load weights -> harness
adapters -> scaling points -> fit -> FLOP-count control (FlopCounterMode on one real step) ->
padding penalty -> CE wall clock -> kernel table -> the double-count control -> outputs (all
written only once everything succeeded). MFU follows probes.profile.flops.MFU_CONVENTION.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probes.contracts import STAGE_OUTPUTS
from probes.errors import ControlFailedError, ProbeError
from probes.io import run_metadata
from probes.lengths import LengthsError, read_training_lengths
from probes.profile import flops as fl
from probes.profile.ce_timing import run_ce
from probes.profile.evidence import device_description, evidence_text, read_recommendation
from probes.profile.penalty import run_padding_penalty, skipped_penalty
from probes.profile.scaling import (
    FlopModel,
    add_fit_columns,
    fit_frame,
    run_flop_control,
    run_kernel_profile,
    run_scaling,
)
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.step import batches as bt
from probes.step.cluster import slurm_environment
from probes.step.dtype import resolve_dtype
from probes.step.fit import fit_control, fit_step_time
from probes.step.harness import Harness, load_harness
from probes.step.idle import check_idle_card, probe_card
from probes.step.load import factory_of
from probes.step.runner import (
    ProfileError,
    Settings,
    StepRunner,
    load_model,
    model_text_config,
    prepare_harness,
    resolve_device,
)
from probes.step.timing import OK
from probes.step.trainer import load_trainer_step, probe_settings

LOG = logging.getLogger("probes.profile")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["profile"])
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_settings(profile: Mapping[str, Any], training: Mapping[str, Any]) -> Settings:
    device = resolve_device(profile["device"], profile["allow_cpu"])
    per_device = profile["cuda" if device.type == "cuda" else "cpu"]
    lengths = sorted({int(v) for v in per_device["lengths"]})
    if len(lengths) < 3:
        raise ProfileError(
            f"profile.{device.type}.lengths: {lengths} has {len(lengths)} distinct length(s); the "
            "scaling fit t(T)=aT^2+bT+c needs at least 3."
        )
    dtype_name, dtype_reason = resolve_dtype(profile["dtype"], device.type)
    return Settings(
        device=device,
        cpu_only=device.type != "cuda",
        dtype=DTYPES[dtype_name],
        dtype_reason=dtype_reason,
        lengths=lengths,
        warmup=int(per_device["warmup"]),
        repeats=int(per_device["repeats"]),
        kernel_steps=int(per_device["kernel_steps"]),
        probe_length=per_device.get("probe_length"),
        micro_batch=int(profile.get("micro_batch_size") or training["micro_batch_size"]),
        max_seq_len=int(training["max_seq_len"]),
        seed=int(profile["seed"]),
    )


def lengths_note(settings: Settings, device_type: str) -> str | None:
    """What to know when the profile times lengths beyond training.max_seq_len (none it trains
    at): said in the log and the provenance, never silently."""
    beyond = [n for n in settings.lengths if n > settings.max_seq_len]
    if not beyond:
        return None
    return (
        f"profile.{device_type}.lengths {beyond} exceed training.max_seq_len="
        f"{settings.max_seq_len}: those step times are at lengths this training never reaches "
        f"(set profile.{device_type}.lengths to at least 3 lengths <= {settings.max_seq_len})"
    )


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


@dataclass
class ProfiledStep:
    """The step the profile times, loaded once: the harness on the real model, or the user's
    trainer (probes.step.load); what the MFU convention counts about it."""

    runner: Any  # StepRunner | TrainerStep
    model: torch.nn.Module
    harness: Harness | None
    vocab_size: int
    pad_id: int
    params: dict[str, Any]
    trainable: int
    flop_model: FlopModel
    has_experts: bool
    described: dict[str, Any]


def load_profiled_step(
    model_path: str | Path, config: Mapping[str, Any], settings: Settings
) -> ProfiledStep:
    """The user's trainer where trainer.factory is set (its model as it built it), else the
    weights in the profiled dtype with the harness's adapters and optimizer."""
    profile = config["profile"]
    spec = factory_of(config)
    if spec:
        output_dir = tempfile.mkdtemp(prefix="probes-trainer-")
        step_settings = probe_settings(
            output_dir, settings.device, settings.dtype, None, settings.seed
        )
        runner = load_trainer_step(spec, step_settings)
        model, harness, head_positions = runner.model, None, "all"  # the stock loss
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = fl.model_active_parameters(base)
        described = runner.describe()
    else:
        harness = load_harness(profile["harness"])
        model = load_model(model_path, settings, profile["attn_implementation"])
        params = fl.model_active_parameters(model)
        options = {"ce_chunk_tokens": int(profile["ce_chunk_tokens"]), **profile["harness_options"]}
        model, optimizer, targets = prepare_harness(model, harness, options)
        runner = StepRunner(model, harness, optimizer, settings.device)
        head_positions = fl.head_positions_of(harness.module)
        described = {**harness.describe(), "target_modules": targets, "options": options}
    text_config = model_text_config(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    LOG.info(
        "%s: %d trainable params; active params %d",
        described.get("trainer") or described.get("spec"),
        trainable,
        params["active_params"],
    )
    return ProfiledStep(
        runner=runner,
        model=model,
        harness=harness,
        vocab_size=int(text_config["vocab_size"]),
        pad_id=int(text_config.get("pad_token_id") or 0),
        params=params,
        trainable=int(trainable),
        flop_model=FlopModel(
            params=fl.step_parameters(model),
            head_positions=head_positions,
            active_params=params["active_params"],
            text_config=text_config,
        ),
        has_experts=fl.moe_active_fraction(text_config) is not None,
        described=described,
    )


def training_loss_share(
    train: Any, profile: Mapping[str, Any], training: Mapping[str, Any]
) -> tuple[float, str]:
    """Which tokens carry loss (training.loss_on): the padding stage counted them per example."""
    if profile.get("loss_fraction") is not None:
        return float(profile["loss_fraction"]), "config profile.loss_fraction"
    if training.get("loss_on", "assistant") == "all":
        return 1.0, "training.loss_on: all"
    return bt.loss_fraction(
        train
    ), "n_loss_tokens / n_tokens of the padding lengths (training.loss_on)"


def check_batchable(train: Any, settings: Settings) -> None:
    """Fail before loading weights if no micro-batch fits the longest length at all; with fewer
    examples than a micro-batch no length can help: the penalty is skipped, said, the rest runs."""
    if len(train) >= settings.micro_batch:
        bt.padding_length_band(train, max(settings.lengths), settings.micro_batch)
    else:
        LOG.warning(
            "%s",
            bt.too_few_for_a_batch(train, len(train), max(settings.lengths), settings.micro_batch),
        )


def peak_of(profile: Mapping[str, Any], settings: Settings, device_name: str) -> tuple[Any, str]:
    """The peak TFLOP/s MFU divides by, and where it came from."""
    if profile.get("peak_tflops") is not None:
        return profile["peak_tflops"], "config profile.peak_tflops"
    peak = fl.peak_tflops_for(device_name) if not settings.cpu_only else None
    if peak is not None:
        return peak, f"bf16 dense peak for '{device_name}'"
    return None, "unknown for this device: MFU is NaN (set profile.peak_tflops)"


def measure_scaling(
    step: ProfiledStep, settings: Settings, loss_share: float, peak: Any
) -> tuple[Any, Any, Any]:
    """The scaling points, their fit, and the points that ran (fails when none did)."""
    scaling = run_scaling(step.runner, settings, loss_share, step.vocab_size, step.flop_model, peak)
    ok = scaling[scaling["status"] == OK]
    fit = fit_step_time(ok["seq_len"].tolist(), ok["time_s"].tolist())
    LOG.info("fit: %s (%s)", fit.method, fit.message)
    scaling = add_fit_columns(scaling, fit)
    if ok.empty:
        raise ProfileError(
            f"every scaling point failed ({scaling['status'].tolist()} at {settings.lengths}); "
            "lower profile lengths or the micro-batch size."
        )
    return scaling, fit, ok


def measure_penalty(
    step: ProfiledStep, settings: Settings, train: Any, profile: Mapping[str, Any], fit, ok
):
    """The padding batches come from the upper length band and stay within the lengths that
    ran, so the fit interpolates them."""
    try:
        picks = bt.pick_padding_batches(
            train,
            settings.micro_batch,
            int(ok["seq_len"].max()),
            settings.seed,
            profile["padding_draws"],
            profile["padding_waste_quantile"],
            n_batches=int(
                profile["cuda" if settings.device.type == "cuda" else "cpu"]["padding_batches"]
            ),
        )
        return run_padding_penalty(step.runner, settings, picks, fit, step.vocab_size, step.pad_id)
    except LengthsError as error:
        LOG.warning("padding penalty skipped: %s", error)
        return skipped_penalty(str(error))


def probe_point(settings: Settings, ok: Any, fit: Any) -> tuple[int, float, bool]:
    """CE and kernel probes at one length: the longest on a GPU (where attention and the head
    weigh most), the shortest on CPU (to keep the fallback run short); its step time, and
    whether it was measured (else the fit's)."""
    probe_length = settings.probe_length or int(
        ok["seq_len"].max() if settings.device.type == "cuda" else ok["seq_len"].min()
    )
    measured = probe_length in set(ok["seq_len"])
    step_at_probe = (
        float(ok.loc[ok["seq_len"] == probe_length, "time_s"].iloc[0])
        if measured
        else fit.predict(probe_length)
    )
    return probe_length, step_at_probe, measured


def real_peak_control(
    step: ProfiledStep,
    settings: Settings,
    model_path: str | Path,
    config: Mapping[str, Any],
    lengths: list[int],
    loss_share: float,
) -> dict[str, Any] | None:
    """The memory prediction against the real peak of the same steps (issue 28): one more
    untimed step of the profile's own runner (the harness's or the user's trainer's) at each
    scaling length, its peak from an instrument other than the predictor (max_memory_allocated
    on CUDA, the profiler's allocator events on CPU), predicted at the same rows, length and
    loss positions; off by more than memory.tolerance fails the stage with the shapes named.
    None where memory is off, or where fake tensors cannot trace the step (said)."""
    from probes.memory.check import real_vs_predicted, trainer_vs_predicted
    from probes.memory.real import scaling_step_peaks

    memory = config.get("memory") or {}
    if not memory.get("enabled", True):
        return None
    generator = torch.Generator().manual_seed(settings.seed + 6)

    def batch_of(length: int) -> dict[str, Any]:  # a scaling point's batch, as it was timed
        rows = settings.micro_batch
        made = bt.uniform_batch(rows, length, loss_share, step.vocab_size, generator)
        return bt.to_device(made, settings.device)

    real = scaling_step_peaks(step.runner, batch_of, lengths)
    tolerance = float(memory.get("tolerance", 0.10))
    round_to = 512 if settings.device.type == "cuda" else 1
    try:
        if step.harness is None:
            control = trainer_vs_predicted(step.runner, real, tolerance, round_to)
        else:
            from probes.mask.trace import config_from_dict, read_config_json
            from probes.memory.predict import functions_of

            model_config = config_from_dict(read_config_json(Path(model_path) / "config.json"))
            dtype = str(settings.dtype).replace("torch.", "")
            harness = functions_of(step.harness)
            control = real_vs_predicted(
                model_config, harness, dtype, real, tolerance, round_to=round_to
            )
    except ProbeError as error:  # fake tensors cannot follow this step: said, not checked
        LOG.warning("memory check skipped: the predictor cannot trace this step (%s)", error)
        return None
    LOG.info("memory check: predicted / real %s", control["observed"]["ratios"])
    if not control["passed"]:
        raise ControlFailedError(f"control memory_real_steps failed: {control['message']}")
    return control


def probe_at_one_length(
    step: ProfiledStep,
    settings: Settings,
    profile: Mapping[str, Any],
    length: int,
    step_time: tuple[float, bool],
    loss_share: float,
) -> tuple[Any, Any, str, dict[str, Any]]:
    """The CE variants beside the step at `length` (its time measured, or the fit's) and the
    kernel table with its double-count check: (ce, kernels, raw table, check)."""
    ce = run_ce(
        step.model,
        step.harness,
        settings,
        length,
        step_time[0],
        loss_share,
        step.vocab_size,
        int(profile["ce_chunk_tokens"]),
        "measured" if step_time[1] else "predicted by the fit",
    )
    kernels, raw_table, check = run_kernel_profile(
        step.runner,
        settings,
        length,
        loss_share,
        step.vocab_size,
        profile["double_count_tolerance"],
        step.has_experts,
    )
    return ce, kernels, raw_table, check


def control_record(controls: list[dict[str, Any]], provenance: dict[str, Any]) -> dict[str, Any]:
    """A control may guard one derived figure only (the FLOP count guards MFU): its failure
    marks that figure, not the stage. Raises when a control that gates the stage failed."""
    unverified = [c["mfu_unverified_reason"] for c in controls if c.get("mfu_unverified_reason")]
    provenance["mfu_verified"] = not unverified
    provenance["mfu_unverified_reason"] = unverified[0] if unverified else None
    if unverified:
        LOG.warning("MFU unverified: %s", unverified[0])
    passed = all(c["passed"] for c in controls if c.get("gates_stage", True))
    if not passed:
        failed = [c["name"] for c in controls if not c["passed"] and c.get("gates_stage", True)]
        observed = [c["observed"] for c in controls]
        raise ControlFailedError(f"control(s) failed: {failed}: {observed}")
    return {
        "name": "profile_controls",
        "description": (
            "the scaling fit recovers known coefficients; the analytic FLOP count matches "
            "FlopCounterMode on a real step; kernel sum <= profiled wall"
        ),
        "expected": {c["name"]: c["expected"] for c in controls},
        "observed": {c["name"]: c["observed"] for c in controls},
        "passed": passed,
        "mfu_verified": provenance["mfu_verified"],
        "mfu_unverified_reason": provenance["mfu_unverified_reason"],
        "checks": controls,
    }


def profile_provenance(
    step: ProfiledStep,
    settings: Settings,
    profile: Mapping[str, Any],
    run: dict[str, Any],
    model_path: str | Path,
    recommendation_path: str | Path | None,
    *,
    idle: Any,
    device: dict[str, Any],
    beyond_note: str | None,
    probe_length: int,
    measured: bool,
    loss: tuple[float, str],
    peak: tuple[Any, str],
) -> dict[str, Any]:
    """What the profile ran, on what, by which convention (provenance.json; one table)."""
    return {
        "device": device,
        "cpu_only": settings.cpu_only,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "dtype_reason": settings.dtype_reason,
        "attn_implementation": profile["attn_implementation"],
        "lengths": settings.lengths,
        "lengths_note": beyond_note,
        "warmup": settings.warmup,
        "warmup_scope": "every timing (each is a new shape: probes.step.timing.ShapesRun)",
        "repeats": settings.repeats,
        "kernel_steps": settings.kernel_steps,
        "probe_length": probe_length,
        "probe_step_time_source": "measured" if measured else "fit",
        "micro_batch_size": settings.micro_batch,
        "loss_fraction": loss[0],
        "loss_fraction_source": loss[1],
        "model_path": str(model_path),
        "params": step.params,
        "trainable_params": step.trainable,
        "step_parameters": step.flop_model.params.as_dict(),
        "lm_head_positions": step.flop_model.head_positions,
        "has_experts": step.has_experts,
        "peak_tflops": peak[0],
        "peak_tflops_source": peak[1],
        "mfu_convention": fl.MFU_CONVENTION,
        "harness": step.described,
        "idle_check": idle,
        "slurm": slurm_environment(),
        "bucket_recommendation": read_recommendation(recommendation_path),
        "versions": run["versions"],
        "run": run,
    }


def profile_summary(device_info, settings, scaling, fit, penalty, ce, kernels) -> dict[str, Any]:
    """The log's summary of the stage."""
    return {
        "device": device_info["name"],
        "cpu_only": settings.cpu_only,
        "scaling": scaling[["seq_len", "status", "time_s", "mfu"]].to_dict("records"),
        "fit": {"a": fit.a, "b": fit.b, "c": fit.c, "method": fit.method},
        "padding_penalty": penalty[
            ["variant", "measured_penalty", "measured_penalty_min", "measured_penalty_max"]
        ].to_dict("records"),
        "ce": ce[["variant", "status", "time_s", "step_share"]].to_dict("records"),
        "kernel_sum_s": float(kernels["device_time_s"].sum()),
        "kernel_wall_s": float(kernels["wall_s"].iloc[0]) if len(kernels) else float("nan"),
    }


def run_profile(
    lengths_path: str | Path,
    recommendation_path: str | Path | None,
    model_path: str | Path,
    outputs: Mapping[str, str | Path],
    config: Mapping[str, Any],
    card_probe: Callable[[int], Any] = probe_card,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run every probe and write every output (or none). Returns a summary for the log."""
    missing = [key for key in OUTPUT_KEYS if key not in outputs]
    if missing:
        raise ProfileError(f"profile outputs missing path(s) for {missing}")
    profile, training = config["profile"], config["training"]
    settings = resolve_settings(profile, training)
    LOG.info(
        "device %s%s, lengths %s, micro-batch %d",
        settings.device,
        " (CPU-only: small lengths, no device kernels)" if settings.cpu_only else "",
        settings.lengths,
        settings.micro_batch,
    )
    beyond_note = lengths_note(settings, settings.device.type)
    if beyond_note:
        LOG.warning("%s", beyond_note)
    # the fit's positive control first: cheap, and a broken fit must not cost a GPU run
    controls = [fit_control(settings.lengths)]
    if not controls[0]["passed"]:
        raise ControlFailedError(f"positive control failed: {controls[0]}")
    train = read_training_lengths(lengths_path, settings.max_seq_len)
    loss_share, loss_source = training_loss_share(train, profile, training)
    check_batchable(train, settings)
    idle = check_idle_card(profile, settings.device, card_probe, sleep)
    if settings.cpu_only:
        torch.set_num_threads(int(profile["cpu"]["threads"]))
    torch.manual_seed(settings.seed)
    step = load_profiled_step(model_path, config, settings)
    device_info = device_description(settings.device)
    peak, peak_source = peak_of(profile, settings, device_info["name"])

    scaling, fit, ok = measure_scaling(step, settings, loss_share, peak)
    controls.append(  # the FLOP count of the MFU convention, on one real step (shortest length)
        run_flop_control(
            step.runner,
            settings,
            int(ok["seq_len"].min()),
            loss_share,
            step.vocab_size,
            step.flop_model,
        )
    )
    peak_check = real_peak_control(
        step, settings, model_path, config, [int(v) for v in ok["seq_len"]], loss_share
    )
    if peak_check is not None:
        controls.append(peak_check)
    penalty = measure_penalty(step, settings, train, profile, fit, ok)
    probe_length, step_at_probe, measured = probe_point(settings, ok, fit)
    ce, kernels, raw_table, check = probe_at_one_length(
        step, settings, profile, probe_length, (step_at_probe, measured), loss_share
    )
    controls.append(check)

    run = run_metadata(dict(config))
    provenance = profile_provenance(
        step,
        settings,
        profile,
        run,
        model_path,
        recommendation_path,
        idle=idle,
        device=device_info,
        beyond_note=beyond_note,
        probe_length=probe_length,
        measured=measured,
        loss=(loss_share, loss_source),
        peak=(peak, peak_source),
    )
    control = control_record(controls, provenance)
    text = evidence_text(provenance, scaling, fit, penalty, ce, kernels, raw_table, controls)
    with all_or_nothing(outputs) as out:
        out.parquet("scaling", scaling, run)
        out.parquet("fit", fit_frame(fit, scaling), run)
        out.parquet("padding_penalty", penalty, run)
        out.parquet("ce", ce, run)
        out.parquet("kernels", kernels, run)
        out.text("raw", text)
        out.json("provenance", provenance)
        out.json("control", control)
    return profile_summary(device_info, settings, scaling, fit, penalty, ce, kernels)


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_profile(
        inputs["lengths"],
        inputs.get("recommendation"),
        Path(inputs["tokenizer"][0]).parent,
        outputs,
        cfg.raw,
    )
    LOG.info("profile summary: %s", summary)
