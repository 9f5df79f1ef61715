"""The playbook-evidence report: load every stage output, derive the summary, render markdown.

Everything here is a pure function of the stage outputs, so a number in the report is traceable in
three hops: the template names a column (``{{ row.time_s | seconds }}``), the column comes from one
table listed in ``TABLES`` (which stage and file), and the derived numbers (expected savings) come
from the functions below.

Never surface the data: the report shows only source labels, ids, counts and numbers. No column
outside ``TABLES`` is ever rendered, reason codes are filtered to code-like strings, and source
labels are shortened and escaped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from probes.io import read_json, read_parquet, read_provenance

NOT_RUN = "not_run"
OK_STATUSES = ("OK", "TRUNCATED")  # the examples that train; EMPTY and ERROR never do
ALL_STATUSES = ("OK", "TRUNCATED", "EMPTY", "ERROR")
MISSING = "—"  # what a missing or non-finite number renders as
STRATEGY_ORDER = ("random", "length_grouped", "packing")


class ReportInputError(ValueError):
    """A stage output the report cannot use; the message names the file, key and what to do."""


# ----------------------------------------------------------------------------------------------
# The contract: which columns the report reads from which table. A missing column fails loudly
# here (naming file, columns and section) instead of rendering garbage.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableSpec:
    stage: str
    section: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


TABLES: dict[str, TableSpec] = {
    "mask_layers": TableSpec(
        "mask",
        "Mask gate",
        (
            "scenario",
            "batch",
            "seq_len",
            "padding",
            "packed",
            "layer_idx",
            "layer_type",
            "head_dim",
            "mask_present",
            "is_causal",
            "band_lower",
            "band_upper",
            "backend",
            "excluded_by",
        ),
    ),
    "padding_lengths": TableSpec(
        "padding",
        "Padding",
        ("example_id", "source", "status", "reason", "n_tokens", "n_loss_tokens"),
        ("n_truncated_tokens", "n_tokens_full", "n_turns"),
    ),
    # waste per batching strategy (random: mean over seeds, with spread)
    "padding_summary": TableSpec(
        "padding",
        "Padding",
        ("strategy", "token_waste", "attention_waste"),
        ("token_waste_std", "attention_waste_std", "n_seeds"),
    ),
    "padding_distribution": TableSpec(
        "padding",
        "Padding",
        ("source", "n_examples", "total_tokens", "p50", "p90", "p99", "max"),
    ),
    "padding_ce_chunks": TableSpec(
        "padding",
        "Cross-entropy",
        (
            "shape",
            "n_tokens",
            "logits_bf16_bytes",
            "logits_fp32_bytes",
            "stock_loss_bytes",
            "max_chunk_tokens",
            "liger_chunk_tokens",
        ),
        ("vocab_size", "hidden_size", "fits_budget"),
    ),
    "bucket_sweep": TableSpec(
        "bucket",
        "Bucketing",
        (
            "strategy",
            "bucket_size",
            "seed",
            "token_efficiency",
            "attention_efficiency",
            "n_micro_batches",
            "distinct_sources_rel",
            "entropy_rel",
            "order_length_corr",
        ),
    ),
    "profile_scaling": TableSpec(
        "profile",
        "Scaling",
        ("seq_len", "batch", "status", "time_s", "peak_mem_bytes", "quadratic_share", "mfu"),
        ("time_std_s", "residual_s", "tokens_per_s"),
    ),
    "profile_fit": TableSpec(
        "profile",
        "Scaling",
        ("a", "b", "c", "n_points", "condition_number"),
        ("residual_rms_s", "max_rel_residual"),
    ),
    "profile_padding_penalty": TableSpec(
        "profile",
        "Scaling",
        ("padded_time_s", "unpadded_time_s", "measured_penalty", "predicted_penalty"),
        ("batch", "longest", "n_real_tokens"),
    ),
    "profile_ce": TableSpec(
        "profile",
        "Cross-entropy",
        ("variant", "time_s", "step_share"),
        ("peak_mem_bytes", "chunk_tokens", "status"),
    ),
    "profile_kernels": TableSpec(
        "profile",
        "Kernels",
        ("category", "device_time_s", "share"),
        ("n_kernels", "device_type"),
    ),
}

# JSON outputs: the keys the report reads (a not-run stage may carry only status + reason).
JSONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mask_gate": ("mask", ("passed", "counts")),
    "bucket_recommendation": ("bucket", ("bucket_size",)),
    "profile_provenance": ("profile", ("device", "cpu_only", "harness")),
    "mask_control": ("mask", ()),
    "padding_control": ("padding", ()),
    "bucket_control": ("bucket", ()),
    "profile_control": ("profile", ()),
}
CONTROL_KEYS = ("name", "description", "expected", "observed", "passed")
STAGES = ("mask", "padding", "bucket", "profile")

# Where each input lives under results/ (the same names as the rule's inputs).
INPUT_FILES: dict[str, str] = {
    "mask_layers": "mask/layers.parquet",
    "mask_gate": "mask/gate.json",
    "mask_control": "mask/control.json",
    "padding_lengths": "padding/lengths.parquet",
    "padding_summary": "padding/summary.parquet",
    "padding_distribution": "padding/distribution.parquet",
    "padding_ce_chunks": "padding/ce_chunks.parquet",
    "padding_control": "padding/control.json",
    "bucket_sweep": "bucket/sweep.parquet",
    "bucket_recommendation": "bucket/recommendation.json",
    "bucket_control": "bucket/control.json",
    "profile_scaling": "profile/scaling.parquet",
    "profile_fit": "profile/fit.parquet",
    "profile_padding_penalty": "profile/padding_penalty.parquet",
    "profile_ce": "profile/ce.parquet",
    "profile_kernels": "profile/kernels.parquet",
    "profile_provenance": "profile/provenance.json",
    "profile_control": "profile/control.json",
}


def default_input_paths(results_dir: str | Path) -> dict[str, Path]:
    """The rule's inputs for a results directory laid out as the workflow writes it."""
    return {key: Path(results_dir) / rel for key, rel in INPUT_FILES.items()}


