"""The padding penalty: the same real examples timed padded and unpadded (one by one, packed),
against the penalty the scaling fit predicts.
"""

from __future__ import annotations

import logging
import math

import pandas as pd
import torch
from tqdm import tqdm

from probes.step import batches as bt
from probes.step.fit import QuadraticFit
from probes.step.runner import Settings, StepRunner
from probes.step.timing import OK, SKIPPED, Timing, release_memory

LOG = logging.getLogger("probes.profile")


PENALTY_VARIANTS = ("one_by_one", "packed")
PREDICTION_BASIS = {
    "one_by_one": (
        "fit read per row: each row its own micro-batch, so one fixed cost c per row "
        "(sum (a n^2 + b n)/B + c)"
    ),
    "packed": (
        "fit read per row: one row of sum(n) tokens whose dense attention costs (sum n)^2, "
        "one fixed cost ((a S^2 + b S)/B + c)"
    ),
}


def predicted_penalties(
    fit: QuadraticFit, pick: bt.PaddingPick, fit_batch: int
) -> dict[str, tuple[float, float, float, str]]:
    """Per variant (padded time, unpadded time, penalty, basis) predicted by the fit, or NaN
    with the reason: no usable fit, or a row longer than the longest fitted length (the packed
    row of sum(n) tokens often is) -- the fit is never used above the range it was measured on.
    Rows shorter than the shortest fitted length are read toward T=0, where c dominates; the
    basis says so."""
    nan = float("nan")
    if not fit.usable:
        return {name: (nan, nan, nan, f"none: {fit.message}") for name in PENALTY_VARIANTS}
    times = bt.predicted_step_times(fit.a, fit.b, fit.c, fit_batch, pick.n_tokens)
    top = max(fit.lengths) if fit.lengths else float("inf")
    bottom = min(fit.lengths) if fit.lengths else 0
    needed = {"one_by_one": pick.longest, "packed": pick.n_real_tokens}
    out = {}
    for name in PENALTY_VARIANTS:
        if needed[name] > top:
            reason = f"none: a {needed[name]}-token row is beyond the longest fitted length {top}"
            out[name] = (times["padded"], nan, nan, reason)
            continue
        if times[name] <= 0 or times["padded"] <= 0:
            out[name] = (nan, nan, nan, "none: the fit predicts a non-positive step time here")
            continue
        basis = PREDICTION_BASIS[name]
        if min(pick.n_tokens) < bottom:
            basis += f"; rows below the shortest fitted length {bottom} read toward T=0"
        out[name] = (times["padded"], times[name], times["padded"] / times[name] - 1.0, basis)
    return out


def _time_padding_variants(
    runner: StepRunner,
    settings: Settings,
    pick: bt.PaddingPick,
    vocab_size: int,
    pad_id: int,
    seed: int,
) -> dict[str, Timing]:
    generator = torch.Generator().manual_seed(seed)
    padded = bt.to_device(
        bt.padded_batch(pick.n_tokens, pick.n_loss_tokens, vocab_size, generator, pad_id=pad_id),
        settings.device,
    )
    # the same examples, one micro-batch each (gradient accumulation, one optimizer step)
    singles = [
        {key: value[row : row + 1, :length] for key, value in padded.items()}
        for row, length in enumerate(pick.n_tokens)
    ]
    packed = bt.to_device(
        bt.packed_batch(pick.n_tokens, pick.n_loss_tokens, vocab_size, generator), settings.device
    )
    variants = {"padded": [padded], "one_by_one": singles, "packed": [packed]}
    timings = {}
    for name, micro_batches in variants.items():
        timings[name] = runner.timed(micro_batches, settings.warmup, settings.repeats)
        LOG.info("padding %s: %s %.4f s", name, timings[name].status, timings[name].time_s)
    del padded, singles, packed, variants
    release_memory(settings.device)
    return timings


def _median(values: list[float]) -> float:
    finite = [v for v in values if isinstance(v, float) and math.isfinite(v)]
    return float(pd.Series(finite).median()) if finite else float("nan")


