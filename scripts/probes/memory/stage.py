"""The memory stage: will each setting fit the target GPU? Predicted from config.json alone.

Order of work: the harness (the profile's, with its options), the controls (a peak known by
construction, real CPU steps), the model on fake tensors, the shapes that matter (training shape,
p99 length, each strategy's largest micro-batch from the bucket stage's plans), a prediction per
shape, the largest micro-batch that fits at max_seq_len and at the p99 length, and the outputs.
The replay's step-level changes are predicted meanwhile in a forked child (step_changes_beside).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pandas as pd

from probes.batching.plans import read_plans
from probes.contracts import BATCH_REBALANCE
from probes.dp.sharding import layer_classes
from probes.forked import forked
from probes.io import read_provenance, run_metadata
from probes.mask.trace import config_from_dict, read_config_json
from probes.memory.control import run_controls
from probes.memory.layers import build_scaled_step, predict_scaled, scaling_saves_work
from probes.memory.predict import (
    CachedPredictor,
    PredictError,
    Prediction,
    Shape,
    StepFunctions,
    build_fake_step,
    functions_of,
    predict,
)
from probes.memory.shapes import (
    P99,
    TRAINING,
    largest_micro_batches,
    quantile_shape,
    rebalance_shape,
    training_shape,
)
from probes.memory.sharded import empty_sharded, needs_sharding, sharded_frame, with_world_sizes
from probes.memory.step_changes import (
    LoadedHarness,
    at_base,
    base_config,
    change_shapes,
    configured,
    fake_attention,
    fake_steps,
)
from probes.memory.tracker import CATEGORIES
from probes.memory.verdict import (
    DOES_NOT_FIT,
    GIB,
    advice,
    headroom_gib,
    largest_fitting_rows,
    verdict,
)
from probes.replay.step_changes import step_changes_for
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.step import changes as sc
from probes.step.change_types import StepConfig
from probes.step.source import given

LOG = logging.getLogger("probes.memory")
MAX_SEQ_LEN = "max_seq_len"


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    start = time.perf_counter()
    loaded = load_harness(cfg)
    functions = functions_of(loaded.harness)
    control = run_controls(functions, cfg.memory.tolerance)
    LOG.info("memory controls: %s", control["observed"])
    plans = _plans(inputs.get("plans"))
    model_config = str(inputs["model_config"])
    config = config_from_dict(read_config_json(model_config), source=model_config)
    predictor, scaled = build_predictor(cfg, config, functions)
    LOG.info("model on fake tensors in %.1f s", predictor.step.build_seconds)
    harness = None if given(cfg.trainer) else loaded  # a trainer's loss is not a setting
    base = step_base(predictor, harness, cfg, inputs)
    at_base(predictor, base)
    shapes = shapes_to_predict(cfg, plans)
    target = int(cfg.memory.target_gib * GIB)
    checkpointing = base.gradient_checkpointing
    # the step-level changes (a child process) predicted beside the shapes (this one)
    query = StepChangeQuery(harness, base, cfg, inputs, plans, target)
    with step_changes_beside(predictor, query) as step_rows:
        shape_table = shapes_frame(shapes, predictor, target, checkpointing)
        fit_table = fitting_frame(shapes, predictor, target, cfg)
        shape_table = add_fitting_advice(shape_table, fit_table, target, checkpointing)
        shape_table = with_checkpointing_checked(
            predictor, harness, base, cfg, shapes, shape_table, target
        )
        steps = step_rows()
    shape_table = pd.concat([shape_table, pd.DataFrame(steps)], ignore_index=True)
    sharded = sharded_frame(
        config, functions, cfg.mask.dtype, shapes[0][1], cfg.memory,
        cfg.profile.attn_implementation, cfg.training.grad_accum,
    ) if needs_sharding(shape_table, cfg.memory) else empty_sharded()  # fmt: skip
    shape_table = with_world_sizes(shape_table, sharded, TRAINING, cfg.memory.target_name)
    changes = changes_frame(shape_table)
    summary = {
        "target_gib": cfg.memory.target_gib,
        "target": cfg.memory.target_name,
        "dtype": cfg.mask.dtype,
        "model_config": model_config,
        "layer_classes": layer_classes(config),  # FSDP2's units, for the fsdp_config to paste
        "harness": cfg.profile.harness,
        "gradient_checkpointing": checkpointing,
        "step_base": dataclasses.asdict(base),
        "plans": "read" if plans is not None else "not given: training shape only",
        "scale_layers": scaled,
        "step_changes": [row["strategy"] for row in steps],
        "build_seconds": predictor.step.build_seconds,
        "predictions": predictor.count,
        "wall_seconds": time.perf_counter() - start,
    }
    provenance = run_metadata(dict(cfg.raw))
    with all_or_nothing(outputs) as out:
        out.parquet("shapes", shape_table, provenance)
        out.parquet("changes", changes, provenance)
        out.parquet("fit", fit_table, provenance)
        out.parquet("sharded", sharded, provenance)
        out.json("summary", summary)
        out.json("control", control)
    for row in shape_table.itertuples():
        LOG.info(
            "%-20s %3d x %-6d %8.2f GiB  %s", row.shape, row.rows, row.length,
            row.predicted_peak_gib if row.predicted_peak_gib == row.predicted_peak_gib else -1,
            row.verdict,
        )  # fmt: skip
    LOG.info("memory stage in %.1f s (%d predictions)", summary["wall_seconds"], predictor.count)


def load_harness(cfg: WorkflowConfig) -> LoadedHarness:
    """The profile's harness with its options (probes.step.harness), as the profile loads it."""
    from probes.step import harness as step_harness

    harness = step_harness.load_harness(cfg.profile.harness)
    configure = harness.hook("configure")
    options = {"ce_chunk_tokens": cfg.profile.ce_chunk_tokens, **cfg.profile.harness_options}
    if configure is not None:
        configure(options)
    return LoadedHarness(harness, {"options": options})


