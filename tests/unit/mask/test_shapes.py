"""Which shape each check runs at (probes.mask.shapes): the semantic shape, the dispatch trace,
SDPA's masks built by blocks of rows; the verdicts against the previous gate's (every scenario
traced densely at the training shape, recorded in old_gate_verdicts.json); and a planted mask
bug per attention implementation, caught at the semantic shape."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, TINY_GEMMA3_CONFIG
from probes.mask import control as mask_control
from probes.mask import gate as mask
from probes.mask import implementations as im
from probes.mask import shapes
from probes.mask import verdict as mask_gate
from probes.mask.digest import digest
from probes.mask.layers import merge_dispatch

OLD = json.loads((REPO / "tests/unit/mask/old_gate_verdicts.json").read_text())
MASK_DEFAULTS = {"pad_fraction": 0.25, "packed_doc_fractions": [0.5, 0.3, 0.2]}
PINNED = {"torch_version": "2.10.0", "confirm_on_cuda": False}
# the suite's tiny shape, and one where the semantic shape (2 x 256) is below the training shape
SPLIT = {"micro_batch_size": 2, "max_seq_len": 512}


def plan(batch, seq_len, window):
    return shapes.plan_shapes(
        MASK_DEFAULTS, {"micro_batch_size": batch, "max_seq_len": seq_len}, window
    )


def test_semantic_shape_puts_rows_and_documents_on_every_side_of_the_window():
    # 2 x 16,384 against a window of 1024: every padded row and packed document is longer than
    # the window; at 2 x 2176 they still are (the longest document 1088), one more block is not
    big = plan(2, 16384, 1024)
    assert big.semantic_seq_len == 2176 and big.reduced
    wanted = shapes.window_relations(16384, 2, MASK_DEFAULTS, 1024)
    found = shapes.window_relations(2176, 2, MASK_DEFAULTS, 1024)
    assert all(found[key] >= sides for key, sides in wanted.items())
    shorter = shapes.window_relations(2176 - 128, 2, MASK_DEFAULTS, 1024)
    assert shorter["packed_documents"] == {"within"}  # no document outgrows the window
    # the same remainder modulo flex's block, at least two blocks, never above the training T
    assert plan(2, 16384 + 5, 1024).semantic_seq_len % shapes.FLEX_BLOCK == 5
    assert plan(2, 24, 8).semantic_seq_len == 24 and not plan(2, 24, 8).reduced
    assert plan(2, 512, None).semantic_seq_len == 2 * shapes.FLEX_BLOCK
    # nothing shorter sits on both sides of the window as 1 x 1100 does: the training shape
    assert plan(1, 1100, 1024).semantic_seq_len == 1100


BASE = {k: v for k, v in TINY_GEMMA3_CONFIG.items() if k not in ("model_type", "layer_types")}
BASE.pop("sliding_window")
# the tiny configs the suite's mask tests use, as the previous gate's verdicts were taken on them
TINY_CONFIGS = {
    "gemma3_tiny": TINY_GEMMA3_CONFIG,
    "llama_tiny": {**BASE, "model_type": "llama"},
    "mistral_tiny": {**BASE, "model_type": "mistral", "sliding_window": 8},
    "qwen3_moe_tiny": {
        **BASE,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    },
    "gemma2_tiny": {**BASE, "model_type": "gemma2", "sliding_window": 8},
    "gemma3_multimodal_tiny": {
        "model_type": "gemma3",
        "text_config": dict(TINY_GEMMA3_CONFIG),
        "vision_config": mask_control.CONTROL_MULTIMODAL["vision_config"],
        "mm_tokens_per_image": 4,
    },
    "gemma4_moe_tiny": {
        **BASE,
        "model_type": "gemma4_text",
        "sliding_window": 8,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 64,
    },
}


def run_gate_without_control(monkeypatch, config, training):
    monkeypatch.setattr(mask, "run_control", lambda: {"name": "stub", "passed": True})
    return mask.run_gate(config, dict(PINNED), training, progress=False)


# every tiny config at the suite's shape; at 2 x 512 (semantic 2 x 256) the ones whose masks
# differ most: sliding + full, the multimodal wrapper (token_type_ids), no window at all
SPLIT_CASES = ("gemma3_tiny@2x512", "gemma3_multimodal_tiny@2x512", "llama_tiny@2x512")
TINY_CASES = sorted(key for key in OLD["tiny"] if key.endswith("@2x24") or key in SPLIT_CASES)


@pytest.mark.parametrize("case", TINY_CASES)
def test_verdicts_equal_the_previous_gates_on_the_tiny_configs(monkeypatch, case):
    name, shape = case.split("@")
    batch, seq_len = (int(v) for v in shape.split("x"))
    training = {"micro_batch_size": batch, "max_seq_len": seq_len}
    layers, gate, _ = run_gate_without_control(monkeypatch, TINY_CONFIGS[name], training)
    assert digest(layers, gate) == OLD["tiny"][case]


def test_verdicts_equal_the_previous_gates_on_gemma3_27b(monkeypatch):
    from probes.mask.trace import read_config_json

    config = read_config_json(REPO / "config/models/gemma-3-27b-it/config.json")
    training = {"micro_batch_size": 2, "max_seq_len": 4096}
    layers, gate, _ = run_gate_without_control(monkeypatch, config, training)
    assert digest(layers, gate) == OLD["real"]["gemma-3-27b-it@2x4096"]
    # the band of the padded, packed and token_type_ids scenarios at 2 x 2176; what SDPA is
    # handed (and the training-shape band of `train`) at 2 x 4096; eager and flex at 2 x 2176
    assert gate["shapes"]["semantic"] == "2x2176"
    by_name = {s["scenario"]: s for s in gate["scenarios"]}
    assert by_name["train"]["band_shape"] == by_name["train"]["dispatch_shape"] == "2x4096"
    assert by_name["right_padded"]["band_shape"] == "2x2176"
    assert by_name["right_padded"]["dispatch_shape"] == "2x4096"
    flex = gate["implementations"]["flex_attention"]["per_scenario"]
    assert {s["scenario"]: s["checked_at"] for s in flex}["packed"] == "1x2176"


# --- a planted bug per implementation --------------------------------------------------------


def window_one_too_wide(arguments):
    """Sliding masks (the interface gets local_size) also attend the key before their window."""
    if not arguments.get("local_size"):
        return arguments
    function, last = arguments["mask_function"], arguments["kv_length"] - 1

    def widened(b, h, q, kv):
        shifted = torch.clamp(kv + 1, max=last)
        return function(b, h, q, kv) | (function(b, h, q, shifted) & (kv < shifted))

    return {**arguments, "mask_function": widened}


def padding_attended(arguments):
    return {**arguments, "attention_mask": None}


def documents_not_apart(arguments):
    """Full-attention masks attend every earlier key, whatever document it belongs to."""
    if arguments.get("local_size"):
        return arguments
    function = arguments["mask_function"]
    return {**arguments, "mask_function": lambda b, h, q, kv: function(b, h, q, kv) | (kv <= q)}


MASK_INTERFACE = {"sdpa": "sdpa", "eager": "eager", "flex_attention": "flex_attention"}
BUGS = {  # the bug, the scenario that must fail, the shape it must be caught at
    "window": (window_one_too_wide, "above_window", "1x9"),
    "padding": (padding_attended, "left_padded", "2x256"),
    "documents": (documents_not_apart, "packed", "1x256"),
}


def plant(monkeypatch, implementation, bug):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    original = mapping[MASK_INTERFACE[implementation]]
    monkeypatch.setitem(
        mapping, MASK_INTERFACE[implementation], lambda **kwargs: original(**bug(kwargs))
    )


@pytest.mark.parametrize("bug", sorted(BUGS))
@pytest.mark.parametrize("implementation", sorted(MASK_INTERFACE))
def test_a_planted_mask_bug_is_caught_per_implementation(monkeypatch, implementation, bug):
    change, scenario, shape = BUGS[bug]
    plant(monkeypatch, implementation, change)
    cfg = mask_gate.merged_mask_config({**PINNED, "scenarios": [scenario]})
    verdicts = im.check_implementations(
        dict(TINY_GEMMA3_CONFIG), cfg, SPLIT, implementations=[implementation]
    )
    verdict = verdicts[implementation]
    assert verdict["status"] == im.FAILED
    entry = {s["scenario"]: s for s in verdict["per_scenario"]}[scenario]
    assert entry["status"] == im.FAILED and entry["checked_at"] == shape
    assert im.padding_free_verdict(verdicts, implementation) is not None


def test_the_other_implementations_stay_clean_beside_a_planted_bug(monkeypatch):
    plant(monkeypatch, "eager", documents_not_apart)
    cfg = mask_gate.merged_mask_config({**PINNED, "scenarios": ["packed"]})
    verdicts = im.check_implementations(
        dict(TINY_GEMMA3_CONFIG), cfg, SPLIT, implementations=["sdpa", "flex_attention"]
    )
    assert {v["status"] for v in verdicts.values()} == {im.PASSED}


# --- the row-built masks and the dispatch trace ----------------------------------------------


def test_the_control_catches_rows_built_one_row_off(monkeypatch):
    assert mask_control.by_rows_agrees_with_dense()
    original = shapes.SdpaMasks.rows

    def shifted(self, arguments, start, stop):
        moved = {**arguments, "q_offset": int(arguments.get("q_offset") or 0) + 1}
        return original(self, moved, start, stop)

    monkeypatch.setattr(shapes.SdpaMasks, "rows", shifted)
    assert not mask_control.by_rows_agrees_with_dense()


def test_a_mask_that_comes_and_goes_with_t_is_measured_at_the_training_shape():
    band = [{"mask_present": True, "band_lower": 7, "seq_len": 256}]
    assert merge_dispatch([{"mask_present": False}], band) is None  # the caller measures at T
    dispatch = [{"mask_present": True, "seq_len": 512, "backend": "efficient"}]
    (merged,) = merge_dispatch(dispatch, band)
    assert merged["band_lower"] == 7  # the band from the semantic shape
    assert merged["seq_len"] == 512 and merged["backend"] == "efficient"  # dispatch from T


def test_torch_confirms_the_calls_of_the_training_shape(monkeypatch):
    # on CUDA each SDPA call is put to torch: those of the training shape, not the band's
    from probes.mask import backend as sdpa_backend
    from probes.mask import confirm as sdpa_confirm

    asked = []
    monkeypatch.setattr(sdpa_confirm, "cuda_available", lambda: True)
    monkeypatch.setattr(
        sdpa_confirm,
        "local_target",
        lambda requires_grad=True: sdpa_backend.resolve_target((9, 0), "2.10.0"),
    )

    def confirm(call, device="cuda", requires_grad=True):
        asked.append(call.q_shape[2])
        return {"ran": True, "backend": "efficient" if call.mask_present else "flash"}

    monkeypatch.setattr(sdpa_confirm, "confirm_with_torch", confirm)
    cfg = mask_gate.merged_mask_config(
        {**PINNED, "confirm_on_cuda": True, "scenarios": ["train", "right_padded", "packed"]}
    )
    _, gate = mask_gate.evaluate(dict(TINY_GEMMA3_CONFIG), cfg, SPLIT, progress=False)
    assert gate["confirm"]["status"] == "agreed"
    assert gate["confirm"]["per_scenario"]["right_padded"] == {"agreed": 4, "total": 4}
    assert set(asked) == {512}  # 2 x 512, never the semantic 2 x 256
