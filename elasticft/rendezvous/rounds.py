"""Rendezvous rounds as etcd keys: O(N) bytes per round, no compare-and-swap storm.

A round ``r`` is formed like this (keys in ``contract/keys.py``):

* every node joining puts ``rdzv/<r>/p/<node>`` under its own lease (one small write,
  no contention: each node writes its own key; liveness is the lease);
* one node, the *closer* (the oldest participant by create revision), watches the
  participants; once the previous round has no live participant left (torch's rule:
  a new round starts when every member of the last one has left it) and
  ``min_nodes`` are there, it waits ``last_call`` for more (none when ``max_nodes``
  are there) and creates ``rdzv/ctl/decision/<r>`` = ``{"revision": R, "size": n}``:
  the participants are the keys that existed at revision R;
* everyone else watches ``rdzv/ctl/`` (round pointer, decisions, closed) and the
  closer's key (its death hands the role to the next oldest); when the decision
  appears, a node's rank is the number of participant keys sorting before its own at
  revision R: one count-only range read, the same answer on every node;
* a node that arrives after the decision (or beyond ``max_nodes``) moves to round
  ``r + 1``. The members of round ``r`` watch ``rdzv/<r+1>/p/`` and their own round's
  keys: ``waiting()`` counts the nodes in the next round (not when the round is full:
  those are torch's redundancy list) plus the members lost since, answered from memory.

When membership does not change nothing is written: the only traffic is lease
keep-alives.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)

from elasticft.contract.keys import RunKeys
from elasticft.rendezvous.keyset import KeySet
from elasticft.store import EtcdClient, Lease, StoreError


class MixedVersionError(RendezvousError):
    """An agent of the old (pickled-state) etcd-v3 backend shares this run."""


@dataclass(frozen=True)
class RoundLimits:
    min_nodes: int
    max_nodes: int
    last_call: float  # seconds to wait for more nodes once min_nodes are there
    join_timeout: float  # seconds a node may wait for a round to form


@dataclass(frozen=True)
class Round:
    number: int
    rank: int
    size: int
    revision: int  # the participants are the keys that existed at this revision


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Rounds:
    """One node's part in the rounds of one run."""

    def __init__(self, client: EtcdClient, keys: RunKeys, node: str, limits: RoundLimits, lease_ttl: float):
        self._client = client
        self._keys = keys
        self.node = node
        self.limits = limits
        self._lease_ttl = lease_ttl
        self._lease: Lease | None = None
        self._joined: tuple[int, str] | None = None  # (round, my participant key)
        self._woken = threading.Condition()
        self._generation = 0
        self._current: Round | None = None
        self._members: KeySet | None = None  # my round's participants, once it formed
        self._next: KeySet | None = None  # the next round's participants (waiting nodes)
        self.cas_losses = 0  # decisions another closer created first (bench figure)

    # -- waking up -------------------------------------------------------------

    def _wake(self) -> None:
        with self._woken:
            self._generation += 1
            self._woken.notify_all()

    def _sleep(self, seen: int, until: float) -> None:
        with self._woken:
            self._woken.wait_for(lambda: self._generation != seen, timeout=max(0.0, until - time.monotonic()))

    # -- the parts of a join ---------------------------------------------------

    def _ensure_lease(self) -> Lease:
        if self._lease is None or self._lease.lost.is_set():
            self._lease = self._client.lease(self._lease_ttl)
            self._joined = None
        return self._lease

    def _pointer(self) -> tuple[int, int | None]:
        found = self._client.get(self._keys.rdzv_round)
        if found is None:
            return 0, None
        return int(json.loads(found.value)["round"]), found.mod_revision

    def _advance_pointer(self, to: int) -> None:
        """Make the round pointer at least ``to`` (one write per round; a lost race means another did it)."""
        current, revision = self._pointer()
        while current < to:
            swapped, now = self._client.compare_and_swap(self._keys.rdzv_round, revision, json.dumps({"round": to}))
            if swapped or now is None:
                return
            current, revision = int(json.loads(now.value)["round"]), now.mod_revision

    def _check_run(self) -> None:
        if self._client.get(self._keys.rdzv_closed) is not None:
            raise RendezvousClosedError()
        self._refuse_old_backend(self._client.get(self._keys.rdzv_state) is not None)

    def _refuse_old_backend(self, present: bool) -> None:
        if present:
            raise MixedVersionError(
                f"etcd-v3 rendezvous: {self._keys.rdzv_state} was written by an agent of an older eft "
                "(pickled-state backend); every agent of a run must run the same eft version"
            )

    def _enter(self, number: int) -> int:
        """Put my participant key in round ``number``, then drop the one in my previous round."""
        key = self._keys.rdzv_participant(number, self.node)
        revision = self._client.put(key, json.dumps({"node": self.node}), lease=self._ensure_lease())
        previous, self._joined = self._joined, (number, key)
        if previous is not None and previous[1] != key:
            self._client.delete(previous[1])
        return revision

    def _resolve(self, number: int, decision: bytes, joined_at: int) -> Round | None:
        """My place in round ``number`` by its decision; None when I came too late for it."""
        fields = json.loads(decision)
        revision, size = int(fields["revision"]), int(fields["size"])
        if joined_at > revision:
            return None
        prefix = self._keys.rdzv_participants(number)
        rank, _ = self._client.count_range(prefix, self._keys.rdzv_participant(number, self.node), revision)
        return Round(number, rank, size, revision) if rank < size else None

    def _close(self, number: int) -> None:
        """Decide round ``number``: its participants are the keys there now."""
        prefix = self._keys.rdzv_participants(number)
        count, revision = self._client.count_range(prefix, _prefix_end(prefix))
        size = min(count, self.limits.max_nodes)
        decision = json.dumps({"revision": revision, "size": size})
        if not self._client.create(self._keys.rdzv_decision(number), decision):
            self.cas_losses += 1

    # -- joining -----------------------------------------------------------------

    def join(self) -> Round:
        """Block until this node is a member of a formed round; its rank and size."""
        self._stop_watching_round()
        deadline = time.monotonic() + self.limits.join_timeout
        self._check_run()
        number, _ = self._pointer()
        try:
            while True:
                if self._client.get(self._keys.rdzv_decision(number)) is not None:
                    number += 1  # that round is formed: wait in the next one
                    self._advance_pointer(number)
                    continue
                joined_at = self._enter(number)
                formed = self._wait_for_decision(number, joined_at, deadline)
                if formed is not None:
                    self._start_watching_round(formed)
                    return formed
                number += 1
                self._advance_pointer(number)
        except BaseException:
            self._drop_key()
            raise

    def _wait_for_decision(self, number: int, joined_at: int, deadline: float) -> Round | None:
        decision_key = self._keys.rdzv_decision(number)
        control = KeySet(self._client, self._keys.rdzv_control, self._wake)
        old_state = KeySet(self._client, self._keys.rdzv_state, self._wake, exact=True)
        closer: KeySet | None = None
        mine: KeySet | None = None
        previous: KeySet | None = None
        last_call_until: float | None = None
        try:
            while True:
                seen = self._generation
                if self._keys.rdzv_closed in control.keys:
                    raise RendezvousClosedError()
                self._refuse_old_backend(len(old_state) > 0)
                if decision_key in control.values:
                    return self._resolve(number, control.values[decision_key], joined_at)
                if closer is None or len(closer) == 0:
                    if closer is not None:
                        closer.close()
                    oldest, _ = self._client.first_created(self._keys.rdzv_participants(number))
                    if oldest is None:
                        raise RendezvousError(f"round {number}: my participant key vanished (lease lost?)")
                    closer = KeySet(self._client, oldest.key, self._wake, exact=True)
                    if oldest.key == self._joined[1] and mine is None:
                        mine = KeySet(self._client, self._keys.rdzv_participants(number), self._wake)
                        if number > 0:
                            previous = KeySet(self._client, self._keys.rdzv_participants(number - 1), self._wake)
                    continue
                now = time.monotonic()
                wake_at = deadline
                if mine is not None and (previous is None or len(previous) == 0):
                    count = len(mine)
                    if count >= self.limits.max_nodes:
                        self._close(number)
                        continue
                    if count >= self.limits.min_nodes:
                        last_call_until = last_call_until or now + self.limits.last_call
                        if now >= last_call_until:
                            self._close(number)
                            continue
                        wake_at = min(wake_at, last_call_until)
                    else:
                        last_call_until = None
                if now >= deadline:
                    raise RendezvousTimeoutError(
                        f"no round of the rendezvous formed within the join timeout ({self.limits.join_timeout:g} s)"
                    )
                self._sleep(seen, wake_at)
        finally:
            for keyset in (control, old_state, closer, mine, previous):
                if keyset is not None:
                    keyset.close()

    # -- after a round formed ---------------------------------------------------

    def _start_watching_round(self, formed: Round) -> None:
        self._current = formed
        self._members = KeySet(self._client, self._keys.rdzv_participants(formed.number), lambda: None)
        self._next = KeySet(self._client, self._keys.rdzv_participants(formed.number + 1), lambda: None)

    def stop_watching(self) -> None:
        """Cancel the watches of the round this node is in (its keys stay until it leaves)."""
        self._stop_watching_round()

    def _stop_watching_round(self) -> None:
        for keyset in (self._members, self._next):
            if keyset is not None:
                keyset.close()
        self._members = self._next = None

    def waiting(self) -> int:
        """Nodes the current round's members should re-rendezvous for (no request to etcd).

        The nodes in the next round, unless this round has ``max_nodes`` live members
        (then they are torch's redundancy list), plus the members lost since it formed.
        """
        formed, members, following = self._current, self._members, self._next
        if formed is None or members is None or following is None:
            return 0
        alive = sum(1 for created in members.snapshot().values() if created <= formed.revision)
        lost = max(0, formed.size - alive)
        redundant = alive >= self.limits.max_nodes
        return lost + (0 if redundant else len(following))

    def is_closed(self) -> bool:
        return self._client.get(self._keys.rdzv_closed) is not None

    def set_closed(self) -> None:
        self._client.put(self._keys.rdzv_closed, "1")

    def _drop_key(self) -> None:
        joined, self._joined = self._joined, None
        if joined is not None:
            try:
                self._client.delete(joined[1])
            except StoreError:
                pass  # the lease will take it

    def leave(self) -> None:
        """Stop taking part: my keys vanish with my lease, the rendezvous stays open."""
        self._stop_watching_round()
        self._current = None
        self._joined = None
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()