def build_predictor(
    cfg: WorkflowConfig, config: Any, functions: StepFunctions
) -> tuple[CachedPredictor, bool]:
    """The fake step (scaled per layer type where that traces fewer layers) and its predictor."""
    build, predict_fn = (build_fake_step, predict)
    scaled = cfg.memory.scale_layers and scaling_saves_work(config)
    if scaled:
        build, predict_fn = (build_scaled_step, predict_scaled)
    attention, notes = fake_attention(cfg.profile.attn_implementation)
    step = build(
        config,
        functions,
        cfg.mask.dtype,
        grad_accum=cfg.training.grad_accum,
        round_to=cfg.memory.allocator_round_bytes,
        attn_implementation=attention,
    )
    for fake in fake_steps(step):
        fake.notes.extend(notes)
    return CachedPredictor(step, predict_fn), scaled


def step_base(
    predictor: CachedPredictor,
    harness: LoadedHarness | None,
    cfg: WorkflowConfig,
    inputs: Mapping[str, Any],
) -> StepConfig:
    """The step the replay's StepSwitch starts from (its step-level changes' base): a user's
    trainer as the padding stage recorded it where it did, else the harness's fake model at the
    profile's attention implementation (probes.memory.step_changes.base_config)."""
    recorded = trainer_record(inputs) if given(cfg.trainer) else None
    if given(cfg.trainer) and recorded is None:
        LOG.info(
            "trainer: its step (checkpointing, attention) is not recorded in the "
            "lengths' provenance; the harness options and the profile's attention stand in"
        )
    base = base_config(predictor.step, harness, cfg.profile.attn_implementation, recorded)
    LOG.info("step-level base: %s", base)
    return base


