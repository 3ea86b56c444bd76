"""The redraw loop of ``eft top``: draw when the mirror changes, never faster than ``refresh``.

Data arrive through the mirror's watch, never by polling etcd. The loop also
redraws at least every ``AGE_TICK`` seconds (rate limit permitting) without
reading anything, so that ages, uptime and staleness keep moving on a quiet run.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from elasticft.tui.mirror import RunMirror
from elasticft.tui.view import View, ViewSettings, build_view

AGE_TICK = 1.0


class Dashboard:
    def __init__(self, mirror: RunMirror, settings: ViewSettings, draw: Callable[[View], None], refresh: float):
        self.mirror = mirror
        self.settings = settings
        self.draw = draw
        self.refresh = refresh

    def run(self, stop: threading.Event) -> None:
        """Draw until ``stop`` is set."""
        next_draw = 0.0
        while not stop.is_set():
            pause = next_draw - time.monotonic()
            if pause > 0 and stop.wait(pause):  # the rate limit, not a wait for data
                return
            self.mirror.changed.clear()
            self.draw(build_view(self.mirror.snapshot(), time.time(), self.settings))
            next_draw = time.monotonic() + self.refresh
            self.mirror.changed.wait(AGE_TICK)
