"""This worker's side of a restart's anatomy (``eft report``): when its start phases ended.

    watch_process_group()              # before init_process_group (inert without eft-run)
    loaded(LoadTier.DISK, path)        # once the newest state is in (memory.py, checkpoints.py)

``imports`` ends when the script calls ``torch.distributed.init_process_group`` (its imports
are done), ``process_group`` when that call returns, ``load`` when the state is loaded; with
the tier it came from and the size of the checkpoint it read. One process is one worker of
one generation, so the ends are the process's own; its heartbeat carries them
(``progress.py``) and its agent puts them in the generation's ``workers_stopped`` event.
A phase this process never marked stays absent (``eft report`` says so).
"""

from __future__ import annotations

import logging
import os
import time

from elasticft.contract.phases import LoadTier, RestartPhase
from elasticft.contract.run_dir import WorkerEnv

log = logging.getLogger(__name__)

_stamps: dict[RestartPhase, float] = {}
_load: dict = {}  # tier and bytes of the last load


def _active() -> bool:
    return bool(os.environ.get(WorkerEnv.RUN_DIR))


def stamp(phase: RestartPhase, when: float | None = None) -> None:
    """``phase`` ended now (or at ``when``); a later mark of the same phase replaces it."""
    _stamps[RestartPhase(phase)] = time.time() if when is None else when


def stamps() -> dict[str, float]:
    """The phases this process marked so far, by name (the heartbeat's ``phases``)."""
    return {str(phase): when for phase, when in _stamps.items()}


def load_facts() -> tuple[str | None, int | None]:
    """(tier, bytes) of the last load, (None, None) before one."""
    return _load.get("tier"), _load.get("bytes")


def loaded(tier: str, path: str | os.PathLike | None = None) -> None:
    """The newest state is loaded from ``tier`` (memory, disk, or none: nothing to load), read
    from the checkpoint at ``path``, whose size on storage is recorded (by local rank 0 only, the
    heartbeat its agent reads: a shared filesystem gets one listing per node). Inert without eft-run."""
    if not _active():
        return
    stamp(RestartPhase.LOAD)
    sized = os.environ.get("LOCAL_RANK", "0") == "0"
    _load.update(tier=str(LoadTier(tier)), bytes=0 if not path else _size(path) if sized else None)


def _size(path: str | os.PathLike) -> int | None:
    """Bytes of the files under ``path`` (a checkpoint directory); None when unreadable."""
    total = 0
    try:
        for root, _dirs, files in os.walk(path):
            total += sum(os.stat(os.path.join(root, name)).st_size for name in files)
    except OSError as exc:
        log.debug("cannot size checkpoint %s: %s", path, exc)
        return None
    return total


def watch_process_group() -> None:
    """Mark ``imports`` and ``process_group`` at ``init_process_group``'s call and return
    (through ``elasticft.torch_seam``). Call it before the script initialises torch.distributed;
    under plain torchrun (no ``EFT_RUN_DIR``) it changes nothing."""
    if not _active():
        return
    from elasticft import torch_seam

    torch_seam.observe_init_process_group(lambda: stamp(RestartPhase.IMPORTS),
                                          lambda: stamp(RestartPhase.PROCESS_GROUP))
