"""Bucket sweep: HF-exact orderings, packing, control, collapse guard, edge cases, determinism."""

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import CANARY, REPO, workflow_config
from probes import lengths
from probes.batching import orders, packing
from probes.bucket import control as bucket_controls
from probes.bucket import guard
from probes.bucket import stage as bucket_stage
from probes.bucket import sweep as bucket
from probes.contracts import RANDOM, STAGE_OUTPUTS, check_table_columns
from probes.errors import ControlFailedError
from probes.io import write_parquet

BUCKET_DEFAULTS = {
    "seeds": [0, 1, 2],
    "bucket_sizes": None,
    "gain_share": 0.9,
    "min_diversity_share": 0.8,
    "gain_metric": "tokens",
    "diversity_level": "step",
    "packing": ["bfd"],
}
TRAINING = {"micro_batch_size": 2, "grad_accum": 4, "max_seq_len": 1024, "loss_on": "assistant"}


def _length_set(values, sources=None) -> lengths.LengthSet:
    lengths_array = np.asarray(values, dtype=np.int64)
    if sources is None:
        sources = np.zeros(lengths_array.size, dtype=np.int32)
    codes, names = lengths.encode_sources(np.asarray(sources).astype(str))
    return lengths.LengthSet(lengths_array, codes, names)


def _outputs(out: Path) -> dict[str, str]:
    return {key: str(out / Path(rel).name) for key, rel in STAGE_OUTPUTS["bucket"].items()}


def _run_stage(lengths_path: Path, out: Path, config_extra=None) -> dict:
    cfg = workflow_config(bucket={**BUCKET_DEFAULTS, **(config_extra or {})}, training=TRAINING)
    bucket_stage.run({"lengths": lengths_path}, _outputs(out), cfg, progress=False)
    return json.loads((out / "recommendation.json").read_text())


@pytest.fixture(scope="module")
def synthetic_lengths_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("padding") / "lengths.parquet"
    bucket_controls.synthetic_lengths_frame(3000, seed=3, max_seq_len=1024).to_parquet(path)
    return path


# ----------------------------------------------------------------------------- orderings


@pytest.mark.parametrize(
    ("n", "batch", "mult", "seed", "max_len"),
    [
        (1, 2, 1, 0, 10),  # a single example
        (7, 3, 1, 1, 5),  # partial last batch, many ties
        (100, 2, 4, 2, 3),  # heavy ties: stability matters
        (101, 4, 5, 3, 1000),  # partial last megabatch
        (500, 2, 50, 4, 4096),  # row-sort path (megabatch >= 64)
        (500, 3, 167, 5, 4096),  # one megabatch: global sort
        (300, 1, 7, 6, 50),  # batch size 1
    ],
)
def test_ordering_equals_hf_get_length_grouped_indices(n, batch, mult, seed, max_len):
    torch = pytest.importorskip("torch")
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = np.random.default_rng(seed).integers(1, max_len + 1, n)
    theirs = get_length_grouped_indices(
        lengths.tolist(), batch, mega_batch_mult=mult, generator=torch.Generator().manual_seed(seed)
    )
    ours = orders.length_grouped_order(lengths, orders.seeded_permutation(n, seed), batch, mult)
    assert ours.tolist() == theirs


def test_auto_bucket_sizes_span_random_to_global_sort():
    sizes = orders.sweep_bucket_sizes_for(7168, 2, 8)
    assert sizes[0] == 1 and sizes[-1] == 3584
    assert 50 in sizes and 400 in sizes  # HF's cap; HF Trainer's default (50 × grad_accum 8)
    assert len(sizes) >= 12
    assert orders.sweep_bucket_sizes_for(10, 2, 1, requested=[3, 99]) == [1, 3, 5]


# ----------------------------------------------------------------------------- packing


