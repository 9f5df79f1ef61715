"""How the report writes numbers, codes and labels: the template's filters (``FILTERS``).

Every value the template renders goes through one of these, so a missing or non-finite number is
always ``MISSING``, a reason is a code or nothing, and a source label is printable, short and safe
in a markdown table cell (the report never surfaces text from the data).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MISSING = "—"  # what a missing or non-finite number renders as


def finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt_seconds(value: Any) -> str:
    """Seconds with a unit that keeps 3 significant digits: 850 µs, 12.3 ms, 1.52 s, 3.4 min,
    44.7 h."""
    x = finite(value)
    if x is None:
        return MISSING
    size = abs(x)
    if size == 0:
        return "0 s"
    if size < 1e-3:
        return f"{x * 1e6:.3g} µs"
    if size < 1:
        return f"{x * 1e3:.3g} ms"
    if size < 120:
        return f"{x:.3g} s"
    if size < 2 * 3600:
        return f"{x / 60:.3g} min"
    return f"{x / 3600:.3g} h"  # a power line's timing to decide can run to days


def fmt_bytes(value: Any) -> str:
    """Binary units: 512 B, 1.50 KiB, 2.00 GiB."""
    x = finite(value)
    if x is None:
        return MISSING
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def fmt_pct(value: Any, digits: int = 1) -> str:
    """A fraction as a percentage: 0.1234 -> 12.3%."""
    x = finite(value)
    return MISSING if x is None else f"{x * 100 + 0.0:.{digits}f}%".replace("-0.0%", "0.0%")


def fmt_count(value: Any) -> str:
    """An integer count with thousands separators: 7,168."""
    x = finite(value)
    return MISSING if x is None else f"{round(x):,}"


def fmt_tokens(value: Any) -> str:
    """A token count with its unit: 4,096 tokens (1 token)."""
    x = finite(value)
    if x is None:
        return MISSING
    return f"{round(x):,} token" + ("" if round(x) == 1 else "s")


def fmt_ratio(value: Any) -> str:
    """A multiplier: 1.23×."""
    x = finite(value)
    return MISSING if x is None else f"{x:.2f}×"


def fmt_number(value: Any, digits: int = 3) -> str:
    """A plain number with `digits` significant digits (coefficients, condition numbers)."""
    x = finite(value)
    return MISSING if x is None else f"{x:.{digits}g}"


def fmt_signed_pct(value: Any) -> str:
    """A change as a signed percentage: +12.3% / -4.0%."""
    x = finite(value)
    return MISSING if x is None else f"{x * 100:+.1f}%"


def fmt_value(value: Any, limit: int = 80) -> str:
    """A control's expected/observed value: numbers formatted, structures as compact JSON."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else MISSING
    if isinstance(value, int | float):
        return fmt_number(value, 4)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return cell(text[: limit - 1] + "…" if len(text) > limit else text)


_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,48}$")


def reason_code(value: Any) -> str:
    """A reason as a code only; anything else (it could carry data) is hidden."""
    text = "" if value is None else str(value)
    return text if _CODE.match(text) else "other_reason"


def cell(value: Any) -> str:
    """Safe inside a markdown table cell: no pipes, no newlines."""
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def label(value: Any, limit: int = 40) -> str:
    """A source label: printable, at most `limit` characters, safe in a table cell."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(value)).strip() or "(unnamed)"
    return cell(text if len(text) <= limit else text[: limit - 1] + "…")


def listed(titles: Any, instead: str, limit: int = 3) -> str:
    """Up to `limit` titles as "A, B and C"; more than that, `instead` (a sentence naming more
    than three changes is one a reader cannot take in: probes.report.lint)."""
    names = [cell(t) for t in titles or ()]
    if len(names) > limit:
        return instead
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1]))) if names else ""


FILTERS = {
    "seconds": fmt_seconds,
    "bytes": fmt_bytes,
    "pct": fmt_pct,
    "count": fmt_count,
    "tokens": fmt_tokens,
    "ratio": fmt_ratio,
    "num": fmt_number,
    "signed_pct": fmt_signed_pct,
    "value": fmt_value,
    "cell": cell,
    "label": label,
    "listed": listed,
}