# ----------------------------------------------------------------------------------------------
# Formatting: every number reaches the report through one of these (jinja filters of the same name).
# ----------------------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt_seconds(value: Any) -> str:
    """Seconds with a unit that keeps 3 significant digits: 850 µs, 12.3 ms, 1.52 s, 3.4 min."""
    x = _finite(value)
    if x is None:
        return MISSING
    size = abs(x)
    if size == 0:
        return "0 s"
    if size < 1e-3:
        return f"{x * 1e6:.3g} µs"
    if size < 1:
        return f"{x * 1e3:.3g} ms"
    if size < 120:
        return f"{x:.3g} s"
    return f"{x / 60:.3g} min"


def fmt_bytes(value: Any) -> str:
    """Binary units: 512 B, 1.50 KiB, 2.00 GiB."""
    x = _finite(value)
    if x is None:
        return MISSING
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def fmt_pct(value: Any, digits: int = 1) -> str:
    """A fraction as a percentage: 0.1234 -> 12.3%."""
    x = _finite(value)
    return MISSING if x is None else f"{x * 100:.{digits}f}%"


def fmt_count(value: Any) -> str:
    """An integer count with thousands separators: 7,168."""
    x = _finite(value)
    return MISSING if x is None else f"{round(x):,}"


def fmt_tokens(value: Any) -> str:
    """A token count with its unit: 4,096 tokens."""
    x = _finite(value)
    return MISSING if x is None else f"{round(x):,} tokens"


def fmt_ratio(value: Any) -> str:
    """A multiplier: 1.23×."""
    x = _finite(value)
    return MISSING if x is None else f"{x:.2f}×"


def fmt_number(value: Any, digits: int = 3) -> str:
    """A plain number with `digits` significant digits (coefficients, condition numbers)."""
    x = _finite(value)
    return MISSING if x is None else f"{x:.{digits}g}"


def fmt_signed_pct(value: Any) -> str:
    """A change as a signed percentage: +12.3% / -4.0%."""
    x = _finite(value)
    return MISSING if x is None else f"{x * 100:+.1f}%"


def fmt_value(value: Any, limit: int = 80) -> str:
    """A control's expected/observed value: numbers formatted, structures as compact JSON."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else MISSING
    if isinstance(value, int | float):
        return fmt_number(value, 4)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return cell(text[: limit - 1] + "…" if len(text) > limit else text)


_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,48}$")


def reason_code(value: Any) -> str:
    """A reason as a code only; anything else (it could carry data) is hidden."""
    text = "" if value is None else str(value)
    return text if _CODE.match(text) else "other_reason"


def cell(value: Any) -> str:
    """Safe inside a markdown table cell: no pipes, no newlines."""
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def label(value: Any, limit: int = 40) -> str:
    """A source label: printable, at most `limit` characters, safe in a table cell."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(value)).strip() or "(unnamed)"
    return cell(text if len(text) <= limit else text[: limit - 1] + "…")


FILTERS = {
    "seconds": fmt_seconds,
    "bytes": fmt_bytes,
    "pct": fmt_pct,
    "count": fmt_count,
    "tokens": fmt_tokens,
    "ratio": fmt_ratio,
    "num": fmt_number,
    "signed_pct": fmt_signed_pct,
    "value": fmt_value,
    "cell": cell,
    "label": label,
}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def not_run_reason(obj: Any) -> str | None:
    """The reason a stage did not run, from its JSON ({"status": "not_run", "reason": ...})."""
    if isinstance(obj, Mapping) and obj.get("status") == NOT_RUN:
        return str(obj.get("reason") or "no reason given")
    return None


