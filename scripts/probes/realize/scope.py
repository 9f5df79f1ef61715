"""Which of the replay's changes the realize stage never checks by real steps, and why: one home
for the rule (probes.realize.stage.select_changes leaves them out; the report says why instead of
asking for more checks)."""

from __future__ import annotations

from probes.step.changes import WORKERS_PREFIX

# prefix of the strategy -> why realize leaves it out, on every device
NEVER_CHECKED = {
    WORKERS_PREFIX: (
        "realize does not check data-loading changes: its real steps, one at a time, would "
        "start the workers again every step (an epoch starts them once)"
    ),
}


def never_checked(strategy: str) -> str | None:
    """Why realize never checks `strategy` by real steps, or None where it can."""
    for prefix, why in NEVER_CHECKED.items():
        if str(strategy).startswith(prefix):
            return why
    return None
