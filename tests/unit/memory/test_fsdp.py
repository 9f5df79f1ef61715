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

# Weight-heavy and short, so the sharded weights, gradients and AdamW states dominate the peak,
# in many small layers: gloo's worker thread can hold one layer's communication buffer a little
# longer (timing), which is one layer's unsharded size at the peak (2.4 MB of 19 MB with two
# layers of 256; here 0.6 MB).
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
OPTIONS = {"gradient_checkpointing": True}


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