def test_sweep_packing_row_counts_trl_rows():
    """The packing row's bins are TRL's rows (tests/unit/batching/test_packing.py: row for row)."""
    full, sources = bucket_controls.synthetic_lengths(1200, seed=5)
    data = lengths.LengthSet(np.minimum(full, 512), sources, tuple("abcdefgh"))
    rows = packing.pack(data.lengths, 512)
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 512, [0, 1], batch_rebalance=False)
    packed = sweep.loc[sweep["strategy"] == "packing_bfd"]
    assert (packed["n_bins"] == rows.n_rows).all()
    assert (packed["padded_tokens"] == rows.n_rows * 512).all()
    given = bucket.sweep_bucket_sizes(
        data, 2, 4, 512, [0, 1], batch_rebalance=False, packed={"bfd": rows}
    )
    pd.testing.assert_frame_equal(given, sweep)


# ----------------------------------------------------------------------------- control, guard


def test_positive_control_recovers_known_answers():
    control = bucket_controls.run_control()
    assert control["passed"], control["observed"]
    assert set(control) == {"name", "description", "expected", "observed", "passed"}
    assert control["observed"]["global_sort_token_efficiency"] == 1.0


def test_positive_control_fails_on_collapsing_ordering():
    control = bucket_controls.run_control(order_fn=bucket_controls.global_sort_collapse)
    assert not control["passed"]


def test_collapse_guard_fires_on_global_sort_injection():
    full, sources = bucket_controls.synthetic_lengths(2000, seed=1)
    data = lengths.LengthSet(np.minimum(full, 1024), sources, tuple("abcdefgh"))
    collapsed = bucket.sweep_bucket_sizes(
        data, 2, 4, 1024, [0, 1], packing=(), order_fn=bucket_controls.global_sort_collapse
    )
    # The collapse is real: every bucket size gave the global sort's efficiency.
    assert collapsed.groupby("bucket_size_batches")["token_efficiency"].mean().nunique() == 1
    with pytest.raises(guard.SweepCollapsedError, match="collapsed"):
        guard.assert_sweep_varies(collapsed, data, 2)
    honest = bucket.sweep_bucket_sizes(data, 2, 4, 1024, [0, 1], packing=())
    checked = guard.assert_sweep_varies(honest, data, 2)
    assert checked["applicable"] and checked["efficiency_spread"] > 0.1


def test_collapse_guard_fires_when_sizes_agree_but_ends_are_right():
    """A sweep whose every row equals random would also be caught (spread check + ends)."""
    full, sources = bucket_controls.synthetic_lengths(500, seed=2)
    data = lengths.LengthSet(np.minimum(full, 1024), sources, tuple("abcdefgh"))

    def never_sorts(lengths, perm, batch, mult):
        return orders.length_grouped_order(lengths, perm, batch, 1)

    sweep = bucket.sweep_bucket_sizes(data, 2, 1, 1024, [0], packing=(), order_fn=never_sorts)
    with pytest.raises(guard.SweepCollapsedError):
        guard.assert_sweep_varies(sweep, data, 2)


# ----------------------------------------------------------------------------- edge cases


def test_all_equal_lengths_nothing_to_gain_no_false_alarm():
    data = _length_set(np.full(301, 128), sources=np.arange(301) % 3)
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 256, [0, 1])
    numeric = sweep.drop(columns=["bucket_size_batches", "bucket_size_examples", "n_bins"])
    assert numeric.notna().all().all()
    grouped = sweep.loc[sweep["bucket_size_batches"].notna()]
    assert (grouped["token_efficiency"] == 1.0).all()
    assert (grouped["order_length_spearman"] == 0.0).all()
    checked = guard.assert_sweep_varies(sweep, data, 2)
    assert not checked["applicable"]
    rec = bucket.recommend(sweep, 0.9, 0.8)
    assert rec["status"] == "nothing_to_gain"
    assert rec["recommended"]["bucket_size_batches"] == 1


def test_one_source_diversity_defined():
    full, _ = bucket_controls.synthetic_lengths(1000, seed=4)
    data = _length_set(np.minimum(full, 1024), sources=np.full(1000, "none"))
    assert not data.sources_known
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 1024, [0, 1])
    relative = sweep.filter(like="_rel_random")
    assert relative.notna().all().all() and (relative == 1.0).all().all()
    numeric = sweep.drop(columns=["bucket_size_batches", "bucket_size_examples", "n_bins"])
    assert numeric.notna().all().all()
    rec = bucket.recommend(sweep, 0.9, 0.8)
    assert rec["status"] == "ok" and rec["recommended"]["diversity_rel_random"] == 1.0


