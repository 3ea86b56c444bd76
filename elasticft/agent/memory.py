"""The node agent's part in the memory checkpoint tier: feed the tier, prepare every start.

``elasticft.memckpt.MemoryTier`` keeps this node's snapshots and other nodes' replicas in
host memory and serves them to peers. This service connects it to the agent: the
workers' outbox messages (a snapshot finished, the workers resumed, a memory iteration did
not load), the membership (who is alive, in which failure domain) and every start of the
workers (prepare the newest iterations the survivors hold, before the workers look for them).

With the tier off it still reports where the workers resumed from (a ``ckpt_restored``
event, from the node of global rank 0), and how many iterations they must do again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.context import AgentContext
from elasticft.config import MemoryConfig, env_name
from elasticft.contract.checkpoints import iter_dir_name
from elasticft.contract.events import EventKind
from elasticft.contract.faults import REPLICA_SLOW_SECONDS, FaultKind, parse_faults
from elasticft.contract.memory import HELD_DIR
from elasticft.contract.progress import reached, read_progress
from elasticft.contract.records import NodeState
from elasticft.contract.run_dir import FIRED_PREFIX, OutboxKind
from elasticft.memckpt import MemoryTier
from elasticft.memckpt.placement import Spares
from elasticft.memckpt.replicator import preload_checkpoint_reader

log = logging.getLogger(__name__)


class MemoryService:
    def __init__(self, config: MemoryConfig, ctx: AgentContext, host: str, run_dir: Path,
                 holds_rank0: Callable[[], bool], inject: str = "", max_lag: int = 2):
        self.config = config
        self._inject = inject
        self._ctx = ctx
        self._run_dir = Path(run_dir)
        self._holds_rank0 = holds_rank0
        self._reached: int | None = None  # the previous generation's highest iteration
        self.tier = (MemoryTier(config, ctx.node_id, host, ctx.client, ctx.keys, self._run_dir, ctx.record,
                                max_lag=max_lag)
                     if config.enabled else None)
        if self.tier is not None:  # spares hold extra copies, to restore from their own memory when promoted
            self.tier.spares = Spares(self._waiting_spares, lambda: ctx.node.record.state is NodeState.SPARE,
                                      ctx.node.record.segment)

    def start(self, ckpt: CheckpointCoordinator) -> MemoryService:
        ckpt.on_outbox(OutboxKind.RESTORED, self._on_restored)
        if self.tier is None:
            return self
        self.tier.start()
        ckpt.on_outbox(OutboxKind.MEM_SAVED, self._on_saved)
        ckpt.on_outbox(OutboxKind.MEM_FALLBACK, self._on_fallback)
        log.info("memory checkpoints every %d iteration(s), %d replica(s), budget %.2f GB, served at %s",
                 self.config.mem_ckpt_interval, self.config.mem_ckpt_replicas, self.config.budget_bytes() / 1e9,
                 self.tier.address)
        return self

    @staticmethod
    def before_joining(config: MemoryConfig) -> None:
        """What the tier needs imported, imported before this node holds a lease (see
        ``preload_checkpoint_reader``)."""
        if config.enabled:
            preload_checkpoint_reader()

    @staticmethod
    def worker_environment(config: MemoryConfig) -> dict[str, str]:
        """What the workers' ``MemoryCheckpoints`` reads (the write directory comes per start)."""
        return {env_name("mem_ckpt_interval"): str(config.mem_ckpt_interval),
                env_name("mem_ckpt_overlap"): str(config.mem_ckpt_overlap).lower()}

    def before_workers_start(self, group_rank: int | None = None, round_revision: int | None = None) -> dict[str, str]:
        """Prepare the restore candidates for the workers about to start; their environment.
        ``round_revision``: the etcd revision the round counted its members at (a memory plan read
        since is this restart's: ``memckpt/plan.py``), None from another rendezvous backend.

        Called before the previous generation's heartbeats are forgotten: they tell how
        far it got, and so how much the next one re-does.
        """
        now = reached(read_progress(self._run_dir))
        self._reached = now if now is not None else self._reached
        if self.tier is None:
            return {}
        members = self._ctx.membership.members()
        # The ring of replica holders is the members'; spares' copies are extra (memckpt/placement.py)
        domains = {node: record.domain for node, record in members.items() if record.state is not NodeState.SPARE}
        domains[self._ctx.node_id] = self.config.domain()
        self.tier.set_members(domains)
        alive = set(members) | {self._ctx.node_id}  # a spare's copies are sources too
        self._inject_corruption(group_rank, alive)
        self._inject_slowness(group_rank)
        return self.tier.prepare_start(alive, self._reached, round_revision)

    def _waiting_spares(self) -> dict[str, str]:
        return {node: record.segment for node, record in self._ctx.membership.members().items()
                if record.state is NodeState.SPARE}

    def _inject_corruption(self, group_rank: int | None, alive: set[str]) -> None:
        """``--eft-inject replica_corrupt:NODE@I``: one flipped byte in a replica held here of the
        newest iteration the survivors could restore."""
        for fault in parse_faults(self._inject):
            marker = self._run_dir / (FIRED_PREFIX + fault.name)
            if (fault.kind is not FaultKind.REPLICA_CORRUPT or fault.target != group_rank or marker.exists()
                    or self._reached is None or self._reached < fault.iteration):
                continue
            newest = self.tier.newest_complete(alive)
            held = Path(self.config.mem_ckpt_dir) / self._ctx.keys.run_id / self._ctx.node_id / HELD_DIR
            parts = sorted(held.glob(f"*/{iter_dir_name(newest)}")) if newest is not None else []
            files = sorted((f for f in parts[0].iterdir() if f.is_file()), key=lambda f: f.stat().st_size) \
                if parts else []
            if not files:
                continue
            with open(files[-1], "r+b") as f:
                f.seek(files[-1].stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0xFF]))
            marker.touch()
            log.warning("injected fault: flipped one byte of the replica %s", files[-1])

    def _inject_slowness(self, group_rank: int | None) -> None:
        """``--eft-inject replica_slow:NODE@I``: this node's shard server holds each replica file it receives."""
        for fault in parse_faults(self._inject):
            if fault.kind is FaultKind.REPLICA_SLOW and fault.target == group_rank and self.tier.slow_replicas is None:
                self.tier.slow_replicas = (fault.iteration, REPLICA_SLOW_SECONDS)
                log.warning("injected fault: replicas of iteration %d on are held %.1f s each on arrival",
                            fault.iteration, REPLICA_SLOW_SECONDS)

    def _on_saved(self, message: dict) -> None:
        self.tier.on_saved(int(message["iteration"]), str(message["path"]))

    def _on_fallback(self, message: dict) -> None:
        """Global rank 0: a memory iteration did not load (a range no holder delivered intact, for one)."""
        fields = {k: message[k] for k in ("iteration", "why", "then", "file", "range") if k in message}
        self._ctx.record(EventKind.MEM_CKPT_FALLBACK, **fields)

    def _on_restored(self, message: dict) -> None:
        iteration = message.get("iteration")
        read = message.get("read")
        if read:  # what this node's ranks read of the memory checkpoint, and from where
            log.info("memory restore: this node's %d rank(s) needed %.1f MB (%.1f MB of it held elsewhere), "
                     "read %.1f MB here and %.1f MB from other nodes", read.get("ranks", 0),
                     read.get("needed", 0) / 1e6, read.get("needed_remote", 0) / 1e6, read.get("local", 0) / 1e6,
                     read.get("fetched", 0) / 1e6)
        rank0 = self._holds_rank0()
        if self.tier is not None:
            self.tier.on_restored(iteration, rank0)
        if not rank0:
            return  # one event per restart: from the node of global rank 0
        reached = self._reached
        redone = reached - (iteration or 0) if reached is not None else None
        self._ctx.record(EventKind.CKPT_RESTORED, iteration=iteration, source=message.get("source"),
                         path=message.get("path"), reached=reached, redone=redone)
        log.info("workers resumed from iteration %s (%s)%s", iteration, message.get("source"),
                 f"; {redone} iteration(s) re-done" if redone is not None else "")

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
