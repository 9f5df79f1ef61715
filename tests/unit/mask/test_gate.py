"""The mask gate on tiny real architectures built from config dicts (meta device, no weights)."""

import pandas as pd
import pytest

from conftest import REPO, TINY_GEMMA3_CONFIG
from probes.mask import backend as sdpa_backend
from probes.mask import confirm as sdpa_confirm
from probes.mask import control as mask_control
from probes.mask import gate as mask
from probes.mask import layers as mask_layers
from probes.mask import verdict as mask_gate
from probes.mask.layers import GateError
from probes.mask.scenarios import Scenario, packed_doc_ids

GEMMA3 = TINY_GEMMA3_CONFIG
WINDOW = GEMMA3["sliding_window"]
# the sizes alone, for other architectures (a Llama: one attention kind, no sliding window)
BASE = {k: v for k, v in GEMMA3.items() if k not in ("model_type", "sliding_window", "layer_types")}
LLAMA = {**BASE, "model_type": "llama"}
TRAINING = {"micro_batch_size": 2, "max_seq_len": 24}


# Backend expectations below are for torch 2.10's wheel (cuDNN 9.10.2: flash first on sm90), so
# they do not move with the torch installed here; test_mask_backend covers the version rules.
PINNED_TARGET = {"torch_version": "2.10.0"}


def run(config, training=TRAINING, **mask_overrides) -> tuple[pd.DataFrame, dict]:
    mask_cfg = mask_gate.merged_mask_config({**PINNED_TARGET, **mask_overrides})
    return mask_gate.evaluate(config, mask_cfg, training, progress=False)


def rows(table: pd.DataFrame, scenario: str, layer_type: str | None = None) -> pd.DataFrame:
    part = table[table["scenario"] == scenario]
    return part if layer_type is None else part[part["layer_type"] == layer_type]


def test_window_boundary_just_below_at_and_above():
    table, gate = run(GEMMA3, scenarios=["below_window", "at_window", "above_window"])
    assert gate["passed"], gate["violations"]
    below = rows(table, "below_window", "sliding_attention")
    assert below["seq_len"].eq(WINDOW - 1).all()
    # T < W: the sliding mask is skipped and SDPA runs is_causal
    assert below["fast_path"].all() and not below["mask_present"].any()
    # T == W: the band is still plain causal, but transformers materialises the mask
    at = rows(table, "at_window", "sliding_attention")
    assert at["mask_present"].all() and not at["fast_path"].any()
    assert at["band_lower"].eq(WINDOW - 1).all() and at["keys_max"].eq(WINDOW).all()
    # T > W: the window cuts in
    above = rows(table, "above_window", "sliding_attention")
    assert above["keys_max"].eq(WINDOW).all() and above["band_lower"].eq(WINDOW - 1).all()
    assert above["band_upper"].eq(0).all() and above["band_ok"].all()
    full = table[table["layer_type"] == "full_attention"]
    assert full["fast_path"].all() and full["backend"].eq("flash").all()


def test_padding_forces_a_mask_on_every_layer():
    table, gate = run(LLAMA, scenarios=["train", "right_padded", "left_padded"])
    assert gate["passed"], gate["violations"]
    assert rows(table, "train")["fast_path"].all()
    for scenario in ("right_padded", "left_padded"):
        padded = rows(table, scenario)
        assert padded["mask_present"].all() and not padded["fast_path"].any()
        assert padded["pad_keys_attended"].eq(0).all() and padded["band_ok"].all()
        assert padded["backend"].eq("efficient").all()
        assert padded["excluded_by"].str.contains("attn_mask present").all()
    # left padding: the padding query rows attend nothing at all
    assert rows(table, "left_padded")["fully_masked_rows"].gt(0).all()


