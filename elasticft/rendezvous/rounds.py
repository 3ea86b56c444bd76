"""Rendezvous rounds as etcd keys: O(N) bytes per round, no compare-and-swap storm.

A round ``r`` is formed like this (keys in ``contract/keys.py``):

* every node watches one key range, the *control* keys (decisions, closers, waiting
  markers, closed; and the old backend's ``rdzv/state``, refused in one line): one
  range read and one watch per node for as long as it takes part;
* a node joins the first undecided round: it puts ``rdzv/<r>/p/<node>`` under its own
  lease (one small write, no contention; liveness is the lease);
* one node, the *closer*, created ``rdzv/ctl/closer/<r>`` first (create-if-absent, under
  its lease: if it dies another waiting node takes the role). Once the previous round has
  no participant left (torch's rule) and ``min_nodes`` are there, it waits ``last_call``
  for more (not at ``max_nodes``, nor after the first round: a lost node costs its lease
  TTL only, a newcomer comes next round) and creates ``rdzv/ctl/decision/<r>`` =
  ``{"revision": R, "size": n, "first": <rank 0>}``: the participants are the keys at revision R;
* a node reads its rank from the decision (``decision.py``: a count of the keys before its
  own, or kept from the round before): no member list sent to anyone; rank 0's store's
  address comes the same way (``master.py``);
* a node that arrives after the decision (or beyond ``max_nodes``) moves to round
  ``r + 1``; the first such node marks ``rdzv/ctl/waiting/<r+1>`` (under its lease).
  The members of ``r`` see the marker in their control watch, and see lost members in
  a watch on their round's keys that starts at R (nothing read): ``waiting()`` answers
  from memory, with a count request only when someone waits and the round is not full
  (and the agent's ``admission`` lets newcomers in now: ``held.py``).

When membership does not change nothing is written: the only traffic is lease keep-alives.
A node that cannot reach its round's master stands aside (``aside.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from elasticft.contract.keys import RunKeys
from elasticft.rendezvous import decision as decision_of_round
from elasticft.rendezvous.decision import SegmentRule
from elasticft.rendezvous.held import Admission, HeldWait
from elasticft.store.keyset import KeySet
from elasticft.rendezvous.member_losses import AgentLosses, MemberLosses, ParticipantWatch
from elasticft.rendezvous.round_lease import OwnLease, RoundLease, SharedLease
from elasticft.rendezvous.standby import SitOut, Standby, after_full
from elasticft.rendezvous.round_types import MixedVersionError, OddOneOut, Round, RoundLimits  # noqa: F401 (theirs)
from elasticft.store import EtcdClient, Lease, StoreError
from elasticft.store.client import prefix_end
from elasticft.store.errors import LeaseNotFound

# Decisions kept after newer rounds formed: a node slow to read its round's decision
# still finds it (a decision is ~40 bytes; rounds happen at membership changes only).
KEPT_DECISIONS = 8


def _round_of(decision_key: str) -> int:
    return int(decision_key.rsplit("/", 1)[1])


class Rounds:
    """One node's part in the rounds of one run."""

    def __init__(self, client: EtcdClient, keys: RunKeys, node: str, limits: RoundLimits, lease_ttl: float):
        self.client = client
        self.keys = keys
        self.node = node
        self.limits = limits
        self._leases: RoundLease = OwnLease(client, lease_ttl)
        self._lease_id: int | None = None  # the lease my keys below were written under
        self._joined: tuple[int, str] | None = None  # (round, my participant key)
        self._roles: list[str] = []  # closer / waiting keys I created in the round I am in
        self._leftover: list[str] = []  # my keys a failed join could not delete (etcd away): next join's
        self._woken = threading.Condition()
        self._generation = 0
        self._control: KeySet | None = None  # the control keys, watched from join to leave
        self._current: Round | None = None
        self._losses: MemberLosses = ParticipantWatch(client, keys)  # members gone since my round formed
        self.cas_losses = 0  # roles or decisions another node created first (bench figure)
        self.admission: Admission | None = None  # asked before newcomers count as waiting (held.py)
        self._held = HeldWait(node, limits.join_timeout)
        self.standby = Standby(limits.join_timeout)  # when this node waits as a spare (standby.py)
        self.segments: SegmentRule | None = None  # set by eft's agent with --eft-segment (decision.py)
        self._waiting = decision_of_round.Waiting(client, keys)  # with segments: who waits next round

    def _wake(self) -> None:
        with self._woken:
            self._generation += 1
            self._woken.notify_all()

    def _sleep(self, seen: int, until: float) -> None:
        with self._woken:
            self._woken.wait_for(lambda: self._generation != seen, timeout=max(0.0, until - time.monotonic()))

    # -- the parts of a join ---------------------------------------------------

    def share_with_agent(self, lease: Lease, renew: Callable[[], None], membership_lost: Callable[[], bool]) -> None:
        """Under eft's agent: my keys go under the node's lease (``round_lease.SharedLease``) and
        members lost are the agent's membership watch's (``member_losses.AgentLosses``)."""
        self._leases = SharedLease(lease, renew)
        self._losses = AgentLosses(self.client, self.keys, membership_lost)

    def _ensure_lease(self) -> Lease:
        lease = self._leases.current()
        if lease.id != self._lease_id:  # a new lease: my keys under the old one are gone with it
            self._lease_id, self._joined, self._roles = lease.id, None, []
        return lease

    def _watch_control(self) -> KeySet:
        """The control keys, re-read and re-watched if the watch broke (etcd restarted, compaction)."""
        if self._control is None or self._control.broken:
            if self._control is not None:
                self._control.close()
            self._control = KeySet(self.client, self.keys.rdzv_control, self._wake, end=self.keys.rdzv_watched_end)
        return self._control

    def _check_run(self, control: KeySet, waiting_in: int | None = None) -> None:
        if self.keys.rdzv_closed in control:
            if waiting_in is not None and self._spare(control, waiting_in):
                raise RendezvousGracefulExitError()  # torch's answer to its redundancy list: a clean exit
            raise RendezvousClosedError()
        if self.keys.rdzv_state in control:
            raise MixedVersionError(
                f"etcd-v3 rendezvous: {self.keys.rdzv_state} was written by an agent of an older eft "
                "(pickled-state backend); every agent of a run must run the same eft version"
            )

    def _spare(self, control: KeySet, number: int) -> bool:
        """Waiting in round ``number`` while the round before it formed full (torch's redundancy list)
        or left this node out (segments)."""
        return (after_full(control, self.keys, number, self.limits.max_nodes)
                or number > 0 and decision_of_round.left_out_of(control.get(self.keys.rdzv_decision(number - 1)),
                                                                self.node))

    def _first_undecided(self, control: KeySet) -> int:
        decided = [_round_of(k) for k in control.snapshot() if k.startswith(self.keys.rdzv_decisions)]
        return max(decided, default=-1) + 1

    def _enter_first(self) -> int | None:
        """A node's first join, its control keys not watched yet: its participant key in round 0,
        round 0's closer if no one is, and the read of the control keys, in one request, unless a
        round was decided before (None: nothing written). The control watch starts from that read:
        N nodes starting at once cost N requests and no lost compare-and-swap."""
        if self._control is not None or self._joined is not None or self._roles or self._leftover:
            return None
        key, decisions = self.keys.rdzv_participant(0, self.node), self.keys.rdzv_decisions
        done = self.client.put_unless_and_read(key, self._value(), self._ensure_lease(),
                                               (decisions, prefix_end(decisions)),
                                               (self.keys.rdzv_control, self.keys.rdzv_watched_end),
                                               claim=(self.keys.rdzv_closer(0), self.node))
        if done is None:
            return None
        self._joined, self._roles = (0, key), [self.keys.rdzv_closer(0)] if done[2] else []
        self._control = KeySet(self.client, self.keys.rdzv_control, self._wake, end=self.keys.rdzv_watched_end,
                               after=done[0], items=done[1])
        return done[0]

    def _enter(self, number: int) -> int:
        """Put my participant key in round ``number`` and drop my keys of the round before (one request)."""
        key = self.keys.rdzv_participant(number, self.node)
        lease = self._ensure_lease()
        stale = self._roles + ([self._joined[1]] if self._joined is not None and self._joined[1] != key else [])
        stale += [k for k in self._leftover if k != key and k not in stale]
        revision = self.client.put_and_delete(key, self._value(), lease, stale)
        self._joined, self._roles, self._leftover = (number, key), [], []
        return revision

    def _value(self) -> str:
        return decision_of_round.participant_value(self.node, self.segments, self._current)

    def _claim(self, key: str) -> None:
        """Create a role key (closer, waiting marker) under my lease if no one holds it."""
        if self.client.create(key, self.node, lease=self._leases.held):
            self._roles.append(key)
        else:
            self.cas_losses += 1

    def _resolve(self, number: int, decision: bytes, joined_at: int) -> Round | None:
        """My place in round ``number`` by its decision; None when I came too late for it or was left out."""
        return decision_of_round.place(self.client, self.keys, number, self.node, decision, joined_at, self._current)

    def _close(self, number: int) -> bytes | None:
        """Decide round ``number``: its participants are the keys there now (``decision.py``).
        The same transaction drops its closer and waiting keys, and a round long gone's decision.
        The decision, or None when another node's came first (the control watch brings that one)."""
        decision = decision_of_round.make(self.client, self.keys, number, self.limits.max_nodes, self.segments,
                                          self._watch_control().get(self.keys.rdzv_decision(number - 1)))
        done = (self.keys.rdzv_closer(number), self.keys.rdzv_waiting(number), self.keys.rdzv_held(number))
        if number >= KEPT_DECISIONS:  # (a recent one, and its master's address, may be read by a slow node)
            done += (self.keys.rdzv_decision(number - KEPT_DECISIONS), self.keys.rdzv_master(number - KEPT_DECISIONS))
        if self.client.create(self.keys.rdzv_decision(number), decision, delete=done):
            self._roles = [k for k in self._roles if k not in done]
            return decision.encode()
        self.cas_losses += 1
        return None

    # -- joining -----------------------------------------------------------------

    def join(self, leave_if: Callable[[dict[str, bytes]], bool] | None = None) -> Round:
        """Block until this node is a member of a formed round; its rank and size. ``leave_if``
        is asked with the control keys at every change seen: True leaves (``OddOneOut``)."""
        self._stop_watching_round()
        deadline = time.monotonic() + self.limits.join_timeout
        try:
            joined_at = self._enter_first()  # None: not a first join, or round 0 was decided
            control = self._watch_control()
            self._check_run(control)
            number = 0 if joined_at is not None else self._first_undecided(control)
            while True:
                joined_at = joined_at or self._enter(number)
                try:
                    formed = self._wait_for_decision(number, joined_at, deadline, leave_if)
                except SitOut as unfit:  # a spare out of every round while it is unfit (standby.py)
                    self._drop_keys()
                    self.standby.sit_out(str(unfit), lambda: self._check_run(self._watch_control()))
                    number, joined_at = self._first_undecided(self._watch_control()), None
                    continue
                if formed is not None:
                    self._current = formed  # what watches members' losses is made at the first waiting()
                    self.standby.member(formed.number)
                    return formed
                number, joined_at = max(number + 1, self._first_undecided(self._watch_control())), None
        except LeaseNotFound:
            # etcd let my lease expire (frozen, or cut off from etcd) before its keeper heard:
            # my keys went with it; the next join takes a new one
            if self._leases.held is not None:
                self._leases.held.lost.set()
            self._drop_keys()
            raise
        except BaseException:
            self._drop_keys()
            raise

    def _wait_for_decision(self, number: int, joined_at: int, deadline: float,
                           leave_if: Callable[[dict[str, bytes]], bool] | None = None) -> Round | None:
        decision_key = self.keys.rdzv_decision(number)
        closer_key, waiting_key = self.keys.rdzv_closer(number), self.keys.rdzv_waiting(number)
        after_formed = self.keys.rdzv_decision(number - 1)
        mine: KeySet | None = None
        previous: KeySet | None = None
        last_call_until: float | None = None
        claimed_at = None  # the generation at which I last tried to claim roles
        try:
            while True:
                seen = self._generation
                control = self._watch_control()
                self._check_run(control, waiting_in=number)
                deadline = self.standby.waiting(number, self._spare(control, number), deadline)  # a spare waits on
                deadline = self._held.deadline(number, control.get(self.keys.rdzv_held(number)), deadline)
                if leave_if is not None and leave_if(control.snapshot()):
                    raise OddOneOut(number)
                decision = control.get(decision_key)
                if decision is not None:
                    return self._resolve(number, decision, joined_at)
                if claimed_at != seen:
                    # a role key that is missing was never made or its holder is gone:
                    # try once per change seen (a lost race shows up as the winner's key)
                    claimed_at = seen
                    if closer_key not in control:
                        self._claim(closer_key)
                    if after_formed in control and waiting_key not in control:
                        self._claim(waiting_key)
                if mine is None and control.get(closer_key) == self.node.encode():
                    mine = KeySet(self.client, self.keys.rdzv_participants(number), self._wake)
                    if number > 0:
                        previous = KeySet(self.client, self.keys.rdzv_participants(number - 1), self._wake)
                now = time.monotonic()
                wake_at = min(deadline, self.standby.next_look())
                if mine is not None and (previous is None or len(previous) == 0):
                    count = decision_of_round.eligible(list(mine.snapshot().values()), number,
                                                       self.limits.max_nodes, self.segments)
                    # after the first round, the round before is empty once each of its live
                    # members is here: no one else to wait for, so no last call (a lost node
                    # costs its lease TTL, not TTL + last call; a newcomer comes next round)
                    close = count >= self.limits.max_nodes or (previous is not None and count >= self.limits.min_nodes)
                    if not close and count >= self.limits.min_nodes:
                        last_call_until = last_call_until or now + self.limits.last_call
                        close, wake_at = now >= last_call_until, min(wake_at, last_call_until)
                    elif not close:
                        last_call_until = None
                    decided = self._close(number) if close else None
                    if decided is not None:  # mine: resolved now, not once my watch brings it back
                        return self._resolve(number, decided, joined_at)
                if now >= deadline:
                    raise RendezvousTimeoutError(
                        f"no round of the rendezvous formed within the join timeout ({self.limits.join_timeout:g} s)"
                    )
                self._sleep(seen, wake_at)
        finally:
            for keyset in (mine, previous):
                if keyset is not None:
                    keyset.close()

    # -- after a round formed ---------------------------------------------------

    def stop_watching(self) -> None:
        """Cancel this node's watches (its keys stay until it leaves)."""
        self._stop_watching_round()
        control, self._control = self._control, None
        if control is not None:
            control.close()

    def _stop_watching_round(self) -> None:
        self._losses.close()
        self._waiting.close()
        if self.admission is not None:
            self.admission.close()

    def waiting(self) -> int:
        """Nodes the current round's members should re-rendezvous for: the members lost since
        it formed, plus the nodes waiting in the next round unless this one has ``max_nodes``
        live members (torch's redundancy list then). From the watches; a count request only
        when something changed."""
        formed, control = self._current, self._control
        if formed is None or control is None:
            return 0
        try:
            control = self._watch_control()  # made anew if its watch broke (etcd restarted)
            lost = self._losses.lost(formed, control)
            if not self.someone_waits() or formed.size - lost >= self.limits.max_nodes:
                return lost
            if not lost and self.segments and not self._waiting.adds(formed, self.limits.max_nodes, self.segments):
                return 0  # they make no whole segment: they wait as spares (segments.py)
            if not lost and self.admission is not None and not self.admission.admit(formed, control):
                return 0  # the members hold the newcomers back (held.py); a loss restarts with them
            following = self.keys.rdzv_participants(formed.number + 1)
            count, _ = self.client.count_range(following, prefix_end(following))
            return lost + max(count, 1)
        except StoreError:
            # etcd out of reach is not a membership change: restarting every node for it
            # would let the control plane stop training (a lost node's lease expiry is seen
            # once etcd answers again, and eft's agent watches node leases as well)
            return 0

    def await_control(self, answer: Callable[[KeySet], object], deadline: float) -> object:
        """``answer``'s first reply but None, asked at every change my control watch sees (no
        request of its own); None once ``deadline`` passed. Raises StoreError."""
        while True:
            seen = self._generation
            found = answer(self._watch_control())
            if found is not None or time.monotonic() >= deadline:
                return found
            self._sleep(seen, deadline)

    def put_mine(self, key: str, value: str) -> None:
        """A key under the lease my round's keys are under: it goes when I do. Raises StoreError."""
        self.client.put(key, value, lease=self._ensure_lease())

    def someone_waits(self) -> bool:
        """A node waits in the round after mine (its marker is in my control watch)."""
        formed, control = self._current, self._control
        return formed is not None and control is not None and self.keys.rdzv_waiting(formed.number + 1) in control

    def control(self) -> dict[str, bytes]:
        return self._watch_control().snapshot()  # the control keys as my watch holds them

    def stand_aside(self, marker: str, why: str) -> None:
        """Leave my round but not the rendezvous: my participant key goes (the others
        re-rendezvous without me) and ``marker`` stays under my lease saying ``why``, in one
        request; my next join deletes it. Raises StoreError."""
        self._stop_watching_round()
        self._current = None
        stale = self._roles + ([self._joined[1]] if self._joined is not None else [])
        try:
            self.client.put_and_delete(marker, why, self._ensure_lease(), stale)
            self._leftover.append(marker)
        except LeaseNotFound:  # my keys went with it: out of the round all the same, unmarked
            self._leases.held.lost.set()
        self._joined, self._roles = None, []

    def is_closed(self) -> bool:
        return self.client.get(self.keys.rdzv_closed) is not None

    def set_closed(self) -> None:
        self.client.put(self.keys.rdzv_closed, "1")

    def _drop_keys(self) -> None:
        joined, self._joined = self._joined, None
        stale, self._roles = self._roles + ([joined[1]] if joined is not None else []), []
        for key in stale:
            try:
                self.client.delete(key)
            except StoreError:
                # etcd away: my lease lives on (etcd extends leases when it restarts), and a key
                # of mine left in the round before would keep the next round from ever forming
                self._leftover.append(key)

    def leave(self) -> None:
        """Stop taking part: my keys vanish with my lease (a shared one: deleted now), the
        rendezvous stays open."""
        self.stop_watching()
        self._current = None
        if not self._leases.release():
            self._roles += [k for k in self._leftover if k not in self._roles]
            self._leftover = []
            self._drop_keys()
        self._joined, self._roles, self._lease_id = None, [], None
