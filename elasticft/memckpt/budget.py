"""The memory budget: when the tier's tmpfs use would pass it, the workers stop taking snapshots.

A memory snapshot that pushes the host into swap or the OOM killer costs far more than the
iterations it would save, so the tier pauses instead: it writes the run directory's pause
marker (the workers read it before each snapshot) and says so once, naming the knob to
raise. It goes on by itself when pruning brings the use back under the budget.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from elasticft.config import flag_name
from elasticft.contract.events import EventKind
from elasticft.contract.memory import PAUSE_MARKER
from elasticft.contract.run_dir import write_atomically

log = logging.getLogger(__name__)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


class PauseGate:
    def __init__(self, run_dir: Path, budget_bytes: int, record: Callable[..., None]):
        self.marker = Path(run_dir) / PAUSE_MARKER
        self.budget = budget_bytes
        self.record = record
        self.paused = self.marker.exists()

    def check(self, used: int, newest: int) -> bool:
        """Pause when the newest part alone, or the use plus room for one more such part, passes the budget.

        ``used`` is what the node dir holds now; the next snapshot needs another ``newest`` bytes
        before the one it replaces can be pruned. Returns whether the tier is paused.
        """
        if newest > self.budget:
            why = f"one snapshot of this node ({_gb(newest)}) is larger than the budget ({_gb(self.budget)})"
        elif used + newest > self.budget:
            why = (f"{_gb(used)} used and the next snapshot needs {_gb(newest)} more: over the budget "
                   f"({_gb(self.budget)})")
        else:
            why = ""
        if why and not self.paused:
            self.paused = True
            write_atomically(self.marker, why + "\n")
            log.warning("memory checkpoints paused: %s; raise %s to go on", why, flag_name("mem_ckpt_budget_gb"))
            self.record(EventKind.MEM_CKPT_PAUSED, paused=True, used_bytes=used, budget_bytes=self.budget, why=why)
        elif not why and self.paused:
            self.paused = False
            self.marker.unlink(missing_ok=True)
            why = f"{_gb(used)} used, room for a {_gb(newest)} snapshot within the budget ({_gb(self.budget)})"
            log.info("memory checkpoints go on: %s", why)
            self.record(EventKind.MEM_CKPT_PAUSED, paused=False, used_bytes=used, budget_bytes=self.budget, why=why)
        return self.paused
