"""A node's memory checkpoint directory: its layout, checksums, size and pruning.

The layout is the contract's (``elasticft.contract.memory``): ``own/g<n>/iter_K`` holds what
this node's workers wrote, ``held/<origin>/iter_K`` the replicas of other nodes' parts, and
``restore/iter_K`` what the last restart prepared (the checkpoint-wide files, links of the
shard files held here). Everything lives on tmpfs, so every byte kept is host memory taken
from training: pruning keeps only what a restart can still use.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from elasticft.contract.checkpoints import iter_dir_name as iter_name  # noqa: F401 - the tier names it so
from elasticft.contract.checkpoints import iteration_of
from elasticft.contract.memory import HELD_DIR, OWN_DIR, RESTORE_DIR, generation_dir

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # crc32 and copies stream in 8 MiB pieces: a shard may be many GB
_GEN = re.compile(r"^g(\d+)$")
# A path component that comes from a peer (node id, file name) may use only these characters,
# so that no request can name anything outside the node directory.
_SAFE = re.compile(r"^[A-Za-z0-9_.@:+=,-]+$")



def safe_component(name: str) -> bool:
    """True if ``name`` is one plain path component ("..", "/" and the like are refused)."""
    return bool(_SAFE.match(name)) and name not in (".", "..")


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _iterations(parent: Path) -> dict[int, Path]:
    if not parent.is_dir():
        return {}
    return {k: parent / e for e in os.listdir(parent) if (k := iteration_of(e)) is not None}


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class NodeDir:
    """``<mem ckpt dir>/<run id>/<node id>``."""

    root: Path

    @property
    def own(self) -> Path:
        return self.root / OWN_DIR

    @property
    def held(self) -> Path:
        return self.root / HELD_DIR

    @property
    def restore(self) -> Path:
        return self.root / RESTORE_DIR

    def create(self) -> None:
        for path in (self.own, self.held, self.restore):
            path.mkdir(parents=True, exist_ok=True)

    def remove(self) -> None:
        _remove(self.root)

    # -- generations ------------------------------------------------------------

    def generations(self) -> list[int]:
        if not self.own.is_dir():
            return []
        return sorted(int(m.group(1)) for e in os.listdir(self.own) if (m := _GEN.match(e)))

    def new_generation(self) -> tuple[int, Path]:
        """A fresh ``own/g<n>``, n one above the largest there: a new start never writes over an old one."""
        n = max(self.generations(), default=0) + 1
        path = self.own / generation_dir(n)
        path.mkdir(parents=True)
        return n, path

    # -- parts ------------------------------------------------------------------

    def own_parts(self) -> dict[int, Path]:
        """iteration -> this node's part; the newest generation wins when two wrote the same iteration."""
        out: dict[int, Path] = {}
        for n in self.generations():
            out.update(_iterations(self.own / generation_dir(n)))
        return out

    def own_part(self, iteration: int) -> Path | None:
        return self.own_parts().get(iteration)

    def held_part(self, origin: str, iteration: int) -> Path:
        return self.held / origin / iter_name(iteration)

    def held_parts(self) -> dict[str, dict[int, Path]]:
        if not self.held.is_dir():
            return {}
        return {o: _iterations(self.held / o) for o in sorted(os.listdir(self.held)) if (self.held / o).is_dir()}

    def used_bytes(self) -> int:
        """Bytes of every file under the node dir; a hard link (restore/ shares own/ and held/) counts once."""
        seen, total = set(), 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:  # pruned while we walked
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
        return total

    # -- pruning ----------------------------------------------------------------

    def prune_own(self, keep_from: int) -> list[int]:
        """Remove own parts older than ``keep_from`` (the older of the two newest restorable iterations seen);
        newer ones may be being written. Emptied generations other than the newest go too. Returns the
        iterations removed."""
        removed = []
        generations = self.generations()
        for n in generations:
            gen = self.own / generation_dir(n)
            for k, path in _iterations(gen).items():
                if k < keep_from:
                    _remove(path)
                    removed.append(k)
            if n != generations[-1] and not any(gen.iterdir()):
                _remove(gen)
        return sorted(set(removed))

    def prune_held(self, keep_from: int) -> None:
        """Remove replicas older than ``keep_from`` (the older of the two newest restorable iterations seen)."""
        for parts in self.held_parts().values():
            for k, path in parts.items():
                if k < keep_from:
                    _remove(path)

    def drop_above(self, iteration: int | None) -> None:
        """Remove own and held parts newer than ``iteration`` (None: all): a timeline the workers left.

        Not the newest generation's own parts: its workers are the ones that resumed at
        ``iteration``, so all they wrote is the new timeline, and they may be writing the
        next iteration already when their report of the restore reaches the agent (a
        snapshot of that iteration lost its directory mid-save, and the ranks crashed)."""
        floor = -1 if iteration is None else iteration
        for n in self.generations()[:-1]:  # every older generation: one may hold the same iteration
            for k, path in _iterations(self.own / generation_dir(n)).items():
                if k > floor:
                    _remove(path)
        for parts in self.held_parts().values():
            for k, path in parts.items():
                if k > floor:
                    _remove(path)

    def clear_restore(self) -> None:
        _remove(self.restore)
        self.restore.mkdir(parents=True, exist_ok=True)
