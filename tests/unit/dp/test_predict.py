import math

import pytest

from probes.dp import predict


def test_predict_step_is_the_slowest_rank_plus_optimizer_and_collective():
    assert predict.predict_step([0.3, 0.5, 0.1], optimizer_s=0.02, collective_s=0.01) == 0.53


def test_predict_epoch_sums_the_slowest_rank_per_step_not_per_epoch():
    # rank 0 slow in step 0, rank 1 in step 1: per step 1.0 + 1.0, not max of sums (1.2)
    single = [[1.0, 0.2], [0.2, 1.0]]
    assert predict.predict_epoch(single, optimizer_s=0.0, collective_s=0.0) == 2.0
    assert predict.predict_epoch(single, 0.1, 0.05) == pytest.approx(2.3)


def test_predict_epoch_refuses_ragged_ranks():
    with pytest.raises(ValueError, match="same number of steps"):
        predict.predict_epoch([[1.0], [1.0, 2.0]], 0.0, 0.0)


def test_decompose_puts_the_rest_in_compute():
    assert predict.decompose(1.0, 0.25, 0.125) == {
        "compute_s": 0.625,
        "wait_s": 0.25,
        "collective_s": 0.125,
    }
    assert predict.decompose(0.1, 0.2, 0.0)["compute_s"] == 0.0


def test_straggler_wait_is_the_gap_to_the_slowest_rank():
    assert predict.straggler_wait([0.5, 0.75, 0.25]) == [0.25, 0.0, 0.5]


def records(step_s, wait_s, single_s, collective=0.1):
    """One round, one step per entry, two ranks."""
    return [
        {
            "round": 0,
            "step": s,
            "rank": r,
            "step_s": step_s[s][r],
            "wait_s": wait_s[s][r],
            "collective_s": collective,
            "single_s": single_s[s][r],
        }
        for s in range(len(step_s))
        for r in range(2)
    ]


def test_strategy_summary_real_is_the_slowest_rank_and_prediction_matches_a_consistent_run():
    # rank 1 computes 0.8, rank 0 0.4 and waits 0.4; both 0.1 of all-reduce and 0.1 optimizer
    steps = records(
        step_s=[[1.0, 1.0], [1.0, 1.0]],
        wait_s=[[0.4, 0.0], [0.4, 0.0]],
        single_s=[[0.4, 0.8], [0.4, 0.8]],
    )
    out = predict.strategy_summary(steps, optimizer_s=0.1, tolerance=0.1)
    assert out["steps_measured"] == 2
    assert out["real_s"] == 2.0
    assert out["predicted_s"] == pytest.approx(2.0)  # 0.8 + 0.1 + 0.1 per step
    assert out["ratio"] == pytest.approx(1.0) and out["within_tolerance"]
    assert out["communication_share"] == pytest.approx(0.1)
    assert out["straggler_wait_share"] == pytest.approx(0.2)  # 0.4 of 2 rank-seconds per step
    assert out["compute_s_per_step"] == pytest.approx((0.5 + 0.9) / 2)


def test_strategy_summary_flags_a_prediction_outside_the_tolerance():
    steps = records(step_s=[[2.0, 2.0]], wait_s=[[0.0, 0.0]], single_s=[[0.4, 0.8]])
    out = predict.strategy_summary(steps, optimizer_s=0.1, tolerance=0.1)
    assert out["ratio"] == pytest.approx(2.0) and not out["within_tolerance"]


def test_saving():
    assert predict.saving(2.0, 1.5) == 0.25
    assert math.isnan(predict.saving(0.0, 1.0))


def test_failed_rank_message_names_the_first_rank_to_fail_and_its_last_error_line():
    errors = [(3, "Traceback ...\n  File x\nRuntimeError: boom on rank three\n"), (0, "E: peer\n")]
    message = predict.failed_rank_message(errors, 1, "launcher noise", 4)
    assert "rank 3 of 4 failed first: RuntimeError: boom on rank three" in message
    assert "then rank(s) [0] failed too" in message and "No output written" in message


def test_failed_rank_message_without_rank_errors_quotes_the_launcher():
    message = predict.failed_rank_message([], 1, "x\nChildFailedError: worker died\n", 2)
    assert "2 ranks failed (exit 1)" in message and "ChildFailedError: worker died" in message


def fsdp_record(rank: int, step_s: float, single_s: float, **extra) -> dict:
    return {
        "sharding": "fsdp2",
        "strategy": "random",
        "round": 0,
        "step": 0,
        "rank": rank,
        "step_s": step_s,
        "single_s": single_s,
        "optimizer_s": 0.1,
        "wait_s": float("nan"),
        "collective_s": float("nan"),
        **extra,
    }


def test_derive_wait_takes_the_smallest_residual_as_fsdp2_communication():
    # rank 0 computed 1.0 s, rank 1 0.4 s; both ended together at 1.5 s: rank 0 waited none,
    # so communication is its residual 0.4 s and rank 1 waited 0.6 s
    derived = predict.derive_wait([fsdp_record(0, 1.5, 1.0), fsdp_record(1, 1.5, 0.4)])
    assert [r["collective_s"] for r in derived] == pytest.approx([0.4, 0.4])
    assert [r["wait_s"] for r in derived] == pytest.approx([0.0, 0.6])


def test_derive_wait_keeps_a_hooked_ddp_wait_and_groups_by_sharding():
    ddp = {**fsdp_record(0, 1.0, 2.0), "sharding": "ddp", "wait_s": 0.2, "collective_s": 0.05}
    derived = predict.derive_wait([ddp, fsdp_record(0, 1.5, 1.0), fsdp_record(1, 1.5, 0.4)])
    assert derived[0] == ddp  # measured by the hook: as it was
    # the DDP row's negative residual (-1.1 s) is not the FSDP2 step's communication
    assert derived[1]["collective_s"] == pytest.approx(0.4)