def test_micro_batch_one_has_no_padding_and_no_false_alarm():
    full, sources = bucket_controls.synthetic_lengths(200, seed=5)
    data = lengths.LengthSet(np.minimum(full, 512), sources, tuple("abcdefgh"))
    sweep = bucket.sweep_bucket_sizes(data, 1, 2, 512, [0], packing=())
    assert (sweep["token_efficiency"] == 1.0).all()
    assert not guard.assert_sweep_varies(sweep, data, 1)["applicable"]


def test_fewer_examples_than_a_micro_batch():
    data = _length_set([5, 9], sources=["a", "b"])
    sweep = bucket.sweep_bucket_sizes(data, 4, 2, 16, [0])
    assert sweep["bucket_size_batches"].dropna().tolist() == [1]
    guard.assert_sweep_varies(sweep, data, 4)
    assert bucket.recommend(sweep, 0.9, 0.8)["recommended"]["bucket_size_batches"] == 1


def test_recommendation_is_smallest_size_meeting_both_thresholds():
    # Sources follow length, so diversity falls as buckets grow.
    full, sources = bucket_controls.synthetic_lengths(4000, seed=6, n_sources=4)
    data = lengths.LengthSet(np.minimum(full, 2048), sources, tuple("abcd"))
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 2048, [0, 1, 2], packing=())
    for gain_share, diversity_share in [(0.9, 0.8), (0.5, 0.95), (0.99, 0.0)]:
        rec = bucket.recommend(sweep, gain_share, diversity_share)
        summary = bucket.summarise(sweep).dropna(subset=["bucket_size_batches"])
        summary = summary.sort_values("bucket_size_batches")
        gain = summary["padded_tokens_saved_vs_random"]
        diversity = np.minimum(
            summary["step_distinct_sources_rel_random"], summary["step_source_entropy_rel_random"]
        )
        ok = (gain >= gain_share * gain.max()) & (diversity >= diversity_share)
        m = rec["recommended"]["bucket_size_batches"]
        if rec["status"] == "ok":
            assert m == int(summary.loc[ok, "bucket_size_batches"].iloc[0])
        else:
            assert rec["status"] == "no_size_meets_both" and not ok.any()


def test_packing_beats_padding_on_tokens_here():
    full, sources = bucket_controls.synthetic_lengths(3000, seed=7)
    data = lengths.LengthSet(np.minimum(full, 2048), sources, tuple("abcdefgh"))
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 2048, [0])
    summary = bucket.summarise(sweep).set_index("strategy")
    for name in ("packing_bfd",):
        assert summary.loc[name, "token_efficiency"] > summary.loc["random", "token_efficiency"]
        assert summary.loc[name, "n_bins"] < 3000 / 2
    rec = bucket.recommend(sweep, 0.9, 0.8)
    assert set(rec["packing"]) == {"packing_bfd"}


@pytest.mark.parametrize(("level", "prefix"), [("step", "step"), ("micro_batch", "micro")])
def test_summary_is_the_mean_over_seeds_in_report_order(level, prefix):
    full, sources = bucket_controls.synthetic_lengths(2000, seed=11, n_sources=4)
    data = lengths.LengthSet(np.minimum(full, 1024), sources, tuple("abcd"))
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 1024, [0, 1, 2])
    summary = bucket.summarise(sweep, level)
    check_table_columns(summary.columns, "bucket_summary", "summary.parquet")
    # random first, the sweep by size, global sort, packing by name, then transformers'
    # batch_rebalance (the last two with bucket size NA)
    assert summary["strategy"].map(bucket.strategy_rank).is_monotonic_increasing
    assert summary["strategy"].iloc[0] == RANDOM
    assert list(summary["strategy"].iloc[-2:]) == ["packing_bfd", "batch_rebalance"]
    assert summary["bucket_size_batches"].dropna().is_monotonic_increasing
    assert summary["bucket_size_batches"].iloc[-2:].isna().all()
    assert (summary["n_seeds"] == 3).all()
    assert len(summary) == len(sweep) // 3
    size = int(summary["bucket_size_batches"].dropna().iloc[2])
    rows = sweep[sweep["bucket_size_batches"] == size]
    row = summary[summary["bucket_size_batches"] == size].iloc[0]
    assert row["token_efficiency"] == pytest.approx(rows["token_efficiency"].mean())
    assert row["attention_efficiency_std"] == pytest.approx(
        rows["attention_efficiency"].std(ddof=0)
    )
    assert row["token_efficiency_std"] > 0  # seeds shuffle differently
    diversity = min(
        rows[f"{prefix}_distinct_sources_rel_random"].mean(),
        rows[f"{prefix}_source_entropy_rel_random"].mean(),
    )
    assert row["diversity_rel_random"] == pytest.approx(diversity)
    # the recommendation judges diversity with the same numbers
    rec = bucket.recommend(sweep, 0.9, 0.8, diversity_level=level)
    chosen = rec["recommended"]["bucket_size_batches"]
    at_chosen = summary.loc[summary["bucket_size_batches"] == chosen, "diversity_rel_random"]
    assert rec["recommended"]["diversity_rel_random"] == at_chosen.iloc[0]


