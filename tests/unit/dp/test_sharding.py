"""The FSDP2 settings a user pastes (probes.dp.sharding), checked against the installed
transformers and accelerate: TrainingArguments takes the fsdp_config dict with no warning or
error and the plugin it builds is FSDP2 on the named layers; the accelerate YAML goes through
accelerate launch's own parsing to the same plugin."""

from __future__ import annotations

import logging
import os
import warnings
from unittest import mock

import pytest

from probes.dp import sharding

LAYERS = ["Gemma3DecoderLayer"]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("reshard", [True, False])
def test_the_fsdp_config_dict_builds_training_arguments_without_a_warning(tmp_path, reshard):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    collect = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(collect)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            args = TrainingArguments(
                str(tmp_path),
                report_to="none",
                **sharding.training_arguments(
                    sharding.FSDP2, sharding.fsdp_config(LAYERS, reshard)
                ),
            )
            plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    finally:
        logger.removeHandler(collect)
    assert collect.messages == []
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is reshard
    assert plugin.transformer_cls_names_to_wrap == LAYERS


def test_the_accelerate_yaml_goes_through_accelerate_launch_to_an_fsdp2_plugin(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "fsdp2.yaml"
    path.write_text(sharding.accelerate_config(4, LAYERS, reshard_after_forward=False))
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args, _, _ = _validate_launch_command(args)
        env = prepare_multi_gpu_env(args)
    assert args.use_fsdp and int(args.num_processes) == 4
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert plugin.transformer_cls_names_to_wrap == LAYERS


def test_ddp_sets_nothing_and_an_unknown_sharding_is_refused():
    assert sharding.training_arguments(sharding.DDP) == {}
    assert sharding.training_arguments(sharding.FSDP2)["fsdp_config"]["version"] == 2
    with pytest.raises(ValueError, match="zero3"):
        sharding.training_arguments("zero3")


def test_layer_classes_from_a_config_alone():
    from transformers import Gemma3TextConfig

    assert sharding.layer_classes(Gemma3TextConfig()) == LAYERS
    assert sharding.layer_classes(object()) == []
