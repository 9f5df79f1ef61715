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

from probes.contracts import (
    JSONS,
    STAGES,
    STATUSES,
    STRATEGY_ORDER,
    TABLES,
    TRAINING_STATUSES,
    report_inputs,
)
from probes.errors import ProbeError
from probes.io import read_json, read_parquet, read_provenance

NOT_RUN = "not_run"
MISSING = "—"  # what a missing or non-finite number renders as
MIN_IDLE_SHARE = 0.01  # examples without a loss token worth a recommendation from this share
TRAINING_SHAPE = "max_seq_len"  # the ce_chunks row sized at the training shape
OTHER_SOURCES = "(other)"  # the padding stage pools sources beyond its limit under this label
DISTRIBUTION_STATS = ("count", "tokens", "p50", "p90", "p99", "max")


class ReportInputError(ProbeError, ValueError):
    """A stage output the report cannot use; the message names the file, key and what to do."""


def default_input_paths(results_dir: str | Path) -> dict[str, Path]:
    """The rule's inputs for a results directory laid out as the workflow writes it."""
    return {key: Path(path) for key, path in report_inputs(results_dir).items()}


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
    return MISSING if x is None else f"{x * 100 + 0.0:.{digits}f}%".replace("-0.0%", "0.0%")


def fmt_count(value: Any) -> str:
    """An integer count with thousands separators: 7,168."""
    x = _finite(value)
    return MISSING if x is None else f"{round(x):,}"


def fmt_tokens(value: Any) -> str:
    """A token count with its unit: 4,096 tokens (1 token)."""
    x = _finite(value)
    if x is None:
        return MISSING
    return f"{round(x):,} token" + ("" if round(x) == 1 else "s")


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
            f"stage, or update probes.contracts.TABLES['{name}'] if the column was renamed."
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
    """Read every stage output named in `paths` (keys as in probes.contracts.report_inputs).

    Returns {"tables": {name: DataFrame}, "json": {name: obj}, "not_run": {stage: reason},
    "provenance": {stage: run_metadata of its first table}}. A stage whose JSON says
    status "not_run" gets empty tables and no column checks.
    """
    missing = set(report_inputs()) - set(paths)
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
    because the efficiencies are real over padded (squared) token slots. The profile's
    predicted padding penalty uses the same per-row reading of a and b.
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
    """Fraction of training time saved moving from `baseline` to `candidate` batching.

    With a fit: one number. Without one: the linear-cost and quadratic-cost limits (a step
    dominated by per-token work saves what token efficiency gains; one dominated by attention
    saves what attention efficiency gains); the true saving lies between them when c is small.
    """
    linear = 1 - baseline.token / candidate.token
    quadratic = 1 - baseline.attention / candidate.attention
    saving = None
    if fit is not None:
        before, after = (
            workload_time(fit, sum_len, sum_len_sq, e.token, e.attention, e.n_micro_batches)
            for e in (baseline, candidate)
        )
        saving = 1 - after / before if before > 0 else None
    return {"saving": saving, "linear_limit": linear, "quadratic_limit": quadratic}


