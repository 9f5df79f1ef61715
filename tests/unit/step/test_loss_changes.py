"""The loss kernel as a step-level change (probes.step.loss_changes): the reference harness's
stock and chunked losses are the same loss, the switch flips it through the harness's own
configure, a trainer's loss is recorded with why it is not priced, and the GPU-only kernels
are listed, never priced, on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
import trl

from conftest import tiny_gemma, workflow_config
from probes.settings import WorkflowConfig
from probes.step import changes as sc
from probes.step import loss_changes as lc
from probes.step import reference_harness as rh
from probes.step.load import load_step

IGNORE = -100


@pytest.fixture(autouse=True)
def reset_reference_harness():
    yield
    rh.configure({})  # the module's options are process-wide


def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded row
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :4] = IGNORE  # a prompt without loss
    padded = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    packed = {  # two documents in one row, position ids restarting (no attention mask)
        "input_ids": ids[:1],
        "position_ids": torch.tensor([list(range(5)) + list(range(7))]),
        "labels": labels[:1],
    }
    return [padded, packed]


def _loss_and_grads(model, batch, kernel: str) -> tuple[float, dict[str, torch.Tensor]]:
    rh.configure({rh.LOSS_OPTION: kernel, "ce_chunk_tokens": 5})  # several chunks
    model.zero_grad(set_to_none=True)
    loss = rh.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_stock_and_chunked_losses_are_the_same_loss_and_gradients(softcap):
    model = tiny_gemma(vocab_size=97).float()
    model.config.final_logit_softcapping = softcap
    for batch in _batches(97):
        chunked, chunked_grads = _loss_and_grads(model, batch, rh.CHUNKED)
        stock, stock_grads = _loss_and_grads(model, batch, rh.STOCK)
        assert chunked == pytest.approx(stock, rel=1e-5)
        assert (
            chunked_grads.keys() == stock_grads.keys()
            and "model.embed_tokens.weight" in stock_grads
        )  # the tied head
        for name, grad in stock_grads.items():
            torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6)
        # the stock head + loss alone (the profile's CE probe) is the model's own loss too
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = model.get_decoder()(**inputs, use_cache=False)[0]  # as compute_loss calls it
        with torch.no_grad():
            alone = rh.loss_from_hidden(model, hidden, batch["labels"])
        assert float(alone) == pytest.approx(stock, rel=1e-5)


def test_configure_keeps_the_heads_positions_in_step_and_refuses_an_unknown_kernel():
    rh.configure({rh.LOSS_OPTION: rh.STOCK})
    assert rh.LM_HEAD_POSITIONS == "all"
    rh.configure({})
    assert rh.LM_HEAD_POSITIONS == "loss" and rh.OPTIONS[rh.LOSS_OPTION] == rh.CHUNKED
    with pytest.raises(ValueError, match="loss_kernel: 'fused' is not one of"):
        rh.configure({rh.LOSS_OPTION: "fused"})


def _config() -> WorkflowConfig:
    return workflow_config(
        profile={
            "harness": "probes.reference_harness",
            "attn_implementation": "sdpa",
            "ce_chunk_tokens": 16,
            "harness_options": {"lora_r": 4},
        }
    )


def test_the_switch_flips_the_harness_loss_through_its_configure(tiny_model_dir):
    runner, *_ = load_step(_config(), tiny_model_dir, torch.device("cpu"), torch.float32, None)
    switch = sc.StepSwitch(runner)
    assert switch.base == sc.StepConfig(False, "sdpa", rh.CHUNKED)
    changes = {c.strategy: c for c in sc.step_changes(switch.base, 2, 8)}
    stock = changes["loss_stock"]
    assert stock.settings == {"harness_options": {"loss_kernel": "stock"}}
    assert stock.micro_batch_size is None and sc.is_step_change("loss_stock")
    switch.configs = {stock.strategy: stock.config}
    switch.set("loss_stock")
    # only the loss changed: the run's own options are kept
    assert rh.OPTIONS == {
        **rh.DEFAULT_OPTIONS,
        "ce_chunk_tokens": 16,
        "lora_r": 4,
        "loss_kernel": "stock",
    }
    assert rh.LM_HEAD_POSITIONS == "all"
    switch.set("random")
    assert rh.OPTIONS[rh.LOSS_OPTION] == rh.CHUNKED and rh.OPTIONS["ce_chunk_tokens"] == 16
    # realize finds the same change by name against the same base
    assert [c.strategy for c in sc.plan_shapes(["loss_stock"], 2, 8)] == ["loss_stock"]


def test_gpu_only_kernels_are_listed_never_priced_on_cpu():
    from probes.replay.step_changes import GPU_ONLY, not_measured

    names = {"loss_liger_fused_linear_cross_entropy", "loss_cut_cross_entropy"}
    assert names <= set(sc.gpu_only("cpu")) and not names & set(sc.gpu_only("cuda"))
    priced = {c.strategy for c in sc.step_changes(sc.StepConfig(False, "sdpa", rh.CHUNKED), 2, 8)}
    assert not names & priced
    harness_step = SimpleNamespace(
        harness=SimpleNamespace(module=rh, hook=lambda name: rh.configure),
        described={"options": {}},
    )
    on_cpu = not_measured(harness_step, cpu_only=True)
    assert {on_cpu[name] for name in names} == {GPU_ONLY}
    assert "loss_chunked" not in on_cpu  # the harness prices it
    on_gpu = not_measured(harness_step, cpu_only=False)
    assert all(on_gpu[name].startswith("not priced yet") for name in names)


def test_a_trainers_loss_is_recorded_with_why_it_is_not_priced():
    from probes.replay.step_changes import not_measured

    # the class is what decides; its __init__ (a model, a dataset) is not needed for that
    sft = SimpleNamespace(trainer=object.__new__(trl.SFTTrainer), harness=None)
    plain = SimpleNamespace(trainer=object.__new__(transformers.Trainer), harness=None)
    assert lc.current_loss(sft) is None and lc.current_loss(plain) is None
    assert "already computes the loss chunked" in not_measured(sft, True)["loss_chunked"]
    assert "needs code you write" in not_measured(plain, True)["loss_chunked"]
    assert lc.loss_step_changes(sc.StepConfig(False, "sdpa")) == []  # nothing priced


def test_a_harness_without_loss_kernels_gets_no_loss_change(tmp_path):
    from probes.step.harness import load_harness

    path = tmp_path / "plain_harness.py"
    path.write_text(
        "def configure(options):\n    pass\n"
        "def discover_target_modules(model):\n    return ['q_proj']\n"
        "def compute_loss(model, batch):\n    return model(**batch).loss\n"
    )
    step = SimpleNamespace(harness=load_harness(str(path)), described={"options": {}})
    assert lc.current_loss(step) is None
    assert "not a setting of this harness" in lc.unpriced_losses(step, "cpu")["loss_chunked"]


def test_the_harness_option_pastes_as_the_harness_option():
    from probes.apply.changes import Baseline, step_level_changes

    base = Baseline(2, 8, 4096, 100, 40_000, 900)
    priced = sc.step_changes(sc.StepConfig(False, "sdpa", rh.CHUNKED), 2, 8)
    provenance = [
        {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
    ]
    change = {c["id"]: c for c in step_level_changes(provenance, base)}["loss_stock"]
    assert not change["expressible_in_training_arguments"]
    assert change["training_arguments"] == base.training_arguments()  # nothing else changes
    assert (
        "# profile.harness_options: {'loss_kernel': 'stock'}" in change["snippets"]["trl"]["text"]
    )
    stock = next(c for c in priced if c.strategy == "loss_stock")
    rh.configure(stock.settings["harness_options"])  # what it names, the harness takes
    assert rh.OPTIONS[rh.LOSS_OPTION] == rh.STOCK


def test_trls_loss_types_are_the_ones_its_step_computes():
    types = lc.trl_loss_types()
    assert types[0] == "nll" and "dft" in types  # the default first
    assert "chunked_nll" not in types  # listed by SFTConfig, refused by SFTTrainer (TRL 1.16)
    changes = lc.loss_step_changes(sc.StepConfig(False, "sdpa", "nll", 0))
    assert [c.strategy for c in changes] == ["loss_dft"]
    assert changes[0].settings == {"loss_type": "dft"} and changes[0].config.loss == "dft"
    assert sc.is_step_change("loss_dft") and "Dynamic Fine-Tuning" in sc.title_of("loss_dft")
    # an SFTConfig's loss_type is the step's loss; a plain TrainingArguments has none
    assert lc.args_loss(trl.SFTConfig(output_dir="x", use_cpu=True, loss_type="dft")) == "dft"
    assert lc.args_loss(SimpleNamespace()) is None


def test_trls_loss_type_pastes_as_an_sftconfig_field_only():
    from probes.apply.changes import Baseline, step_level_changes

    base = Baseline(2, 8, 4096, 100, 40_000, 900)
    priced = lc.loss_step_changes(sc.StepConfig(False, "sdpa", "nll", 0))
    provenance = [
        {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
    ]
    (change,) = step_level_changes(provenance, base)
    assert change["training_arguments"] is None and "transformers" not in change["snippets"]
    assert not change["expressible_in_training_arguments"]
    assert trl.SFTConfig(output_dir="x", use_cpu=True, **change["sft_config"]).loss_type == "dft"
