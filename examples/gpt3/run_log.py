"""Rank 0's records of a training run: JSON lines for the tests and the demo's story, a short line for people."""

from __future__ import annotations

import json
import time


class Log:
    """Rank 0's records: JSON lines to --log-file, a short line to stdout."""

    def __init__(self, path, rank: int):
        # Open for the whole run, line-buffered: a killed run keeps every finished line.
        self.file = open(path, "a", buffering=1) if path and rank == 0 else None  # noqa: SIM115
        self.rank = rank

    def record(self, **fields):
        if self.file is not None:
            self.file.write(json.dumps({**fields, "time": time.time()}) + "\n")

    def say(self, text: str):
        if self.rank == 0:
            print(text, flush=True)


def layout_text(layout: dict) -> str:
    if not layout:
        return "an unknown layout"
    return f"TP{layout['tp']}xPP{layout['pp']}xDP{layout['dp']} ({layout['world_size']} ranks)"


def log_async_save(log, iteration: int, saves, checkpoints, layout: dict) -> None:
    """A periodic save that completed in the background (elasticft.worker.async_save)."""
    log.record(event="save", iteration=iteration, seconds=None, stall=saves.last_stall,
               path=str(checkpoints.dir_of(iteration)), reason="interval", **layout)
    log.say(f"saved iteration {iteration} (interval; training stalled {saves.last_stall:.2f} s)")
