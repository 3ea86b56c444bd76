"""``--eft-join-at``: the moment the members of a running job let a node that waits to join in.

A node that comes back (repaired, or a spare) waits in the round after the running one;
torch's agent restarts every worker of the job for it as soon as it sees it. With
``--eft-join-at save`` (the default) the members hold that restart until the next
checkpoint of either tier is complete (a disk save in ``ckpt/latest``, or a memory
iteration complete in the index), so that it costs no work, and at most
``--eft-join-wait`` seconds. ``JoinGate`` is the rendezvous's ``Admission``
(``rendezvous/held.py``):

* the round's rank 0 makes the decision for everyone: it creates ``rdzv/ctl/held/<r>``
  (``JoinHold``: the newest checkpoint now, the most seconds), watches ``ckpt/latest``
  and the memory index while it holds, and rewrites the record with ``let_in`` once a
  newer checkpoint is complete or the time is up;
* every member (and the waiting node) reads the record from the control keys it watches
  anyway, so all of them restart at about the same time, at the same checkpoint;
* a member that sees no decision within the wait (and a margin) lets the nodes in itself.

A failure or a lost member while a join is held restarts the round as before: the lost
count is not held back, and the waiting nodes join in that round. With neither tier
configured the nodes join at once (one log line says so); with ``--eft-join-at now``, too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence

from elasticft.agent.context import AgentContext
from elasticft.config import Settings
from elasticft.contract.argv import flag_value
from elasticft.contract.events import EventKind
from elasticft.contract.memory import MemPart
from elasticft.contract.records import JoinHold, LetIn
from elasticft.memckpt.index import complete_iterations, parts_of
from elasticft.rendezvous.held import Formed
from elasticft.store.keyset import KeySet
from elasticft.store import StoreError

log = logging.getLogger(__name__)

# A member that has not seen the round's rank 0 decide within the wait lets the nodes in
# itself this much later: the bound holds even when the decider's write is lost.
DECIDER_MARGIN = 10.0


def newest_checkpoint(latest: bytes | None, parts: Sequence[MemPart], alive: set[str]) -> int | None:
    """The newest complete checkpoint of either tier: ``ckpt/latest``'s iteration (``latest``:
    its value) or the newest memory iteration the live nodes hold in full; None: none."""
    newest = []
    if latest is not None:
        try:
            newest.append(int(json.loads(latest)["iteration"]))
        except (ValueError, TypeError, KeyError) as exc:
            log.debug("ignoring a malformed ckpt/latest: %s", exc)
    complete = complete_iterations(list(parts), alive) if parts else []
    newest += [complete[0].iteration] if complete else []
    return max(newest, default=None)


def checkpoint_tiers(settings: Settings, args: Sequence[str]) -> list[str]:
    """The checkpoint tiers a job has, in words: Megatron's ``--save`` with ``--save-interval``,
    and the memory tier."""
    tiers = []
    interval = flag_value(list(map(str, args)), "--save-interval")
    if flag_value(list(map(str, args)), "--save") and interval and interval.isdigit() and int(interval) > 0:
        tiers.append(f"disk every {interval} iterations")
    if settings.memory.enabled:
        tiers.append(f"memory every {settings.memory.mem_ckpt_interval} iteration(s)")
    return tiers


class CheckpointWatch:
    """``ckpt/latest`` and the memory index, watched while a join is held (the decider only)."""

    def __init__(self, ctx: AgentContext, memory: bool):
        self._ctx = ctx
        self._changes = 0
        self._seen = -1
        self._newest: int | None = None
        self._latest = KeySet(ctx.client, ctx.keys.ckpt_latest, self._changed, exact=True)
        self._parts = KeySet(ctx.client, ctx.keys.mem_parts, self._changed) if memory else None

    def _changed(self) -> None:
        self._changes += 1

    def newest(self) -> int | None:
        """The newest complete checkpoint (worked out again only after a change)."""
        if self._seen != self._changes:
            self._seen = self._changes
            parts = parts_of(self._ctx.keys.mem_parts, self._parts.snapshot().items() if self._parts else ())
            alive = set(self._ctx.membership.members()) | {self._ctx.node_id}
            self._newest = newest_checkpoint(self._latest.get(self._ctx.keys.ckpt_latest), parts, alive)
        return self._newest

    def close(self) -> None:
        for keyset in (self._latest, self._parts):
            if keyset is not None:
                keyset.close()


class JoinGate:
    """One member's ``Admission``: asked at every look while a node waits for the next round."""

    def __init__(self, ctx: AgentContext, join_at: str, wait: float, tiers: list[str], memory: bool):
        self._ctx = ctx
        self._now = join_at == "now" or wait <= 0
        self._wait = wait
        self._tiers = tiers
        self._memory = memory
        self._said_no_tier = False
        self._number: int | None = None  # the round the nodes wait in
        self._since = 0.0  # when this member first saw them, or the node the record holds (monotonic)
        self._waiter: str | None = None  # the node the record holds
        self._told: JoinHold | None = None  # the record last logged
        self._watch: CheckpointWatch | None = None  # the decider's, while it holds

    @classmethod
    def for_agent(cls, settings: Settings, ctx: AgentContext, args: Sequence[str]) -> JoinGate:
        start = settings.start
        return cls(ctx, start.join_at, start.join_wait, checkpoint_tiers(settings, args), settings.memory.enabled)

    def admit(self, formed: Formed, control: KeySet) -> bool:
        if self._now:
            return True
        if not self._tiers:
            if not self._said_no_tier:
                self._said_no_tier = True
                log.info("--eft-join-at save: the job has no checkpoint tier (neither --save with --save-interval "
                         "nor --eft-mem-ckpt-interval): nodes waiting to join come in now")
            return True
        number = formed.number + 1
        if number != self._number:
            self.close()
            self._number, self._since, self._told, self._waiter = number, time.monotonic(), None, None
        try:
            return self._look(formed, control)
        except StoreError as exc:  # etcd away: no one joins meanwhile; the bound still holds
            log.debug("held join: %s", exc)
            return self._waited() >= self._wait + DECIDER_MARGIN

    def _waited(self) -> float:
        return time.monotonic() - self._since

    def _look(self, formed: Formed, control: KeySet) -> bool:
        key = self._ctx.keys.rdzv_held(self._number)
        raw = control.get(key)
        waiting = (control.get(self._ctx.keys.rdzv_waiting(self._number)) or b"?").decode()
        try:
            hold = JoinHold.from_json(raw) if raw is not None else None
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("a malformed %s lets the nodes waiting to join in: %s", key, exc)
            return True
        mine = hold is not None and hold.by == self._ctx.node_id
        if formed.rank == 0 and (hold is None or (mine and hold.let_in is None and hold.waiting != waiting)):
            if self._moved_on(formed, waiting):
                return True  # not a newcomer: a member whose workers failed, and the round restarts for it
            hold = self._hold(key, waiting, fresh=hold is None)  # a new waiter, or the one held left
        if hold is None:  # the decider's record is on its way
            return self._waited() >= self._wait + DECIDER_MARGIN
        if hold.let_in is None and hold.waiting != self._waiter:  # a new hold: its wait starts now
            self._waiter, self._since = hold.waiting, time.monotonic()
        self._tell(hold)
        if hold.let_in is not None:
            return True
        if hold.by == self._ctx.node_id:
            return self._decide(key, hold)
        if self._waited() >= hold.wait + DECIDER_MARGIN:
            log.warning("node %s decided nothing within the wait: nodes waiting to join come in now", hold.by)
            return True
        return False

    def _moved_on(self, formed: Formed, waiting: str) -> bool:
        """The node that waits was a member of ``formed`` (its lost key shows a moment later)."""
        key = self._ctx.keys.rdzv_participant(formed.number, waiting)
        count, _ = self._ctx.client.count_range(key, key + "\0", formed.revision)
        return count > 0

    def _hold(self, key: str, waiting: str, fresh: bool) -> JoinHold | None:
        """As the round's rank 0: hold the nodes waiting to join until a checkpoint newer than now's."""
        if self._watch is None:
            self._watch = CheckpointWatch(self._ctx, self._memory)
        hold = JoinHold(by=self._ctx.node_id, waiting=waiting, after=self._watch.newest(), wait=self._wait)
        if fresh:
            if not self._ctx.client.create(key, hold.to_json(), lease=self._ctx.lease):
                return None  # made meanwhile (a rank 0 of before): read it from the control keys
        else:
            self._ctx.client.put(key, hold.to_json(), lease=self._ctx.lease)
        self._ctx.record(EventKind.JOIN_HELD, waiting=waiting, round=self._number, after=hold.after, wait=self._wait)
        return hold

    def _decide(self, key: str, hold: JoinHold) -> bool:
        """As the decider: let them in once a newer checkpoint is complete, or the wait is over."""
        if self._watch is None:
            self._watch = CheckpointWatch(self._ctx, self._memory)
        newest = self._watch.newest()
        if newest is not None and (hold.after is None or newest > hold.after):
            done = dataclasses.replace(hold, let_in=LetIn.CHECKPOINT.value, iteration=newest)
        elif self._waited() >= hold.wait:
            done = dataclasses.replace(hold, let_in=LetIn.WAITED.value)
        else:
            return False
        self._ctx.client.put(key, done.to_json(), lease=self._ctx.lease)
        self._ctx.record(EventKind.JOIN_LET_IN, round=self._number, why=done.let_in, iteration=done.iteration,
                         held=round(self._waited(), 1))
        self._tell(done)
        self.close()
        return True

    def _tell(self, hold: JoinHold) -> None:
        """One log line per record: held, then let in."""
        if hold == self._told:
            return
        self._told = hold
        if hold.let_in is None:
            log.info("node %s waits to join: held until the next checkpoint (at most %g s; newest now: %s)",
                     hold.waiting, hold.wait, "none" if hold.after is None else f"iteration {hold.after}")
        elif hold.let_in == LetIn.CHECKPOINT:
            log.info("node %s joins now: the checkpoint of iteration %s is complete (held %.1f s)",
                     hold.waiting, hold.iteration, self._waited())
        else:
            log.info("node %s joins now: no checkpoint within %g s", hold.waiting, hold.wait)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
