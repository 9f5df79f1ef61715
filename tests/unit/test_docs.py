"""Docs that cannot rot: README.md, config/README.md and docs/ against the tree
(tools/docs_check.py, tools/config_docs.py). Fast: no stage runs; a stage script's parser is
built in-process."""

import importlib.util

from conftest import REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_check = _load("docs_check")
config_docs = _load("config_docs")


def test_every_command_link_and_key_the_docs_show_exists():
    assert docs_check.problems() == []


def test_config_readme_is_generated_from_the_schema():
    schema = config_docs.load_schema()
    assert config_docs.missing_descriptions(schema) == []
    assert config_docs.PAGE.read_text() == config_docs.render(schema), (
        "config/README.md differs from the schema: run python tools/config_docs.py --write"
    )


def test_config_readme_goes_stale_when_the_schema_changes():
    schema = config_docs.load_schema()
    schema["properties"]["training"]["properties"]["new_key"] = {"type": "integer"}
    assert config_docs.render(schema) != config_docs.PAGE.read_text()
    assert config_docs.missing_descriptions(schema) == ["training.new_key"]


def _problems(text):
    return docs_check.check_page(REPO / "docs" / "planted.md", text)


def test_a_broken_link_fails():
    assert _problems("[a](stages/nowhere.md)")
    assert _problems("[a](stages/replay.md#no-such-heading)")
    assert _problems("[a](stages/replay.md#controls) and [b](../config/README.md#replay)") == []


def test_a_missing_make_target_or_script_fails():
    assert _problems("```bash\nmake runn\n```")
    assert _problems("`python scripts/run_nothing.py --help`")
    assert _problems("```bash\nmake run TORCH='torch>=2.4'   # a comment\n```") == []


def test_a_flag_the_script_lacks_fails():
    assert _problems("```bash\npython scripts/run_mask.py --resultz /tmp/x\n```")
    assert _problems("`python bench/default_run.py --no-such-flag`")
    assert (
        _problems(
            "```bash\npython scripts/run_mask.py --results /tmp/x --set mask.dtype=float32\n```"
        )
        == []
    )


def test_an_unknown_config_key_fails():
    assert _problems("set `replay.cpu.budget_sec` higher")
    assert _problems("```bash\npython scripts/run_profile.py --set profile.lenghts=[1,2,3]\n```")
    assert _problems("```bash\nsnakemake --cores 1 report --config 'trainr={}'\n```")
    assert (
        _problems(
            "`replay.cpu.budget_s`, `data.files[0].path`, `profile.idle.*`, `trainer.train()`"
        )
        == []
    )


def test_snakemake_targets_are_rules():
    assert _problems("```bash\nsnakemake --cores 2 bucket_sweeps\n```")
    assert _problems("```bash\nsnakemake --cores 2 report --resources gpu=1 timing=1\n```") == []
