"""The worker's end of the relay: the files through which a node agent and its workers talk.

Workers never talk to etcd (thousands of workers must not all hold watches). The agent
writes the current checkpoint request to ``<run dir>/request.json``; rank 0 leaves
messages for its agent in ``<run dir>/outbox/``. The full contract is in
docs/checkpoint.md ("Relay").
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from pathlib import Path

from elasticft.contract.records import CheckpointRequest
from elasticft.contract.run_dir import OUTBOX_DIR, REQUEST_FILE, write_atomically

log = logging.getLogger(__name__)



class RequestFile:
    """Watches ``request.json`` for a new version at the cost of one ``os.stat``.

    The agent replaces the file (tmp + os.replace), so a new version has a new inode;
    the inode is compared as well as mtime and size, because mtime is only as fine as
    the kernel's clock tick and two requests may well have the same size.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / REQUEST_FILE
        self._version: tuple[int, int, int] | None = None

    def poll(self) -> CheckpointRequest | None:
        """The request in the file if the file changed since the last call, else None."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._version = None
            return None
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        if version == self._version:
            return None
        self._version = version
        try:
            return CheckpointRequest.from_json(json.loads(self.path.read_text()))
        except FileNotFoundError:  # replaced again between stat and read: the next poll sees it
            self._version = None
            return None
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError too
            log.warning("ignoring %s: %s", self.path, err)
            return None

    def read(self) -> CheckpointRequest | None:
        """The request in the file now, without taking it from ``poll`` (None if none)."""
        try:
            return CheckpointRequest.from_json(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


class Outbox:
    """Rank 0's messages to its agent: one JSON object per file, written atomically.

    The agent reads and deletes ``*.json``; it never sees a half-written message
    because each is written as ``<name>.tmp`` and renamed to ``<name>.json``.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = Path(run_dir) / OUTBOX_DIR
        self._seq = itertools.count()

    def send(self, message: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns()}-{os.getpid()}-{next(self._seq)}"
        path = self.dir / f"{name}.json"
        write_atomically(path, json.dumps(message))
        return path