def _spread(values: list[float]) -> tuple[float, float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return float("nan"), float("nan"), float("nan")
    return min(finite), _median(finite), max(finite)


def run_padding_penalty(
    runner: StepRunner,
    settings: Settings,
    picks: list[bt.PaddingPick],
    fit: QuadraticFit,
    vocab_size: int,
    pad_id: int,
) -> pd.DataFrame:
    """Each picked batch padded, one by one and packed; one row per unpadded variant with the
    penalty's spread over the batches (min / median / max) and the fit's prediction."""
    per_batch = [
        _time_padding_variants(runner, settings, pick, vocab_size, pad_id, settings.seed + 1 + i)
        for i, pick in enumerate(tqdm(picks, desc="padding penalty", unit="batch"))
    ]
    predictions = [predicted_penalties(fit, pick, settings.micro_batch) for pick in picks]
    rows = []
    for name in PENALTY_VARIANTS:
        padded_times, unpadded_times, measured, statuses = [], [], [], []
        for timings in per_batch:
            padded_t, unpadded_t = timings["padded"], timings[name]
            both_ok = padded_t.status == OK and unpadded_t.status == OK
            failed = f"padded:{padded_t.status},{name}:{unpadded_t.status}"
            statuses.append(OK if both_ok else failed)
            padded_times.append(padded_t.time_s)
            unpadded_times.append(unpadded_t.time_s)
            measured.append(padded_t.time_s / unpadded_t.time_s - 1.0 if both_ok else float("nan"))
        low, middle, high = _spread(measured)
        predicted = [p[name][2] for p in predictions]
        n_ok = statuses.count(OK)
        rows.append(
            {
                "variant": name,
                "status": OK if n_ok == len(statuses) else "; ".join(sorted(set(statuses))),
                "n_batches": len(picks),
                "n_batches_ok": n_ok,
                "padded_time_s": _median(padded_times),
                "unpadded_time_s": _median(unpadded_times),
                "measured_penalty": middle,
                "measured_penalty_min": low,
                "measured_penalty_max": high,
                "predicted_padded_time_s": _median([p[name][0] for p in predictions]),
                "predicted_unpadded_time_s": _median([p[name][1] for p in predictions]),
                "predicted_penalty": _median(predicted),
                "prediction": "; ".join(sorted({p[name][3] for p in predictions})),
                "padded_peak_mem_bytes": max(t["padded"].peak_mem_bytes for t in per_batch),
                "unpadded_peak_mem_bytes": max(t[name].peak_mem_bytes for t in per_batch),
                "batch": settings.micro_batch,
                "longest": max(p.longest for p in picks),
                "n_real_tokens": _median([float(p.n_real_tokens) for p in picks]),
                "padding_waste": _median([p.padding_waste for p in picks]),
                "batch_padded_time_s": padded_times,
                "batch_unpadded_time_s": unpadded_times,
                "batch_measured_penalty": measured,
                "batch_predicted_penalty": predicted,
                "batch_padding_waste": [p.padding_waste for p in picks],
                "batch_example_ids": [p.example_ids for p in picks],
                "batch_example_lengths": [p.n_tokens for p in picks],
                "batch_example_loss_tokens": [p.n_loss_tokens for p in picks],
                "repeats_per_batch": settings.repeats,
                "pick": picks[0].method,
                "timer": per_batch[0]["padded"].timer,
            }
        )
    return pd.DataFrame(rows)


def skipped_penalty(reason: str) -> pd.DataFrame:
    nan = float("nan")
    return pd.DataFrame(
        [
            {
                "variant": name,
                "status": SKIPPED,
                "n_batches": 0,
                "n_batches_ok": 0,
                "padded_time_s": nan,
                "unpadded_time_s": nan,
                "measured_penalty": nan,
                "measured_penalty_min": nan,
                "measured_penalty_max": nan,
                "predicted_penalty": nan,
                "prediction": "none: no batch was timed",
                "batch": 0,
                "longest": 0,
                "n_real_tokens": 0.0,
                "padding_waste": nan,
                "pick": reason,
            }
            for name in PENALTY_VARIANTS
        ]
    )
