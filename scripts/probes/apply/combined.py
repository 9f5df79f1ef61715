"""The combined configuration (probes.step.combined) as settings that paste: the batching
change's own entry with the step-level changes' settings written into its arguments, and their
extra lines (e.g. the model loaded with another attention implementation) before its trainer.

Measured as one configuration by the replay, so its entry carries its own measurement (its id
is the replayed strategy, like a step-level change's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from probes.apply.snippets import call_text
from probes.step import combined as cb

ARG_CLASSES = {"transformers": "TrainingArguments", "trl": "SFTConfig"}
KWARG_KEYS = {"transformers": "training_arguments", "trl": "sft_config"}


def own_settings(entry: Mapping[str, Any], key: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """What a step-level entry sets beyond the baseline's arguments."""
    kwargs = entry.get(key) or {}
    return {k: v for k, v in kwargs.items() if k not in base or base[k] != v}


def extra_lines(snippet: Mapping[str, Any]) -> list[str]:
    """A step-level snippet's lines besides its imports, arguments and trainer line."""
    skip = {*snippet.get("imports", []), snippet.get("args", "")}
    return [
        line
        for line in str(snippet.get("text", "")).splitlines()
        if line.strip() and line not in skip and not line.startswith("trainer = ")
    ]


def merged_snippet(
    batching: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any],
    library: str,
) -> dict[str, Any]:  # fmt: skip
    """The batching snippet with the merged arguments, the steps' imports and extra lines."""
    imports = list(batching.get("imports", []))
    for step in steps:
        imports += [i for i in step.get("imports", []) if i not in imports]
    args = "args = " + call_text(ARG_CLASSES[library], kwargs)
    lines = str(batching.get("text", "")).splitlines()
    extra = [line for step in steps for line in extra_lines(step)]
    body = [line for line in lines if line and line not in batching.get("imports", [])]
    body = [args if line == batching.get("args") else line for line in body]
    at = next((i for i, line in enumerate(body) if line.startswith("trainer = ")), len(body))
    body = body[:at] + extra + body[at:]
    return {"imports": imports, "args": args, "text": "\n".join([*imports, "", *body]) + "\n"}


def combined_change(
    strategy: str,
    changes: Sequence[Mapping[str, Any]],
    strategy_of: Mapping[str, str],
    baseline: Mapping[str, Any],
) -> dict[str, Any] | None:
    """recommendations.json's entry for the replayed combination `strategy`, or None where its
    batching change or a step-level change has no applicable entry to build it from."""
    parts = cb.parse(strategy)
    by_strategy = {strategy_of.get(str(c.get("id"))): c for c in changes}
    batching = by_strategy.get(parts.batching)
    steps = [by_strategy.get(s) for s in parts.steps]
    if batching is None or not batching.get("applies") or any(s is None for s in steps):
        return None
    entry = {
        **{k: v for k, v in batching.items() if k not in ("id", "title", "how", "estimate")},
        "id": strategy,
        "step_level": True,  # measured as its own strategy (probes.replay.combined)
        "combined_of": [str(batching["id"]), *(str(s["id"]) for s in steps)],
        "title": " + ".join(str(c.get("title")) for c in (batching, *steps)),
        "how": "apply together: " + "; ".join(str(c.get("how")) for c in (batching, *steps)),
        "estimate": None,
    }
    for library, key in KWARG_KEYS.items():
        if batching.get(key) is None:
            continue
        if any(s.get(key) is None for s in steps):  # a part this library cannot express
            entry[key] = None
            entry["snippets"] = {
                k: v for k, v in (entry.get("snippets") or {}).items() if k != library
            }
            continue
        kwargs = dict(batching[key])
        for step in steps:
            kwargs.update(own_settings(step, key, baseline.get(key) or {}))
        entry[key] = kwargs
        snippets = dict(entry.get("snippets") or {})
        if library in snippets:
            step_snippets = [(s.get("snippets") or {}).get(library) or {} for s in steps]
            snippets[library] = merged_snippet(snippets[library], step_snippets, kwargs, library)
        entry["snippets"] = snippets
    model_kwargs = {
        k: v for c in (batching, *steps) for k, v in (c.get("model_kwargs") or {}).items()
    }
    entry["model_kwargs"] = model_kwargs or None
    entry["expressible_in_training_arguments"] = bool(
        batching.get("expressible_in_training_arguments")
    ) and all(s.get("expressible_in_training_arguments") for s in steps)
    return entry
