"""FSDP2 per-rank peaks: predicted on fake tensors with a fake process group, checked against a
real sharded step at W = 2 on CPU (gloo, two spawned processes)."""

from __future__ import annotations

import torch.distributed as dist

from probes.mask.trace import config_from_dict
from probes.memory.control import within
from probes.memory.fsdp import Sharding, predict_sharded
from probes.memory.fsdp_real import real_sharded_peaks
from probes.memory.predict import Shape, build_fake_step, functions_of, predict

from . import full_finetune_harness as harness

# Weight-heavy and short, so the sharded weights, gradients and AdamW states dominate the peak.
# Checkpointing off: the peak is at the loss, before any reduce-scatter. With it on, the peak is
# in the backward, where a CPU rank's autograd can run ahead of gloo's worker thread, which then
# holds several layers' reduce-scatter inputs (0.93-1.00 and once 0.89 of the prediction over
# runs); a GPU's FSDP2 waits for the previous reduce-scatter, so it holds one. Off, the real peak
# is the same in every run: predicted / real 1.006.
TINY_TIED = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
SHAPE = Shape("check", 2, 32)
OPTIONS = {"gradient_checkpointing": False}
SCALED_OPTIONS = {"gradient_checkpointing": True}


def test_predicted_per_rank_peak_meets_the_real_fsdp2_step_at_w2():
    harness.configure(OPTIONS)
    try:
        functions = functions_of(harness)
        config = config_from_dict(dict(TINY_TIED))
        sharded = predict_sharded(config, functions, "float32", SHAPE, Sharding(2))
        unsharded = predict(build_fake_step(config, functions, "float32"), SHAPE).peak_bytes
    finally:
        harness.configure({})
    assert not dist.is_initialized()  # the fake process group is gone again
    real = real_sharded_peaks(TINY_TIED, harness.__name__, OPTIONS, SHAPE, 2)
    assert len(real) == 2
    for rank_peak in real:
        assert within(sharded.peak_bytes, rank_peak, 0.10), (sharded.peak_bytes, real)
        # the same check given the one-GPU prediction (no sharding) must fail
        assert not within(unsharded, rank_peak, 0.10), (unsharded, real)
    print("fsdp2 w2 predicted", sharded.peak_bytes, "unsharded", unsharded, "real", real)


def test_the_shards_shrink_with_the_world_size():
    harness.configure(OPTIONS)
    try:
        functions = functions_of(harness)
        config = config_from_dict(dict(TINY_TIED))
        found = {
            w: predict_sharded(config, functions, "float32", SHAPE, Sharding(w)) for w in (1, 4)
        }
    finally:
        harness.configure({})
    one, four = found[1].by_kind, found[4].by_kind
    # a quarter of the states and weights per rank (FSDP2 pads each shard to whole rows)
    for kind in ("OPT", "SHARDED_PARAM"):
        assert abs(four[kind] * 4 / one[kind] - 1) < 0.1, (kind, one[kind], four[kind])
    assert found[4].peak_bytes < found[1].peak_bytes


def test_scaled_sharded_prediction_equals_the_whole_models():
    from probes.memory import control
    from probes.memory.fsdp import predict_sharded_scaled

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 4  # 24 layers: scaling saves work
    config = dict(control.TINY_GEMMA3, num_hidden_layers=len(types), layer_types=types)
    harness.configure(SCALED_OPTIONS)
    try:
        functions = functions_of(harness)
        shape = Shape("s", 1, 32)
        whole = predict_sharded(config_from_dict(dict(config)), functions, "float32", shape,
                                Sharding(2))  # fmt: skip
        scaled = predict_sharded_scaled(config_from_dict(dict(config)), functions, "float32",
                                        shape, Sharding(2))  # fmt: skip
    finally:
        harness.configure({})
    assert scaled.by_kind == whole.by_kind
    assert "scaled per layer type to the model's 24" in scaled.notes[0]


def test_a_model_fsdp2_cannot_shard_is_unknown_with_its_words(monkeypatch):
    from types import SimpleNamespace

    from probes.memory import sharded

    def refuses(*args, **kwargs):
        raise AttributeError("'FSDPParam' object has no attribute '_unsharded_param'")

    monkeypatch.setattr(sharded, "predict_sharded", refuses)
    memory = SimpleNamespace(target_gib=139, world_sizes=[2], reshard_after_forward=[True],
                             scale_layers=False, every_world_size=False)  # fmt: skip
    frame = sharded.sharded_frame(None, None, "bfloat16", SHAPE, memory, "sdpa")
    row = frame.iloc[0]
    assert row["verdict"] == "unknown" and "AttributeError" in row["reason"]
    assert sharded.fits_on_words(frame, "H200") == "not predicted under FSDP2"


def test_world_sizes_stop_at_the_first_that_fits_unless_every_one_is_asked(monkeypatch):
    """The smallest world size that fits is the answer: larger ones are predicted only with
    memory.every_world_size; none at all where the training shape fits one GPU."""
    from types import SimpleNamespace

    import pandas as pd

    from probes.memory import sharded

    asked = []

    def per_rank(config, functions, dtype, shape, sharding, *rest):
        asked.append(sharding.world_size)
        raise sharded.PredictError(f"stands in for {100 // sharding.world_size} GiB")

    monkeypatch.setattr(sharded, "predict_sharded", per_rank)
    monkeypatch.setattr(
        sharded, "sharded_row",
        lambda found, s, shape, target: {"world_size": s.world_size, "predicted_peak_gib": 1.0,
                                         "verdict": "fits" if s.world_size >= 4 else "x"},
    )  # fmt: skip
    memory = SimpleNamespace(target_gib=139, world_sizes=[8, 1, 4, 2], scale_layers=False,
                             reshard_after_forward=[True], every_world_size=False)  # fmt: skip
    sharded.sharded_frame(None, None, "bfloat16", SHAPE, memory, "sdpa")
    assert asked == [1, 2, 4]
    asked.clear()
    every = SimpleNamespace(**{**vars(memory), "every_world_size": True})
    sharded.sharded_frame(None, None, "bfloat16", SHAPE, every, "sdpa")
    assert asked == [1, 2, 4, 8]
    fits = pd.DataFrame({"shape": ["training"], "verdict": ["fits"]})
    assert not sharded.needs_sharding(fits, memory) and sharded.needs_sharding(fits, every)
    assert sharded.needs_sharding(fits.assign(verdict="does not fit"), memory)
