"""MemoryTier: the node agent's whole memory checkpoint tier behind a few calls.

The agent calls ``start`` once, ``set_members`` on every membership change, ``prepare_start``
before every start of its workers, ``on_saved`` and ``on_restored`` when local rank 0's outbox
says so, and ``close`` at the end. Everything slow (checksums, pushes to peers) happens on
the tier's own thread or the shard server's; ``prepare_start`` is the one call that waits
(the workers cannot start before their restore candidates are prepared) and it never raises
for a peer's failure: a candidate it could not prepare is marked not ready and the event log
says why.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from elasticft.config import MemoryConfig
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.memory import LAG_MARKER, RESTORE_FILE, RestorePlan
from elasticft.contract.run_dir import WorkerEnv, write_atomically
from elasticft.memckpt.budget import PauseGate
from elasticft.memckpt.index import MemIndex, complete_iterations
from elasticft.memckpt.lag import LagGate
from elasticft.memckpt.node_dir import NodeDir
from elasticft.memckpt.placement import Spares
from elasticft.memckpt.plan import Plan, restart_plan
from elasticft.memckpt.reclaim import claim, reclaim_and_say, remove_run_dir_if_empty
from elasticft.memckpt.replicator import Replicator
from elasticft.memckpt.restore import prepare_candidates
from elasticft.memckpt.server import ShardServer
from elasticft.store import EtcdClient, StoreError
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)


class MemoryTier:
    def __init__(self, config: MemoryConfig, node_id: str, host: str, client: EtcdClient, keys: RunKeys,
                 run_dir: Path, record: Callable[..., None], timeout: float = 60.0, max_lag: int = 2):
        self.config = config
        self.node_id = node_id
        self.host = host
        self.client = client
        self.keys = keys
        self.run_dir = Path(run_dir)
        self.record = record
        self.timeout = timeout  # one transfer's socket timeout
        self.max_lag = max_lag  # --eft-mem-ckpt-max-lag
        self.node_dir = NodeDir(Path(config.mem_ckpt_dir) / keys.run_id / node_id)
        self.index = MemIndex(client, keys)
        self._lock = threading.RLock()
        self._domains: dict[str, str] = {node_id: config.domain()}
        self._server: ShardServer | None = None
        self._replicator: Replicator | None = None
        self._servers: KeySet | None = None  # the peers' shard server addresses, watched
        self.spares = Spares()  # the agent's live view of the spares, set before start (placement.py)

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        reclaim_and_say(Path(self.config.mem_ckpt_dir), keep=self.node_dir.root)
        self.node_dir.create()
        claim(self.node_dir.root)
        self._server = ShardServer(self.node_dir, self.node_id, self.keys.run_id, self.host,
                                   self.config.mem_ckpt_port, on_received=self._on_received).start()
        self._server.room = self._room
        self.client.put(self.keys.mem_server(self.node_id), self.address)
        gate = PauseGate(self.run_dir, self.config.budget_bytes(), self.record)
        self._replicator = Replicator(self.node_dir, self.node_id, self.address, self.keys.run_id, self.index,
                                      self.config.mem_ckpt_replicas, gate, self._members, self._address_of,
                                      self._lock, self.timeout,
                                      LagGate(self.run_dir / LAG_MARKER, self.max_lag, self.record), self.spares)
        self._replicator.start()

    def _room(self, nbytes: int) -> bool:
        """A spare takes one more extra copy only within its budget: without segments every member's
        part comes to every spare, which no spare's memory holds at a thousand nodes."""
        return not self.spares.this_node() or self.node_dir.used_bytes() + nbytes <= self.config.budget_bytes()

    def close(self) -> None:
        if self._replicator is not None:
            self._replicator.close()
        if self._servers is not None:
            self._servers.close()
        if self._server is not None:
            self._server.close()
            try:
                self.client.delete(self.keys.mem_server(self.node_id))
            except StoreError as exc:
                log.warning("memory tier: could not remove this node's server address: %s", exc)
        self.node_dir.remove()
        remove_run_dir_if_empty(self.node_dir.root.parent)

    @property
    def slow_replicas(self) -> tuple[int, float] | None:
        """An injected slow link (``replica_slow``): from which iteration, how many seconds per received file."""
        return self._server.slow if self._server is not None else None

    @slow_replicas.setter
    def slow_replicas(self, slow: tuple[int, float] | None) -> None:
        if self._server is not None:
            self._server.slow = slow

    def served(self) -> dict[str, int]:
        """Bytes this node's shard server served so far, per requesting node (what restores cost the network)."""
        return self._server.served() if self._server is not None else {}

    @property
    def restorable_seen(self) -> int | None:
        """The newest restorable iteration this node has seen (``mem/restorable``, watched)."""
        return self._running().lag.newest

    def replicated(self) -> dict[str, int]:
        """Bytes of this node's snapshots pushed so far, per replica holder."""
        return dict(self._running().replicated)

    def replication_lag(self) -> int:
        """Snapshots this node took after the newest restorable iteration it has seen (``lag.LagGate``)."""
        replicator = self._running()
        return replicator.lag.lag(list(replicator.published))

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("MemoryTier.start() was not called")
        return self._server.address

    # -- membership -------------------------------------------------------------

    def set_members(self, domains: dict[str, str]) -> None:
        with self._lock:
            self._domains = dict(domains)

    def _members(self) -> dict[str, str]:
        with self._lock:
            return dict(self._domains)

    def _address_of(self, node: str) -> str | None:
        """A peer's shard server, from a watched copy of ``mem/servers/``: no etcd request per push."""
        with self._lock:
            if self._servers is None or self._servers.broken:
                if self._servers is not None:
                    self._servers.close()
                self._servers = KeySet(self.client, self.keys.mem_server(""), lambda: None)
            servers = self._servers
        value = servers.get(self.keys.mem_server(node))
        return value.decode() if value is not None else None

    # -- the workers' events ----------------------------------------------------

    def on_saved(self, iteration: int, path: str) -> None:
        """Local rank 0 reported a finished snapshot; publish and replicate it in the background."""
        self._running().saved(iteration, path)

    def _on_received(self, origin: str, iteration: int) -> None:
        if self._replicator is not None:
            self._replicator.received(origin, iteration)

    def on_restored(self, iteration: int | None, is_rank0_node: bool) -> None:
        """The workers resumed at ``iteration`` (None: from scratch or an older disk checkpoint): every
        part newer than that belongs to an abandoned timeline; rank 0's node clears the whole index of them."""
        replicator = self._running()
        replicator.discard_pending()
        with self._lock:
            self.node_dir.drop_above(iteration)
            replicator.forget_above(-1 if iteration is None else iteration)
            try:
                if is_rank0_node:
                    self.index.drop_above(iteration)
            except StoreError as exc:
                log.warning("memory tier: could not drop index entries above iteration %s: %s", iteration, exc)
            replicator.check_budget()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the tier's thread has done everything queued so far (tests, an orderly stop)."""
        return self._running().flush(timeout)

    # -- restarts ---------------------------------------------------------------

    def prepare_start(self, alive: set[str], reached: int | None, since: int | None = None) -> dict[str, str]:
        """Before a start of the workers: a fresh generation dir, the restore candidates, mem-restore.json.
        ``since``: the etcd revision the round counted its members at (``plan.restart_plan``)."""
        self._running().discard_pending()
        with self._lock:
            generation, own = self.node_dir.new_generation()
            self.node_dir.clear_restore()
            try:  # one key read here, the index read once for the job (plan.py)
                plan = restart_plan(self.index, self.node_id, set(alive), since=since)
            except StoreError as exc:
                log.warning("memory tier: cannot read the index (%s); no memory checkpoint for this start", exc)
                plan = Plan([], None)
            complete = complete_iterations(plan.parts, set(alive))
            self._report_lost_share(plan.lost, complete[0].iteration if complete else None)
            candidates = prepare_candidates(self.node_dir, self.node_id, self.keys.run_id, complete, self.record,
                                            self.timeout, plan.parts)
        plan = RestorePlan(candidates=candidates, generation=generation, reached=reached, run_id=self.keys.run_id,
                           node=self.node_id)
        write_atomically(self.run_dir / RESTORE_FILE, plan.to_json())
        return {WorkerEnv.MEM_DIR.value: str(own)}

    def _report_lost_share(self, lost: tuple[int, str] | None, newest_complete: int | None) -> None:
        """A newer iteration was lost with its node and every replica holder (``index.lost_share``):
        say so, once per start."""
        if lost is None:
            return
        then = ("the newest disk checkpoint" if newest_complete is None
                else f"iteration {newest_complete} from memory")
        log.warning("memory checkpoint %d cannot be restored: %s; falling back to %s", lost[0], lost[1], then)
        self.record(EventKind.MEM_CKPT_FALLBACK, iteration=lost[0], why=lost[1], then=then)

    def newest_complete(self, alive: set[str]) -> int | None:
        complete = complete_iterations(self.index.parts(), set(alive))
        return complete[0].iteration if complete else None

    def _running(self) -> Replicator:
        if self._replicator is None:
            raise RuntimeError("MemoryTier.start() was not called")
        return self._replicator
