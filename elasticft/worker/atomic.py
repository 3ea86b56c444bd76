"""Write a file so that a reader sees the old content or the new, never half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    """Write ``text`` to ``path`` through ``<stem>.tmp`` beside it and ``os.replace``.

    The tmp name keeps no suffix of ``path``, so a reader that lists ``*.json`` never
    picks up a file being written.

    ``durable`` also fsyncs the file and its directory, so that the new content
    survives a crash of the machine right after (a checkpoint tracker needs that; a
    message to a local agent does not).
    """
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
