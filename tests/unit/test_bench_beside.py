"""bench/realized_beside.py: what the replay priced beside its table (its provenance's
"compile" and "optim") becomes rows of the bench's table with the settings that realize them;
--changes keeps only the named changes. No epoch is run here."""

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import realized_beside as rb  # noqa: E402

PROVENANCE = {
    "compile": {
        "torch_compile": {"saving": -2.5, "saving_low": -3.0, "saving_high": -2.0},
        "torch_compile_pad_to_multiple_of_64": {
            "recommended": False,
            "why": "failed to compile: BackendCompilerFailed at shape (2, 64)",
        },
    },
    "optim": {
        "optim_adamw_torch": {
            "optim": "adamw_torch",
            "against": "adamw_torch_fused",
            "saving": -0.003,
            "saving_low": -0.01,
            "saving_high": 0.002,
        }
    },
}


def test_priced_changes_become_rows_with_their_settings_and_the_unpriced_say_why():
    rows, skipped = rb.beside_changes(PROVENANCE)
    by_id = {r["id"]: r for r in rows}
    assert by_id["torch_compile"]["settings"] == {"torch_compile": True}
    assert by_id["torch_compile"]["measured_saving"] == -2.5
    assert (by_id["torch_compile"]["saving_ci_low"], by_id["torch_compile"]["saving_ci_high"]) == (
        -3.0,
        -2.0,
    )
    assert by_id["optim_adamw_torch"]["settings"] == {"optim": "adamw_torch"}
    assert len(skipped) == 1 and "BackendCompilerFailed" in skipped[0]
    assert rb.beside_settings("torch_compile_pad_to_multiple_of_64", {}) == {
        "torch_compile": True,
        "pad_to_multiple_of": 64,
    }


def test_changes_selects_and_names_what_it_left_out():
    runnable = [{"id": "packing"}, {"id": "torch_compile"}, {"id": "optim_adamw_torch"}]
    kept, skipped = rb.selected(runnable, "torch_compile, optim_adamw_torch,nope")
    assert [c["id"] for c in kept] == ["torch_compile", "optim_adamw_torch"]
    assert skipped == [
        "packing: not in --changes",
        "nope: named in --changes, not a runnable change of this run",
    ]
    assert rb.selected(runnable, None) == (runnable, [])
    assert rb.prices_compile("optim_adamw_torch,torch_compile_pad_to_multiple_of_64")
    assert not rb.prices_compile("optim_adamw_torch") and not rb.prices_compile(None)


def test_compile_seconds_sets_the_records_seconds_beside_the_paired_realized_ones():
    record = {
        "saving_s": -100.0, "saving_s_low": -110.0, "saving_s_high": -90.0, "compile_s": 101.0,
        "compile_s_low": 91.0, "compile_s_high": 111.0, "shapes": 9, "shapes_measured": 4,
        "recompiles_measured": 1, "micro_batch_saving_s": 0.01, "run_micro_batches": 100,
    }  # fmt: skip
    changes = [{"id": "torch_compile", "record": record}, {"id": "optim_adamw_torch"}]
    runs = {
        "random": [{"train_runtime": t} for t in (5.0, 6.0, 5.0)],
        "torch_compile": [{"train_runtime": t} for t in (104.0, 108.0, 102.0)],
    }
    (line,) = rb.compile_seconds(changes, runs)
    assert line.startswith(
        "- torch_compile: promised 100.0 s more [90.0, 110.0] in a process that has compiled "
        "= compile 101.0 s"
    )
    assert "realized 99.3 s more [" in line and "over 3 rounds" in line
    # a fresh process's first compile: in the record's seconds, apart in the bench's promise
    first = {"first_compile_s": 12.0, "first_compile_s_low": 8.0, "first_compile_s_high": 16.0}
    seconds = {"saving_s": -112.0, "saving_s_low": -126.0, "saving_s_high": -98.0,
               "compile_s": 113.0, "compile_s_low": 99.0, "compile_s_high": 127.0}  # fmt: skip
    fresh = {**record, **seconds, **first}
    (line,) = rb.compile_seconds([{"id": "torch_compile", "record": fresh}], runs)
    assert "promised 100.0 s more [90.0, 110.0] in a process that has compiled" in line
    assert "compile 101.0 s [91.0, 111.0]" in line and "first compile 12.0 s [8.0, 16.0]" in line


def test_compiles_promise_is_the_warm_process_one_where_recorded():
    """The bench's compiled epochs run after the replay's compiles in its process: they pay no
    first-compile excess, so the row's promise is the record's saving_warm_process."""
    record = {"saving": -3.0, "saving_low": -3.5, "saving_high": -2.5, "saving_warm_process": -2.0,
              "saving_warm_process_low": -2.4, "saving_warm_process_high": -1.6}  # fmt: skip
    (row,), _ = rb.beside_changes({"compile": {"torch_compile": record}})
    assert (row["measured_saving"], row["saving_ci_low"], row["saving_ci_high"]) == (
        -2.0,
        -2.4,
        -1.6,
    )
