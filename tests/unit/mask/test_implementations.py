"""The mask gate per attention implementation (probes.mask.implementations) on a tiny Gemma 3
built from a config dict (meta device, no weights): eager, sdpa and flex keep packed documents
apart, padding unattended and the window exact; a collator that lets documents see each other is
refused by name; flash is never passed unchecked."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_GEMMA3_CONFIG
from probes.mask import flex
from probes.mask import implementations as im
from probes.mask import verdict as mask_gate
from probes.mask.scenarios import CollatorError, flattening_collator

TRAINING = {"micro_batch_size": 2, "max_seq_len": 24}
SCENARIOS = ["above_window", "right_padded", "left_padded", "packed"]


def check(implementations, scenarios=SCENARIOS, collator=None) -> dict:
    cfg = mask_gate.merged_mask_config({"torch_version": "2.10.0", "scenarios": scenarios})
    return im.check_implementations(
        dict(TINY_GEMMA3_CONFIG),
        cfg,
        TRAINING,
        packed_collator=collator,
        implementations=implementations,
    )


def test_eager_sdpa_and_flex_keep_documents_apart_padding_out_and_the_window_exact():
    verdicts = check(["eager", "sdpa", "flex_attention"])
    for name in ("eager", "sdpa", "flex_attention"):
        verdict = verdicts[name]
        assert verdict["status"] == im.PASSED, (name, verdict["violation"])
        assert verdict["scenarios"] == SCENARIOS and verdict["packed_checked"]
        # every layer's pattern is known (3 sliding, 1 full) and was checked in every scenario
        assert all(s["layers_checked"] == 4 for s in verdict["per_scenario"])
        assert im.padding_free_verdict(verdicts, name) is None


def test_a_collator_with_an_all_ones_mask_beside_packed_positions_is_refused():
    # transformers#46634: a 2-D mask beside restarting position_ids disables packed detection
    leaky = im.with_all_ones_mask(flattening_collator())
    verdicts = check(["eager", "sdpa"], scenarios=["right_padded", "packed"], collator=leaky)
    for name in ("eager", "sdpa"):
        verdict = verdicts[name]
        assert verdict["status"] == im.FAILED
        by_scenario = {s["scenario"]: s for s in verdict["per_scenario"]}
        assert by_scenario["right_padded"]["status"] == im.PASSED  # padding is not the problem
        assert by_scenario["packed"]["violations"] == 4  # every layer
        # the second document (tokens 12..18) starts at row 12, which sees the first document
        assert "scenario 'packed'" in verdict["violation"]
        assert "row 12 attends keys [5..12]" in verdict["violation"]
        reason = im.padding_free_verdict(verdicts, name)
        assert reason is not None and verdict["violation"] in reason


def test_flash_is_listed_not_checked_and_never_cleared():
    verdicts = check(["flash_attention_2"])
    assert verdicts["flash_attention_2"]["status"] == im.NOT_CHECKED
    assert "takes no mask" in verdicts["flash_attention_2"]["reason"]
    assert "did not check" in im.padding_free_verdict(verdicts, "flash_attention_2")


def test_without_the_packed_scenario_separation_is_unchecked():
    verdicts = check(["sdpa"], scenarios=["right_padded"])
    assert verdicts["sdpa"]["status"] == im.PASSED and not verdicts["sdpa"]["packed_checked"]
    assert "add 'packed' to mask.scenarios" in im.padding_free_verdict(verdicts, "sdpa")
    assert "did not check attention implementation eager" in im.padding_free_verdict(
        verdicts, "eager"
    )


def test_a_collator_that_does_not_flatten_fails_naming_it():
    def padded(features):
        return {"input_ids": torch.ones(len(features), 12, dtype=torch.long)}

    with pytest.raises(CollatorError, match=r"scenario 'packed'.*not \(1, 24\)"):
        check(["eager"], scenarios=["packed"], collator=padded)


def test_flex_dense_mask_is_what_the_kernel_attends():
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    def doc_causal(b, h, q, kv):
        return (q >= kv) & (q // 40 == kv // 40)

    block_mask = create_block_mask(doc_causal, 1, 1, 100, 100, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(flex.dense_allowed(block_mask), create_mask(doc_causal, 1, 1, 100, 100))
    # a block marked full is attended whole, whatever mask_mod says: the kernel never asks it
    wrong = block_mask._adjust(100, 100)
    full = torch.zeros_like(wrong.kv_num_blocks)
    full[0, 0, 1] = 1  # query block 1 (rows 32..63): key block 0 full
    indices = torch.zeros_like(wrong.kv_indices)
    forced = type(block_mask).from_kv_blocks(
        wrong.kv_num_blocks,
        wrong.kv_indices,
        full,
        indices,
        BLOCK_SIZE=32,
        mask_mod=doc_causal,
        seq_lengths=(100, 100),
    )
    dense = flex.dense_allowed(forced)[0, 0]
    assert dense[45, :32].all()  # row 45 (document 2) sees document 1's keys 0..31


def test_further_implementations_trace_the_packed_padded_and_window_scenarios_only():
    verdicts = check(["eager"], scenarios=["train", "token_type_ids", "packed"])
    assert verdicts["eager"]["scenarios"] == ["packed"] and verdicts["eager"]["packed_checked"]
    nothing = check(["eager"], scenarios=["train"])["eager"]
    assert nothing["status"] == im.NOT_CHECKED and "add 'packed'" in nothing["reason"]
