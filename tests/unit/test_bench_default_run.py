"""bench/default_run.py reads the benchmark files every rule writes; no workflow run here."""

import importlib.util

import pytest

from conftest import REPO

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def bench_module():
    spec = importlib.util.spec_from_file_location("default_run", REPO / "bench" / "default_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_benchmark(directory, rule, wall, cpu):
    path = directory / "benchmarks" / f"{rule}.tsv"
    path.parent.mkdir(exist_ok=True)
    path.write_text(HEADER + f"{wall}\t0:00:01\t512.5\t900\t400\t450\t1\t2\t55.0\t{cpu}\n")


def test_the_table_lists_every_rule_slowest_first_with_the_budget(tmp_path):
    bench = bench_module()
    write_benchmark(tmp_path, "mask", 9.5, 8.0)
    write_benchmark(tmp_path, "default_model", 40.25, 21.0)
    rules = bench.read_benchmarks(tmp_path)
    assert rules.set_index("rule")["cpu_s"].to_dict() == {"default_model": 21.0, "mask": 8.0}
    table = bench.format_table(rules, total_wall_s=301.0).splitlines()
    assert table[1].startswith("default_model") and table[2].startswith("mask")
    assert "49.8" in table[3] and "29.0" in table[3]  # sums of wall and CPU
    assert "OVER the 300 s budget" in table[4]
    assert "within" in bench.format_table(rules, total_wall_s=120.0)


def test_a_file_that_is_not_a_benchmark_fails_naming_it(tmp_path):
    bench = bench_module()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "odd.tsv").write_text("a\tb\n1\t2\n")
    with pytest.raises(ValueError, match="odd.tsv"):
        bench.read_benchmarks(tmp_path)
