"""The tier's own thread: publish each saved part, push its replicas, prune, watch the lag and budget.

``MemoryTier.on_saved`` only queues; the agent's monitor loop must never wait for a copy to
another node. While a save of this node waits behind another one being replicated, or the
node took more than ``--eft-mem-ckpt-max-lag`` snapshots since the newest restorable
iteration, the run directory's ``LAG_MARKER`` exists and the workers take no new snapshot
(their vote pauses every rank alike): so when replication is slower than the snapshots, the
snapshot rate backs off to what replication carries, and no save is ever dropped. Pruning
keeps everything from the older of the two newest restorable iterations this node has seen
(``lag.LagGate``): a node never drops the last good copy. A part is published with the origin
as its only holder *before* any push, and each holder is added only after it accepted every
file, so the index never claims more copies than exist.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elasticft.contract.memory import DCP_METADATA, GLOBAL_FILES, MemPart
from elasticft.memckpt.budget import PauseGate
from elasticft.memckpt.chunks import checksum_part
from elasticft.memckpt.index import MemIndex, restorable_iterations
from elasticft.memckpt.lag import LagGate
from elasticft.memckpt.node_dir import NodeDir
from elasticft.memckpt.placement import replica_holders
from elasticft.memckpt.transfer import TransferError, push
from elasticft.store import StoreError

log = logging.getLogger(__name__)


def needs_of(part_dir: Path) -> list[str] | None:
    """Every file of the checkpoint, read from rank 0's ``.metadata``; None if it cannot be read.

    The shard files come from DCP's own index (``storage_data``); the global files megatron adds
    beside ``.metadata`` count when this part has them.
    """
    from torch.distributed.checkpoint import FileSystemReader  # the agent has torch; keep importing us cheap

    try:
        metadata = FileSystemReader(str(part_dir)).read_metadata()
        shards = {item.relative_path for item in (metadata.storage_data or {}).values()}
    except Exception as exc:  # a torn or foreign .metadata: the part is published, never complete
        log.warning("memory checkpoint %s: cannot read %s: %s", part_dir, DCP_METADATA, exc)
        return None
    return sorted(shards | {name for name in GLOBAL_FILES if (part_dir / name).is_file()})


@dataclass
class _Saved:
    iteration: int
    path: Path


@dataclass
class _Received:
    origin: str
    iteration: int


class _Recheck:
    """No job came while the workers are held: read the index again, retry the replicas that failed."""


RECHECK = 0.5  # seconds between reads of the index while the workers hold their snapshots (lag, budget)


class Replicator:
    def __init__(self, node_dir: NodeDir, node_id: str, address: str, run_id: str, index: MemIndex,
                 replicas: int, gate: PauseGate, members: Callable[[], dict[str, str]],
                 address_of: Callable[[str], str | None], lock: threading.RLock, timeout: float = 60.0,
                 lag: LagGate | None = None):
        self.node_dir = node_dir
        self.node_id = node_id
        self.address = address
        self.run_id = run_id
        self.index = index
        self.replicas = replicas
        self.gate = gate
        self.members = members  # node id -> failure domain, as the tier last heard
        self.address_of = address_of  # a peer's shard server address, from etcd
        self.lock = lock  # the tier's: pruning and a restart's assembly never interleave
        self.timeout = timeout
        self.published: list[int] = []  # this node's iterations in the index, oldest first
        self.lag = lag or LagGate(None, 1 << 30, lambda *a, **k: None)
        self._short: dict[int, tuple[MemPart, Path, list[str]]] = {}  # own parts some holder refused
        self._kept_from: int | None = None
        self._refreshed = float("-inf")  # time.monotonic() of the last read of the index
        self.newest_size = 0
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self._warned_short = False
        self._failing: set[str] = set()  # holders whose failure was logged (once, until they work again)
        self._thread = threading.Thread(target=self._loop, name="eft-mem-replicator", daemon=True)
        self._replicating = False  # the job in progress is a save

    # -- the agent's side -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def saved(self, iteration: int, path: str) -> None:
        self._put(_Saved(iteration, Path(path)))

    def received(self, origin: str, iteration: int) -> None:
        self._put(_Received(origin, iteration))

    def discard_pending(self) -> None:
        """Forget queued saves: a new start of the workers left their timeline."""
        with self._cond:
            self._jobs = deque(j for j in self._jobs if not isinstance(j, _Saved))
            self._mark_lag()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._jobs.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.lag.close()

    def forget_above(self, floor: int) -> None:
        """The workers resumed at ``floor``: this node's parts above it are gone (under the tier's lock)."""
        self.published = [k for k in self.published if k <= floor]
        self._short = {k: v for k, v in self._short.items() if k <= floor}
        with self._cond:
            self.lag.forget_above(floor, self.published)

    def _mark_lag(self) -> None:
        """The marker's first reason: a save of this node queued behind one in progress (under _cond)."""
        self.lag.hold_queued(self._replicating + sum(isinstance(j, _Saved) for j in self._jobs) > 1)

    # -- the thread -------------------------------------------------------------

    def _put(self, job) -> None:
        with self._cond:
            self._jobs.append(job)
            self._mark_lag()
            self._cond.notify_all()

    def _next(self):
        with self._cond:
            self._busy = self._replicating = False
            self._mark_lag()
            self._cond.notify_all()
            # While the workers are held (the lag, the budget), no save comes to look at the index again.
            held = self.lag.lagging or self.gate.paused
            self._cond.wait_for(lambda: self._jobs or self._stop, RECHECK if held else None)
            if self._stop:
                return None
            job = self._jobs.popleft() if self._jobs else _Recheck()
            self._busy = True
            self._replicating = isinstance(job, _Saved)
            return job

    def _loop(self) -> None:
        # The first save must not wait seconds for torch's checkpoint reader to import (needs_of).
        import torch.distributed.checkpoint  # noqa: F401

        while (job := self._next()) is not None:
            try:
                if isinstance(job, _Saved):
                    self._replicate(job)
                elif isinstance(job, _Recheck):
                    self._retry_short()
                # A replica file that came in: only now and then (a spare node, which saves nothing, still prunes).
                if not isinstance(job, _Received) or time.monotonic() - self._refreshed >= RECHECK:
                    self._refresh()
                self._prune_and_check()
            except (OSError, StoreError) as exc:
                log.warning("memory tier on %s: %s failed: %s", self.node_id, job, exc)

    def _replicate(self, job: _Saved) -> None:
        files = checksum_part(job.path)  # and each shard file's chunk table, written beside it
        if not files:
            # Normal with data parallelism: only one replica of each shard is written.
            log.debug("memory checkpoint %d: %s holds no files; not published", job.iteration, job.path)
            return
        needs = needs_of(job.path) if DCP_METADATA in files else None
        holders = self._holders()
        part = MemPart(node=self.node_id, iteration=job.iteration, address=self.address, files=files,
                       holders=[self.node_id], addresses={self.node_id: self.address}, replicas=len(holders),
                       needs=needs, path=os.path.relpath(job.path, self.node_dir.root), time=time.time())
        self.index.publish(part)
        with self.lock:  # on_restored trims the list from the agent's thread
            self.published = [k for k in self.published if k != job.iteration] + [job.iteration]
        self.newest_size = part.size
        missing = [holder for holder in holders if not self._push_to(holder, part, job.path)]
        if missing:
            with self.lock:
                self._short[job.iteration] = (part, job.path, missing)

    def _retry_short(self) -> None:
        """While the workers wait for replication: push again what a holder refused (it may work now)."""
        with self.lock:
            short = sorted(self._short.items())
        for iteration, (part, path, missing) in short:
            missing = [holder for holder in missing if not self._push_to(holder, part, path)]
            with self.lock:
                if iteration in self._short:
                    if missing:
                        self._short[iteration] = (part, path, missing)
                    else:
                        del self._short[iteration]

    def _refresh(self) -> None:
        """Read the index: the restorable iterations seen, and so what to keep and how far this node lags."""
        alive = set(self.members()) | {self.node_id}
        self._refreshed = time.monotonic()
        restorable = restorable_iterations(self.index.parts(), alive)
        with self.lock, self._cond:
            self.lag.seen(restorable)
            self.lag.update(self.published)

    def _holders(self) -> list[str]:
        members = dict(self.members())
        members.setdefault(self.node_id, "")
        holders = replica_holders(self.node_id, members, self.replicas)
        if len(holders) < self.replicas and not self._warned_short:
            self._warned_short = True
            log.warning("memory checkpoints: %d replica(s) asked for, but only %d other node(s): replicating to "
                        "as many as there are", self.replicas, len(members) - 1)
        return holders

    def _push_to(self, holder: str, part: MemPart, path: Path) -> bool:
        address = self.address_of(holder)
        try:
            if not address:
                raise TransferError(f"{holder} has published no shard server address")
            for name, (_, crc) in part.files.items():
                push(address, self.run_id, self.node_id, part.iteration, path / name, crc, self.timeout)
        except TransferError as exc:
            if holder not in self._failing:
                self._failing.add(holder)
                log.warning("memory checkpoint %d: no replica on %s (%s); skipping it until it works again",
                            part.iteration, holder, exc)
            return False
        self._failing.discard(holder)
        self.index.add_holder(self.node_id, part.iteration, holder, address)  # False: the part was dropped meanwhile
        return True

    def _prune_and_check(self) -> None:
        """Keep everything from ``lag.keep_from()`` on: own parts, their index entries, the replicas held here."""
        with self.lock:
            keep_from = self.lag.keep_from()
            if keep_from is not None:
                self.published = [k for k in self.published if k >= keep_from]
                self._short = {k: v for k, v in self._short.items() if k >= keep_from}
                self.node_dir.prune_own(keep_from)
                self.node_dir.prune_held(keep_from)
                if keep_from != self._kept_from:
                    self.index.drop_node_below(self.node_id, keep_from)
                    self._kept_from = keep_from
            self.check_budget()

    def check_budget(self) -> bool:
        return self.gate.check(self.node_dir.used_bytes(), self.newest_size)
