"""probes.profile.scaling: the fit's columns on the scaling table and the fit's own row."""

import pandas as pd

from probes.profile.scaling import add_fit_columns, fit_frame
from probes.step.fit import fit_step_time
from probes.step.timing import OK


def scaling_table() -> pd.DataFrame:
    lengths = [64, 128, 256, 512]
    # an exact cost: a = 1e-6 s/token^2, b = 1e-3 s/token, c = 0.05 s per step
    times = [1e-6 * t * t + 1e-3 * t + 0.05 for t in lengths]
    frame = pd.DataFrame({"seq_len": lengths, "time_s": times, "status": OK})
    frame.loc[3, "status"] = "OOM"
    return frame


def test_shares_sum_to_one_on_fitted_points_and_failed_points_are_said():
    scaling = scaling_table()
    ok = scaling[scaling["status"] == OK]
    fit = fit_step_time(ok["seq_len"].tolist(), ok["time_s"].tolist())
    assert abs(fit.a - 1e-6) < 1e-12 and abs(fit.c - 0.05) < 1e-9
    with_shares = add_fit_columns(scaling, fit)
    assert len(with_shares) == len(scaling) and "quadratic_share" in with_shares
    shares = with_shares.filter(like="_share").iloc[:3].sum(axis=1)
    assert ((shares - 1.0).abs() < 1e-9).all()
    row = fit_frame(fit, scaling).iloc[0]
    assert row["dropped_points"] == ["512:OOM"] and "not fitted: 512:OOM" in row["message"]
