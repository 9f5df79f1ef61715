"""The Memory section's sharded part (probes.report.sections.sharding): each rank's predicted
FSDP2 peak per world size, the smallest W that fits, and the fsdp_config / accelerate YAML it
prints, pasted back into the installed transformers and accelerate."""

from __future__ import annotations

import ast
import logging
import os
import re
import warnings
from unittest import mock

import jinja2
import pandas as pd

from conftest import REPO
from probes.report.format import FILTERS
from probes.report.sections.sharding import sharding_section

TEMPLATE = REPO / "workflow" / "templates" / "playbook-evidence.md.j2"
SUMMARY = {"target": "H200", "target_gib": 139, "dtype": "bfloat16",
           "gradient_checkpointing": True, "layer_classes": ["Gemma3DecoderLayer"]}  # fmt: skip


def sharded(peaks: dict[int, float]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"shape": "training", "strategy": "fsdp2", "world_size": w,
          "reshard_after_forward": True, "rows": 2, "length": 16384, "target_gib": 139.0,
          "parameters_gib": 50.0 / w, "gradients_gib": 50.0 / w, "optimizer_state_gib": 100 / w,
          "activations_gib": 20.0, "communication_gib": 1.0, "predicted_peak_gib": peak,
          "headroom_gib": 139.0 - peak, "verdict": "fits" if peak <= 139 else "does not fit",
          "reason": ""} for w, peak in peaks.items()]
    )  # fmt: skip


def shapes(smallest: int | None, words: str) -> pd.DataFrame:
    return pd.DataFrame(
        [{"shape": "training", "smallest_world_size": smallest, "fits_on_gpus": words}]
    ).astype({"smallest_world_size": "Int64"})


def render(section: dict) -> str:
    text = TEMPLATE.read_text()
    macros = text[: text.index("# Playbook evidence")]
    start = text.index("{# each rank's peak under FSDP2")
    end = text.index("{% if memory_report.assumptions %}")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)  # fmt: skip
    env.filters.update(FILTERS)
    return env.from_string(macros + text[start:end]).render(memory_sharding=section)


def block(markdown: str, language: str) -> str:
    match = re.search(rf"```{language}\n(.*?)```", markdown, re.S)
    assert match, f"no {language} block in:\n{markdown}"
    return match.group(1)


def test_two_gpus_needed_prints_the_table_the_smallest_w_and_what_pastes(tmp_path):
    section = sharding_section(
        {"memory_sharded": sharded({1: 226.2, 2: 126.9}),
         "memory_shapes": shapes(2, "fits on 2 H200 GPUs (FSDP2)")},
        {"memory_summary": SUMMARY},
        {},
    )  # fmt: skip
    markdown = render(section)
    assert "the smallest world size that fits is **W = 2**" in markdown
    assert re.search(r"^\| 1 \| yes \| 50\S* \| .* \| 226 \| .* \| \*\*does not fit\*\* \|",
                     markdown, re.M)  # fmt: skip
    assert re.search(r"^\| 2 \| yes \| .* \| 127 \| .* \| fits \|", markdown, re.M)
    assert "This needs **2 GPUs**: train with FSDP2 and gradient checkpointing on" in markdown
    code = block(markdown, "python")
    config = ast.literal_eval(code.split("fsdp_config=", 1)[1].strip().removesuffix(")"))
    assert config == {"version": 2, "reshard_after_forward": True,
                      "transformer_layer_cls_to_wrap": ["Gemma3DecoderLayer"]}  # fmt: skip
    assert_builds_training_arguments(tmp_path, config)
    assert_accelerate_launch_reads(tmp_path, block(markdown, "yaml"), world_size=2)


def assert_builds_training_arguments(tmp_path, config: dict) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            args = TrainingArguments(str(tmp_path), fsdp=True, fsdp_config=config, report_to="none")
            plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert said == [] and plugin.fsdp_version == 2


def assert_accelerate_launch_reads(tmp_path, yaml_text: str, world_size: int) -> None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "fsdp2.yaml"
    path.write_text(yaml_text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and int(args.num_processes) == world_size
    assert args.mixed_precision == "bf16"
    with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == [
        "Gemma3DecoderLayer"
    ]


def test_one_gpu_enough_shows_the_table_and_pastes_nothing():
    section = sharding_section(
        {"memory_sharded": sharded({1: 13.0, 2: 12.8}),
         "memory_shapes": shapes(1, "fits on 1 H200 GPU (FSDP2)")},
        {"memory_summary": SUMMARY},
        {},
    )  # fmt: skip
    markdown = render(section)
    assert "**W = 1**" in markdown and section["paste"] is None and "```" not in markdown


def test_silent_without_sharded_rows_or_the_memory_stage():
    empty = sharded({}).reindex(columns=["world_size"])
    assert sharding_section({"memory_sharded": empty}, {}, {})["status"] == "none"
    assert sharding_section({}, {}, {"memory": "memory.enabled false"})["status"] == "none"
    assert render({"status": "none"}).strip() == ""
