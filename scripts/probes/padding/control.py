"""The padding stage's positive control: a synthetic set whose lengths, waste, distribution and
CE chunk sizes are worked out by hand (``CONTROL_EXPECTED``), checked against the stage's own
functions (``synthetic_control``) and, for the random order, against every permutation
(``brute_force_random_slots``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import permutations
from typing import Any

import numpy as np
import pandas as pd

from probes.batching.metrics import batch_slots
from probes.contracts import EMPTY, ERROR, OK, TRUNCATED
from probes.padding.waste import (
    WASTE_METRICS,
    ce_chunk_rows,
    distribution_table,
    summary_table,
    usable_lengths,
)

# --- positive control -------------------------------------------------------------------------
# A synthetic set whose lengths and waste are worked out by hand below; the stage must reproduce
# every number exactly before it is trusted with real data.
CONTROL_MAX_SEQ_LEN = 16
# (status from the loader, full tokens, loss tokens in full, loss tokens in the first 16)
CONTROL_ROWS = (
    (OK, 2, 1, 1),
    (OK, 24, 12, 6),  # longer than 16: TRUNCATED, 8 tokens lost, 6 loss tokens lost
    (OK, 4, 2, 2),
    (OK, 8, 4, 4),
    (EMPTY, 0, 0, 0),
    (OK, 4, 2, 2),
    (ERROR, 0, 0, 0),
    (OK, 8, 4, 4),
)
# Usable kept lengths in data order: [2, 16, 4, 8, 4, 8]; sum 42, sum of squares 420.
# Sorted: [2, 4, 4, 8, 8, 16]. E[max of a random 2-subset] = (1*4 + 2*4 + 3*8 + 4*8 + 5*16) / 15
# = 148/15, of its square 1776/15; of a random 4-subset (C(j-1,3)/15) = (1*8 + 4*8 + 10*16) / 15
# = 200/15, squared 2880/15.
CONTROL_EXPECTED = {
    "status_counts": {OK: 5, EMPTY: 1, ERROR: 1, TRUNCATED: 1},
    "tokens_lost": 8,
    "loss_tokens_lost": 6,
    "real": {"token_waste": 42, "attention_waste": 420},
    # batch size -> metric -> strategy -> padded slots (random: exact expectation as a fraction)
    "slots": {
        2: {
            "token_waste": {
                "pad_to_max_seq_len": 96,  # 6 * 16
                "dataset_order": 64,  # (2,16)(4,8)(4,8): 2*16 + 2*8 + 2*8
                "sorted": 56,  # (2,4)(4,8)(8,16): 2*4 + 2*8 + 2*16
                "random": (888, 15),  # 3 batches * 2 rows * 148/15
            },
            "attention_waste": {
                "pad_to_max_seq_len": 1536,  # 6 * 256
                "dataset_order": 768,  # 2*256 + 2*64 + 2*64
                "sorted": 672,  # 2*16 + 2*64 + 2*256
                "random": (10656, 15),  # 6 * 1776/15
            },
        },
        4: {
            "token_waste": {
                "pad_to_max_seq_len": 96,
                "dataset_order": 80,  # (2,16,4,8)(4,8): 4*16 + 2*8
                "sorted": 64,  # (2,4,4,8)(8,16): 4*8 + 2*16
                "random": (1096, 15),  # 4 * 200/15 + 2 * 148/15
            },
            "attention_waste": {
                "pad_to_max_seq_len": 1536,
                "dataset_order": 1152,  # 4*256 + 2*64
                "sorted": 768,  # 4*64 + 2*256
                "random": (15072, 15),  # 4 * 2880/15 + 2 * 1776/15
            },
        },
    },
    # numpy linear percentiles of [2, 4, 4, 8, 8, 16]
    "distribution": {"count": 6, "tokens": 42, "p50": 6.0, "p90": 12.0, "p99": 15.6, "max": 16},
    # V=262144, H=640, B*T=8192: ceil(V/H)=410, ceil(8192/410)=20, next_pow2 -> 32 tokens;
    # 2 GiB / (262144 * 10 B) = 819.2 -> 819 tokens.
    "ce": {"liger_chunk_tokens": 32, "chunk_tokens": 819},
}


def brute_force_random_slots(lengths: Sequence[int], batch_size: int, power: int) -> Fraction:
    """Mean padded slots over every order of a small set, as an exact fraction."""
    orders = list(permutations(lengths))
    total = sum(batch_slots(np.asarray(order), batch_size, power) for order in orders)
    return Fraction(total, len(orders))


def _check(name: str, expected: Any, observed: Any, passed: bool) -> dict[str, Any]:
    return {"name": name, "expected": expected, "observed": observed, "passed": bool(passed)}


def synthetic_control(seeds: Sequence[int] = (0, 1, 2)) -> list[dict[str, Any]]:
    """Run the synthetic set through the stage's own functions; one check per known value."""
    lengths = control_lengths()
    return [
        *status_checks(lengths),
        *waste_checks(lengths, seeds),
        *distribution_checks(lengths),
        ce_chunk_check(),
    ]