def check_columns(frame: pd.DataFrame, name: str, path: str | Path) -> pd.DataFrame:
    """Fail with the file, the missing columns and the section that needs them."""
    spec = TABLES[name]
    missing = [c for c in spec.required if c not in frame.columns]
    if missing:
        raise ReportInputError(
            f"{path}: column(s) {missing} missing; the report's {spec.section} section reads them "
            f"from the {spec.stage} stage (it wrote {sorted(map(str, frame.columns))}). Rerun the "
            f"stage, or update probes.report.TABLES['{name}'] if the column was renamed."
        )
    return frame


def check_keys(obj: Any, name: str, path: str | Path) -> Any:
    stage, required = JSONS[name]
    if not isinstance(obj, Mapping | list):
        raise ReportInputError(f"{path}: expected a JSON object from the {stage} stage.")
    if isinstance(obj, Mapping) and not_run_reason(obj) is None:
        missing = [k for k in required if k not in obj]
        if missing:
            raise ReportInputError(
                f"{path}: key(s) {missing} missing; the report reads them from the {stage} stage."
            )
    return obj


def load_inputs(paths: Mapping[str, str | Path]) -> dict[str, Any]:
    """Read every stage output named in `paths` (keys as in INPUT_FILES).

    Returns {"tables": {name: DataFrame}, "json": {name: obj}, "not_run": {stage: reason},
    "provenance": {stage: run_metadata of its first table}}. A stage whose JSON says
    status "not_run" gets empty tables and no column checks.
    """
    missing = set(INPUT_FILES) - set(paths)
    if missing:
        raise ReportInputError(f"report inputs missing: {sorted(missing)}")
    jsons: dict[str, Any] = {}
    for name in JSONS:
        path = Path(paths[name])
        try:
            jsons[name] = read_json(path)
        except FileNotFoundError as err:
            raise ReportInputError(f"{path}: not found; run the {JSONS[name][0]} stage.") from err
        except json.JSONDecodeError as err:
            message = f"{path}: not valid JSON ({err.msg}, line {err.lineno})."
            raise ReportInputError(message) from err
        check_keys(jsons[name], name, path)
    not_run: dict[str, str] = {}
    for name, (stage, _) in JSONS.items():
        reason = not_run_reason(jsons[name])
        if reason and stage not in not_run:
            not_run[stage] = reason
    tables: dict[str, pd.DataFrame] = {}
    provenance: dict[str, dict[str, Any]] = {}
    for name, spec in TABLES.items():
        path = Path(paths[name])
        if not path.exists():
            raise ReportInputError(f"{path}: not found; run the {spec.stage} stage.")
        frame = read_parquet(path)
        if spec.stage not in not_run:
            check_columns(frame, name, path)
        tables[name] = frame
        provenance.setdefault(spec.stage, read_provenance(path))
    return {"tables": tables, "json": jsons, "not_run": not_run, "provenance": provenance}


# ----------------------------------------------------------------------------------------------
# Derived numbers: the time model and expected savings
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFit:
    """t(T) = a·T² + b·T + c: seconds for one micro-batch of `batch` rows padded to T tokens."""

    a: float
    b: float
    c: float
    batch: int


def workload_time(
    fit: StepFit,
    sum_len: float,
    sum_len_sq: float,
    token_efficiency: float,
    attention_efficiency: float,
    n_micro_batches: float,
) -> float:
    """Seconds to run a dataset under one batching strategy, from the fit and its efficiencies.

    Summed over micro-batches j of `batch` rows padded to T_j:
      Σ a·T_j² = (a/B)·Σ B·T_j² = (a/B)·ΣL² / attention_efficiency
      Σ b·T_j  = (b/B)·Σ B·T_j  = (b/B)·ΣL  / token_efficiency
      Σ c      = c · n_micro_batches
    because the efficiencies are real over padded (squared) token slots.
    """
    return (
        fit.a / fit.batch * sum_len_sq / attention_efficiency
        + fit.b / fit.batch * sum_len / token_efficiency
        + fit.c * n_micro_batches
    )


@dataclass(frozen=True)
class Efficiency:
    token: float
    attention: float
    n_micro_batches: float


