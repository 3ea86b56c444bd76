"""etcd housekeeping: one agent of the run compacts etcd's history and bounds ``events/``.

etcd keeps every revision of every key until it is compacted; health records alone are
rewritten every few seconds per GPU, so a long job on many nodes would otherwise walk
into etcd's space quota (2 GiB by default), after which every write fails.

Compaction is cluster-wide (one revision for all keys of all runs), so exactly one agent
of a run does it: the holder of ``housekeeper``, a key under its node lease (when that
node goes, the next agent to look takes the role). It compacts to the revision etcd had
``--eft-compact-retention`` seconds ago, which keeps every watch eft starts (each from a
revision read just before) and every run's recent history, but never past a *floor*:
the rendezvous reads its participants at the revision its round formed at, for as long as
the round lasts (days), so each run's housekeeper publishes the oldest decision revision
it keeps under ``<prefix>/.compaction-floors/<run>`` and every run's compaction stays at
or below all of them. A run of an older eft, or another program on the same etcd, has no
floor: the time-based retention is all it gets.

Compaction frees pages for etcd to reuse: the database file stops growing, but does not
shrink (that takes a defragment, which blocks the member, and is left to its operator).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable

from elasticft.agent.context import AgentContext
from elasticft.config import HousekeepingConfig
from elasticft.periodic import PeriodicTask
from elasticft.store import StoreError

log = logging.getLogger(__name__)


class EtcdHousekeeper(PeriodicTask):
    name = "eft-etcd-housekeeping"
    run_first = False  # a job's first minutes have little history to drop

    def __init__(self, config: HousekeepingConfig, ctx: AgentContext, archive: str,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.interval = config.compact_interval
        self._ctx = ctx
        self.archive = archive
        self._clock = clock
        self._seen: deque[tuple[float, int]] = deque()  # (when, etcd's revision then), oldest first
        self.compacted = 0  # the revision this agent last compacted to
        self.moved = 0  # events moved to the archive by this agent

    @property
    def enabled(self) -> bool:
        return self.config.compact_interval > 0

    def check_once(self) -> int | None:
        """One round: the revision compacted to (None: none this round, or not the housekeeper)."""
        if not self.is_housekeeper():
            self._seen.clear()  # a holder again later starts its retention window anew
            return None
        if self.config.max_events > 0:
            moved = self._ctx.events.move_oldest(self.archive, self.config.max_events)
            if moved:
                self.moved += moved
                log.info("moved the %d oldest events of the run from etcd to %s", moved, self.archive)
        return self.compact()

    def is_housekeeper(self) -> bool:
        ctx = self._ctx
        if ctx.client.create(ctx.keys.housekeeper, ctx.node_id, lease=ctx.lease):
            log.info("this node does the run's etcd housekeeping (compaction, events bound)")
            return True
        held = ctx.client.get(ctx.keys.housekeeper)
        return held is not None and held.value.decode() == ctx.node_id

    def compact(self) -> int | None:
        client = self._ctx.client
        now, revision = self._clock(), client.revision()
        self._seen.append((now, revision))
        old = [i for i, (when, _) in enumerate(self._seen) if now - when >= self.config.compact_retention]
        if not old:
            return None
        for _ in range(old[-1]):  # the newest old-enough sample is the target; older ones are spent
            self._seen.popleft()
        target = min([self._seen[0][1], *self._floors()])
        if target <= self.compacted:
            return None
        try:
            client.compact(target)
        except StoreError as exc:
            if "compacted" not in str(exc):
                raise
            log.debug("etcd was already compacted past %d (another run's housekeeper)", target)
            self.compacted = target
            return None
        self.compacted = target
        log.info("compacted etcd's history before revision %d (now %d)", target, revision)
        return target

    def _floors(self) -> list[int]:
        """Publish this run's floor (its oldest kept round decision), then read every live run's."""
        ctx = self._ctx
        decisions, _ = ctx.client.get_prefix(ctx.keys.rdzv_decisions)
        mine = [int(json.loads(d.value)["revision"]) for d in decisions]
        if mine:
            ctx.client.put(ctx.keys.compaction_floor, str(min(mine)), lease=ctx.lease)
        floors, _ = ctx.client.get_prefix(ctx.keys.compaction_floors)
        return [int(f.value) for f in floors if f.value.isdigit()]
