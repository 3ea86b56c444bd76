"""What a node keeps, and when its workers hold their snapshots: the restorable iterations it has seen.

An iteration is restorable when the index says it is complete with every part's replicas in
place (``index.restorable_iterations``): it survives the loss of a node. A node keeps its
parts and the replicas it holds of every iteration from the older of the two newest
restorable iterations it has seen on (``keep_from``; None: keep everything): never the last
good copy, and the one before for when the newest turns out corrupt at rest. Once a node has
seen iteration K restorable, it stays so until someone drops a part of it, which no node does
before it has seen two newer ones restorable: so whatever order the nodes read and prune in,
the newest restorable iteration ever seen stays complete (short of losing more nodes than
there are replicas).

The lag is how many snapshots this node took after the newest restorable iteration it has
seen. Over ``--eft-mem-ckpt-max-lag`` the run directory's ``LAG_MARKER`` holds the workers'
next snapshot (on every rank: the vote), a ``mem_ckpt_lag`` event says so, and one more when
it caught up: the snapshot rate backs off to what replication carries, and what is kept stays
bounded (about max-lag + 2 parts per origin). The marker also stands while a save of this node
waits behind another one being replicated (the replicator's one part of slack).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from elasticft.config import flag_name
from elasticft.contract.events import EventKind

log = logging.getLogger(__name__)

KEEP = 2  # restorable iterations kept: a corrupt newest one still leaves the one before


class LagGate:
    def __init__(self, marker: Path | None, max_lag: int, record: Callable[..., None]):
        self.marker = marker
        self.max_lag = max_lag
        self.record = record
        self.restorable: list[int] = []  # the newest KEEP restorable iterations seen, oldest first
        self.lagging = False  # over max_lag: the workers hold their snapshots
        self.queued = False  # a save waits behind one being replicated
        self._said_queued = False

    @property
    def newest(self) -> int | None:
        return self.restorable[-1] if self.restorable else None

    def keep_from(self) -> int | None:
        """Parts and replicas older than this may go; None: keep them all (too few restorable yet)."""
        return self.restorable[0] if len(self.restorable) >= KEEP else None

    def seen(self, restorable: list[int]) -> None:
        """The index's restorable iterations, newest first: what is seen once stays seen."""
        self.restorable = sorted(set(self.restorable) | set(restorable[:KEEP]))[-KEEP:]

    def forget_above(self, floor: int, published: list[int]) -> None:
        """The workers resumed at ``floor``: restorable iterations above it belong to a timeline they left.
        No event: the restart is the news (``ckpt_restored``), not a catching up."""
        self.restorable = [k for k in self.restorable if k <= floor]
        self.lagging = self.lag(published) > self.max_lag
        self._mark()

    def lag(self, published: list[int]) -> int:
        newest = self.newest
        return sum(1 for k in published if newest is None or k > newest)

    def update(self, published: list[int]) -> None:
        """After a read of the index or a change of ``published``: the event when the lag crosses max_lag."""
        lag = self.lag(published)
        lagging = lag > self.max_lag
        if lagging != self.lagging:
            self.lagging = lagging
            fields = dict(lagging=lagging, lag=lag, newest=max(published, default=None), restorable=self.newest,
                          max_lag=self.max_lag)
            if lagging:
                log.warning("memory checkpoints: %d snapshot(s) taken since the newest iteration with every replica "
                            "in place (%s); the workers take no more until replication catches up (%s %d)", lag,
                            self.newest, flag_name("mem_ckpt_max_lag"), self.max_lag)
            else:
                log.info("memory checkpoints: replication caught up (iteration %s has every replica in place)",
                         self.newest)
            self.record(EventKind.MEM_CKPT_LAG, **fields)
        self._mark()

    def hold_queued(self, queued: bool) -> None:
        if queued and not self._said_queued:
            self._said_queued = True
            log.info("memory checkpoints: replication is slower than the snapshots; each snapshot now waits "
                     "for the one before to be replicated")
        self.queued = queued
        self._mark()

    def _mark(self) -> None:
        if self.marker is None:
            return
        if self.queued or self.lagging:
            self.marker.touch()
        else:
            self.marker.unlink(missing_ok=True)

    def close(self) -> None:
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