def expected_saving(
    baseline: Efficiency,
    candidate: Efficiency,
    fit: StepFit | None,
    sum_len: float,
    sum_len_sq: float,
) -> dict[str, float | None]:
    """Fraction of step time saved moving from `baseline` to `candidate` batching.

    With a fit: one number. Without one: the linear-cost and quadratic-cost limits (a step
    dominated by per-token work saves what token efficiency gains; one dominated by attention
    saves what attention efficiency gains); the true saving lies between them when c is small.
    """
    linear = 1 - baseline.token / candidate.token
    quadratic = 1 - baseline.attention / candidate.attention
    saving = None
    if fit is not None:
        before = workload_time(
            fit, sum_len, sum_len_sq, baseline.token, baseline.attention, baseline.n_micro_batches
        )
        after = workload_time(
            fit,
            sum_len,
            sum_len_sq,
            candidate.token,
            candidate.attention,
            candidate.n_micro_batches,
        )
        saving = 1 - after / before if before > 0 else None
    return {"saving": saving, "linear_limit": linear, "quadratic_limit": quadratic}


def usable_fit(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> StepFit | None:
    """The scaling fit if the profile ran and fitted ≥ 3 points; else None."""
    if "profile" in not_run or tables["profile_fit"].empty:
        return None
    row = tables["profile_fit"].iloc[0]
    if (_finite(row["n_points"]) or 0) < 3:
        return None
    coeffs = [_finite(row[k]) for k in ("a", "b", "c")]
    if any(v is None for v in coeffs):
        return None
    ok = tables["profile_scaling"]
    ok = ok[ok["status"] == "OK"]
    batch = int(ok["batch"].iloc[0]) if not ok.empty else 1
    return StepFit(*coeffs, batch=batch)  # type: ignore[arg-type]


def training_lengths(lengths: pd.DataFrame) -> pd.Series:
    """Token counts of the examples that train (OK and TRUNCATED; EMPTY/ERROR never do)."""
    return lengths.loc[lengths["status"].isin(OK_STATUSES), "n_tokens"].astype("float64")


def sweep_means(sweep: pd.DataFrame) -> pd.DataFrame:
    """Mean and spread over seeds for each strategy × bucket size (bucket_size NaN kept)."""
    if sweep.empty:
        return sweep
    metrics = [
        "token_efficiency",
        "attention_efficiency",
        "n_micro_batches",
        "distinct_sources_rel",
        "entropy_rel",
        "order_length_corr",
    ]
    keys = sweep[["strategy", "bucket_size"]].astype({"bucket_size": "float64"})
    frame = pd.concat([keys, sweep[[*metrics, "seed"]]], axis=1)
    grouped = frame.groupby(["strategy", "bucket_size"], dropna=False, sort=False)
    means = grouped[metrics].mean()
    spread = grouped[["token_efficiency", "attention_efficiency"]].std(ddof=0).fillna(0.0)
    means["token_efficiency_std"] = spread["token_efficiency"]
    means["attention_efficiency_std"] = spread["attention_efficiency"]
    means["n_seeds"] = grouped["seed"].nunique()
    out = means.reset_index()
    # random first (the baseline), then the sweep by size, then packing and anything else
    order = {name: i for i, name in enumerate(STRATEGY_ORDER)}
    out["_order"] = out["strategy"].map(order).fillna(len(order))
    out = out.sort_values(["_order", "strategy", "bucket_size"], na_position="last")
    return out.drop(columns="_order").reset_index(drop=True)


def _efficiency(row: Mapping[str, Any]) -> Efficiency:
    return Efficiency(
        float(row["token_efficiency"]),
        float(row["attention_efficiency"]),
        float(row["n_micro_batches"]),
    )


def _baseline_row(means: pd.DataFrame) -> Mapping[str, Any] | None:
    random = means[means["strategy"] == "random"]
    if random.empty:  # length-grouped with one batch per bucket is random batching
        random = means[(means["strategy"] == "length_grouped") & (means["bucket_size"] == 1)]
    return None if random.empty else random.iloc[0].to_dict()


def recommendations(
    tables: Mapping[str, pd.DataFrame],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    limit: int = 4,
) -> list[dict[str, Any]]:
    """The top changes, each with its expected step-time saving and what the number rests on.

    Sorted by expected saving (the fitted saving, else the midpoint of its limits); a change whose
    saving is not a step time (CE chunking frees memory) comes after those that save time.
    """
    fit = usable_fit(tables, not_run)
    recs: list[dict[str, Any]] = []
    lengths = (
        training_lengths(tables["padding_lengths"])
        if "padding" not in not_run
        else pd.Series(dtype="float64")
    )
    sum_len, sum_len_sq = float(lengths.sum()), float((lengths**2).sum())

    if "bucket" not in not_run and not tables["bucket_sweep"].empty and len(lengths):
        means = sweep_means(tables["bucket_sweep"])
        base = _baseline_row(means)
        rec = jsons["bucket_recommendation"]
        size = _finite(rec.get("bucket_size"))
        if base is not None and size is not None:
            chosen = means[(means["strategy"] == "length_grouped") & (means["bucket_size"] == size)]
            if not chosen.empty:
                row = chosen.iloc[0].to_dict()
                saving = expected_saving(
                    _efficiency(base), _efficiency(row), fit, sum_len, sum_len_sq
                )
                recs.append(
                    {
                        "kind": "time",
                        "title": f"Group batches by length, buckets of {size:g} micro-batches",
                        "detail": (
                            f"token efficiency {fmt_pct(base['token_efficiency'])} → "
                            f"{fmt_pct(row['token_efficiency'])}, source diversity "
                            f"{fmt_pct(row['entropy_rel'], 0)} of random"
                        ),
                        "baseline": "random batches",
                        **saving,
                    }
                )
        packed = means[means["strategy"] == "packing"]
        if base is not None and not packed.empty:
            row = packed.iloc[0].to_dict()
            saving = expected_saving(_efficiency(base), _efficiency(row), fit, sum_len, sum_len_sq)
            recs.append(
                {
                    "kind": "time",
                    "title": "Pack whole examples into max_seq_len rows",
                    "detail": (
                        f"token efficiency {fmt_pct(row['token_efficiency'])}, "
                        f"{fmt_count(row['n_micro_batches'])} micro-batches instead of "
                        f"{fmt_count(base['n_micro_batches'])}; needs a collator and attention "
                        "that keep documents apart (see the mask gate)"
                    ),
                    "baseline": "random batches",
                    **saving,
                }
            )

    if "padding" not in not_run and len(lengths):
        summary = tables["padding_summary"].set_index("strategy")
        if {"pad_to_max", "random"} <= set(summary.index):
            n_batches = math.ceil(len(lengths) / (fit.batch if fit else 1))

            def eff(name: str) -> Efficiency:
                return Efficiency(
                    1 - float(summary.loc[name, "token_waste"]),
                    1 - float(summary.loc[name, "attention_waste"]),
                    n_batches,
                )

            saving = expected_saving(eff("pad_to_max"), eff("random"), fit, sum_len, sum_len_sq)
            recs.append(
                {
                    "kind": "time",
                    "title": "Pad each batch to its longest member, not to max_seq_len",
                    "detail": (
                        f"token waste {fmt_pct(summary.loc['pad_to_max', 'token_waste'])} → "
                        f"{fmt_pct(summary.loc['random', 'token_waste'])}; applies only if "
                        "you pad to max_seq_len today"
                    ),
                    "baseline": "pad to max_seq_len",
                    **saving,
                }
            )

    if "padding" not in not_run and not tables["padding_ce_chunks"].empty:
        chunks = tables["padding_ce_chunks"]
        train = chunks[chunks["shape"] == "training"]
        row = (train if not train.empty else chunks).iloc[0]
        recs.append(
            {
                "kind": "memory",
                "title": (
                    f"Chunk the cross-entropy at ≤ {fmt_tokens(row['max_chunk_tokens'])} per chunk"
                ),
                "detail": (
                    f"the stock loss path holds ~{fmt_bytes(row['stock_loss_bytes'])} of logits "
                    f"at the {label(row['shape'])} shape; Liger's heuristic picks "
                    f"{fmt_tokens(row['liger_chunk_tokens'])}"
                ),
                "baseline": "unchunked loss",
                "saving": None,
                "linear_limit": None,
                "quadratic_limit": None,
                "memory_saving_bytes": _finite(row["stock_loss_bytes"]),
            }
        )

    def rank(rec: dict[str, Any]) -> tuple[int, float]:
        if rec["saving"] is not None:
            return (0, -rec["saving"])
        if rec["linear_limit"] is not None:
            return (0, -(rec["linear_limit"] + rec["quadratic_limit"]) / 2)
        return (1, 0.0)

    return sorted(recs, key=rank)[:limit]


# ----------------------------------------------------------------------------------------------
# Sections: each returns a dict for the template; {"status": "not_run", "reason": ...} when the
# stage behind it did not run.
# ----------------------------------------------------------------------------------------------


def _records(frame: pd.DataFrame, columns: Sequence[str]) -> list[dict[str, Any]]:
    present = [c for c in columns if c in frame.columns]
    rows = frame[present].to_dict(orient="records")
    for row in rows:  # optional columns a stage did not write render as "—"
        for column in columns:
            row.setdefault(column, None)
    return rows


def _not_run(reason: str) -> dict[str, Any]:
    return {"status": NOT_RUN, "reason": reason}


def _columns(name: str) -> tuple[str, ...]:
    return TABLES[name].required + TABLES[name].optional


def scaling_section(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons):
    if "profile" in not_run:
        return _not_run(not_run["profile"])
    provenance = jsons["profile_provenance"]
    scaling = tables["profile_scaling"].sort_values("seq_len")
    fit = tables["profile_fit"]
    fit_row = _records(fit, _columns("profile_fit"))[0] if not fit.empty else None
    n_ok = int((scaling["status"] == "OK").sum())
    return {
        "status": "ok",
        "cpu_only": bool(provenance.get("cpu_only")),
        "device": str(provenance.get("device", "unknown")),
        "points": _records(scaling, _columns("profile_scaling")),
        "n_ok": n_ok,
        "n_oom": int((scaling["status"] == "OOM").sum()),
        "fit": fit_row,
        "fit_usable": usable_fit(tables, not_run) is not None,
        "max_fitted_len": _finite(scaling.loc[scaling["status"] == "OK", "seq_len"].max()),
        "penalty": _records(tables["profile_padding_penalty"], _columns("profile_padding_penalty")),
    }


def padding_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], top_sources: int
) -> dict[str, Any]:
    if "padding" in not_run:
        return _not_run(not_run["padding"])
    lengths = tables["padding_lengths"]
    counts = lengths.groupby("status").size().reindex(list(ALL_STATUSES), fill_value=0)
    unknown = sorted(set(lengths["status"]) - set(ALL_STATUSES))
    if unknown:
        raise ReportInputError(
            f"padding lengths: unknown status value(s) {unknown}; expected {list(ALL_STATUSES)}."
        )
    by_source = (
        lengths.groupby(["source", "status"]).size().unstack(fill_value=0)
        if not lengths.empty
        else pd.DataFrame(columns=list(ALL_STATUSES))
    )
    by_source = by_source.reindex(columns=list(ALL_STATUSES), fill_value=0)
    by_source["total"] = by_source.sum(axis=1)
    by_source = by_source.sort_values("total", ascending=False)
    problems = lengths[lengths["status"].isin(["EMPTY", "ERROR"])]
    reasons = (
        problems.assign(code=problems["reason"].map(reason_code))
        .groupby(["status", "code"])
        .size()
        .reset_index(name="n")
        .sort_values("n", ascending=False)
        .head(10)
        .to_dict(orient="records")
    )
    dist = tables["padding_distribution"].sort_values("n_examples", ascending=False)
    trains = lengths["status"].isin(OK_STATUSES)
    truncated = (
        float(lengths["n_truncated_tokens"].sum()) if "n_truncated_tokens" in lengths else None
    )
    return {
        "status": "ok",
        "counts": {k: int(v) for k, v in counts.items()},
        "n_examples": len(lengths),
        "n_sources": int(lengths["source"].nunique()),
        "status_by_source": [
            {"source": src, **{k: int(v) for k, v in row.items()}}
            for src, row in by_source.head(top_sources).iterrows()
        ],
        "more_sources": max(0, len(by_source) - top_sources),
        "reasons": reasons,
        "distribution": _records(dist.head(top_sources + 1), _columns("padding_distribution")),
        "more_distribution_rows": max(0, len(dist) - top_sources - 1),
        "waste": _records(tables["padding_summary"], _columns("padding_summary")),
        "train_tokens": float(lengths.loc[trains, "n_tokens"].sum()),
        "loss_tokens": float(lengths.loc[trains, "n_loss_tokens"].sum()),
        "truncated_tokens": truncated,
    }