def control_lengths() -> pd.DataFrame:
    """The synthetic set (CONTROL_ROWS) as the stage's lengths table at CONTROL_MAX_SEQ_LEN."""
    from probes.padding.data import Example
    from probes.padding.tokenize import lengths_table

    examples = [
        Example(f"control{i}", "control.jsonl", i + 1, f"s{i % 2}", status, n_turns=2)
        for i, (status, *_rest) in enumerate(CONTROL_ROWS)
    ]
    columns = np.asarray([row[1:] for row in CONTROL_ROWS], dtype=np.int64)
    return lengths_table(
        examples, columns[:, 0], columns[:, 1], columns[:, 2], set(), CONTROL_MAX_SEQ_LEN
    )


def status_checks(lengths: pd.DataFrame) -> list[dict[str, Any]]:
    """Every status counted in its own bucket, and the tokens and loss tokens truncation lost."""
    want = CONTROL_EXPECTED
    counts = lengths["status"].value_counts().to_dict()
    counts = {status: int(counts.get(status, 0)) for status in want["status_counts"]}
    truncated = lengths[lengths["status"] == TRUNCATED]
    lost = int(truncated["n_truncated_tokens"].sum())
    loss_lost = int((truncated["n_loss_tokens_full"] - truncated["n_loss_tokens"]).sum())
    return [
        _check("status_counts", want["status_counts"], counts, counts == want["status_counts"]),
        _check("tokens_lost", want["tokens_lost"], lost, lost == want["tokens_lost"]),
        _check(
            "loss_tokens_lost",
            want["loss_tokens_lost"],
            loss_lost,
            loss_lost == want["loss_tokens_lost"],
        ),
    ]


def waste_checks(lengths: pd.DataFrame, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Each strategy's padded slots at each batch size and metric against the hand-worked ones;
    random's expected waste against the exact expectation and the brute force over orders."""
    checks = []
    usable = usable_lengths(lengths)
    for batch_size, by_metric in CONTROL_EXPECTED["slots"].items():
        summary = summary_table(lengths, batch_size, CONTROL_MAX_SEQ_LEN, seeds)
        waste = summary[summary["section"] == "waste"].set_index(["metric", "strategy"])
        for metric, by_strategy in by_metric.items():
            real = CONTROL_EXPECTED["real"][metric]
            for strategy, slots in by_strategy.items():
                row = waste.loc[(metric, strategy)]
                name = f"B={batch_size} {metric} {strategy}"
                if strategy == "random":
                    exact = Fraction(*slots)
                    expected_waste = float(1 - Fraction(real) / exact)
                    brute = brute_force_random_slots(usable, batch_size, WASTE_METRICS[metric])
                    checks.append(
                        _check(
                            f"{name} expected waste",
                            expected_waste,
                            float(row["expected"]),
                            math.isclose(row["expected"], expected_waste, rel_tol=1e-12)
                            and brute == exact,
                        )
                    )
                else:
                    observed = (int(row["real"]), int(row["slots"]))
                    checks.append(
                        _check(
                            f"{name} real/slots",
                            [real, slots],
                            list(observed),
                            observed == (real, slots)
                            and math.isclose(row["value"], 1 - real / slots, rel_tol=1e-12),
                        )
                    )
    return checks


def distribution_checks(lengths: pd.DataFrame) -> list[dict[str, Any]]:
    """The length distribution's statistics, and a histogram that holds every usable example."""
    want = CONTROL_EXPECTED["distribution"]
    distribution = distribution_table(lengths, n_bins=8, max_sources=10)
    tokens = distribution[
        (distribution["scope"] == "overall") & (distribution["measure"] == "n_tokens")
    ]
    overall = tokens[tokens["kind"] == "stat"].set_index("statistic")["value"]
    observed = {key: float(overall[key]) for key in want}
    bins = tokens[tokens["kind"] == "bin"]
    return [
        _check(
            "distribution n_tokens",
            want,
            observed,
            all(math.isclose(observed[k], v, rel_tol=1e-12) for k, v in want.items()),
        ),
        _check(
            "histogram holds every example", 6, int(bins["value"].sum()), bins["value"].sum() == 6
        ),
    ]


def ce_chunk_check() -> dict[str, Any]:
    """CE chunk sizing at a Gemma-3-sized vocabulary against the hand-worked sizes."""
    ce = ce_chunk_rows({"control": 4096}, 2, {"control": 262144}, 640, 2.0).iloc[0]
    observed = {
        "liger_chunk_tokens": int(ce["liger_chunk_tokens"]),
        "chunk_tokens": int(ce["chunk_tokens"]),
    }
    want = CONTROL_EXPECTED["ce"]
    return _check("ce chunk sizing", want, observed, observed == want)