# ----------------------------------------------------------------------------- input contract


def test_read_lengths_counts_statuses_and_skips_empty_error(tmp_path):
    frame = bucket_controls.synthetic_lengths_frame(500, seed=8, max_seq_len=256)
    path = tmp_path / "lengths.parquet"
    frame.to_parquet(path)
    data = lengths.read_lengths(path, 256)
    counts = frame["status"].value_counts()
    assert data.lengths.size == counts.get("OK", 0) + counts.get("TRUNCATED", 0)
    assert data.status_counts["EMPTY"] == counts.get("EMPTY", 0) > 0
    assert data.status_counts["TRUNCATED"] == counts.get("TRUNCATED", 0) > 0
    assert data.lengths.min() >= 1 and data.lengths.max() <= 256


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.drop(columns=["n_tokens"]), "n_tokens"),
        (lambda f: f.assign(status="MAYBE"), "MAYBE"),
        (lambda f: f.assign(n_tokens=f["n_tokens"] * 0 + 5000), "example_id="),
        (lambda f: f.assign(status="EMPTY"), "no row has status OK or TRUNCATED"),
    ],
)
def test_bad_lengths_input_names_the_problem(tmp_path, mutate, message):
    frame = mutate(bucket_controls.synthetic_lengths_frame(50, seed=9, max_seq_len=4096))
    path = tmp_path / "lengths.parquet"
    frame.to_parquet(path)
    with pytest.raises(lengths.LengthsError, match=message):
        lengths.read_lengths(path, 4096)


def test_missing_lengths_file_is_a_clear_error(tmp_path):
    with pytest.raises(lengths.LengthsError, match="padding"):
        lengths.read_lengths(tmp_path / "nope.parquet", 4096)


# ----------------------------------------------------------------------------- stage, outputs