def ce_section(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> dict[str, Any]:
    chunks = (
        _not_run(not_run["padding"])
        if "padding" in not_run
        else {
            "status": "ok",
            "rows": _records(tables["padding_ce_chunks"], _columns("padding_ce_chunks")),
        }
    )
    wall = (
        _not_run(not_run["profile"])
        if "profile" in not_run
        else {"status": "ok", "rows": _records(tables["profile_ce"], _columns("profile_ce"))}
    )
    return {"status": "ok", "chunks": chunks, "wall": wall}


def kernels_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return _not_run(not_run["profile"])
    cpu_only = bool(jsons["profile_provenance"].get("cpu_only"))
    kernels = device_rows(tables["profile_kernels"], cpu_only).sort_values("share", ascending=False)
    return {
        "status": "ok",
        "cpu_only": cpu_only,
        "rows": _records(kernels, _columns("profile_kernels")),
        "total_s": float(kernels["device_time_s"].sum()),
        "share_sum": float(kernels["share"].sum()),
    }


def device_rows(kernels: pd.DataFrame, cpu_only: bool) -> pd.DataFrame:
    """Device kernel rows only: the ATen op and the kernel it launched carry the same time."""
    if "device_type" not in kernels.columns:
        return kernels
    wanted = "CPU" if cpu_only else "CUDA"
    return kernels[kernels["device_type"].astype(str).str.upper() == wanted]


def bucket_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "bucket" in not_run:
        return _not_run(not_run["bucket"])
    means = sweep_means(tables["bucket_sweep"])
    rec = jsons["bucket_recommendation"]
    known = ("bucket_size", "reason", "min_gain_share", "min_diversity_share", "strategy")
    return {
        "status": "ok",
        "rows": means.to_dict(orient="records"),
        "n_seeds": int(tables["bucket_sweep"]["seed"].nunique()),
        "recommendation": {k: rec.get(k) for k in known},
        "packing": means[means["strategy"] == "packing"].to_dict(orient="records"),
    }


def fast_path(frame: pd.DataFrame) -> pd.Series:
    """A layer keeps SDPA's is_causal fast path: no explicit mask, is_causal set."""
    return (~frame["mask_present"].astype(bool)) & frame["is_causal"].astype(bool)


def mask_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "mask" in not_run:
        return _not_run(not_run["mask"])
    layers = tables["mask_layers"].copy()
    layers["fast_path"] = fast_path(layers)
    scenarios = []
    for name, group in layers.groupby("scenario", sort=False):
        first = group.iloc[0]
        bands = (
            group.groupby("layer_type", sort=True)
            .agg(
                n=("layer_idx", "size"),
                fast=("fast_path", "sum"),
                lower=("band_lower", _band),
                upper=("band_upper", _band),
            )
            .reset_index()
            .to_dict(orient="records")
        )
        backends = group.groupby("backend").size().sort_values(ascending=False)
        excluded = (
            group["excluded_by"].dropna().astype(str).map(reason_code).replace("", pd.NA).dropna()
        )
        scenarios.append(
            {
                "scenario": name,
                "batch": first["batch"],
                "seq_len": first["seq_len"],
                "padding": first["padding"],
                "packed": bool(first["packed"]),
                "n_layers": len(group),
                "n_fast": int(group["fast_path"].sum()),
                "bands": bands,
                "backends": ", ".join(f"{cell(k)} ×{v}" for k, v in backends.items()),
                "excluded_by": ", ".join(
                    f"{k} ×{v}" for k, v in excluded.value_counts().head(4).items()
                ),
            }
        )
    gate = jsons["mask_gate"]
    counts = gate.get("counts") or {}
    return {
        "status": "ok",
        "passed": bool(gate.get("passed")),
        "counts": {str(k): v for k, v in counts.items() if isinstance(v, int | float | str | bool)},
        "scenarios": scenarios,
    }


def _band(values: pd.Series) -> str:
    """The band of a group of layers: one value, a range, or "none" (no mask: is_causal)."""
    finite = pd.to_numeric(values, errors="coerce").dropna()
    if finite.empty:
        return "none"
    low, high = int(finite.min()), int(finite.max())
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


def controls_section(jsons: Mapping[str, Any], not_run: Mapping[str, str]) -> list[dict]:
    """Every probe's positive control and its result, one row each (a stage may list several)."""
    rows = []
    for stage in STAGES:
        obj = jsons[f"{stage}_control"]
        entries = obj if isinstance(obj, list) else [obj]
        for entry in entries:
            # a stage that did not run may still write a control with passed: null
            reason = not_run_reason(entry)
            if reason is None and stage in not_run and entry.get("passed") is None:
                reason = not_run[stage]
            if reason:
                rows.append(
                    {"stage": stage, "name": entry.get("name", MISSING), "result": "not run"}
                    | {"description": reason, "expected": None, "observed": None}
                )
                continue
            missing = [k for k in CONTROL_KEYS if k not in entry]
            if missing:
                raise ReportInputError(
                    f"results/{stage}/control.json: key(s) {missing} missing; every control "
                    f"needs {list(CONTROL_KEYS)}."
                )
            rows.append(
                {
                    "stage": stage,
                    "name": entry["name"],
                    "description": entry["description"],
                    "expected": entry["expected"],
                    "observed": entry["observed"],
                    "result": "passed" if entry["passed"] is True else "FAILED",
                }
            )
    return rows


def provenance_section(
    provenance: Mapping[str, Mapping[str, Any]],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    report_meta: Mapping[str, Any],
) -> dict[str, Any]:
    """Config hash, commit, date and command line per stage, with a warning when they differ."""
    stages = []
    for stage in STAGES:
        meta = provenance.get(stage) or {}
        stages.append(
            {
                "stage": stage,
                "status": "not run" if stage in not_run else "ran",
                "config_hash": meta.get("config_hash", MISSING),
                "git_commit": meta.get("git_commit", MISSING),
                "date": meta.get("date", MISSING),
                "command_line": meta.get("command_line", MISSING),
            }
        )
    hashes = {s["config_hash"] for s in stages if s["config_hash"] != MISSING}
    versions = dict(report_meta.get("versions") or {})
    differing = sorted(
        {
            name
            for meta in provenance.values()
            for name, version in (meta.get("versions") or {}).items()
            if name in versions and version != versions[name]
        }
    )
    profile = jsons["profile_provenance"]
    slurm = profile.get("slurm") if isinstance(profile, Mapping) else None
    return {
        "report": dict(report_meta),
        "versions": versions,
        "stages": stages,
        "config_hashes_agree": len(hashes) <= 1,
        "versions_differ": differing,
        "device": profile.get("device", MISSING) if isinstance(profile, Mapping) else MISSING,
        "cpu_only": bool(profile.get("cpu_only")) if isinstance(profile, Mapping) else None,
        "harness": profile.get("harness", MISSING) if isinstance(profile, Mapping) else MISSING,
        "slurm": {str(k): v for k, v in slurm.items()} if isinstance(slurm, Mapping) else None,
    }


def summary_section(
    inputs: Mapping[str, Any], scaling: Mapping[str, Any], mask: Mapping[str, Any], limit: int
) -> dict[str, Any]:
    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    recs = recommendations(tables, jsons, not_run, limit=limit)
    if "profile" in not_run:
        fit_note = (
            f"The profile did not run ({not_run['profile']}): savings are given as the range "
            "between a step whose cost is linear and one whose cost is quadratic in length."
        )
    elif not scaling.get("fit_usable"):
        fit_note = (
            "The scaling fit has fewer than 3 usable points: savings are given as the range "
            "between a linear-cost and a quadratic-cost step."
        )
    elif scaling.get("cpu_only"):
        fit_note = (
            "The scaling fit came from the CPU, at lengths up to "
            f"{fmt_tokens(scaling.get('max_fitted_len'))}: its a/b/c do not transfer to a GPU, "
            "so the savings below are indicative only. Rerun the profile on the training GPU."
        )
    else:
        fit_note = (
            f"Savings combine the scaling fit measured on {scaling.get('device')} with the "
            "padding/bucket efficiencies."
        )
    lengths = inputs["tables"]["padding_lengths"]
    extrapolated = None
    if scaling.get("status") == "ok" and "padding" not in not_run and len(lengths):
        p99 = float(training_lengths(lengths).quantile(0.99)) if len(lengths) else None
        top = scaling.get("max_fitted_len")
        if p99 and top and p99 > top:
            extrapolated = {"p99": p99, "max_fitted_len": top}
    failed = [c for c in controls_section(jsons, not_run) if c["result"] == "FAILED"]
    return {
        "recommendations": recs,
        "fit_note": fit_note,
        "extrapolated": extrapolated,
        "not_run": dict(not_run),
        "mask_passed": mask.get("passed") if mask.get("status") == "ok" else None,
        "failed_controls": failed,
    }


def build_context(
    inputs: Mapping[str, Any],
    figures: Mapping[str, str | None],
    report_meta: Mapping[str, Any],
    top_sources: int = 8,
    max_recommendations: int = 4,
) -> dict[str, Any]:
    """Everything the template renders, as plain dicts and lists."""
    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    scaling = scaling_section(tables, not_run, jsons)
    mask = mask_section(tables, not_run, jsons)
    return {
        "summary": summary_section(inputs, scaling, mask, max_recommendations),
        "scaling": scaling,
        "padding": padding_section(tables, not_run, top_sources),
        "ce": ce_section(tables, not_run),
        "kernels": kernels_section(tables, not_run, jsons),
        "bucket": bucket_section(tables, not_run, jsons),
        "mask": mask,
        "controls": controls_section(jsons, not_run),
        "provenance": provenance_section(inputs["provenance"], jsons, not_run, report_meta),
        "figures": dict(figures),
    }


SECTION_TITLES = (
    "Summary",
    "Scaling",
    "Padding",
    "Cross-entropy",
    "Kernels",
    "Bucketing",
    "Mask gate",
    "Controls",
    "Provenance",
)


def render_markdown(context: Mapping[str, Any], template_path: str | Path) -> str:
    """Render the template; an undefined name fails instead of rendering as empty."""
    import jinja2

    path = Path(template_path)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(path.parent),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # markdown, not HTML; cells are escaped by the `cell`/`label` filters
    )
    env.filters.update(FILTERS)
    return env.get_template(path.name).render(**context)


def linked_figures(markdown: str) -> list[str]:
    """Relative paths of every image the markdown links to."""
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown)
