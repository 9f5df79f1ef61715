"""The combined configuration: the best batching change with the best step-level change(s),
measured as one configuration (issue #29: "combinations are measured, not added").

Its strategy name says what it combines, ``length_grouped+attention_eager+micro_batch_size_4``:
the batching change first, then the step-level changes, so that realize (and anyone reading the
table) rebuilds its plan and its step from the name alone. Its plan is the batching change's own
plan (at the micro-batch size a micro-batch change sets, tokens per update kept); its step is the
base step with every chosen change's setting applied, one change per setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from probes.contracts import RANDOM
from probes.step import changes as sc

SEPARATOR = "+"


@dataclasses.dataclass(frozen=True)
class Combination:
    batching: str
    steps: tuple[str, ...]

    @property
    def name(self) -> str:
        return SEPARATOR.join((self.batching, *self.steps))


def is_combined(name: str) -> bool:
    return SEPARATOR in str(name)


def parse(name: str) -> Combination:
    batching, *steps = str(name).split(SEPARATOR)
    return Combination(batching, tuple(steps))


def title_of(name: str, part_title: Callable[[str], str]) -> str:
    """The Summary's words: each part's own title (`part_title`, the report's), joined."""
    parts = parse(name)
    return "Combined: " + " + ".join(part_title(p) for p in (parts.batching, *parts.steps))


def changed_fields(base: Any, config: Any) -> frozenset[str]:
    """The StepConfig fields `config` sets differently from `base`."""
    return frozenset(
        f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(config, f.name)
    )


def choose(table: pd.DataFrame, base: Any, changes: Sequence[sc.StepChange]) -> Combination | None:
    """From a priced replay table: the best valid batching change that measurably saves time
    (its saving's 95% interval above 0), with the best such step-level change per setting (at
    most one micro-batch size); None where either side has none. A point estimate above 0 alone
    is not enough: the report recommends no change whose interval includes 0, so timing their
    combination spent the replay's minutes on a row that could only tie (on CPU, a third of the
    default's cold runs, 16-17 s each). Step changes that alter the plan beyond the micro-batch
    size (or were not priced) are left out: they cannot stack on another plan."""
    by_name = {c.strategy: c for c in changes}
    priced = table[table["valid"].astype(bool) & table["saving_ci_low"].notna()]
    priced = priced.set_index("strategy")
    measured = priced.index[priced["saving_ci_low"].astype(float) > 0]
    saving = priced.loc[measured, "saving_vs_random"].astype(float).sort_values(ascending=False)
    batching = [
        n for n in saving.index if n != RANDOM and not sc.is_step_change(n) and not is_combined(n)
    ]
    if not batching:
        return None
    chosen: list[str] = []
    taken: set[str] = set()
    for name in (n for n in saving.index if n in by_name):
        change = by_name[name]
        fields = changed_fields(base, change.config) | (
            {"micro_batch_size"} if change.micro_batch_size else set()
        )
        if not fields or fields & taken or not stackable(change, base):
            continue
        chosen.append(name)
        taken |= fields
    return Combination(batching[0], tuple(chosen)) if chosen else None


def stackable(change: sc.StepChange, base: Any) -> bool:
    """A change that is a setting of the step (or the micro-batch size), not a plan of its own
    (padding-free flattens the baseline's micro-batches: it cannot stack on another plan)."""
    if change.settings.get("padding_free"):
        return False
    return bool(change.micro_batch_size) or change.config != base


def merged_config(base: Any, changes: Sequence[sc.StepChange]) -> Any:
    """The base step with each change's own settings applied (they set disjoint fields)."""
    values = {}
    for change in changes:
        for field in changed_fields(base, change.config):
            values[field] = getattr(change.config, field)
    return dataclasses.replace(base, **values)


def micro_shape(changes: Sequence[sc.StepChange], micro: int, grad_accum: int) -> tuple[int, int]:
    """(micro-batch size, grad_accum) of the combination: a micro-batch change's, else the base."""
    for change in changes:
        if change.micro_batch_size:
            return int(change.micro_batch_size), int(change.grad_accum or grad_accum)
    return micro, grad_accum


def combined_plan(
    combination: Combination,
    device_plans: pd.DataFrame,
    plans_at: Mapping[tuple[int, int], pd.DataFrame],
    shape: tuple[int, int],
    base_shape: tuple[int, int],
) -> pd.DataFrame:
    """The batching change's own plan, at the combination's micro-batch size (`plans_at` holds
    every strategy's plan at each other size), under the combination's name."""
    source = device_plans if shape == base_shape else plans_at[shape]
    rows = source[source["strategy"] == combination.batching]
    if rows.empty:
        raise ValueError(f"no plan for {combination.batching!r} at micro-batch shape {shape}")
    return rows.assign(strategy=combination.name)
