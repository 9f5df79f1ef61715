"""The replay's one reading of its settings (probes.replay.prepare.stage_settings): resolved for
the device, so no other part of the stage chooses between replay.* and replay.cpu.*."""

from __future__ import annotations

from conftest import workflow_config
from probes.replay.prepare import settings_for, stage_settings


def test_the_cpu_run_reads_the_cpu_section_and_names_its_key():
    cfg = workflow_config(
        replay={"budget_s": 900.0, "combined_budget_s": 90.0, "round_size": 40, "combined": True}
    )
    cpu = stage_settings(cfg.replay, 8, 64, cpu_only=True)
    gpu = stage_settings(cfg.replay, 8, 4096, cpu_only=False)
    assert cfg.replay.cpu.budget_s != 900.0  # the two sections differ, so the test can tell
    assert cpu.budget_s == cfg.replay.cpu.budget_s and cpu.budget_key == "replay.cpu.budget_s"
    assert gpu.budget_s == 900.0 and gpu.budget_key == "replay.budget_s"
    assert cpu.combined_budget_s == cfg.replay.cpu.combined_budget_s
    assert gpu.combined_budget_s == 90.0 and gpu.round_size == 40
    assert cpu.round_size == cfg.replay.cpu.round_size
    assert (
        cpu.fit_repeats == cfg.replay.cpu.fit_repeats and gpu.fit_repeats == cfg.replay.fit.repeats
    )
    assert cpu.threads == cfg.replay.cpu.threads and gpu.threads is None
    configured = bool(cfg.replay.fit.cpu_lengths)
    assert (cpu.fit_lengths_source == "configured") == configured
    assert configured or cpu.fit_lengths_source.endswith("up to max_seq_len 64")
    # the sampling settings resolve the same way (the control's own, from replay.control)
    assert settings_for(cfg.replay, 8, True).n_strata == cfg.replay.cpu.n_strata
    assert cpu.control_sampling.n_strata == cfg.replay.control.n_strata


def test_without_the_combined_configuration_its_budget_is_the_race_s():
    cfg = workflow_config(replay={"combined": False})
    stage = stage_settings(cfg.replay, 8, 64, cpu_only=True)
    assert not stage.combined and stage.combined_budget_s == 0.0
