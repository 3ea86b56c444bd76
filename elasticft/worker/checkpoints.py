"""Checkpoint hygiene in Megatron's layout: a save that dies halfway never becomes latest.

    root/iter_0000100/            one directory per save (Megatron's name)
    root/iter_0000100/.complete   written by ``commit`` once every rank has finished
    root/latest_checkpointed_iteration.txt   the iteration to resume from (Megatron's tracker)

The tracker is replaced atomically and fsynced only after the marker exists, so after a
crash at any point it names a complete checkpoint (or the previous one). ``commit``
then keeps the newest ``keep`` complete checkpoints and removes older ones, and the
debris of older saves that never completed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from elasticft.contract.checkpoints import (
    COMPLETE_MARKER,
    TRACKER,
    iter_dir_name,
    iteration_of,
)
from elasticft.contract.phases import LoadTier
from elasticft.contract.run_dir import write_atomically
from elasticft.worker import phases

log = logging.getLogger(__name__)



class CheckpointDir:
    """One run's checkpoints under ``root``; ``keep`` complete ones survive each commit."""

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep: expected at least 1 checkpoint to keep, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def dir_of(self, iteration: int) -> Path:
        return self.root / iter_dir_name(iteration)

    def path_for(self, iteration: int) -> Path:
        """The directory to save ``iteration`` into, created; call it on every rank.

        A directory left by an earlier run for the same iteration loses its marker, so
        it counts as incomplete until this save is committed.
        """
        path = self.dir_of(iteration)
        path.mkdir(parents=True, exist_ok=True)
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        return path

    def empty(self, iteration: int) -> None:
        """Remove what a directory left by an abandoned timeline holds (rank 0, before a save)."""
        for entry in os.scandir(self.dir_of(iteration)):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)

    def commit(self, iteration: int) -> None:
        """Mark ``iteration`` complete, make it latest, prune. Rank 0 only, after a barrier."""
        path = self.dir_of(iteration)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint directory {path} to commit")
        write_atomically(path / COMPLETE_MARKER, json.dumps({"iteration": iteration, "time": time.time()}), durable=True)
        write_atomically(self.root / TRACKER, str(iteration), durable=True)
        self._prune(iteration)

    def _prune(self, committed: int) -> None:
        """Remove complete checkpoints beyond the ``keep`` newest, and crashed saves.

        Only iterations below the committed one are candidates: a newer one is from a
        timeline that training abandoned by resuming earlier, and is left for a person
        to judge (a later save of the same iteration replaces it).
        """
        older = [i for i in self._iterations() if i < committed]
        older_complete = [i for i in older if self.is_complete(i)]
        doomed = older_complete[self.keep - 1:] + [i for i in older if i not in older_complete]
        for iteration in doomed:
            log.info("removing checkpoint %s", self.dir_of(iteration))
            shutil.rmtree(self.dir_of(iteration), ignore_errors=True)

    # -- reading -----------------------------------------------------------------------

    def _iterations(self) -> list[int]:
        """Every iteration with a directory, complete or not, newest first."""
        if not self.root.is_dir():
            return []
        found = (iteration_of(entry.name) for entry in os.scandir(self.root) if entry.is_dir())
        return sorted((i for i in found if i is not None), reverse=True)

    def is_complete(self, iteration: int) -> bool:
        return (self.dir_of(iteration) / COMPLETE_MARKER).is_file()

    def complete_iterations(self) -> list[int]:
        """Iterations whose save was committed, newest first."""
        return [i for i in self._iterations() if self.is_complete(i)]

    def tracked_iteration(self) -> int | None:
        """The iteration the tracker names, or None (absent or unreadable: logged)."""
        tracker = self.root / TRACKER
        try:
            text = tracker.read_text().strip()
        except FileNotFoundError:
            return None
        try:
            return int(text)
        except ValueError:
            log.warning("%s holds %r, not an iteration; ignoring it", tracker, text[:40])
            return None

    def load_latest(self, load_fn: Callable[[Path, int], Any],
                    agree: Callable[[list[int]], list[int]] | None = None) -> tuple[int | None, Any]:
        """``load_fn(path, iteration)`` on the latest checkpoint that loads; (iteration, result).

        Tries the tracker's checkpoint first, then older complete ones, newest first;
        each one skipped is a warning. (None, None) when none loads. A load can fail on one
        rank alone (megatron-core 0.19 loads each rank's part without a collective): with
        ``agree`` (the MAX over the ranks, ``Hook.agree``) every rank moves to the older one
        together; without it ``load_fn`` must fail on every rank or on none, or ranks could
        resume from different iterations.
        """
        tracked = self.tracked_iteration()
        complete = self.complete_iterations()
        if tracked is None:
            if complete:
                log.warning("no readable %s in %s; trying complete checkpoints newest first", TRACKER, self.root)
            candidates = complete
        else:
            candidates = [tracked] + [i for i in complete if i < tracked]
        for iteration in candidates:
            path = self.dir_of(iteration)
            if not self.is_complete(iteration):
                log.warning("checkpoint %s is not marked complete (its save did not finish); "
                            "falling back to an older one", path)
                continue
            error: BaseException | None = None
            try:
                result = load_fn(path, iteration)
            except (KeyboardInterrupt, SystemExit):
                raise
            # BaseException: torch.distributed.checkpoint's CheckpointException derives from
            # it, and any failure to load means: try the previous one.
            except BaseException as err:  # noqa: BLE001
                error = err
            error = agreed_error(error, agree)
            if error is None:
                phases.loaded(LoadTier.DISK, path)  # eft report: the load phase ends here
                return iteration, result
            log.warning("could not load checkpoint %s (%s: %s); falling back to an older one",
                        path, type(error).__name__, error)
        phases.loaded(LoadTier.NONE)
        return None, None


def agreed_error(error: BaseException | None, agree: Callable[[list[int]], list[int]] | None) -> BaseException | None:
    """This rank's load error; or, where this rank's load went through but another rank's did not
    (``agree``: the MAX over the ranks, a collective), one saying so: every rank moves on together."""
    if agree is not None and agree([int(error is not None)])[0] and error is None:
        return RuntimeError("another rank could not load it")
    return error