def test_packing_gives_a_block_diagonal_band():
    table, gate = run(GEMMA3, scenarios=["packed"], packed_doc_fractions=[0.5, 0.3, 0.2])
    assert gate["passed"], gate["violations"]
    packed = rows(table, "packed")
    assert packed["n_docs"].eq(3).all() and packed["blocks"].eq(3).all()
    assert packed["mask_present"].all() and packed["band_ok"].all()
    # documents of 12, 7, 5 tokens: a full layer reaches back 11 keys, a sliding one W - 1
    assert rows(table, "packed", "full_attention")["band_lower"].eq(11).all()
    assert rows(table, "packed", "sliding_attention")["band_lower"].eq(WINDOW - 1).all()


def test_full_attention_only_model_keeps_the_fast_path():
    table, gate = run(LLAMA, scenarios=["train"])
    train = rows(table, "train")
    assert len(train) == 4 and train["fast_path"].all()
    assert train["gqa_path"].eq("enable_gqa").all() and train["backend"].eq("flash").all()
    assert gate["headline"].startswith("4 of 4 decoder layers keep")


def test_head_dim_above_256_excludes_flash():
    table, _ = run({**LLAMA, "head_dim": 512}, scenarios=["train"])
    train = rows(table, "train")
    assert train["head_dim"].eq(512).all() and train["fast_path"].all()
    # no mask, yet flash is out; transformers also drops enable_gqa above 256 (repeat_kv)
    assert train["backend"].eq("efficient").all()
    assert train["excluded_by"].eq("flash: head_dim 512 > 256").all()
    assert train["gqa_path"].eq("repeat_kv").all()


def test_gate_fails_on_a_deliberately_wrong_window():
    table, gate = run(GEMMA3, scenarios=["train"], expected_sliding_window=WINDOW + 1)
    assert not gate["passed"] and gate["violations_total"] == 3
    first = gate["violations"][0]
    assert "layer 0 (sliding_attention, expected window 9)" in first
    assert "scenario 'train'" in first and "row 8 attends keys [1..8]" in first
    assert rows(table, "train", "full_attention")["band_ok"].all()


def test_gate_catches_documents_leaking_into_each_other(monkeypatch):
    # simulate a transformers that ignores restarting position_ids: packed docs must then fail
    import transformers.masking_utils as masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    _, gate = run(LLAMA, scenarios=["packed"])
    assert not gate["passed"]
    assert "scenario 'packed'" in gate["violations"][0]
    assert "row 12 attends keys [0..12]" in gate["violations"][0]


def test_mistral_slides_every_layer_without_layer_types():
    table, gate = run(
        {**BASE, "model_type": "mistral", "sliding_window": WINDOW},
        scenarios=["train", "below_window"],
    )
    assert gate["passed"], gate["violations"]
    assert table["layer_type"].eq("sliding_attention").all()
    assert rows(table, "train")["keys_max"].eq(WINDOW).all()
    assert rows(table, "below_window")["fast_path"].all()