def test_stage_is_deterministic(synthetic_lengths_file, tmp_path):
    """Same input and seeds: identical data, byte-identical JSON; Parquet bytes differ only by
    the provenance (date, command line), so with one provenance they are byte-identical too."""
    first, second = tmp_path / "a", tmp_path / "b"
    _run_stage(synthetic_lengths_file, first)
    _run_stage(synthetic_lengths_file, second)
    assert pq.read_table(first / "sweep.parquet").equals(pq.read_table(second / "sweep.parquet"))
    for name in ("recommendation.json", "control.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    frame = pd.read_parquet(first / "sweep.parquet")
    provenance = {"config_hash": "fixed", "date": "fixed"}
    write_parquet(frame, tmp_path / "x.parquet", provenance)
    write_parquet(pd.read_parquet(second / "sweep.parquet"), tmp_path / "y.parquet", provenance)
    assert (tmp_path / "x.parquet").read_bytes() == (tmp_path / "y.parquet").read_bytes()


def test_stage_outputs_and_recommendation_contents(synthetic_lengths_file, tmp_path):
    rec = _run_stage(synthetic_lengths_file, tmp_path)
    assert rec["status"] == "ok"
    assert rec["recommended"]["gain"] >= 0.9 * rec["best_gain"]["gain"]
    assert rec["thresholds"]["gain_share"] == 0.9
    assert rec["input"]["rows_skipped"]["EMPTY"] > 0
    shapes = rec["batch_shapes"]
    assert shapes["padded_length_p50"] <= shapes["padded_length_p90"] <= 1024
    sweep = pd.read_parquet(tmp_path / "sweep.parquet")
    assert {"random", "length_grouped", "global_sort", "packing_bfd"} <= set(sweep["strategy"])
    assert sweep["seed"].nunique() == 3
    summary = pd.read_parquet(tmp_path / "summary.parquet")
    expected = bucket.summarise(sweep, BUCKET_DEFAULTS["diversity_level"])
    pd.testing.assert_frame_equal(summary, expected)
    control = json.loads((tmp_path / "control.json").read_text())
    assert control["passed"] is True


def test_no_data_text_in_outputs_or_log(tmp_path, caplog):
    frame = bucket_controls.synthetic_lengths_frame(400, seed=10, max_seq_len=1024)
    frame["source"] = frame["source"] + CANARY  # sources may be prompt text (chitchat)
    lengths_path = tmp_path / "lengths.parquet"
    frame.to_parquet(lengths_path)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="probes.bucket.sweep"):
        _run_stage(lengths_path, out)
    assert "recommended bucket size" in caplog.text
    assert CANARY not in caplog.text
    for path in out.iterdir():
        assert CANARY.encode() not in path.read_bytes(), path.name


def test_failed_control_writes_nothing(synthetic_lengths_file, tmp_path, monkeypatch):
    monkeypatch.setattr(
        bucket_controls,
        "run_control",
        lambda: {"name": "x", "description": "", "expected": 1, "observed": 0, "passed": False},
    )
    with pytest.raises(ControlFailedError, match="positive control failed"):
        _run_stage(synthetic_lengths_file, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_schema_fills_bucket_defaults_and_rejects_unknown_keys():
    yaml = pytest.importorskip("yaml")
    from snakemake.utils import validate

    schema = str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.pop("bucket")
    validate(config, schema=schema)
    assert config["bucket"]["seeds"] == [0, 1, 2, 3, 4]
    assert config["bucket"]["bucket_sizes"] is None
    config["bucket"]["bucket_sise"] = [1]
    with pytest.raises(Exception, match="bucket_sise"):
        validate(config, schema=schema)


@pytest.mark.parametrize(
    ("gain_metric", "diversity_level"), [("attention", "micro_batch"), ("tokens", "step")]
)
def test_recommend_variants_echo_thresholds(gain_metric, diversity_level):
    full, sources = bucket_controls.synthetic_lengths(1500, seed=12)
    data = lengths.LengthSet(np.minimum(full, 1024), sources, tuple("abcdefgh"))
    sweep = bucket.sweep_bucket_sizes(data, 2, 4, 1024, [0], packing=("bfd",))
    rec = bucket.recommend(sweep, 0.8, 0.5, gain_metric, diversity_level)
    assert rec["thresholds"]["gain_metric"] == gain_metric
    column = (
        "padded_tokens_saved_vs_random"
        if gain_metric == "tokens"
        else ("attention_cost_saved_vs_random")
    )
    assert rec["recommended"]["gain"] == rec["recommended"][column]
    assert rec["recommended"]["gain"] >= 0.8 * rec["best_gain"]["gain"]
    assert json.loads(json.dumps(rec)) == rec  # plain JSON types only


def test_fewer_examples_than_grad_accum_answers_without_batch_rebalance(tmp_path):
    # grad_accum is 4 in TRAINING: three usable examples cannot feed the sampler's 4 micro-batches.
    path = tmp_path / "lengths.parquet"
    bucket_controls.synthetic_lengths_frame(3, seed=1, max_seq_len=1024).to_parquet(path)
    recommendation = _run_stage(path, tmp_path / "out")
    assert recommendation["batch_rebalance"] is None
    assert "training.grad_accum=4" in recommendation["batch_rebalance_not_run"]
    assert "got 3" in recommendation["batch_rebalance_not_run"]
    sweep = pd.read_parquet(tmp_path / "out" / "sweep.parquet")
    assert "batch_rebalance" not in set(sweep["strategy"])
