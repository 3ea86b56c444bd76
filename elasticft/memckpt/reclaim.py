"""Reclaim the memory checkpoints of agents that died on this host.

A node directory lives on tmpfs: host memory, gigabytes on a real node. An agent that ends
normally removes its own; one killed outright (kill -9, an OOM kill, a crashed launcher)
leaves it behind on a host that lives on, and the next job on the host trains with that
much less memory. So every agent records itself as its node directory's owner
(``OWNER_FILE``: pid and process start time, which tells a pid reused by another process
apart), and an agent starting on the host removes every node directory whose owner is no
longer alive, and the run directories left empty.

A dead owner's files are of no use to anyone: the shard server that served them died with
it, and its index entries in etcd expire with its lease. Directories without an owner
record (written by another tool, or by an eft before this one) are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import psutil

from elasticft.contract.memory import OWNER_FILE

log = logging.getLogger(__name__)

# An empty run directory younger than this may be one another agent is creating its node directory in.
EMPTY_RUN_GRACE = 60.0


def claim(node_dir: Path) -> None:
    """Record this process as ``node_dir``'s owner (the directory exists)."""
    me = psutil.Process()
    (node_dir / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "started": me.create_time()}))


def owner_alive(node_dir: Path) -> bool | None:
    """Whether the agent that owns ``node_dir`` still runs; None when no owner is recorded."""
    try:
        owner = json.loads((node_dir / OWNER_FILE).read_text())
        pid, started = int(owner["pid"]), float(owner["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def reclaim_stale(root: Path, keep: Path | None = None, now: float | None = None) -> tuple[int, int]:
    """Remove the node directories under ``root`` (``<run id>/<node id>``) whose owner is dead,
    and run directories left empty; ``keep`` (this agent's own) is never touched.
    Returns (directories removed, bytes freed)."""
    now = time.time() if now is None else now
    removed = freed = 0
    if not root.is_dir():
        return 0, 0
    for run in _subdirs(root):
        for node in _subdirs(run):
            if keep is not None and node == keep:
                continue
            if owner_alive(node) is False:
                freed += _size(node)
                shutil.rmtree(node, ignore_errors=True)
                removed += 1
        try:
            if not any(run.iterdir()) and now - run.stat().st_mtime > EMPTY_RUN_GRACE:
                run.rmdir()
                removed += 1
        except OSError:
            pass  # not empty after all, or gone
    return removed, freed


def reclaim_and_say(root: Path, keep: Path) -> None:
    """``reclaim_stale`` with one line when it freed anything."""
    removed, freed = reclaim_stale(root, keep)
    if removed:
        log.info("memory checkpoints: removed %d director(ies) of agents no longer running under %s (%.1f MB)",
                 removed, root, freed / 1e6)


def remove_run_dir_if_empty(run_dir: Path) -> None:
    """After this node's directory is gone: its run's directory too, if no other node's is in it."""
    try:
        run_dir.rmdir()
    except OSError:
        pass


def _subdirs(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total