def test_moe_model_traces_on_meta():
    config = {
        **BASE,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    table, gate = run(config, scenarios=["train", "packed"])
    assert gate["passed"], gate["violations"]
    assert rows(table, "train")["fast_path"].all()
    assert rows(table, "packed")["blocks"].eq(3).all()


def test_eager_only_model_is_reported_not_crashed():
    # Gemma 2 softcaps attention logits: transformers refuses SDPA and runs eager
    table, gate = run(
        {**BASE, "model_type": "gemma2", "sliding_window": WINDOW}, scenarios=["train", "packed"]
    )
    assert gate["passed"], gate["violations"]
    assert table["backend"].eq("eager").all() and table["mask_present"].all()
    assert table["mask_dtype"].str.startswith("bfloat16").all()  # additive float masks
    assert gate["model"]["sdpa_supported"] is False
    assert any("SDPA unsupported" in note for note in gate["notes"])


def test_multimodal_wrapper_with_token_type_ids_loses_the_full_layer_fast_path():
    from probes.mask.control import CONTROL_MULTIMODAL

    config = {**CONTROL_MULTIMODAL, "text_config": {**GEMMA3}}  # the control's vision tower
    table, gate = run(config, scenarios=["train", "token_type_ids"])
    assert gate["passed"], gate["violations"]
    assert gate["model"]["traced_class"] == "Gemma3Model"
    assert rows(table, "train", "full_attention")["fast_path"].all()
    with_tti = rows(table, "token_type_ids", "full_attention")
    assert with_tti["mask_present"].all() and not with_tti["fast_path"].any()
    assert with_tti["band_ok"].all()


def test_token_type_ids_scenario_skips_itself_for_text_models():
    _, gate = run(LLAMA, scenarios=["train", "token_type_ids", "at_window"])
    assert [s["scenario"] for s in gate["scenarios"]] == ["train"]
    assert len(gate["notes"]) == 2


def test_positive_control_recovers_the_known_answer():
    control = mask_control.run_control()
    assert control["passed"], control["mismatches"]
    assert control["observed"]["wrong_window_detected"] is True
    assert set(control) >= {"name", "description", "expected", "observed", "passed"}


def test_oversized_mask_is_refused_with_a_clear_message():
    # eager (Gemma 2 refuses SDPA) is handed its masks dense: those are refused over the limit
    gemma2 = {**BASE, "model_type": "gemma2", "sliding_window": WINDOW}
    with pytest.raises(GateError, match="max_mask_gib"):
        run(
            gemma2,
            training={"micro_batch_size": 2, "max_seq_len": 64},
            scenarios=["train"],
            max_mask_gib=1e-9,
        )
    # SDPA's are built and measured a block of rows at a time: no whole mask to refuse
    _, gate = run(
        LLAMA,
        training={"micro_batch_size": 2, "max_seq_len": 64},
        scenarios=["train", "right_padded"],
        max_mask_gib=1e-9,
    )
    assert gate["passed"]


def test_unknown_scenario_names_the_key():
    with pytest.raises(ValueError, match="mask.scenarios"):
        run(LLAMA, scenarios=["bogus"])


def test_layers_table_has_the_stable_columns():
    table, _ = run(GEMMA3, scenarios=["train"])
    assert list(table.columns) == list(mask_layers.LAYER_COLUMNS)
    assert str(table["band_lower"].dtype) == "Int64"


def test_shipped_gemma3_27b_config_traces_its_real_layer_pattern():
    from probes.mask.trace import read_config_json

    repo = REPO
    config = read_config_json(repo / "config" / "models" / "gemma-3-27b-it" / "config.json")
    table, gate = run(
        config, training={"micro_batch_size": 1, "max_seq_len": 1100}, scenarios=["train"]
    )
    model = gate["model"]
    assert model["num_layers"] == 62 and model["traced_class"] == "Gemma3Model"
    assert model["layer_type_counts"] == {"sliding_attention": 52, "full_attention": 10}
    train = rows(table, "train")
    assert train["q_heads"].eq(32).all() and train["kv_heads"].eq(16).all()
    assert train["head_dim"].eq(128).all()
    assert rows(table, "train", "sliding_attention")["keys_max"].eq(1024).all()
    assert gate["headline"].startswith("10 of 62")


def test_gemma4_moe_global_layers_have_head_dim_512_and_lose_flash():
    config = {
        **BASE,
        "model_type": "gemma4_text",
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 64,
    }
    table, gate = run(config, scenarios=["train"])
    assert gate["passed"], gate["violations"]
    full = rows(table, "train", "full_attention")
    assert full["head_dim"].eq(512).all() and full["fast_path"].all()
    assert full["backend"].eq("efficient").all()
    assert full["excluded_by"].eq("flash: head_dim 512 > 256").all()
    assert rows(table, "train", "sliding_attention")["head_dim"].eq(16).all()


def test_meta_replay_does_not_change_the_recorded_calls(monkeypatch):
    from probes.mask import trace as mask_trace

    inputs = Scenario("packed", "", packed_doc_ids([10, 6, 8])).inputs()

    def calls():
        probe = mask_trace.build_probe_model(GEMMA3)
        records = mask_trace.trace_attention(probe, inputs)
        return [(r.layer_idx, r.call, None if r.mask is None else r.mask.tolist()) for r in records]

    with_replay = calls()
    monkeypatch.setattr(mask_trace, "memoise_decoder_submodules", lambda layers: None)
    monkeypatch.setattr(mask_trace, "MEMOISED_HELPERS", ())
    assert calls() == with_replay and len(with_replay) == 4


def test_a_layer_without_an_attention_call_fails_the_gate(monkeypatch):
    traced = mask_layers.trace_attention
    monkeypatch.setattr(
        mask_layers, "trace_attention", lambda probe, inputs: traced(probe, inputs)[1:]
    )  # layer 0's call goes missing
    _, gate = run(LLAMA, scenarios=["train"])
    assert not gate["passed"]
    assert gate["violations"] == [
        "layer 0 (full_attention) in scenario 'train': no attention call recorded"
    ]


# --- backend confirmation (torch's own choice stubbed: this suite runs without a GPU) -----------

CONFIRM_SCENARIOS = ["train", "right_padded", "packed"]


def stub_confirmation(monkeypatch, torch_chooses) -> None:
    """Pretend a CUDA device is here and torch picks `torch_chooses(call)` for every call."""
    monkeypatch.setattr(sdpa_confirm, "cuda_available", lambda: True)
    monkeypatch.setattr(
        sdpa_confirm,
        "local_target",
        lambda requires_grad=True: sdpa_backend.resolve_target((9, 0), "2.10.0"),
    )
    monkeypatch.setattr(
        sdpa_confirm,
        "confirm_with_torch",
        lambda call, device="cuda", requires_grad=True: {
            "ran": True,
            "backend": torch_chooses(call),
            "can_use": {},
        },
    )


def test_confirmation_counts_agreed_calls_per_scenario(monkeypatch):
    # flash-first rules (torch 2.10 wheel): flash without a mask, efficient with one
    stub_confirmation(monkeypatch, lambda call: "efficient" if call.mask_present else "flash")
    _, gate = run(GEMMA3, scenarios=CONFIRM_SCENARIOS)
    confirm = gate["confirm"]
    assert confirm["status"] == "agreed" and gate["passed"]
    assert (confirm["agreed"], confirm["total"]) == (12, 12)  # 4 layers x 3 scenarios
    assert confirm["per_scenario"] == {
        name: {"agreed": 4, "total": 4} for name in CONFIRM_SCENARIOS
    }
    for entry in gate["scenarios"]:
        assert (entry["confirm_agreed"], entry["confirm_total"]) == (4, 4)


def test_a_confirmation_disagreement_fails_the_gate(monkeypatch):
    # torch "runs" cuDNN wherever a mask is present. Which layers carry a mask is known from the
    # scenarios (the control's answers): at T=24 > window 8 the 3 sliding layers of `train` do and
    # its full layer does not; padding and packing put one on all 4. So 1 of 4 agree in train.
    stub_confirmation(monkeypatch, lambda call: "cudnn" if call.mask_present else "flash")
    _, gate = run(GEMMA3, scenarios=CONFIRM_SCENARIOS)
    confirm = gate["confirm"]
    assert confirm["status"] == "disagreed" and not gate["passed"]
    assert confirm["per_scenario"] == {
        "train": {"agreed": 1, "total": 4},
        "right_padded": {"agreed": 0, "total": 4},
        "packed": {"agreed": 0, "total": 4},
    }
    assert confirm["disagreements"][0].endswith("predicted efficient, torch chose cudnn")
    with pytest.raises(GateError, match=r"1 of 12 calls agree \(train 1/4, right_padded 0/4"):
        mask.run_gate(
            GEMMA3, {**PINNED_TARGET, "scenarios": CONFIRM_SCENARIOS}, TRAINING, progress=False
        )


def test_without_cuda_the_gate_says_not_confirmed(monkeypatch):
    monkeypatch.setattr(sdpa_confirm, "cuda_available", lambda: False)
    table, gate = run(GEMMA3, scenarios=["train"])
    confirm = gate["confirm"]
    assert confirm["ran"] is False and confirm["status"] == "not confirmed: no CUDA"
    assert confirm["per_scenario"] == {} and confirm["agreed"] is None
    assert gate["scenarios"][0]["confirm_total"] is None and gate["passed"]
    assert table["confirmed_backend"].isna().all()
