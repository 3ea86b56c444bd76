"""The tier's own thread: publish each saved part, push its replicas, prune, watch the lag and budget.

``MemoryTier.on_saved`` only queues; the agent's monitor loop must never wait for a copy to
another node. While a save of this node waits behind another one being replicated, or the
node took more than ``--eft-mem-ckpt-max-lag`` snapshots since the newest restorable
iteration, the run directory's ``LAG_MARKER`` exists and the workers take no new snapshot
(their vote pauses every rank alike): so when replication is slower than the snapshots, the
snapshot rate backs off to what replication carries, and no save is ever dropped. Pruning
keeps everything from the older of the two newest restorable iterations this node has seen
(``lag.LagGate``): a node never drops the last good copy.

etcd sees one write per snapshot of this node: its record (``mem/parts/<node>``, every part it
keeps), written once the new part's pushes are done, naming as holders the origin and each node
that accepted every file, so the index never claims more copies than exist. Older parts pruned
meanwhile leave the record at that write too. Which iterations are restorable comes from one
watched key (``restorable.RestorableView``), not from reading every node's record.
"""

from __future__ import annotations

import dataclasses
import importlib
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
from elasticft.memckpt.index import MemIndex
from elasticft.memckpt.lag import LagGate
from elasticft.memckpt.node_dir import NodeDir
from elasticft.memckpt.placement import Spares, replica_holders, spare_holders
from elasticft.memckpt.restorable import RestorableView
from elasticft.memckpt.transfer import TransferError, push
from elasticft.store import StoreError

log = logging.getLogger(__name__)


def preload_checkpoint_reader() -> None:
    """Import torch's checkpoint reader (``needs_of``) now. The node agent calls this before it
    joins: the import holds the GIL for seconds on a busy host, and in a thread of an agent that
    holds a lease it starved the lease's keep-alives until etcd let the lease expire (a healthy
    node taken for lost). Done here, the first save does not wait for it either."""
    importlib.import_module("torch.distributed.checkpoint")


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
    """The restorable iterations changed, or the workers are held: look again, retry the replicas that failed."""


RECHECK = 0.5  # seconds between retries of refused replicas while the workers hold their snapshots
SPARE_BACKOFF = 30.0  # seconds before a spare that failed to take a copy is sent one again


