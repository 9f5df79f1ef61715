"""Pure pieces of the profile stage: FLOPs/MoE, chunked CE, batch shapes, harness loading,
schema defaults."""

import dataclasses
import textwrap

import pandas as pd
import pytest
import torch
from torch import nn

from conftest import workflow_config
from probes.config import SCHEMA, fill_defaults, load_yaml
from probes.lengths import LengthsError, read_training_lengths
from probes.profile.flops import (
    active_parameter_count,
    attended_pairs,
    attention_training_flops,
    mfu,
    peak_tflops_for,
)
from probes.step import batches as bt
from probes.step.ce import chunked_linear_cross_entropy, full_logits_cross_entropy
from probes.step.harness import HarnessError, load_harness

# --- FLOPs ----------------------------------------------------------------------------------


def test_moe_counts_only_the_routed_share_of_experts():
    sizes = [
        ("model.embed_tokens.weight", 1000),
        ("model.layers.0.self_attn.q_proj.weight", 100),
        ("model.layers.0.mlp.router.weight", 10),
        ("model.layers.0.mlp.experts.gate_up_proj", 800),
        ("model.layers.0.mlp.experts.down_proj", 400),
        ("model.layers.0.mlp.shared_expert.up_proj.weight", 50),
        ("model.vision_tower.blocks.0.weight", 5000),
    ]
    config = {"num_experts": 8, "num_experts_per_tok": 2}
    counts = active_parameter_count(
        sizes, config, input_embedding_names=["model.embed_tokens.weight"], tied_head_size=1000
    )
    # dense 100 + router 10 + shared 50 + routed 1200 * 2/8 + tied head 1000
    assert counts["active_params"] == 100 + 10 + 50 + 300 + 1000
    assert counts["moe_active_fraction"] == 0.25
    assert counts["non_text_params"] == 5000
    dense = active_parameter_count(sizes, {}, ["model.embed_tokens.weight"], tied_head_size=1000)
    assert dense["active_params"] == 100 + 10 + 800 + 400 + 50 + 1000


def test_attention_flops_follow_the_mask():
    assert attended_pairs(4, None) == 1 + 2 + 3 + 4
    assert attended_pairs(6, 2) == 1 + 2 + 2 + 2 + 2 + 2
    assert attended_pairs(3, 8) == attended_pairs(3, None)
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "sliding_window": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    # pairs kept: sliding window 2 over 6 tokens 1+2+2+2+2+2 = 11, causal 1+...+6 = 21;
    # 2 matmuls x 2 FLOPs x 4 heads x 16 dims per pair, x3 for forward + backward
    assert attention_training_flops(config, [6]) == 3 * 2 * 2 * 4 * 16 * (11 + 21)


def test_peak_and_mfu():
    assert peak_tflops_for("NVIDIA H200") == 989.0
    assert peak_tflops_for("AMD EPYC") is None
    assert mfu(989e12, 1.0, 989.0) == pytest.approx(1.0)
    assert mfu(1e12, 1.0, None) != mfu(1e12, 1.0, None)  # NaN without a peak


# --- chunked cross-entropy --------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("head_grad", [False, True])
def test_chunked_ce_matches_full_logits(softcap, head_grad):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    head.weight.requires_grad_(head_grad)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :4] = -100

    reference = full_logits_cross_entropy(hidden, head, labels, softcap)
    reference.backward()
    ref_grad = hidden.grad.clone()
    ref_weight_grad = head.weight.grad.clone() if head_grad else None
    hidden.grad = None
    head.weight.grad = None

    from probes.step.ce import shifted_loss_positions

    rows, targets = shifted_loss_positions(hidden, labels)
    chunked = chunked_linear_cross_entropy(rows, head, targets, 3, softcap) / targets.numel()
    chunked.backward()
    assert chunked.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, ref_grad, atol=1e-6)
    if head_grad:
        assert torch.allclose(head.weight.grad, ref_weight_grad, atol=1e-6)


# --- batches ----------------------------------------------------------------------------------


def lengths_frame(n=40):
    return pd.DataFrame(
        {
            "example_id": [f"id{i:03d}" for i in range(n)],
            "source": "s",
            "status": ["OK"] * (n - 3) + ["EMPTY", "ERROR", "TRUNCATED"],
            "n_tokens": [10 + 7 * i for i in range(n)],
            "n_loss_tokens": [5 + i for i in range(n)],
        }
    )


