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
    assert line.startswith("- torch_compile: promised 100.0 s more [90.0, 110.0] = compile 101.0 s")
    assert "realized 99.3 s more [" in line and "over 3 rounds" in line
