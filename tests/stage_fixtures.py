"""Stage outputs written the way each stage writes them, small and hand-checkable.

The one home of these fixture writers: the report tests render from them, the Snakemake report
test stands in for each stage with them, and bench/report_render.py scales them up.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from conftest import CANARY
from probes.bucket import sweep as bucket
from probes.contracts import BATCH_REBALANCE, RANDOM, STAGES, TABLES, report_inputs
from probes.io import run_metadata, write_json, write_parquet
from probes.profile.flops import MFU_CONVENTION

NOT_RUN_REASON = "no GPU and profile.cpu_fallback is false"
FIT = {"a": 2e-9, "b": 1e-4, "c": 0.05}  # seconds per micro-batch of 2 rows
BATCH = 2


# ------------------------------------------------------------------------------------------
# Fixture tables: the columns of probes.contracts.TABLES, plus planted extras that must never show
# ------------------------------------------------------------------------------------------


def mask_layers() -> pd.DataFrame:
    rows = []
    scenarios = [
        ("training", 2, 4096, "none", False),
        ("right_padded", 2, 4096, "right", False),
        ("packed", 1, 8192, "none", True),
        ("short", 2, 256, "none", False),
    ]
    for scenario, batch, seq_len, padding, packed in scenarios:
        for layer in range(6):
            sliding = layer % 6 != 5
            masked = padding != "none" or packed or (sliding and seq_len > 512)
            rows.append(
                {
                    "scenario": scenario,
                    "batch": batch,
                    "seq_len": seq_len,
                    "padding": padding,
                    "packed": packed,
                    "layer_idx": layer,
                    "layer_type": "sliding_attention" if sliding else "full_attention",
                    "head_dim": 256,
                    "mask_present": masked,
                    "is_causal": not masked,
                    "band_lower": (511 if sliding else seq_len - 1) if masked else np.nan,
                    "band_upper": 0 if masked else np.nan,
                    "backend": "efficient" if masked else "flash",
                    "excluded_by": "flash: attn_mask present; cudnn: attn_mask present"
                    if masked
                    else None,
                    "violation": None,
                }
            )
    return pd.DataFrame(rows)


def padding_lengths(n: int = 240, n_sources: int = 3) -> pd.DataFrame:
    """probes.padding.tokenize.LENGTH_COLUMNS, every status, plus a planted text column."""
    rng = np.random.default_rng(0)
    names = np.array(["chitchat", "support", "code"] + [f"topic-{i}" for i in range(n_sources)])
    sources = names[:n_sources][rng.integers(0, n_sources, n)]
    full = np.exp(rng.normal(6.0, 1.0, n)).astype(int) + 20
    status = np.where(full > 4096, "TRUNCATED", "OK").astype(object)
    status[:3] = "EMPTY"
    status[3:6] = "ERROR"
    bad = np.isin(status, ["EMPTY", "ERROR"])
    full = np.where(bad, 0, full)
    tokens = np.minimum(full, 4096)
    reason = np.array([""] * n, dtype=object)
    reason[:3] = "no_content"
    reason[3:5] = "invalid_json"
    reason[5] = f"parse failed near '{CANARY}'"  # must be hidden: not a code
    reason[status == "TRUNCATED"] = "longer_than_max_seq_len"
    return pd.DataFrame(
        {
            "example_id": [f"{i:016x}" for i in range(n)],
            "file": "data.jsonl",
            "row": np.arange(1, n + 1),
            "source": sources,
            "status": status,
            "reason": reason,
            "n_tokens": tokens,
            "n_tokens_full": full,
            "n_loss_tokens": tokens // 2,
            "n_turns": 4,
            "n_truncated_tokens": full - tokens,
            "text": CANARY,  # a column the report must never render
        }
    )


def padding_tables(lengths: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """summary / distribution / ce_chunks in probes.padding.waste's long formats."""
    usable = lengths[lengths["status"].isin(["OK", "TRUNCATED"])]
    summary = []
    waste = {
        "pad_to_max_seq_len": (0.91, 0.99, 0.0),
        "dataset_order": (0.44, 0.63, 0.0),
        "random": (0.42, 0.61, 0.01),
        "sorted": (0.02, 0.03, 0.0),
    }
    for strategy, (token, attention, std) in waste.items():
        for metric, value in (("token_waste", token), ("attention_waste", attention)):
            summary.append(
                {"section": "waste", "strategy": strategy, "metric": metric, "value": value}
                | {"std": std, "expected": value, "n_seeds": 8 if std else 1}
            )
    for status in ("OK", "EMPTY", "ERROR", "TRUNCATED"):
        count = float((lengths["status"] == status).sum())
        summary.append({"section": "status", "status": status, "metric": "count", "value": count})
    lost = float(lengths["n_truncated_tokens"].sum())
    summary.append(
        {"section": "status", "status": "TRUNCATED", "metric": "tokens_lost", "value": lost}
    )
    reasons = lengths[lengths["reason"] != ""].groupby(["status", "reason"]).size()
    for (status, reason), count in reasons.items():
        summary.append(
            {"section": "reason", "status": status, "reason": reason, "metric": "count"}
            | {"value": float(count)}
        )
    summary = pd.DataFrame(summary)
    for column in ("strategy", "status", "reason"):
        summary[column] = summary[column].fillna("")

    dist = []
    edges = np.geomspace(1, 4097, 21)
    groups = [
        ("overall", "(all)", usable),
        *(("source", k, g) for k, g in usable.groupby("source")),
    ]
    for scope, source, group in groups:
        t = group["n_tokens"].to_numpy()
        base = {"scope": scope, "source": source, "measure": "n_tokens"}
        stats = {"count": len(t), "tokens": t.sum(), "p50": np.percentile(t, 50)}
        stats |= {"p90": np.percentile(t, 90), "p99": np.percentile(t, 99), "max": t.max()}
        for statistic, value in stats.items():
            dist.append(base | {"kind": "stat", "statistic": statistic, "value": float(value)})
        hist, _ = np.histogram(t, bins=edges)
        for i, count in enumerate(hist):
            dist.append(
                base
                | {"kind": "bin", "statistic": "bin", "bin_index": i, "value": float(count)}
                | {"bin_lo": edges[i], "bin_hi": edges[i + 1]}
            )
    vocab, hidden = 262144, 640
    ce = []
    for shape, seq_len in (("max_seq_len", 4096), ("p50", 450), ("p99", 3000)):
        tokens = 2 * seq_len
        chunk = min(819, tokens)
        ce.append(
            {
                "shape": shape,
                "seq_len": seq_len,
                "tokens": tokens,
                "vocab_source": "tokenizer",
                "vocab_size": vocab,
                "hidden_size": hidden,
                "logits_bf16_bytes": tokens * vocab * 2,
                "logits_fp32_bytes": tokens * vocab * 4,
                "stock_loss_bytes": tokens * vocab * 10,
                "budget_gib": 2.0,
                "stock_fits_budget": tokens * vocab * 10 <= 2 * 2**30,
                "chunk_tokens": chunk,
                "n_chunks": -(-tokens // chunk),
                "liger_chunk_tokens": 32,
            }
        )
    return {"summary": summary, "distribution": pd.DataFrame(dist), "ce_chunks": pd.DataFrame(ce)}


# 234 training examples at micro-batch 2 × grad_accum 8: HF's group_by_length bucket is
# min(234 // 64, 50) × 8 = 24 micro-batches; 117 holds every example (a global sort).
HF_BUCKET, ALL_BUCKET = 24, 117


def bucket_sweep() -> pd.DataFrame:
    """probes.bucket.sweep.sweep_bucket_sizes' columns: random, length_grouped, global_sort, packing
    (ffd and bfd, with n_bins) and the batch_rebalance comparison row (variable micro-batches)."""
    rows = []
    sizes = [1, 2, 4, 8, HF_BUCKET, ALL_BUCKET]
    for seed in range(3):
        jitter = 0.002 * seed
        for i, m in enumerate(sizes):
            strategy = (
                "random" if m == 1 else "global_sort" if m == ALL_BUCKET else "length_grouped"
            )
            token = 0.58 + 0.07 * i + jitter
            diversity = (1 - 0.1 * i, 1 - 0.12 * i, 1 - 0.05 * i, 1 - 0.06 * i)
            rows.append((strategy, m, seed, token, 0.39 + 0.1 * i, 117, *diversity, 0.15 * i))
        rows.append(("packing_ffd", None, seed, 0.97, 0.5, 40, 1.0, 1.0, 1.0, 1.0, 0.0))
        rows.append(("packing_bfd", None, seed, 0.96, 0.5, 41, 1.0, 1.0, 1.0, 1.0, 0.0))
        rows.append((BATCH_REBALANCE, None, seed, 0.8 + jitter, 0.7, 150, 0.9, 0.9, 1, 1, 0.05))
    frame = pd.DataFrame(rows, columns=list(TABLES["bucket_sweep"].required))
    frame["bucket_size_batches"] = frame["bucket_size_batches"].astype("Int64")
    random = frame["strategy"] == "random"
    frame["padded_tokens_saved_vs_random"] = (
        1 - frame.loc[random, "token_efficiency"].mean() / frame["token_efficiency"]
    )
    frame["attention_cost_saved_vs_random"] = (
        1 - frame.loc[random, "attention_efficiency"].mean() / frame["attention_efficiency"]
    )
    frame["is_hf_trainer_default"] = frame["bucket_size_batches"].eq(HF_BUCKET).fillna(False)
    frame["n_bins"] = frame["n_micro_batches"].where(frame["strategy"].str.startswith("packing"))
    rebalance = frame["strategy"] == BATCH_REBALANCE
    frame["micro_batch_rows_max"] = np.where(rebalance, 6.0, 2.0)
    frame["micro_batch_padded_tokens_max"] = 8192.0
    frame["step_real_tokens_cv"] = np.where(rebalance, 0.3, 0.6)
    frame["top_kernels_like_list"] = [[CANARY]] * len(frame)  # never rendered
    return frame


def bucket_data_parallel() -> pd.DataFrame:
    """probes.bucket.data_parallel's table, computed on 234 lengths at the fixture's sizes."""
    from probes.bucket import data_parallel
    from probes.lengths import LengthSet

    values = np.random.default_rng(7).integers(20, 2000, 234).astype(np.int64)
    data = LengthSet(values, np.zeros(values.size, np.int32), ("none",))
    return data_parallel.data_parallel_sweep(
        data, 2, 8, 4096, seeds=[0, 1, 2], bucket_sizes=[1, 2, 4, 8, HF_BUCKET, ALL_BUCKET]
    )


POINT_KEYS = (
    "bucket_size_batches",
    "token_efficiency",
    "attention_efficiency",
    "padded_tokens_saved_vs_random",
    "attention_cost_saved_vs_random",
    "n_micro_batches",
    "diversity_rel_random",
    "micro_batch_rows_max",
    "micro_batch_padded_tokens_max",
    "step_real_tokens_cv",
    "n_bins",
)


def _point(row: pd.Series) -> dict:
    """A summary row as probes.bucket.sweep.recommend writes its points (plain numbers, NA left
    out)."""
    return {k: float(row[k]) for k in POINT_KEYS if k in row and pd.notna(row[k])}


def bucket_recommendation(summary: pd.DataFrame | None = None) -> dict:
    """recommendation.json as probes.bucket.stage writes it, its points read off the summary."""
    if summary is None:
        summary = bucket.summarise(bucket_sweep(), "step")
    by_size = summary.set_index("bucket_size_batches", drop=False)
    by_strategy = summary.set_index("strategy", drop=False)
    return {
        "status": "ok",
        "thresholds": {
            "gain_share": 0.9,
            "min_diversity_share": 0.8,
            "gain_metric": "tokens",
            "diversity_level": "step",
        },
        "recommended": {
            **_point(by_size.loc[4]),
            "bucket_size_examples": 8,
            "how_to_use": "get_length_grouped_indices(lengths, batch_size=2, mega_batch_mult=4)",
            "hf_trainer_equivalent": "not expressible in HF Trainer(group_by_length)",
        },
        "random": _point(by_strategy.loc[RANDOM]),
        "hf_trainer_default": _point(by_size.loc[HF_BUCKET]),
        "packing": {name: _point(by_strategy.loc[name]) for name in ("packing_ffd", "packing_bfd")},
        BATCH_REBALANCE: _point(by_strategy.loc[BATCH_REBALANCE]),
        "attention_note": "attention efficiency is what a dense kernel computes",
        "batch_shapes": {"micro_batch_size": BATCH, "padded_length_max": 4096},
        "input": {"examples_used": 234, "real_tokens": 144610},
        "training": {"micro_batch_size": BATCH, "grad_accum": 8, "max_seq_len": 4096},
    }


def profile_tables() -> dict[str, pd.DataFrame]:
    """probes.profile.stage's tables (scaling with term shares, fit row, penalty, ce, kernels)."""
    return {
        "scaling": profile_scaling(),
        "fit": profile_fit(),
        "padding_penalty": profile_penalty(),
        "ce": profile_ce(),
        "kernels": profile_kernels(),
    }


def profile_scaling() -> pd.DataFrame:
    """Scaling points on the known FIT, the longest out of memory."""
    lengths = [1024, 2048, 4096, 8192]
    rows = []
    for t in lengths:
        time_s = FIT["a"] * t * t + FIT["b"] * t + FIT["c"]
        oom = t == 8192
        rows.append(
            {
                "seq_len": t,
                "batch": BATCH,
                "tokens": BATCH * t,
                "status": "OOM" if oom else "OK",
                "time_s": np.nan if oom else time_s,
                "time_std_s": np.nan if oom else 0.002,
                "peak_mem_bytes": np.nan if oom else 1.2e9 * t / 1024,
                "mfu": np.nan if oom else 0.12,  # LoRA convention (probes.profile.flops)
                "mfu_dense_6n": np.nan if oom else 0.31,  # the old 6·N·tokens reading
                "quadratic_share": np.nan if oom else FIT["a"] * t * t / time_s,
                "linear_share": np.nan if oom else FIT["b"] * t / time_s,
                "fixed_share": np.nan if oom else FIT["c"] / time_s,
                "error": "" if not oom else "CUDA out of memory",
            }
        )
    return pd.DataFrame(rows)


def profile_fit() -> pd.DataFrame:
    """The fit row: exact through the three measured points."""
    return pd.DataFrame(
        [
            {**FIT, "n_points": 3, "method": "exact", "condition_number": 17.0}
            | {"residual_rms_s": np.nan, "max_rel_residual": np.nan, "r_squared": np.nan}
            | {"message": "exact through 3 points; not fitted: 8192:OOM"}
        ]
    )


def profile_penalty() -> pd.DataFrame:
    """The padding penalty, one by one and packed (packed beyond the fitted range)."""
    return pd.DataFrame(
        [
            {
                "variant": variant,
                "status": "OK",
                "n_batches": 5,
                "n_batches_ok": 5,
                "padded_time_s": 0.61,
                "unpadded_time_s": unpadded,
                "measured_penalty": 0.61 / unpadded - 1,
                "measured_penalty_min": low,
                "measured_penalty_max": high,
                "predicted_penalty": predicted,
                "prediction": prediction,
                "batch_example_ids": [["0000000000000001", "0000000000000002"]] * 5,
            }
            for variant, unpadded, low, high, predicted, prediction in (
                ("one_by_one", 0.40, 0.31, 0.66, 0.48, "fit read per row: one c per row"),
                (
                    "packed",
                    0.42,
                    0.22,
                    0.58,
                    np.nan,
                    "none: a 5000-token row is beyond the longest fitted length 4096",
                ),
            )
        ]
    )


def profile_ce() -> pd.DataFrame:
    """probes.profile.ce_timing.run_ce: the step, then one change per row (positions, then
    chunking)."""
    return pd.DataFrame(
        {
            "variant": [
                "train_step",
                "all_positions_unchunked",
                "loss_positions_unchunked",
                "loss_positions_chunked",
            ],
            "status": ["OK", "OK", "OK", "OK"],
            "time_s": [0.39, 0.177, 0.083, 0.069],
            "step_share": [1.0, 0.177 / 0.39, 0.083 / 0.39, 0.069 / 0.39],
            "seq_len": 4096,
            "batch": BATCH,
            "loss_tokens": 3358,
            "positions": [None, "all", "loss", "loss"],
            "n_positions": pd.array([None, 8192, 3358, 3358], dtype="Int64"),
            "chunk_tokens": pd.array([None, None, None, 1024], dtype="Int64"),
            "peak_mem_bytes": [np.nan, 6.3e9, 2.6e9, 2.1e9],
            "source": [
                "step time at this length (measured): harness.compute_loss + backward + "
                "optimizer step",
                "probes.step.ce.full_logits_cross_entropy (stock causal-LM loss: every position's "
                "logits)",
                "probes.step.ce.loss_positions_cross_entropy (stock loss on the loss "
                "positions' logits)",
                "harness.loss_from_hidden (probes.step.reference_harness.loss_from_hidden)",
            ],
        }
    )


def profile_kernels() -> pd.DataFrame:
    """Kernel categories on CUDA, and the CPU-side ATen twin of the GEMM the report drops."""
    return pd.DataFrame(
        {
            "category": ["GEMM", "attention", "elementwise", "GEMM"],
            "device_type": ["CUDA", "CUDA", "CUDA", "CPU"],  # the ATen twin must be dropped
            "device_time_s": [0.31, 0.12, 0.05, 0.31],
            "share": [0.646, 0.25, 0.104, 0.646],
            "share_of_wall": [0.55, 0.21, 0.09, 0.55],
            "n_kernels": [12, 3, 40, 12],
            "n_calls": [120, 36, 400, 120],
            "top_kernels": [["sm90_xmma_gemm"], ["flash_fwd"], ["elementwise"], ["aten::mm"]],
        }
    )


def flop_check(ratio: float = 1.04, tolerance: float = 0.15) -> dict:
    """The profile's FLOP control as probes.profile.flops.flop_counter_control writes it."""
    return {
        "name": "analytic_flops_match_flop_counter",
        "description": "analytic linear FLOPs of the MFU convention over FlopCounterMode's count",
        "expected": {"analytic_over_counted": 1.0, "tolerance": tolerance},
        "observed": {
            "analytic_over_counted": ratio,
            "analytic_linear_flops": 1.9e12 * ratio,
            "counted_linear_flops": 1.9e12,
            "analytic": {"frozen": 1.5e12, "trainable": 1e10, "head": 3.9e11},
            "counted_by_op": {"aten.mm": 1.9e12},
            "old_6n_over_counted_total": 1.6,
            "shape": {"batch": 2, "seq_len": 256},
            "counter_error": None,
            "hint": None,
        },
        "passed": abs(ratio - 1) <= tolerance,
    }


def control(name: str, passed: bool = True, checks: int = 0) -> dict:
    entry = {
        "name": name,
        "description": f"{name} recovers a known answer",
        "expected": {"value": 1.0},
        "observed": {"value": 1.0 if passed else 0.5},
        "passed": passed,
    }
    if checks:
        entry["checks"] = [
            {"name": f"check {i}", "expected": i, "observed": i, "passed": True}
            for i in range(checks)
        ]
        entry["checks"][-1]["passed"] = passed
    return entry


REPLAY_GRAD_ACCUM, REPLAY_MAX_LEN, REPLAY_BUCKET = 8, 4096, 4


def fixture_plans() -> pd.DataFrame:
    """Every strategy's plan of the fixture lengths (probes.batching.plans)."""
    from probes.batching import plans as pl

    lengths = padding_lengths()
    used = lengths[lengths["status"].isin(["OK", "TRUNCATED"])]
    loss = used["n_loss_tokens"].to_numpy(np.int64)
    examples = pl.PlanExamples(
        used["example_id"].to_numpy(object), used["n_tokens"].to_numpy(np.int64), loss
    )
    return pl.build_plans(examples, BATCH, REPLAY_GRAD_ACCUM, REPLAY_MAX_LEN, REPLAY_BUCKET, seed=0)


def replay_tables(cpu_only: bool = False) -> dict[str, pd.DataFrame]:
    """probes.replay.stage's three tables, made by the stage's own functions: the plans of the
    fixture lengths (probes.batching.plans), the race's first round
    (probes.replay.sequential.first_round) 'timed' at a known synthetic cost (no clock), the
    per-strategy table (strategy_table) with the fit as its diagnostic, and the fit with
    bootstrap intervals (probes.step.fit.fit_with_intervals)."""
    from probes.batching.plans import batch_shape
    from probes.replay.estimate import FitPricing, strategy_table
    from probes.replay.greg import greg_estimate_all
    from probes.replay.sequential import build_design, first_round, strategy_designs
    from probes.replay.timing import FIT_POINT, MICRO_BATCH, OPTIMIZER_STEP, TIMER, ReplaySettings
    from probes.step import fit as ft
    from probes.step.synthetic import SyntheticCost

    plans = fixture_plans()
    cost = SyntheticCost.scaled_to(plans)
    settings = ReplaySettings(4, 3, 400, REPLAY_GRAD_ACCUM, seed=0)
    rng = np.random.default_rng(3)
    design = build_design(plans, settings.n_strata, settings.seed)
    steps = first_round(design, settings.n_strata * settings.samples_per_stratum, settings.seed)
    exact = np.array([cost.micro_batch_s(*batch_shape(r)) for r in steps.itertuples()])
    steps["time_s"] = exact * rng.uniform(0.97, 1.03, len(steps))
    steps["times_s"] = [[t] for t in steps["time_s"]]
    steps["status"] = "OK"
    steps["kind"] = MICRO_BATCH
    steps["timer"] = TIMER
    steps["gpu_busy_share"] = np.nan if cpu_only else rng.uniform(0.4, 0.99, len(steps))
    steps["host_bound"] = steps["gpu_busy_share"] < settings.host_bound_threshold
    optimizer = np.full(8, cost.optimizer_s)
    fit_lengths = np.repeat([32, 256, 1024, 2048, 4096], 3)
    fit_times = [cost.micro_batch_s(BATCH, int(t)) for t in fit_lengths]
    fitted = ft.fit_with_intervals(fit_lengths, fit_times * rng.uniform(0.99, 1.01, 15), 200)
    pricing = FitPricing(fitted.fit, BATCH, fitted.low, fitted.high)
    greg, _ = greg_estimate_all(
        strategy_designs(design, steps),
        optimizer,
        0.03,
        4.0,
    )
    table = strategy_table(
        plans, steps, optimizer, settings, {}, pricing, cpu_only, REPLAY_MAX_LEN, greg=greg
    )
    points = pd.DataFrame(
        {
            "kind": FIT_POINT,
            "padded_length": fit_lengths,
            "rows": BATCH,
            "computed_tokens": BATCH * fit_lengths,
            "time_s": fit_times,
            "status": "OK",
        }
    )
    optimizer_rows = pd.DataFrame({"kind": OPTIMIZER_STEP, "time_s": optimizer, "status": "OK"})
    all_steps = pd.concat([steps, optimizer_rows, points], ignore_index=True)
    for column in ("example_ids", "example_lengths", "example_loss_tokens", "documents_per_row"):
        all_steps[column] = all_steps[column].map(
            lambda v: list(v) if isinstance(v, list | np.ndarray) else []
        )
    all_steps["times_s"] = all_steps["times_s"].map(lambda v: v if isinstance(v, list) else [])
    fit_row = fitted.as_row() | {"rows": BATCH, "loss_share": 0.5, "cpu_only": cpu_only}
    fit_row |= {"max_seq_len": REPLAY_MAX_LEN, "lengths_source": "configured"}
    timed_plans = plans.assign(stratum=0, paired=False)
    for column in ("example_ids", "example_lengths", "example_loss_tokens", "documents_per_row"):
        if column in timed_plans:
            timed_plans[column] = timed_plans[column].map(list)
    return {
        "estimates": table,
        "steps": all_steps,
        "fit": pd.DataFrame([fit_row]),
        "plans": timed_plans,
    }


def realize_tables(
    estimates: pd.DataFrame, cpu_only: bool = False, disagree: bool = False
) -> tuple[dict[str, pd.DataFrame], dict]:
    """probes.realize.stage's tables and summary, made by its own functions: the fixture plans'
    steps 'timed' at the replay fixture's known cost (no clock) with 1% noise, scaled to what the
    replay measured; `disagree` makes the realized optimizer step 10× slower, so the change is not
    confirmed."""
    from probes.batching.plans import batch_shape
    from probes.realize.estimate import realized_table
    from probes.realize.sample import sample_steps
    from probes.realize.stage import select_changes
    from probes.realize.timing import step_rows
    from probes.step.synthetic import SyntheticCost, exact_epoch_s

    plans = fixture_plans()
    cost = SyntheticCost.scaled_to(plans)
    exact = exact_epoch_s(plans, cost, REPLAY_GRAD_ACCUM)
    measured = estimates.set_index("strategy")["estimated_time_s"]
    optimizer_s = cost.optimizer_s * (10 if disagree else 1)
    changes = select_changes(estimates, 1)
    rng = np.random.default_rng(0)
    records, promises = [], {}
    for name in (RANDOM, *changes):
        steps = step_rows(plans[plans["strategy"] == name])
        optimizer_total = len(steps) * cost.optimizer_s
        scale = (measured[name] - optimizer_total) / (exact[name] - optimizer_total)
        for i, rows in enumerate(steps):  # the replay promised the known cost
            promises[(name, i)] = sum(cost.micro_batch_s(*batch_shape(r)) for r in rows)
        for i in sample_steps(len(steps), 4, rng):
            micro = sum(cost.micro_batch_s(*batch_shape(r)) for r in steps[i])
            micro *= scale * (1 + 0.01 * rng.standard_normal())  # noise
            records.append(
                {
                    "strategy": name,
                    "optimizer_step_index": int(i),
                    "time_s": micro + optimizer_s + 1e-4,
                    "status": "OK",
                    "computed_tokens": sum(r.computed_tokens for r in steps[i]),
                    "micro_batch_s": micro,
                    "optimizer_s": optimizer_s,
                    "rest_s": 1e-4,
                }
            )
    steps = pd.DataFrame(records)
    promised = pd.Series(promises).rename_axis(["strategy", "optimizer_step_index"])
    table = realized_table(
        steps, estimates, plans, changes, 0.05, cpu_only, REPLAY_MAX_LEN, promised
    )
    verdicts = {r.strategy: r.verdict for r in table.itertuples() if r.role == "change"}
    summary = {"status": "ran", "verdicts": verdicts, "changes": changes, "cpu_only": cpu_only}
    return {"realized": table, "steps": steps}, summary


def replay_control(passed: bool = True) -> dict:
    """replay_control.json as probes.replay.control.run_synthetic_control writes it (abridged)."""
    return {
        "name": "replay_recovers_known_step_cost",
        "description": "a synthetic harness spins c + b*rows*T + a*rows*T^2 s per micro-batch",
        "expected": {"time_ratio_rel_error_max": 0.05, "fit_rel_error_max": 0.1},
        "observed": {
            "strategies": {"packing": {"time_ratio_rel_error": 0.01 if passed else 0.2}},
            "fit": {"rel_error": {"a": 0.02, "b": 0.01, "c": 0.03}},
            "wall_s": 2.5,
        },
        "passed": passed,
        "host_bound_threshold": 0.7,
    }


def write_stage(
    stage: str,
    paths: dict[str, Path],
    profile: str = "gpu",  # gpu | cpu | not_run
    failed: tuple[str, ...] = (),
) -> None:
    """Write one stage's outputs (keys as in contracts.report_inputs) as the stage would."""
    meta = run_metadata({"fixture": True})
    if stage == "memory":  # an optional stage (memory.enabled): its outputs as the stage writes
        from unit.memory.stage_outputs import write_memory_stage

        write_memory_stage(paths)
    elif stage == "replay":
        write_replay(paths, meta, profile, failed)
    elif stage == "realize":
        write_realize(paths, meta, profile, failed)
    elif stage not in ("mask", "padding", "bucket") and profile == "not_run":
        write_profile_not_run(paths, meta)
    else:
        if stage == "mask":
            write_mask(paths, meta)
        elif stage == "padding":
            write_padding(paths, meta)
        elif stage == "bucket":
            write_bucket(paths, meta)
        else:
            write_profile(paths, meta, cpu=profile == "cpu")
        write_json(stage_control(stage, stage not in failed), paths[f"{stage}_control"])


def write_mask(paths: dict[str, Path], meta: dict) -> None:
    write_parquet(mask_layers(), paths["mask_layers"], meta)
    gate = {
        "passed": True,
        "violations_total": 0,
        "violations": [],
        "headline": "1 of 6 decoder layers keep SDPA's is_causal fast path at 2x4096",
        # as a CUDA run writes it (probes.mask.gate: confirmation against what torch dispatched)
        "confirm": {
            "status": "agreed",
            "ran": True,
            "agreed": 6,
            "total": 6,
            "per_scenario": {"training": {"agreed": 6, "total": 6}},
        },
        "target": {
            "compute_capability": "9.0",
            "torch_version": "2.11.0+cu130",
            "cudnn_version_source": "bundled with torch 2.11.0+cu130",
            "priority_order": ["cudnn", "flash", "efficient", "math"],
        },
    }
    write_json(gate, paths["mask_gate"])


def write_padding(paths: dict[str, Path], meta: dict) -> None:
    lengths = padding_lengths()
    write_parquet(lengths, paths["padding_lengths"], meta)
    for name, frame in padding_tables(lengths).items():
        write_parquet(frame, paths[f"padding_{name}"], meta)


def write_bucket(paths: dict[str, Path], meta: dict) -> None:
    sweep = bucket_sweep()
    # as probes.bucket.stage writes it: the one function that summarises the sweep
    summary = bucket.summarise(sweep, "step")
    write_parquet(sweep, paths["bucket_sweep"], meta)
    write_parquet(summary, paths["bucket_summary"], meta)
    write_json(bucket_recommendation(summary), paths["bucket_recommendation"])
    write_parquet(bucket_data_parallel(), paths["bucket_data_parallel"], meta)


def write_replay(paths: dict[str, Path], meta: dict, profile: str, failed: tuple[str, ...]) -> None:
    if profile == "not_run":
        for name in ("estimates", "steps", "fit", "plans"):
            write_parquet(pd.DataFrame(), paths[f"replay_{name}"], meta)
        write_json({"status": "not_run", "reason": NOT_RUN_REASON}, paths["replay_control"])
        return
    for name, frame in replay_tables(cpu_only=profile == "cpu").items():
        write_parquet(frame, paths[f"replay_{name}"], meta)
    write_json(replay_control("replay" not in failed), paths["replay_control"])


def write_realize(
    paths: dict[str, Path], meta: dict, profile: str, failed: tuple[str, ...]
) -> None:
    if profile == "not_run":
        for name in ("realized", "steps"):
            write_parquet(pd.DataFrame(), paths[f"realize_{name}"], meta)
        note = {"status": "not_run", "reason": NOT_RUN_REASON}
        write_json(note, paths["realize_summary"])
        write_json({**note, "name": "realize_recovers_known_step_cost"}, paths["realize_control"])
        return
    estimates = replay_tables(cpu_only=profile == "cpu")["estimates"]
    # failed "realize_verdict": the realized saving disagrees with the promise
    tables, summary = realize_tables(estimates, profile == "cpu", "realize_verdict" in failed)
    for name, frame in tables.items():
        write_parquet(frame, paths[f"realize_{name}"], meta)
    write_json(summary, paths["realize_summary"])
    passed = "realize" not in failed
    write_json(control("realize_recovers_known_step_cost", passed), paths["realize_control"])


def write_profile_not_run(paths: dict[str, Path], meta: dict) -> None:
    for name in ("scaling", "fit", "padding_penalty", "ce", "kernels"):
        write_parquet(pd.DataFrame(), paths[f"profile_{name}"], meta)
    note = {"status": "not_run", "reason": NOT_RUN_REASON}
    write_json(note, paths["profile_provenance"])
    write_json({**note, "name": "profile_controls"}, paths["profile_control"])


def write_profile(paths: dict[str, Path], meta: dict, cpu: bool) -> None:
    for name, frame in profile_tables().items():
        write_parquet(frame, paths[f"profile_{name}"], meta)
    provenance = {
        "device": {"type": "cpu", "name": "x86_64"}
        if cpu
        else {"type": "cuda", "name": "NVIDIA H200", "capability": "9.0"},
        "cpu_only": cpu,
        "harness": {"spec": "probes.reference_harness", "functions": {}},
        "dtype": "float32" if cpu else "bfloat16",
        "dtype_reason": "auto: this CPU emulates bfloat16 (AVX2, no AVX512-BF16/AMX)"
        if cpu
        else "auto: CUDA computes bfloat16 natively",
        "mfu_convention": MFU_CONVENTION,
        "slurm": {"job_id": "1234", "gpus": None},
    }
    write_json(provenance, paths["profile_provenance"])


def stage_control(stage: str, passed: bool) -> dict:
    """The mask, padding, bucket or profile control JSON (the profile's with its FLOP check)."""
    name = "profile_controls" if stage == "profile" else f"{stage}_control"
    checks = {"padding": 3, "profile": 2}.get(stage, 0)
    entry = control(name, passed, checks)
    if stage == "profile":  # its third check: the analytic FLOP count against FlopCounterMode
        entry["checks"].append(flop_check())
    return entry


# Each kind of results (write_results' keyword arguments) written once per process, then copied:
# building the tables takes ~2 s (the bucket's data-parallel sweep, the replay's tables, the
# provenance's git and package versions), and dozens of report tests each write their own copy.
_WRITTEN: dict[str, Path] = {}
_WRITTEN_HOME: list[tempfile.TemporaryDirectory] = []  # removed when the process ends


def write_results(root: Path, **kwargs) -> dict[str, Path]:
    """Write every stage output the report reads under root/ (the workflow's results layout):
    the same files whichever test asks, its own copy to change."""
    key = repr(sorted(kwargs.items()))
    if key not in _WRITTEN:
        if not _WRITTEN_HOME:
            _WRITTEN_HOME.append(tempfile.TemporaryDirectory(prefix="stage-fixtures-"))
        written = Path(_WRITTEN_HOME[0].name) / str(len(_WRITTEN))
        paths = {name: Path(path) for name, path in report_inputs(written).items()}
        for stage in STAGES:
            write_stage(stage, paths, **kwargs)
        _WRITTEN[key] = written
    shutil.copytree(_WRITTEN[key], root, dirs_exist_ok=True)
    return {name: Path(path) for name, path in report_inputs(root).items()}


def write_data_parallel(root: Path) -> dict[str, Path]:
    """The data_parallel stage's outputs (world_size 2, gloo, CPU), for the report's measured
    data-parallel part: rank 1 is the straggler of random batching."""
    from probes.contracts import optional_report_inputs

    paths = {
        k: Path(v) for k, v in optional_report_inputs({"training": {"world_size": 2}}, root).items()
    }
    rows = [
        {
            "sharding": "ddp",
            "strategy": strategy,
            "round": 0,
            "step": step,
            "rank": rank,
            "step_s": 1.0 if strategy == "random" else 0.6,
            "wait_s": 0.3 if (strategy == "random" and rank == 0) else 0.0,
            "collective_s": 0.05,
            "optimizer_s": 0.01,
            "single_s": 0.6 if (strategy == "random" and rank == 0) else 0.9,
        }
        for strategy in ("random", "length_grouped")
        for step in (0, 3)
        for rank in (0, 1)
    ]
    write_parquet(pd.DataFrame(rows), paths["data_parallel_steps"], {})

    def strategy(real, predicted, wait):
        return {
            "steps_measured": 2,
            "real_s": real,
            "predicted_s": predicted,
            "ratio": real / predicted,
            "within_tolerance": abs(real / predicted - 1) <= 0.1,
            "compute_s_per_step": 0.5,
            "wait_s_per_step": wait,
            "collective_s_per_step": 0.05,
            "optimizer_s": 0.01,
            "communication_share": 0.05,
            "straggler_wait_share": wait,
            "real_saving_vs_random_per_step": 1 - real / 2.0,
            "predicted_saving_vs_random_per_step": 1 - predicted / 1.92,
        }

    summary = {
        "world_size": 2,
        "backend": "gloo",
        "device_type": "cpu",
        "cpu_only": True,
        "max_seq_len_measured": 64,
        "tolerance": 0.1,
        "runs": {
            "ddp": {
                "random": strategy(2.0, 1.92, 0.15),
                "length_grouped": strategy(1.2, 1.92, 0.0),
            },
        },
        "ranks": [
            {
                "rank": r,
                "local_rank": r,
                "hostname": "node1",
                "device": "cpu",
                "slurm": {"job_id": "7"},
            }
            for r in (0, 1)
        ],
    }
    write_json(summary, paths["data_parallel_summary"])
    return paths
