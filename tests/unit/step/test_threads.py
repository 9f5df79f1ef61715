"""A timing stage's CPU threads: the configured count, else the rule's, else every core."""

from __future__ import annotations

import os

from probes.step.threads import RULE_THREADS_ENV, available_cores, timing_threads


def test_a_configured_count_wins(monkeypatch):
    monkeypatch.setenv(RULE_THREADS_ENV, "4")
    assert timing_threads(3) == 3


def test_null_takes_the_rules_threads(monkeypatch):
    monkeypatch.setenv(RULE_THREADS_ENV, "4")
    assert timing_threads(None) == 4


def test_null_outside_a_rule_takes_every_core_this_process_may_use(monkeypatch):
    monkeypatch.delenv(RULE_THREADS_ENV, raising=False)
    assert timing_threads(None) == available_cores() == len(os.sched_getaffinity(0))


def test_the_rule_passes_its_threads_to_the_stage(monkeypatch, tmp_path):
    """probes.stage.main under Snakemake sets the variable from the rule's threads (capped by
    Snakemake at --cores), which timing_threads then reads."""
    from probes import stage

    monkeypatch.delenv(RULE_THREADS_ENV, raising=False)
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    seen = {}

    def run(inputs, outputs, cfg):
        seen["threads"] = timing_threads(None)

    class Rule:
        threads = 3
        log = [str(tmp_path / "stage.log")]
        config = load_default_config()
        input = type("Named", (), {"keys": lambda self: []})()
        output = type("Named", (), {"keys": lambda self: []})()

    monkeypatch.setattr(stage, "call_stage", lambda run_, i, o, cfg, log: run_(i, o, cfg) or 0)
    monkeypatch.setattr(stage, "_snakemake_inputs", lambda smk: {})
    try:
        stage.main("profile", run, "", {"snakemake": Rule()})
    except SystemExit as exit_:
        assert exit_.code == 0
    assert seen["threads"] == 3


def load_default_config():
    from probes.config import load_config

    return load_config()


def test_a_timing_script_restarts_once_with_the_steady_allocator(monkeypatch):
    """glibc reads its allocator settings at start: the script starts itself again with them
    (the same interpreter and arguments), and not again once they are set or switched off."""
    import sys

    from probes.step import threads

    calls = []
    monkeypatch.setattr(threads.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(sys, "platform", "linux")
    for key in threads.STEADY_ALLOCATOR:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(threads.STEADY_ALLOCATOR_OFF, raising=False)
    threads.steady_allocator(["scripts/run_replay.py", "--results", "r"])
    ((executable, argv, env),) = calls
    assert executable == sys.executable and argv == [sys.executable, "scripts/run_replay.py",
                                                     "--results", "r"]  # fmt: skip
    assert all(env[k] == v for k, v in threads.STEADY_ALLOCATOR.items())
    for key, value in threads.STEADY_ALLOCATOR.items():
        monkeypatch.setenv(key, value)
    threads.steady_allocator(["x"])
    assert len(calls) == 1  # already set: it runs on
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv(threads.STEADY_ALLOCATOR_OFF, "0")
    threads.steady_allocator(["x"])
    assert len(calls) == 1  # switched off
