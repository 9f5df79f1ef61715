"""The profile stage: time real training steps of the real model through the user's trainer
(trainer.factory) or harness (profile.harness).

Order of work: settings (probes.profile.prepare) -> fit control (cheap, fails fast) -> the
data's loss share and batch check -> idle-card check -> load weights -> harness adapters
(probes.profile.load) -> scaling points -> fit -> FLOP-count control (FlopCounterMode on one real
step) -> memory check -> padding penalty -> CE wall clock -> kernel table -> the double-count
control -> outputs (probes.profile.outputs; all written only once everything succeeded). MFU
follows probes.profile.flops.MFU_CONVENTION.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from probes.contracts import STAGE_OUTPUTS
from probes.errors import ControlFailedError, ProbeError
from probes.io import run_metadata
from probes.lengths import LengthsError, read_training_lengths
from probes.profile.ce_timing import run_ce
from probes.profile.evidence import device_description, evidence_text
from probes.profile.load import ProfiledStep, load_profiled_step
from probes.profile.outputs import control_record, profile_provenance, profile_summary
from probes.profile.penalty import run_padding_penalty, skipped_penalty
from probes.profile.prepare import (
    check_batchable,
    logged_settings,
    peak_of,
    training_loss_share,
)
from probes.profile.scaling import (
    add_fit_columns,
    fit_frame,
    run_flop_control,
    run_kernel_profile,
    run_scaling,
)
from probes.settings import MemoryConfig, ProfileConfig, WorkflowConfig
from probes.stage import all_or_nothing
from probes.step import batches as bt
from probes.step.fit import QuadraticFit, fit_control, fit_step_time
from probes.step.idle import check_idle_card, probe_card
from probes.step.runner import ProfileError, Settings
from probes.step.threads import timing_threads
from probes.step.timing import OK

LOG = logging.getLogger("probes.profile")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["profile"])


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


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


# A user's trainer: the replay times its padding-free setting on the trainer's own micro-batches,
# with an interval; the penalty's one batch of the same question would be that fact twice
PRICED_BY_REPLAY = (
    "the replay prices padding-free (padding_free_sdpa, padding_free_eager) on the trainer's "
    "own micro-batches, with intervals: see the measured savings"
)


def measure_penalty(
    step: ProfiledStep, settings: Settings, train: Any, cfg: WorkflowConfig, fit, ok
):
    """The padding batches come from the upper length band and stay within the lengths that
    ran, so the fit interpolates them. None for a trainer whose step-level changes the replay
    prices (PRICED_BY_REPLAY)."""
    profile = cfg.profile
    if step.harness is None and cfg.replay.step_changes:
        LOG.info("padding penalty not timed: %s", PRICED_BY_REPLAY)
        return skipped_penalty(PRICED_BY_REPLAY)
    try:
        picks = bt.pick_padding_batches(
            train,
            settings.micro_batch,
            int(ok["seq_len"].max()),
            settings.seed,
            profile.padding_draws,
            profile.padding_waste_quantile,
            n_batches=int(
                (profile.cuda if settings.device.type == "cuda" else profile.cpu).padding_batches
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
    memory: MemoryConfig,
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

    if not memory.enabled:
        return None
    generator = torch.Generator().manual_seed(settings.seed + 6)

    def batch_of(length: int) -> dict[str, Any]:  # a scaling point's batch, as it was timed
        rows = settings.micro_batch
        made = bt.uniform_batch(rows, length, loss_share, step.vocab_size, generator)
        return bt.to_device(made, settings.device)

    real = scaling_step_peaks(step.runner, batch_of, lengths)
    tolerance = float(memory.tolerance)
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
    profile: ProfileConfig,
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
        int(profile.ce_chunk_tokens),
        "measured" if step_time[1] else "predicted by the fit",
    )
    kernels, raw_table, check = run_kernel_profile(
        step.runner,
        settings,
        length,
        loss_share,
        step.vocab_size,
        profile.double_count_tolerance,
        step.has_experts,
    )
    return ce, kernels, raw_table, check


@dataclass
class ProfileTables:
    """What the profile measured on the loaded step: the tables it writes, the length the CE
    and kernel probes ran at (its step time measured, or the fit's), and the controls run on
    the way (the FLOP count, the memory check where it ran, the kernels' double count)."""

    scaling: pd.DataFrame
    fit: QuadraticFit
    penalty: pd.DataFrame
    ce: pd.DataFrame
    kernels: pd.DataFrame
    raw_table: str
    probe_length: int
    measured: bool
    controls: list[dict[str, Any]]


def fit_control_first(settings: Settings) -> dict[str, Any]:
    """The fit's positive control: cheap, and a broken fit must not cost a GPU run."""
    control = fit_control(settings.lengths)
    if not control["passed"]:
        raise ControlFailedError(f"positive control failed: {control}")
    return control


def load_seeded_step(
    model_path: str | Path, cfg: WorkflowConfig, settings: Settings
) -> ProfiledStep:
    """The profiled step, loaded after the CPU threads are set and torch is seeded."""
    if settings.cpu_only:
        torch.set_num_threads(timing_threads(cfg.profile.cpu.threads))
    torch.manual_seed(settings.seed)
    return load_profiled_step(model_path, cfg, settings)


def measure_all(
    step: ProfiledStep,
    settings: Settings,
    train: Any,
    cfg: WorkflowConfig,
    model_path: str | Path,
    loss_share: float,
    peak: Any,
) -> ProfileTables:
    """Scaling points and fit -> FLOP-count control (one real step at the shortest length that
    ran) -> memory check -> padding penalty -> CE variants and kernel table at the probe length."""
    profile = cfg.profile
    scaling, fit, ok = measure_scaling(step, settings, loss_share, peak)
    shortest = int(ok["seq_len"].min())
    controls = [
        run_flop_control(
            step.runner, settings, shortest, loss_share, step.vocab_size, step.flop_model
        )
    ]
    peak_check = real_peak_control(
        step, settings, model_path, cfg.memory, [int(v) for v in ok["seq_len"]], loss_share
    )
    if peak_check is not None:
        controls.append(peak_check)
    penalty = measure_penalty(step, settings, train, cfg, fit, ok)
    probe_length, step_at_probe, measured = probe_point(settings, ok, fit)
    ce, kernels, raw_table, check = probe_at_one_length(
        step, settings, profile, probe_length, (step_at_probe, measured), loss_share
    )
    return ProfileTables(
        scaling, fit, penalty, ce, kernels, raw_table, probe_length, measured, [*controls, check]
    )


def write_outputs(
    outputs: Mapping[str, str | Path],
    tables: ProfileTables,
    controls: list[dict[str, Any]],
    run: dict[str, Any],
    provenance: dict[str, Any],
) -> None:
    """Every output, or none: the tables, the evidence text, provenance.json and control.json
    (which raises first when a control that gates the stage failed)."""
    control = control_record(controls, provenance)
    text = evidence_text(
        provenance, tables.scaling, tables.fit, tables.penalty, tables.ce, tables.kernels,
        tables.raw_table, controls,
    )  # fmt: skip
    with all_or_nothing(outputs) as out:
        out.parquet("scaling", tables.scaling, run)
        out.parquet("fit", fit_frame(tables.fit, tables.scaling), run)
        out.parquet("padding_penalty", tables.penalty, run)
        out.parquet("ce", tables.ce, run)
        out.parquet("kernels", tables.kernels, run)
        out.text("raw", text)
        out.json("provenance", provenance)
        out.json("control", control)


def run_profile(
    lengths_path: str | Path,
    recommendation_path: str | Path | None,
    model_path: str | Path,
    outputs: Mapping[str, str | Path],
    cfg: WorkflowConfig,
    card_probe: Callable[[int], Any] = probe_card,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run every probe and write every output (or none). Returns a summary for the log."""
    missing = [key for key in OUTPUT_KEYS if key not in outputs]
    if missing:
        raise ProfileError(f"profile outputs missing path(s) for {missing}")
    profile, training = cfg.profile, cfg.training
    settings, beyond_note = logged_settings(profile, training)
    controls = [fit_control_first(settings)]
    train = read_training_lengths(lengths_path, settings.max_seq_len)
    loss = training_loss_share(train, profile, training)
    check_batchable(train, settings)
    idle = check_idle_card(profile.idle, settings.device, card_probe, sleep)
    step = load_seeded_step(model_path, cfg, settings)
    device_info = device_description(settings.device)
    peak = peak_of(profile, settings, device_info["name"])
    tables = measure_all(step, settings, train, cfg, model_path, loss[0], peak[0])
    controls.extend(tables.controls)
    run = run_metadata(dict(cfg.raw))  # the whole config as a dict: the provenance hashes it
    provenance = profile_provenance(
        step, settings, profile, run, model_path, recommendation_path,
        idle=idle, device=device_info, beyond_note=beyond_note,
        probe_length=tables.probe_length, measured=tables.measured, loss=loss, peak=peak,
    )  # fmt: skip
    write_outputs(outputs, tables, controls, run, provenance)
    return profile_summary(
        device_info, settings, tables.scaling, tables.fit, tables.penalty, tables.ce,
        tables.kernels,
    )  # fmt: skip


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_profile(
        inputs["lengths"],
        inputs.get("recommendation"),
        Path(inputs["tokenizer"][0]).parent,
        outputs,
        cfg,
    )
    LOG.info("profile summary: %s", summary)
