"""The gap rule: whether a risk-driven checkpoint request is worth a save now.

Pure, no I/O. A GPU that looks risky just after a save costs little if it dies (little
progress is lost), while a save costs real time; so a risk request is dropped while
fewer than ``gap * save_interval`` iterations have run since the last save. Requests
a person or a preemption made (manual, signal, watchdog) and requests to stop always run.
"""

from __future__ import annotations


def gap_filter(
    reason: str,
    iteration: int,
    last_saved_iteration: int | None,
    save_interval: int | None,
    gap: float,
    exit: bool = False,
) -> str | None:
    """None when the request should be honoured, else one line saying why it is dropped."""
    if reason != "risk" or exit or save_interval is None or last_saved_iteration is None:
        return None
    since = iteration - last_saved_iteration
    needed = gap * save_interval
    if since >= needed:
        return None
    return (
        f"{since} iteration(s) since the save at iteration {last_saved_iteration}, "
        f"fewer than the gap {gap:g} x save interval {save_interval} = {needed:g}"
    )
