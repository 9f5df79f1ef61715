"""TRL's own ``trl sft`` CLI, unmodified, probed through trainer.command on a tiny model: a local
dataset folder, LoRA via --use_peft, loss on assistant turns. Each change's settings reach the
trainer the CLI builds (its args and its model's config); nothing is saved, pushed or logged."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from conftest import chat_rows
from probes.apply.libraries import SAMPLING_FIELD
from probes.step.changes import checkpointing_field
from probes.step.command import Command
from probes.step.trainer import TrainerStep, probe_settings

CHECKPOINTING = checkpointing_field()
# a change's settings as the stages pass them (probes.apply.changes: TrainingArguments / SFTConfig
# fields; attn_implementation and dtype for from_pretrained), and where each must land
CHANGES = {
    "baseline": {},
    "length_grouped": {SAMPLING_FIELD: "group_by_length"},
    "batch_rebalance": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
    # padding-free is the trainer's own collator in its flattened form (probes.step.trainer
    # .packed_collator), switched on the built trainer, not a build setting
    "checkpointing_on": {CHECKPOINTING: True},
    "attention_eager": {"attn_implementation": "eager"},
}


@pytest.fixture(scope="module")
def trl_sft(tmp_path_factory, tiny_model_dir):
    directory = tmp_path_factory.mktemp("trl-sft")
    data = directory / "chat"
    data.mkdir()
    pd.DataFrame(chat_rows(16)).to_parquet(data / "train.parquet")
    user_out = directory / "user-out"
    argv = ["trl", "sft", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data)]
    argv += ["--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
    argv += ["--assistant_only_loss", "True", "--max_length", "256", "--dtype", "bfloat16"]
    argv += ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    argv += ["--output_dir", str(user_out), "--report_to", "wandb", "--push_to_hub"]
    return Command.of(argv), user_out, directory


def test_every_changes_settings_reach_the_trainer_trl_sft_builds(trl_sft, tmp_path):
    command, user_out, _ = trl_sft
    for name, change in CHANGES.items():
        out = tmp_path / name
        settings = probe_settings(str(out), torch.device("cpu"), torch.float32, 256, 0, change)
        step = TrainerStep(command.build(settings), command)
        args, model = step.trainer.args, step.model
        assert type(step.trainer).__name__ == "SFTTrainer" and hasattr(model, "peft_config")
        for key, value in change.items():
            if key == "attn_implementation":
                assert model.config._attn_implementation == value, name
            else:
                assert getattr(args, key) == value, name
        assert model.dtype == torch.float32, name  # the workflow's dtype over the CLI's bf16
        assert args.report_to == [] and not args.push_to_hub and args.save_strategy == "no"
        assert args.output_dir == str(out) and not [p for p in out.rglob("*") if p.is_file()]
        assert step.describe()["command"]["package"].startswith("trl ")
    # the trainer's own step runs (forward + backward through its training_step)
    batch = step.collate(["0", "1"], packed=False)
    assert torch.isfinite(step.forward_backward(batch))
    assert not user_out.exists()  # no checkpoint, no save_model, no push: nothing after train()


def test_the_config_takes_one_trainer_source_and_knows_the_commands_files(tmp_path):
    from pathlib import Path

    from probes.config import ConfigError, check_config_paths, load_config, stage_inputs

    config = load_config(Path("config/config.yaml"))
    config["trainer"] = {"factory": "examples/sft_trainer.py:build_trainer", "command": "trl sft"}
    with pytest.raises(ConfigError, match="trainer.factory and trainer.command are both set"):
        check_config_paths(config, Path.cwd())
    config["trainer"] = {"command": "python no/such/train.py --lr 1"}
    with pytest.raises(ConfigError, match="config key trainer.command .*does not exist"):
        check_config_paths(config, Path.cwd())
    script = "python examples/train_script.py --lr 1"
    config["trainer"] = {"command": script, "command_inputs": ["data/x.parquet"]}
    inputs = stage_inputs("padding", config)
    assert inputs["factory"] == "examples/train_script.py"  # an edit to it reruns the stage
    assert inputs["command_inputs"] == ["data/x.parquet"]
    assert "command_inputs" not in stage_inputs("mask", config)


def test_a_stage_whose_command_fails_names_it_and_writes_nothing(tmp_path):
    from pathlib import Path

    from conftest import workflow_config
    from probes.contracts import STAGE_OUTPUTS
    from probes.padding import stage as padding
    from probes.step.command import CommandError

    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit(3)\n")
    cfg = workflow_config(trainer={"command": ["python", str(script)]})
    outputs = {k: str(tmp_path / "out" / Path(v).name) for k, v in STAGE_OUTPUTS["padding"].items()}
    with pytest.raises(CommandError, match=r"trainer.command 'python .../train.py': it exited"):
        padding.run({"tokenizer": ["unused"], "model_config": "unused"}, outputs, cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def emitted_sft_builds() -> list[dict]:
    """Every setting recommendations.json can emit for an SFTTrainer (probes.apply: batching,
    step-level, combined; model_kwargs as the model keys), grouped into as few builds as
    hold each key once: one build per value a key takes (three: micro-batch 2, 1 and 4)."""
    from unit.apply.test_current_names import every_change

    pairs: list[tuple[str, object]] = []
    for change in every_change():
        sft = {**(change.get("sft_config") or {}), **(change.get("model_kwargs") or {})}
        pairs += [p for p in sft.items() if p not in pairs]
    builds: list[dict] = []
    for key, value in pairs:
        build = next((b for b in builds if key not in b), None)
        if build is None:
            builds.append(build := {})
        build[key] = value
    return builds


def test_every_emitted_sft_setting_reaches_the_trainer_trl_sft_builds(trl_sft, tmp_path):
    command, user_out, _ = trl_sft
    builds = emitted_sft_builds()
    assert {"packing", "padding_free", "loss_type", "attn_implementation"} <= set().union(*builds)
    for index, wanted in enumerate(builds):
        out = tmp_path / str(index)
        settings = probe_settings(str(out), torch.device("cpu"), torch.float32, None, 0, wanted)
        trainer = command.build(settings)
        for key, value in wanted.items():
            if key == "attn_implementation":
                assert trainer.model.config._attn_implementation == value, (index, key)
            else:
                assert getattr(trainer.args, key) == value, (index, key)
        assert not [p for p in out.rglob("*") if p.is_file()]
    assert not user_out.exists()