def test_training_lengths_exclude_empty_and_error(tmp_path):
    path = tmp_path / "lengths.parquet"
    lengths_frame().to_parquet(path)
    train = read_training_lengths(path, max_seq_len=400)
    assert set(train["status"]) == {"OK", "TRUNCATED"}
    assert len(train) == len(lengths_frame()) - 2
    with pytest.raises(LengthsError, match="max_seq_len=200"):  # the one reader's check
        read_training_lengths(path, max_seq_len=200)
    with pytest.raises(LengthsError, match="missing column"):
        lengths_frame().drop(columns="n_loss_tokens").to_parquet(path)
        read_training_lengths(path, 400)


def test_padding_pick_is_deterministic_and_fits():
    train = lengths_frame()
    one = bt.pick_padding_batches(train, 2, max_len=150, seed=0, n_batches=3)
    two = bt.pick_padding_batches(train, 2, max_len=150, seed=0, n_batches=3)
    assert one == two and len(one) == 3
    assert len({frozenset(p.example_ids) for p in one}) == 3  # distinct batches
    assert all(p.longest <= 150 and len(p.example_ids) == 2 for p in one)
    assert all(0 <= p.padding_waste < 1 for p in one)


def test_padded_and_packed_batches_have_the_same_tokens_with_loss():
    gen = torch.Generator().manual_seed(0)
    padded = bt.padded_batch([5, 3], [2, 1], 100, gen)
    assert padded["input_ids"].shape == (2, 5)
    assert padded["attention_mask"].sum().item() == 8
    assert (padded["labels"] != -100).sum().item() == 3
    packed = bt.packed_batch([5, 3], [2, 1], 100, gen)
    assert packed["input_ids"].shape == (1, 8)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert (packed["labels"] != -100).sum().item() == 3
    assert "attention_mask" not in packed


# --- harness loading --------------------------------------------------------------------------


def test_harness_from_file_path_and_import_path(tmp_path):
    file = tmp_path / "my_train.py"
    file.write_text(
        textwrap.dedent(
            """
            def discover_target_modules(model):
                return ["q_proj"]

            def compute_loss(model, batch):
                return 0
            """
        )
    )
    harness = load_harness(str(file))
    assert harness.describe()["functions"]["compute_loss"].endswith(".compute_loss")
    assert harness.hook("apply_adapters") is None
    reference = load_harness("probes.reference_harness")
    assert {"apply_adapters", "loss_from_hidden", "configure"} <= set(reference.hooks)


def test_harness_errors_say_what_to_do(tmp_path):
    with pytest.raises(HarnessError, match="does not exist"):
        load_harness(str(tmp_path / "missing.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_loss(model, batch):\n    return 0\n")
    with pytest.raises(HarnessError, match="discover_target_modules"):
        load_harness(str(bad))
    with pytest.raises(HarnessError, match="cannot import"):
        load_harness("no_such_package.train")


def test_reference_harness_targets_projections_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from probes.step import reference_harness

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    targets = reference_harness.discover_target_modules(model)
    leaves = {name.rsplit(".", 1)[-1] for name in targets}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("embed" in t or "lm_head" in t or "router" in t for t in targets)
    assert len(targets) == 4 * 7


# --- config -----------------------------------------------------------------------------------


def test_schema_defaults_fill_the_profile_section():
    schema = load_yaml(SCHEMA)["properties"]["profile"]
    filled = fill_defaults({"cpu": {"lengths": [8, 16, 32]}}, schema)
    assert filled["cpu"] == {
        "lengths": [8, 16, 32],
        "warmup": 1,
        "repeats": 2,
        "kernel_steps": 1,
        "padding_batches": 1,
        "probe_length": None,
        "threads": None,
    }
    assert filled["cuda"]["lengths"] == [4096, 8192, 16384]
    assert filled["harness"] == "probes.reference_harness"
    assert filled["idle"]["timeout_s"] == 600


def test_profile_lengths_beyond_max_seq_len_are_said():
    from probes.profile.prepare import lengths_note, resolve_settings

    schema = load_yaml(SCHEMA)["properties"]
    profile = fill_defaults({"device": "cpu"}, schema["profile"])
    training = fill_defaults({"max_seq_len": 8}, schema["training"])
    cfg = workflow_config(profile=profile, training=training)
    settings = resolve_settings(cfg.profile, cfg.training)
    note = lengths_note(settings, "cpu")
    assert note.startswith("profile.cpu.lengths [16, 32, 64] exceed training.max_seq_len=8")
    longer = dataclasses.replace(cfg.training, max_seq_len=64)
    assert lengths_note(resolve_settings(cfg.profile, longer), "cpu") is None