def trainer_record(inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The trainer's step as the padding stage recorded it (probes.step.changes.config_record
    under "trainer" in the lengths' provenance), or None."""
    lengths = inputs.get("lengths")
    if not _given(lengths):
        return None
    trainer = read_provenance(lengths).get("trainer") or {}
    return trainer.get(sc.RECORD_KEY)


def with_checkpointing_checked(
    predictor: CachedPredictor,
    harness: LoadedHarness | None,
    base: StepConfig,
    cfg: WorkflowConfig,
    shapes: list[tuple[str, Shape]],
    table: pd.DataFrame,
    target: int,
) -> pd.DataFrame:
    """Checkpointing off and a shape that does not fit: predict it with checkpointing on (the
    replay's gradient_checkpointing_on change, set on the same fake model) and say whether that
    fits."""
    over = set(table.index[table["verdict"] == DOES_NOT_FIT])
    if base.gradient_checkpointing or not over:
        return table
    (on,) = [c for c in step_changes_for(base, cfg.training) if c.strategy == sc.GC_ON]
    checked = table.copy()
    try:
        with configured(predictor, harness, base, on):
            for index in sorted(over):
                note_checkpointing(checked, index, shapes[index][1], predictor, target)
    except (ValueError, NotImplementedError) as error:
        LOG.info("checkpointing not checked: %s", error)
        return table
    return checked


def note_checkpointing(
    table: pd.DataFrame, index: int, shape: Shape, predictor: CachedPredictor, target: int
) -> None:
    """The row's reason led by the shape's peak with checkpointing on (set on `predictor`)."""
    try:
        peak = predictor(shape).peak_bytes
    except PredictError as error:
        LOG.info("checkpointing not checked for %s: %s", shape.name, error)
        return
    words = "fits" if peak <= target else "still does not fit"
    before = table.at[index, "reason"]
    table.at[index, "reason"] = (
        f"with gradient checkpointing {peak / GIB:.1f} GiB, {words}; {before}"
    )


def _given(path: Any) -> bool:
    """An input given on the command line as `--input key=` (empty) is not given."""
    return path is not None and str(path).strip() not in ("", ".")


def _plans(path: Any) -> pd.DataFrame | None:
    """The bucket stage's plans; none given (`--input plans=`): the training shape only."""
    return read_plans(path) if _given(path) else None


def shapes_to_predict(cfg: WorkflowConfig, plans: pd.DataFrame | None) -> list[tuple[str, Shape]]:
    """(strategy or "", shape): the training shape, the p99 length, each strategy's largest."""
    training = cfg.training
    shapes = [("", training_shape(training.micro_batch_size, training.max_seq_len))]
    if plans is not None:
        shapes.append(
            ("", quantile_shape(plans, training.micro_batch_size, cfg.memory.length_quantile))
        )
        for strategy, shape in largest_micro_batches(plans).items():
            shapes.append((strategy, shape))
        if BATCH_REBALANCE in {name for name, _ in shapes}:
            return shapes
        seed = int(cfg.bucket.seeds[0])
        found = rebalance_shape(plans, training.micro_batch_size, training.grad_accum, seed)
        if isinstance(found, Shape):
            shapes.append((BATCH_REBALANCE, found))
        else:
            LOG.info("no batch_rebalance shape: %s", found)
    return shapes


def shape_row(
    strategy: str, shape: Shape, predictor: CachedPredictor, target: int, checkpointing: bool
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "shape": shape.name,
        "strategy": strategy,
        "rows": shape.rows,
        "length": shape.length,
        "layout": shape.layout,
        "loss_positions": shape.loss_positions(),
        "target_gib": target / GIB,
    }
    try:
        found = predictor(shape)
    except PredictError as error:
        return {**row, "predicted_peak_gib": None, "headroom_gib": None,
                "verdict": verdict(None, target), "reason": str(error)}  # fmt: skip
    row.update({f"{c}_gib": found.by_category[c] / GIB for c in CATEGORIES})
    row.update(
        predicted_peak_gib=found.peak_bytes / GIB,
        headroom_gib=headroom_gib(found.peak_bytes, target),
        verdict=verdict(found.peak_bytes, target),
        reason="",
        peak_phase=found.phase,
        peak_op=found.op,
        seconds=found.seconds,
        assumptions="; ".join(found.assumptions),
    )
    if row["verdict"] == DOES_NOT_FIT:
        row["reason"] = advice(found.by_category, target, checkpointing, None)
    return row


@dataclasses.dataclass(frozen=True)
class StepChangeQuery:
    """What the step-level changes are predicted from. `harness` None: a user's trainer, whose
    loss is not a setting of its step, as in the replay; `target`: the target's bytes."""

    harness: LoadedHarness | None
    base: StepConfig
    cfg: WorkflowConfig
    inputs: Mapping[str, Any]
    plans: pd.DataFrame | None
    target: int


def step_change_rows(predictor: CachedPredictor, query: StepChangeQuery) -> list[dict[str, Any]]:
    """Each step-level change the replay prices against `query.base` (its step_changes_for),
    predicted on the same fake model with the change set as the replay sets it, at its own
    largest micro-batch (probes.memory.step_changes)."""
    base, cfg, inputs, target = query.base, query.cfg, query.inputs, query.target
    changes = step_changes_for(base, cfg.training)
    lengths_given = _given(inputs.get("lengths"))
    shapes = change_shapes(changes, query.plans, inputs, cfg.training, lengths_given)
    rows = []
    for change in changes:
        shape = shapes[change.strategy]
        if isinstance(shape, str):
            rows.append(unpredicted_row(change.strategy, shape, target))
            continue
        try:
            with configured(predictor, query.harness, base, change):
                gc = change.config.gradient_checkpointing
                rows.append(shape_row(change.strategy, shape, predictor, target, gc))
        except (ValueError, NotImplementedError) as error:
            # the model or the user's harness refusing the setting (an attention implementation
            # it lacks, checkpointing it does not support, a loss_kernel option it rejects) is
            # this change's answer, not the stage's failure
            reason = f"{change.strategy}: setting it raised {type(error).__name__}: {error}"
            rows.append(unpredicted_row(change.strategy, reason, target))
    return rows


# The step-level changes are predicted in a forked child (probes.forked) beside the parent's shape
# predictions: ~7 s and ~9 s of the default run's ~25 s, on two cores. fork is safe here: the parent
# has built the model on fake tensors only, but the controls before the fork ran real CPU steps, so
# torch's OpenMP workers exist (idle) in the parent, and a forked child that opened an OpenMP
# parallel region would wait on workers it does not have (a real matmul in such a child hangs). The
# child computes nothing real (fake tensors), and it sets torch to one thread first, so no op of it
# can open one. The parent's other threads at the fork (pyarrow's jemalloc background thread,
# torch's idle pools) belong to libraries that re-initialise across fork; a hung child is still
# caught by the timeout below. The controls stay first, to fail fast before the model is built.
STEP_CHANGES = "the memory stage's step-change predictions"
# A child that reports nothing for this long after the parent's own predictions is treated as hung
# (the default model's take ~8 s in all; far larger models are predicted on a few layers).
STEP_CHANGES_TIMEOUT_SECONDS = 1800


@contextlib.contextmanager
def step_changes_beside(
    predictor: CachedPredictor, query: StepChangeQuery
) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Within this block step_change_rows runs in a forked child; yields a function that waits
    for its rows (a child that raises, dies or hangs: a ForkedError naming STEP_CHANGES) and
    counts its predictions in `predictor`. The replay prices step-level changes only where
    replay.step_changes is on: off, no child and no rows."""
    if not query.cfg.replay.step_changes:
        yield lambda: []
        return
    with forked(
        step_changes_in_child,
        (predictor, query),
        what=STEP_CHANGES,
        timeout=STEP_CHANGES_TIMEOUT_SECONDS,
        name="memory-step-changes",
    ) as done:

        def rows() -> list[dict[str, Any]]:
            found, made = done()
            predictor.absorb(made)
            return found

        yield rows


def step_changes_in_child(
    predictor: CachedPredictor, query: StepChangeQuery
) -> tuple[list[dict[str, Any]], dict[tuple, Prediction]]:
    """The child's work: step_change_rows(predictor, query), and the predictions it made that
    the parent's predictor had not at the fork (both picklable)."""
    import torch

    torch.set_num_threads(1)  # no OpenMP parallel region in a forked child (see above)
    before = set(predictor.cache)
    rows = step_change_rows(predictor, query)
    return rows, predictor.made_since(before)


def unpredicted_row(strategy: str, reason: str, target: int) -> dict[str, Any]:
    return {"shape": strategy, "strategy": strategy, "rows": None, "length": None,
            "layout": None, "target_gib": target / GIB, "predicted_peak_gib": None,
            "headroom_gib": None, "verdict": verdict(None, target), "reason": reason}  # fmt: skip


def shapes_frame(
    shapes: list[tuple[str, Shape]], predictor: CachedPredictor, target: int, checkpointing: bool
) -> pd.DataFrame:
    rows = [shape_row(s, shape, predictor, target, checkpointing) for s, shape in shapes]
    return pd.DataFrame(rows)


def fitting_frame(
    shapes: list[tuple[str, Shape]], predictor: CachedPredictor, target: int, cfg: WorkflowConfig
) -> pd.DataFrame:
    """The largest micro-batch that fits at max_seq_len and at the p99 length, equal tokens per
    update (micro_batch_size x grad_accum rows kept)."""
    training = cfg.training
    rows_per_update = training.micro_batch_size * training.grad_accum
    lengths = {MAX_SEQ_LEN: training.max_seq_len}
    for _, shape in shapes:
        if shape.name == P99:
            lengths[P99] = shape.length
    out = []
    for kind, length in lengths.items():
        row: dict[str, Any] = {"length_kind": kind, "length": length,
                               "rows_per_update": rows_per_update}  # fmt: skip
        try:
            found = largest_fitting_rows(
                lambda rows, n=length, k=kind: predictor(Shape(f"fit_{k}", rows, n)).peak_bytes,
                target,
                rows_per_update,
            )
        except PredictError as error:
            out.append({**row, "max_micro_batch_size": None, "grad_accum": None,
                        "predicted_peak_gib": None, "method": str(error)})  # fmt: skip
            continue
        out.append(
            {
                **row,
                "max_micro_batch_size": found.rows,
                "grad_accum": found.grad_accum,
                "predicted_peak_gib": None if found.peak_bytes is None else found.peak_bytes / GIB,
                "method": found.method,
            }
        )
    return pd.DataFrame(out)


def add_fitting_advice(
    shapes: pd.DataFrame, fit: pd.DataFrame, target: int, checkpointing: bool
) -> pd.DataFrame:
    """A training shape that does not fit says how many rows would."""
    at_max = fit[fit["length_kind"] == MAX_SEQ_LEN]["max_micro_batch_size"]
    rows = None if at_max.empty or pd.isna(at_max.iloc[0]) else int(at_max.iloc[0])
    shapes = shapes.copy()
    for index, row in shapes.iterrows():
        if row["verdict"] == DOES_NOT_FIT and row["shape"] == TRAINING:
            split = {c: int(row[f"{c}_gib"] * GIB) for c in CATEGORIES}
            shapes.at[index, "reason"] = advice(split, target, checkpointing, rows)
    return shapes


def changes_frame(shapes: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy (and the training shape as `training`): its largest micro-batch."""
    rows = shapes[shapes["strategy"] != ""].copy()
    base = shapes[shapes["shape"] == TRAINING].copy()
    base["strategy"] = TRAINING
    both = pd.concat([base, rows], ignore_index=True)
    both = both.rename(columns={"rows": "shape_rows", "length": "shape_length"})
    columns = ["strategy", "shape_rows", "shape_length", "layout", "predicted_peak_gib",
               "headroom_gib", "verdict", "reason"]  # fmt: skip
    return both[columns].reset_index(drop=True)
