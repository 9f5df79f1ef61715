"""The trainer factory: loading, the settings helper, and every bad-factory case named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from probes.config import ConfigError, check_config_paths, load_config
from probes.step.factory import (
    FactoryError,
    apply_settings,
    build_trainer,
    load_factory,
    model_kwargs,
    static_problem,
)

GOOD = """
def build_trainer(settings):
    return TRAINER
"""


def _write(tmp_path: Path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"{path}:build_trainer"


def test_apply_settings_writes_only_the_arguments_fields():
    args = transformers.TrainingArguments(output_dir="x", per_device_train_batch_size=2)
    settings = {"per_device_train_batch_size": 7, "dtype": torch.bfloat16, "no_such": 1}
    applied = apply_settings(args, settings)
    assert applied.per_device_train_batch_size == 7
    assert args.per_device_train_batch_size == 2  # the factory's own object is not altered
    assert model_kwargs(settings) == {"dtype": torch.bfloat16}


@pytest.mark.parametrize(
    ("spec", "text", "words"),
    [
        ("no-colon.py", None, "a module, a colon"),
        ("{dir}/missing.py:build_trainer", None, "does not exist"),
        ("{file}", "def build_trainer(settings:\n", "does not parse"),
        ("{file}", "def other(settings):\n    pass\n", "defines no"),
        ("no_such_package_xyz:build_trainer", None, "no module"),
    ],
)
def test_a_visibly_bad_factory_is_refused_at_parse_time(tmp_path, spec, text, words):
    if text is not None:
        spec = _write(tmp_path, text)
    spec = spec.format(dir=tmp_path)
    problem = static_problem(spec, tmp_path)
    assert problem is not None and "trainer.factory" in problem and words in problem
    config = load_config(Path("config/config.yaml"))
    config["trainer"] = {"factory": spec}
    with pytest.raises(ConfigError, match="config key trainer.factory"):
        check_config_paths(config, Path.cwd())


def test_a_factory_that_raises_names_its_own_line(tmp_path):
    spec = _write(tmp_path, "def build_trainer(settings):\n    x = 1\n    raise KeyError('oops')\n")
    with pytest.raises(FactoryError) as error:
        build_trainer(load_factory(spec), {"output_dir": "o"})
    message = str(error.value)
    assert "trainer.factory" in message and "KeyError" in message and "train.py:3" in message


def test_an_import_that_raises_names_the_file(tmp_path):
    spec = _write(tmp_path, "import no_such_module_xyz\n\ndef build_trainer(settings):\n    pass\n")
    with pytest.raises(FactoryError, match="importing .*ModuleNotFoundError"):
        load_factory(spec)


def test_a_factory_must_return_a_trainer_with_a_train_dataset(tmp_path, tiny_model_dir):
    spec = _write(tmp_path, "def build_trainer(settings):\n    return {'not': 'a trainer'}\n")
    with pytest.raises(FactoryError, match="returned dict, not a transformers.Trainer"):
        build_trainer(load_factory(spec), {})
    text = (
        "import transformers\n"
        "def build_trainer(settings):\n"
        f"    model = transformers.AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})\n"
        "    args = transformers.TrainingArguments(output_dir=settings['output_dir'],"
        " report_to='none', use_cpu=True)\n"
        "    return transformers.Trainer(model=model, args=args)\n"
    )
    spec = _write(tmp_path, text, "no_data.py")
    with pytest.raises(FactoryError, match="has no train_dataset"):
        build_trainer(load_factory(spec), {"output_dir": str(tmp_path / "out")})


def test_a_stage_whose_factory_raises_names_it_and_writes_nothing(tmp_path):
    from conftest import workflow_config
    from probes.contracts import STAGE_OUTPUTS
    from probes.padding import stage as padding

    spec = _write(tmp_path, "def build_trainer(settings):\n    raise ValueError('bad path')\n")
    cfg = workflow_config(trainer={"factory": spec})
    outputs = {k: str(tmp_path / "out" / Path(v).name) for k, v in STAGE_OUTPUTS["padding"].items()}
    with pytest.raises(FactoryError, match=r"trainer.factory .*ValueError: bad path at train.py:2"):
        padding.run({"tokenizer": ["unused"], "model_config": "unused"}, outputs, cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
