"""The checkpoint directory as every side reads it: Megatron's layout plus eft's marker.

    root/iter_0000100/            one directory per save (Megatron's name, 7+ digits)
    root/iter_0000100/.complete   eft's marker: every rank finished this save
    root/latest_checkpointed_iteration.txt   the iteration to resume from (Megatron's tracker)

The workers write it (``elasticft.worker.checkpoints``); the agent's storage watchdog
reads it to learn a checkpoint's size.
"""

from __future__ import annotations

import re

TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = ".complete"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    """Megatron's directory name for a save at ``iteration``."""
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int | None:
    """The iteration a directory named ``name`` holds, or None when it is no save of Megatron's."""
    match = _ITER_DIR.match(name)
    return int(match.group(1)) if match else None