def fit_problem(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> str | None:
    """Why the scaling fit cannot price the savings, or None when it can."""
    if "profile" in not_run:
        return f"the profile did not run ({not_run['profile']})"
    scaling, fit = tables["profile_scaling"], tables["profile_fit"]
    if fit.empty or (scaling["status"] == "OK").sum() == 0:
        return "the profile has no measured scaling point"
    row = fit.iloc[0]
    coeffs = {k: _finite(row[k]) for k in ("a", "b", "c")}
    if (_finite(row["n_points"]) or 0) < 3 or None in coeffs.values():
        return "the scaling fit has fewer than 3 usable points (three terms need three)"
    negative = [f"{k} = {fmt_number(v)}" for k, v in coeffs.items() if v is not None and v < 0]
    if negative:
        # a cost that shrinks with length: noise (a busy CPU, too few repeats), not a model
        return (
            f"the scaling fit has a negative coefficient ({', '.join(negative)}): it is not a "
            "cost that grows with length at the measured lengths"
        )
    return None


def usable_fit(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> StepFit | None:
    """The scaling fit when it can price savings (see fit_problem); else None."""
    if fit_problem(tables, not_run) is not None:
        return None
    row = tables["profile_fit"].iloc[0]
    scaling = tables["profile_scaling"]
    batch = int(scaling.loc[scaling["status"] == "OK", "batch"].iloc[0])
    return StepFit(float(row["a"]), float(row["b"]), float(row["c"]), batch=batch)


def training_lengths(lengths: pd.DataFrame) -> pd.Series:
    """Token counts of the examples that train (OK and TRUNCATED; EMPTY/ERROR never do)."""
    return lengths.loc[lengths["status"].isin(TRAINING_STATUSES), "n_tokens"].astype("float64")


def strategy_rank(strategy: str) -> int:
    """Random first (the baseline), the sweep, global sort, then packing and anything else."""
    for rank, prefix in enumerate(STRATEGY_ORDER):
        if str(strategy).startswith(prefix):
            return rank
    return len(STRATEGY_ORDER)


def sweep_means(sweep: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds for each strategy × bucket size (packing: bucket size NA), with spread."""
    if sweep.empty:
        return sweep
    keys = ["strategy", "bucket_size_batches"]
    metrics = [c for c in _columns("bucket_sweep") if c in sweep.columns and c not in keys]
    metrics = [c for c in metrics if c != "seed" and pd.api.types.is_numeric_dtype(sweep[c])]
    frame = sweep.assign(bucket_size_batches=sweep["bucket_size_batches"].astype("float64"))
    grouped = frame.groupby(keys, dropna=False, sort=False)
    means = grouped[metrics].mean()
    spread = grouped[["token_efficiency", "attention_efficiency"]].std(ddof=0).fillna(0.0)
    means["token_efficiency_std"] = spread["token_efficiency"]
    means["attention_efficiency_std"] = spread["attention_efficiency"]
    means["n_seeds"] = grouped["seed"].nunique()
    out = means.reset_index()
    out["_rank"] = out["strategy"].map(strategy_rank)
    out = out.sort_values(["_rank", "bucket_size_batches", "strategy"], na_position="last")
    return out.drop(columns="_rank").reset_index(drop=True)


def diversity_prefix(recommendation: Mapping[str, Any]) -> str:
    """The diversity level the bucket stage recommended at: micro-batch or optimizer step."""
    level = (recommendation.get("thresholds") or {}).get("diversity_level", "step")
    return "micro" if level == "micro_batch" else "step"


def diversity(means: pd.DataFrame, prefix: str) -> pd.Series:
    """The lower of distinct sources and source entropy, relative to random (as the bucket stage
    judges diversity for its recommendation)."""
    return means[
        [f"{prefix}_distinct_sources_rel_random", f"{prefix}_source_entropy_rel_random"]
    ].min(axis=1)


def _efficiency(row: Mapping[str, Any]) -> Efficiency:
    return Efficiency(
        float(row["token_efficiency"]),
        float(row["attention_efficiency"]),
        float(row["n_micro_batches"]),
    )


def waste_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Waste rows of summary.parquet pivoted to one row per strategy: value and std per metric."""
    waste = summary[summary["section"] == "waste"]
    wide = waste.pivot_table(
        index="strategy", columns="metric", values=["value", "std"], aggfunc="first", sort=False
    )
    wide.columns = [f"{metric}_{stat}" for stat, metric in wide.columns]
    return wide.reset_index()


def subset_saving(
    fit: StepFit | None, before: pd.Series, after: pd.Series, efficiency: Efficiency
) -> dict[str, float | None]:
    """Fraction of training time saved by training on `after` instead of `before` (lengths),
    batched the same way (same efficiencies, micro-batches in proportion to examples)."""
    s1, s2 = float(before.sum()), float((before**2).sum())
    k1, k2 = float(after.sum()), float((after**2).sum())
    saving = None
    if fit is not None:
        per_example = efficiency.n_micro_batches / max(len(before), 1)
        full = workload_time(
            fit, s1, s2, efficiency.token, efficiency.attention, len(before) * per_example
        )
        part = workload_time(
            fit, k1, k2, efficiency.token, efficiency.attention, len(after) * per_example
        )
        saving = 1 - part / full if full > 0 else None
    return {
        "saving": saving,
        "linear_limit": 1 - k1 / s1 if s1 else None,
        "quadratic_limit": 1 - k2 / s2 if s2 else None,
    }


def _no_saving() -> dict[str, None]:
    return {"saving": None, "linear_limit": None, "quadratic_limit": None}


def recommendations(
    tables: Mapping[str, pd.DataFrame],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    limit: int = 4,
) -> list[dict[str, Any]]:
    """The top changes, each with its expected saving of training time and what it rests on.

    The `limit` best by expected saving (the fitted saving, else the midpoint of its limits),
    then changes that save memory rather than time (CE chunking).
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
        rec = jsons["bucket_recommendation"]
        prefix = diversity_prefix(rec)
        means["diversity"] = diversity(means, prefix)
        random = means[means["strategy"] == "random"]
        size = _finite((rec.get("recommended") or {}).get("bucket_size_batches"))
        chosen = means[means["bucket_size_batches"] == size]
        if not random.empty and size is not None and size > 1 and not chosen.empty:
            base, row = random.iloc[0], chosen.iloc[0]
            recs.append(
                {
                    "kind": "time",
                    "title": f"Group batches by length: buckets of {size:g} micro-batches",
                    "detail": (
                        f"token efficiency {fmt_pct(base['token_efficiency'])} → "
                        f"{fmt_pct(row['token_efficiency'])}; source diversity per "
                        f"{'micro-batch' if prefix == 'micro' else 'optimizer step'} "
                        f"{fmt_pct(row['diversity'], 0)} of random"
                    ),
                    "baseline": "random batches",
                    **expected_saving(
                        _efficiency(base), _efficiency(row), fit, sum_len, sum_len_sq
                    ),
                }
            )
        packed = means[means["strategy"].str.startswith("packing")]
        if not random.empty and not packed.empty:
            base = random.iloc[0]
            row = packed.sort_values("token_efficiency", ascending=False).iloc[0]
            recs.append(
                {
                    "kind": "time",
                    "title": f"Pack whole examples into max_seq_len rows ({row['strategy']})",
                    "detail": (
                        f"token efficiency {fmt_pct(row['token_efficiency'])}, "
                        f"{fmt_count(row['n_micro_batches'])} micro-batches instead of "
                        f"{fmt_count(base['n_micro_batches'])}; attention counted dense (a varlen "
                        "kernel would do better); needs attention that keeps documents apart "
                        "(see the mask gate)"
                    ),
                    "baseline": "random batches",
                    **expected_saving(
                        _efficiency(base), _efficiency(row), fit, sum_len, sum_len_sq
                    ),
                }
            )

    if "padding" not in not_run and len(lengths):
        waste = waste_table(tables["padding_summary"]).set_index("strategy")
        needed = {"token_waste_value", "attention_waste_value"}
        if {"pad_to_max_seq_len", "random"} <= set(waste.index) and needed <= set(waste.columns):
            n_batches = math.ceil(len(lengths) / (fit.batch if fit else 1))

            def eff(name: str) -> Efficiency:
                return Efficiency(
                    1 - float(waste.loc[name, "token_waste_value"]),
                    1 - float(waste.loc[name, "attention_waste_value"]),
                    n_batches,
                )

            recs.append(
                {
                    "kind": "time",
                    "title": "Pad each batch to its longest member, not to max_seq_len",
                    "detail": (
                        "token waste "
                        f"{fmt_pct(waste.loc['pad_to_max_seq_len', 'token_waste_value'])} → "
                        f"{fmt_pct(waste.loc['random', 'token_waste_value'])}; applies only if "
                        "you pad to max_seq_len today"
                    ),
                    "baseline": "pad to max_seq_len",
                    **expected_saving(
                        eff("pad_to_max_seq_len"), eff("random"), fit, sum_len, sum_len_sq
                    ),
                }
            )

    if "padding" not in not_run and len(lengths):
        trains = tables["padding_lengths"]
        trains = trains[trains["status"].isin(TRAINING_STATUSES)]
        idle = (trains["n_loss_tokens"] == 0).to_numpy()
        waste = waste_table(tables["padding_summary"]).set_index("strategy")
        if idle.mean() >= MIN_IDLE_SHARE and "random" in waste.index:
            random = Efficiency(
                1 - float(waste.loc["random", "token_waste_value"]),
                1 - float(waste.loc["random", "attention_waste_value"]),
                math.ceil(len(trains) / (fit.batch if fit else 1)),
            )
            tokens = trains["n_tokens"].astype("float64")
            recs.append(
                {
                    "kind": "time",
                    "title": (
                        f"Drop the {fmt_count(idle.sum())} examples that carry no loss token"
                    ),
                    "detail": (
                        f"{fmt_pct(idle.mean())} of the examples that train, "
                        f"{fmt_pct(tokens[idle].sum() / tokens.sum())} of their tokens: they cost "
                        "compute and teach nothing (check training.loss_on and truncation)"
                    ),
                    "baseline": "every OK/TRUNCATED example",
                    **subset_saving(fit, tokens, tokens[~idle], random),
                }
            )

    if "padding" not in not_run and not tables["padding_ce_chunks"].empty:
        chunks = tables["padding_ce_chunks"]
        train = chunks[chunks["shape"] == TRAINING_SHAPE]
        row = (train if not train.empty else chunks).iloc[0]
        fits = bool(row.get("stock_fits_budget", False))
        if not fits:
            recs.append(
                {
                    "kind": "memory",
                    "title": f"Chunk the cross-entropy: {fmt_tokens(row['chunk_tokens'])} a chunk",
                    "detail": (
                        f"at {fmt_count(row['tokens'])} tokens × {fmt_count(row['vocab_size'])} "
                        f"vocabulary the stock loss path holds {fmt_bytes(row['stock_loss_bytes'])}"
                        f"; {fmt_count(row['n_chunks'])} chunks stay within the budget; Liger's "
                        "heuristic "
                        f"picks {fmt_tokens(row['liger_chunk_tokens'])}"
                    ),
                    "baseline": "unchunked loss",
                    "memory_before": _finite(row["stock_loss_bytes"]),
                    "memory_after": _finite(row.get("chunk_bytes")),
                    **_no_saving(),
                }
            )

    def rank(rec: dict[str, Any]) -> float:
        if rec["saving"] is not None:
            return -rec["saving"]
        return -(rec["linear_limit"] + rec["quadratic_limit"]) / 2

    # the `limit` best time savings, then what saves memory rather than time
    timed = sorted((r for r in recs if r["kind"] == "time"), key=rank)[:limit]
    return timed + [r for r in recs if r["kind"] != "time"]


# ----------------------------------------------------------------------------------------------
# Sections: each returns a dict for the template; {"status": "not_run", "reason": ...} when the
# stage behind it did not run.
# ----------------------------------------------------------------------------------------------


def _columns(name: str) -> tuple[str, ...]:
    return TABLES[name].required + TABLES[name].optional


def _records(frame: pd.DataFrame, columns: Sequence[str]) -> list[dict[str, Any]]:
    """Only the named columns (never anything else a stage wrote); absent optional ones → None."""
    present = [c for c in columns if c in frame.columns]
    rows = frame[present].to_dict(orient="records")
    for row in rows:
        for column in columns:
            value = row.setdefault(column, None)
            # NaN/NA means "not measured": None, so the template's `is not none` tests hold
            if value is pd.NA or (isinstance(value, float) and not math.isfinite(value)):
                row[column] = None
    return rows


def _not_run(reason: str) -> dict[str, Any]:
    return {"status": NOT_RUN, "reason": reason}


def _device_name(device: Any) -> str:
    if isinstance(device, Mapping):
        return str(device.get("name") or device.get("type") or "unknown")
    return str(device) if device else "unknown"


def scaling_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return _not_run(not_run["profile"])
    provenance = jsons["profile_provenance"]
    scaling = tables["profile_scaling"].sort_values("seq_len")
    fit = tables["profile_fit"]
    ok = scaling["status"] == "OK"
    return {
        "status": "ok",
        "cpu_only": bool(provenance.get("cpu_only")),
        "device": _device_name(provenance.get("device")),
        "points": _records(scaling, _columns("profile_scaling")),
        "n_ok": int(ok.sum()),
        "n_failed": int((~ok).sum()),
        "fit": _records(fit, _columns("profile_fit"))[0] if not fit.empty else None,
        "fit_usable": usable_fit(tables, not_run) is not None,
        "fit_problem": fit_problem(tables, not_run),
        "max_fitted_len": _finite(scaling.loc[ok, "seq_len"].max()),
        "penalty": _records(tables["profile_padding_penalty"], _columns("profile_padding_penalty")),
    }


def distribution_rows(distribution: pd.DataFrame, top_sources: int) -> tuple[list[dict], int]:
    """Per-source statistics of tokens per example: overall first, then the largest sources."""
    stats = distribution[(distribution["kind"] == "stat") & (distribution["measure"] == "n_tokens")]
    wide = stats.pivot_table(
        index=["scope", "source"], columns="statistic", values="value", aggfunc="first", sort=False
    ).reset_index()
    for column in DISTRIBUTION_STATS:
        if column not in wide.columns:
            wide[column] = None
    wide["_overall"] = wide["scope"] != "overall"
    wide["_other"] = wide["source"] == OTHER_SOURCES
    wide = wide.sort_values(["_overall", "_other", "count"], ascending=[True, True, False])
    shown = wide.head(top_sources + 1)
    return shown[["scope", "source", *DISTRIBUTION_STATS]].to_dict(orient="records"), max(
        0, len(wide) - len(shown)
    )


def padding_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], top_sources: int
) -> dict[str, Any]:
    if "padding" in not_run:
        return _not_run(not_run["padding"])
    lengths, summary = tables["padding_lengths"], tables["padding_summary"]
    unknown = sorted(set(lengths["status"]) - set(STATUSES))
    if unknown:
        raise ReportInputError(
            f"padding lengths: unknown status value(s) {unknown}; expected {list(STATUSES)}."
        )
    status_rows = summary[summary["section"] == "status"]
    counts = status_rows[status_rows["metric"] == "count"].set_index("status")["value"]
    lost = status_rows[status_rows["metric"].isin(["tokens_lost", "loss_tokens_lost"])]
    by_source = lengths.groupby(["source", "status"]).size().unstack(fill_value=0)
    by_source = by_source.reindex(columns=list(STATUSES), fill_value=0)
    by_source["total"] = by_source.sum(axis=1)
    by_source = by_source.sort_values("total", ascending=False)
    reasons = summary[summary["section"] == "reason"].assign(
        code=lambda f: f["reason"].map(reason_code)
    )
    reasons = (
        reasons.groupby(["status", "code"], sort=False)["value"]
        .sum()
        .reset_index()
        .sort_values("value", ascending=False)
        .head(10)
    )
    distribution, more = distribution_rows(tables["padding_distribution"], top_sources)
    trains = lengths["status"].isin(TRAINING_STATUSES)
    return {
        "status": "ok",
        "counts": {s: int(counts.get(s, 0)) for s in STATUSES},
        "lost": {r["metric"]: r["value"] for r in lost.to_dict(orient="records")},
        "n_examples": len(lengths),
        "n_sources": int(lengths["source"].nunique()),
        "status_by_source": [
            {"source": src, **{k: int(v) for k, v in row.items()}}
            for src, row in by_source.head(top_sources).iterrows()
        ],
        "more_sources": max(0, len(by_source) - top_sources),
        "reasons": reasons.to_dict(orient="records"),
        "distribution": distribution,
        "more_distribution_rows": more,
        "waste": waste_table(summary).to_dict(orient="records"),
        "train_tokens": float(lengths.loc[trains, "n_tokens"].sum()),
        "loss_tokens": float(lengths.loc[trains, "n_loss_tokens"].sum()),
    }


def ce_section(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> dict[str, Any]:
    if "padding" in not_run:
        chunks = _not_run(not_run["padding"])
    else:
        frame = tables["padding_ce_chunks"]
        chunks = {
            "status": "ok",
            "rows": _records(frame, _columns("padding_ce_chunks")),
            "budget_gib": _finite(frame["budget_gib"].iloc[0]) if "budget_gib" in frame else None,
        }
    wall = (
        _not_run(not_run["profile"])
        if "profile" in not_run
        else {"status": "ok", "rows": _records(tables["profile_ce"], _columns("profile_ce"))}
    )
    return {"status": "ok", "chunks": chunks, "wall": wall}


def device_rows(kernels: pd.DataFrame, cpu_only: bool) -> pd.DataFrame:
    """Device kernel rows only: the ATen op and the kernel it launched carry the same time."""
    wanted = "CPU" if cpu_only else "CUDA"
    return kernels[kernels["device_type"].astype(str).str.upper() == wanted]


def kernels_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return _not_run(not_run["profile"])
    cpu_only = bool(jsons["profile_provenance"].get("cpu_only"))
    kernels = device_rows(tables["profile_kernels"], cpu_only)
    kernels = kernels.sort_values("device_time_s", ascending=False)
    return {
        "status": "ok",
        "cpu_only": cpu_only,
        "rows": _records(kernels, _columns("profile_kernels")),
        "total_s": float(kernels["device_time_s"].sum()),
        "share_sum": float(kernels["share"].sum()),
        "dropped_rows": len(tables["profile_kernels"]) - len(kernels),
    }


def bucket_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "bucket" not in not_run and tables["bucket_sweep"].empty:
        raise ReportInputError("bucket sweep.parquet has no rows; rerun the bucket_sweep rule.")
    if "bucket" in not_run:
        return _not_run(not_run["bucket"])
    rec = jsons["bucket_recommendation"]
    prefix = diversity_prefix(rec)
    means = sweep_means(tables["bucket_sweep"])
    means["diversity"] = diversity(means, prefix)
    recommended = rec.get("recommended") or {}
    thresholds = rec.get("thresholds") or {}
    return {
        "status": "ok",
        "rows": means.to_dict(orient="records"),
        "n_seeds": int(tables["bucket_sweep"]["seed"].nunique()),
        "level": "micro-batch" if prefix == "micro" else "optimizer step",
        "result": str(rec.get("status", "")),
        "bucket_size": _finite(recommended.get("bucket_size_batches")),
        "bucket_size_examples": _finite(recommended.get("bucket_size_examples")),
        "how_to_use": recommended.get("how_to_use"),
        "hf_trainer_equivalent": recommended.get("hf_trainer_equivalent"),
        "gain_share": _finite(thresholds.get("gain_share")),
        "min_diversity_share": _finite(thresholds.get("min_diversity_share")),
        "gain_metric": thresholds.get("gain_metric"),
        "attention_note": rec.get("attention_note"),
        "packing": means[means["strategy"].str.startswith("packing")].to_dict(orient="records"),
    }


def fast_path(frame: pd.DataFrame) -> pd.Series:
    """A layer keeps SDPA's is_causal fast path: no explicit mask, is_causal set."""
    return (~frame["mask_present"].astype(bool)) & frame["is_causal"].astype(bool)


def _band(values: pd.Series) -> str:
    """The band of a group of layers: one value, a range, or "none" (no mask: is_causal)."""
    finite = pd.to_numeric(values, errors="coerce").dropna()
    if finite.empty:
        return "none"
    low, high = int(finite.min()), int(finite.max())
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


def stage_text(value: Any, limit: int = 100) -> str:
    """A message a stage generated (rules, violations): printable, short, safe in a cell."""
    return label(value, limit)


def excluded_counts(excluded_by: pd.Series) -> str:
    """ "flash: reason; cudnn: reason" per layer, counted per distinct part over the layers."""
    parts = [
        part.strip()
        for text in excluded_by.dropna().astype(str)
        for part in text.split(";")
        if part.strip()
    ]
    counts = pd.Series(parts, dtype="object").value_counts()
    return "; ".join(f"{stage_text(k, 90)} ×{v}" for k, v in counts.head(4).items())


def mask_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "mask" in not_run:
        return _not_run(not_run["mask"])
    layers = tables["mask_layers"].copy()
    # the stage's own fast_path column when it wrote one; the same definition otherwise
    if "fast_path" not in layers.columns:
        layers["fast_path"] = fast_path(layers)
    layers["fast_path"] = layers["fast_path"].fillna(False).astype(bool)
    violation = (
        layers["violation"] if "violation" in layers.columns else pd.Series(index=layers.index)
    )
    layers["has_violation"] = violation.notna() & (violation.astype(str) != "")
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
        backends = group["backend"].dropna().astype(str).map(reason_code).value_counts()
        scenarios.append(
            {
                "scenario": name,
                "batch": first["batch"],
                "seq_len": first["seq_len"],
                "padding": first["padding"],
                "packed": bool(first["packed"]),
                "n_layers": len(group),
                "n_fast": int(group["fast_path"].sum()),
                "n_violations": int(group["has_violation"].sum()),
                "bands": bands,
                "backends": ", ".join(f"{k} ×{v}" for k, v in backends.items()),
                "excluded_by": excluded_counts(group["excluded_by"]),
            }
        )
    gate = jsons["mask_gate"]
    violations = gate.get("violations") or []
    return {
        "status": "ok",
        "passed": bool(gate.get("passed")),
        "headline": gate.get("headline"),
        "violations_total": _finite(gate.get("violations_total")) or len(violations),
        "violations": [stage_text(v, 160) for v in violations[:5]],
        "scenarios": scenarios,
    }


def controls_section(jsons: Mapping[str, Any], not_run: Mapping[str, str]) -> list[dict]:
    """Every probe's positive control and its result; a control made of checks lists each."""
    rows = []
    for stage in STAGES:
        entry = jsons[f"{stage}_control"]
        # a stage that did not run may still write a control with passed: null
        reason = not_run_reason(entry)
        if reason is None and stage in not_run and entry.get("passed") is None:
            reason = not_run[stage]
        if reason:
            rows.append(
                {
                    "stage": stage,
                    "name": entry.get("name", MISSING),
                    "description": reason,
                    "expected": None,
                    "observed": None,
                    "result": "not run",
                    "checks": [],
                }
            )
            continue
        checks = [
            {
                "name": check.get("name", MISSING),
                "expected": check.get("expected"),
                "observed": check.get("observed"),
                "result": "passed" if check.get("passed") is True else "FAILED",
            }
            for check in entry.get("checks") or []
            if isinstance(check, Mapping)
        ]
        n_passed = sum(c["result"] == "passed" for c in checks)
        rows.append(
            {
                "stage": stage,
                "name": entry["name"],
                "description": entry["description"],
                # a control made of many checks: the counts here, each check on its own row
                "expected": f"{len(checks)} checks pass" if checks else entry["expected"],
                "observed": f"{n_passed} of {len(checks)} pass" if checks else entry["observed"],
                "result": "passed" if entry["passed"] is True else "FAILED",
                "checks": checks,
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
    harness = profile.get("harness")
    slurm = profile.get("slurm")
    return {
        "report": dict(report_meta),
        "versions": versions,
        "stages": stages,
        "config_hashes_agree": len(hashes) <= 1,
        "versions_differ": differing,
        "device": _device_name(profile.get("device")) if "profile" not in not_run else MISSING,
        "cpu_only": bool(profile.get("cpu_only")),
        "harness": harness.get("spec", MISSING) if isinstance(harness, Mapping) else harness,
        "slurm": (
            {str(k): v for k, v in slurm.items() if v is not None}
            if isinstance(slurm, Mapping)
            else None
        ),
    }


def summary_section(
    inputs: Mapping[str, Any], scaling: Mapping[str, Any], mask: Mapping[str, Any], limit: int
) -> dict[str, Any]:
    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    recs = recommendations(tables, jsons, not_run, limit=limit)
    problem = fit_problem(tables, not_run)
    if problem:
        fit_note = (
            f"No time model: {problem}. Savings are given as the range between a step whose "
            "cost is linear in length (token efficiency) and one whose cost is quadratic "
            "(attention efficiency)."
        )
    elif scaling.get("cpu_only"):
        fit_note = (
            "**The scaling fit came from the CPU**, at lengths up to "
            f"{fmt_tokens(scaling.get('max_fitted_len'))}: its a/b/c do not transfer to a GPU, "
            "so the savings below are indicative only. Rerun the profile on the training GPU."
        )
    else:
        fit_note = (
            f"Savings combine the scaling fit measured on {scaling.get('device')} with the "
            "padding/bucket efficiencies."
        )
    extrapolated = None
    lengths = training_lengths(tables["padding_lengths"]) if "padding" not in not_run else None
    if not problem and lengths is not None and len(lengths):
        p99, top = float(lengths.quantile(0.99)), scaling.get("max_fitted_len")
        if top and p99 > top:
            extrapolated = {"p99": p99, "max_fitted_len": top}
    failed = [c for c in controls_section(jsons, not_run) if c["result"] == "FAILED"]
    return {
        "recommendations": recs,
        "fit_note": fit_note,
        "priced": problem is None,
        "extrapolated": extrapolated,
        "not_run": dict(not_run),
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