class Replicator:
    def __init__(self, node_dir: NodeDir, node_id: str, address: str, run_id: str, index: MemIndex,
                 replicas: int, gate: PauseGate, members: Callable[[], dict[str, str]],
                 address_of: Callable[[str], str | None], lock: threading.RLock, timeout: float = 60.0,
                 lag: LagGate | None = None, spares: Spares | None = None):
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
        self.replicated: dict[str, int] = {}  # holder -> bytes of this node's parts pushed to it (metrics)
        self.lag = lag or LagGate(None, 1 << 30, lambda *a, **k: None)
        self._kept: dict[int, MemPart] = {}  # this node's record: the parts it keeps, by iteration
        self._short: dict[int, tuple[MemPart, Path, list[str]]] = {}  # own parts some holder refused
        self.spares = spares or Spares()
        self.view = RestorableView(index, node_id, members, self._poke, self.spares.this_node)
        self._dirty = False  # the restorable iterations (or, where this agent computes them, a record) changed
        self.newest_size = 0
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self._warned_short = False
        self._failing: set[str] = set()  # holders whose failure was logged (once, until they work again)
        self._spare_backoff: dict[str, float] = {}  # spare -> when a copy to it is tried again (monotonic)
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
        self.view.close()
        self.lag.close()

    def forget_above(self, floor: int) -> None:
        """The workers resumed at ``floor``: this node's parts above it are gone (under the tier's lock);
        its record says so at once (one write per restart, and only when it held such parts)."""
        self.published = [k for k in self.published if k <= floor]
        self._short = {k: v for k, v in self._short.items() if k <= floor}
        if any(k > floor for k in self._kept):
            self._kept = {k: p for k, p in self._kept.items() if k <= floor}
            self._write_record()
        with self._cond:
            self.lag.forget_above(floor, self.published)

    def _poke(self) -> None:
        """From a watch thread: the restorable iterations may have changed; the thread looks once, however many came."""
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

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
            # While the workers are held (the lag, the budget), retry refused replicas now and then.
            held = self.lag.lagging or self.gate.paused
            self._cond.wait_for(lambda: self._jobs or self._dirty or self._stop, RECHECK if held else None)
            if self._stop:
                return None
            job = self._jobs.popleft() if self._jobs else _Recheck()
            if not isinstance(job, _Received):
                self._dirty = False  # this job looks at the restorable iterations again
            self._busy = True
            self._replicating = isinstance(job, _Saved)
            return job

    def _loop(self) -> None:
        preload_checkpoint_reader()  # a no-op where the agent imported it before joining
        while (job := self._next()) is not None:
            try:
                if isinstance(job, _Saved):
                    self._replicate(job)
                elif isinstance(job, _Recheck):
                    self._retry_short()
                if not isinstance(job, _Received) or self.spares.this_node():
                    self._refresh()  # (a replica that came in changes nothing, but on a spare: it follows the job)
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
        missing = [holder for holder in holders if not self._push_to(holder, part, job.path)]
        with self.lock:  # on_restored trims the record from the agent's thread
            self._kept[job.iteration] = part
            self._write_record()
            self.published = [k for k in self.published if k != job.iteration] + [job.iteration]
            if missing:
                self._short[job.iteration] = (part, job.path, missing)
        self.newest_size = part.size
        self._copy_to_spares(part, job.path)

    def _copy_to_spares(self, part: MemPart, path: Path) -> None:
        """The spares' extra copies, after the record (the job waits for none of them): the index does
        not list them (a spare finds its own on disk), and one that failed is not retried for
        ``SPARE_BACKOFF`` seconds (a frozen spare would hold each save for a socket timeout)."""
        now = time.monotonic()
        for spare in spare_holders(self.node_id, self.spares):
            if self._spare_backoff.get(spare, 0.0) > now:
                continue
            if self._push_to(spare, dataclasses.replace(part, holders=list(part.holders),
                                                        addresses=dict(part.addresses)), path):
                self._spare_backoff.pop(spare, None)
            else:
                self._spare_backoff[spare] = now + SPARE_BACKOFF

    def _write_record(self) -> None:
        """This node's record as it stands: the one etcd write of a snapshot (under the tier's lock)."""
        keep_from = self.lag.keep_from()
        if keep_from is not None:  # pruned since the last write: their files are gone, so are they here
            self._kept = {k: p for k, p in self._kept.items() if k >= keep_from}
        self.index.write(self.node_id, list(self._kept.values()))

    def _retry_short(self) -> None:
        """While the workers wait for replication: push again what a holder refused (it may work now)."""
        with self.lock:
            short = sorted(self._short.items())
        for iteration, (part, path, missing) in short:
            still = [holder for holder in missing if not self._push_to(holder, part, path)]
            with self.lock:
                if iteration in self._short:
                    if still:
                        self._short[iteration] = (part, path, still)
                    else:
                        del self._short[iteration]
                if len(still) < len(missing) and iteration in self._kept:
                    self._write_record()  # the new holders

    def _refresh(self) -> None:
        """The restorable iterations (one watched key): what to keep, and how far this node lags."""
        restorable = self.view.refresh()
        with self.lock, self._cond:
            self.lag.seen(restorable)
            self.lag.update(self.published)

    def _holders(self) -> list[str]:
        members = dict(self.members())  # the ring: the agent leaves the spares out (agent/memory.py)
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
        self.replicated[holder] = self.replicated.get(holder, 0) + sum(size for size, _ in part.files.values())
        if holder not in part.holders:
            part.holders.append(holder)
        part.addresses[holder] = address
        return True

    def _prune_and_check(self) -> None:
        """Keep everything from ``lag.keep_from()`` on: own parts, their index entries, the replicas held here."""
        with self.lock:
            keep_from = self.lag.keep_from()
            if keep_from is not None:
                # The record still lists the pruned parts until this node's next write: one write per
                # snapshot. They are older than two restorable iterations, so no restore picks them
                # unless both of those were lost, and then a missing file only makes that try fail.
                self.published = [k for k in self.published if k >= keep_from]
                self._short = {k: v for k, v in self._short.items() if k >= keep_from}
                self.node_dir.prune_own(keep_from)
                self.node_dir.prune_held(keep_from)
            self.check_budget()

    def check_budget(self) -> bool:
        return self.gate.check(self.node_dir.used_bytes(), self.newest_size)
