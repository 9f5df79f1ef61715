"""The padding-penalty batches (upper length band, several batches, per-variant prediction) and
the three CE variants, each against numbers computed here by other means."""

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from probes.step import batches as bt
from probes.step.ce import (
    chunked_linear_cross_entropy,
    full_logits_cross_entropy,
    loss_positions_cross_entropy,
    shifted_loss_positions,
)
from probes.step.fit import fit_step_time


def training_lengths(n=200):
    rng = np.random.default_rng(1)
    tokens = np.sort(rng.lognormal(5.0, 0.8, n).astype(int) + 4)
    return pd.DataFrame(
        {
            "example_id": [f"{i:04x}" for i in range(n)],
            "status": "OK",
            "n_tokens": tokens,
            "n_loss_tokens": tokens // 3,
        }
    )


def test_padding_batches_come_from_the_upper_length_band():
    train = training_lengths()
    low, high = np.percentile(train["n_tokens"], [75, 95])
    picks = bt.pick_padding_batches(train, 4, max_len=10_000, seed=0, draws=32)
    assert len(picks) == bt.PADDING_BATCHES == 3
    for pick in picks:
        assert all(low <= n <= high for n in pick.n_tokens)
        assert len(pick.example_ids) == 4
    assert len({tuple(p.example_ids) for p in picks}) == 3  # distinct batches
    assert "p75-p95" in picks[0].method


def test_the_band_shrinks_to_what_fits_the_longest_length_that_ran():
    train = training_lengths()
    max_len = int(np.percentile(train["n_tokens"], 60))  # below the p75-p95 band
    fits = train.loc[train["n_tokens"] <= max_len, "n_tokens"]
    low, high = np.percentile(fits, [75, 95])
    picks = bt.pick_padding_batches(train, 2, max_len=max_len, seed=0, draws=8)
    assert all(low <= n <= high for p in picks for n in p.n_tokens)
    assert "fit" in picks[0].method
    with pytest.raises(bt.LengthsError, match="raise the largest profile length"):
        bt.pick_padding_batches(train, 2, max_len=3, seed=0)
    # one usable example: a longer profile length cannot help, more data can
    with pytest.raises(bt.LengthsError, match=r"only 1 usable .*\(use more data\)$"):
        bt.pick_padding_batches(train.head(1), 2, max_len=10_000, seed=0)


def test_predicted_step_times_per_variant_by_hand():
    # fit of B=2 rows: a=1e-6 s/token^2, b=1e-3 s/token, c=0.1 s; rows of 100 and 300 tokens
    times = bt.predicted_step_times(1e-6, 1e-3, 0.1, 2, [100, 300])
    # padded: 2 rows of 300 -> (0.09 + 0.3) + 0.1
    assert times["padded"] == pytest.approx(0.49)
    # one by one: two steps, (0.01 + 0.1)/2 + 0.1 and (0.09 + 0.3)/2 + 0.1
    assert times["one_by_one"] == pytest.approx(0.055 + 0.1 + 0.195 + 0.1)
    # packed: one row of 400 tokens, dense attention over 400^2: (0.16 + 0.4)/2 + 0.1
    assert times["packed"] == pytest.approx(0.38)


def test_profile_penalty_prediction_is_none_beyond_the_fitted_range():
    from probes.profile.penalty import predicted_penalties

    lengths = [128, 256, 512]
    fit = fit_step_time(lengths, [1e-6 * t * t + 1e-3 * t + 0.1 for t in lengths])
    inside = bt.PaddingPick(["a", "b"], [100, 300], [30, 90], 0.33, "test")
    predicted = predicted_penalties(fit, inside, 2)
    assert predicted["one_by_one"][2] == pytest.approx(0.49 / 0.45 - 1.0, rel=1e-6)
    assert predicted["packed"][2] == pytest.approx(0.49 / 0.38 - 1.0, rel=1e-6)
    beyond = bt.PaddingPick(["a", "b"], [400, 500], [1, 1], 0.1, "test")  # packed: 900 > 512
    outside = predicted_penalties(fit, beyond, 2)
    assert np.isnan(outside["packed"][2]) and outside["packed"][3].startswith("none")
    assert np.isfinite(outside["one_by_one"][2])


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_three_ce_variants_compute_the_same_loss_on_different_positions(softcap):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 9, 16)
    labels = torch.randint(0, 50, (2, 9))
    labels[:, :5] = -100  # loss on the last 4 tokens of each row
    # independent reference: mean over loss positions of -log softmax, written out by hand
    logits = hidden @ head.weight.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp = logits.log_softmax(-1)
    picked = [
        -logp[r, t - 1, labels[r, t]] for r in range(2) for t in range(1, 9) if labels[r, t] >= 0
    ]
    expected = torch.stack(picked).mean().item()
    assert full_logits_cross_entropy(hidden, head, labels, softcap).item() == pytest.approx(
        expected, rel=1e-5
    )
    assert loss_positions_cross_entropy(hidden, head, labels, softcap).item() == pytest.approx(
        expected, rel=1e-5
    )
    rows, targets = shifted_loss_positions(hidden, labels)
    chunked = chunked_linear_cross_entropy(rows, head, targets, 3, softcap) / targets.numel()
    assert chunked.item() == pytest.approx(expected, rel=1e-5)
    assert bt.loss_position_count(labels) == len(picked) == 8


def test_head_variants_name_positions_and_the_loss_they_time(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from probes.profile.ce_timing import head_variants
    from probes.step.harness import load_harness

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    labels = torch.full((2, 10), -100)
    labels[:, 7:] = 5
    variants = head_variants(model, load_harness(None), labels, 4)
    assert list(variants) == [
        "all_positions_unchunked",
        "loss_positions_unchunked",
        "loss_positions_chunked",
    ]
    assert [v.positions for v in variants.values()] == ["all", "loss", "loss"]
    assert [v.n_positions for v in variants.values()] == [20, 6, 6]
    assert [v.chunk_tokens for v in variants.values()] == [None, None, 4]
    assert "reference_harness.loss_from_hidden" in variants["loss_positions_chunked"].source
    hidden = torch.randn(2, 10, model.config.hidden_size)
    values = [v.loss(hidden).item() for v in variants.values()]
    assert values == pytest.approx([values[0]] * 3, rel=1e-3)
