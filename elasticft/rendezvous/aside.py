"""Standing aside: a node that reaches etcd but not its round's master leaves the round until it can.

etcd decides who is in a round; gloo needs every node to reach the others. A node cut
off from its peers while it still reaches etcd would be put in every new round, and
every round would stall in setup until the network healed. So, once a round has formed,
every node but rank 0 opens a TCP connection to the master's store (the one its
workers are about to use). A node whose connection neither opens nor is refused (a
refusal is an answer: the host is there) within ``probe_timeout`` stands aside: it
leaves the round with a marker naming the master it could not reach, the others
re-rendezvous without it, and it joins again once it reaches the newest round's master.

The one cut off may be the master itself: then every other node stands aside naming
it. A node named by at least two markers, and by most of the other members of the
round they left, is the odd one out: it stands aside too (naming itself), and the nodes
that named it join again at once. Two nodes cut from each other: one marker is not
enough to make a master step back, so the master trains on alone.

A master whose host died looks, from outside, like one cut off; but its lease then
expires and its keys go, which ends a probe or a wait at once: standing aside is
only ever for a master that still reaches etcd.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

from elasticft.rendezvous.rounds import Round, Rounds

log = logging.getLogger(__name__)

# One connection attempt waits at most this long; a probe makes attempts until its timeout
# (each a fresh SYN, so a lost one costs a second, not the kernel's backoff).
ATTEMPT = 1.0


def reachable(addr: str, port: int, timeout: float, give_up: Callable[[], bool] = lambda: False) -> bool:
    """Whether ``addr`` answers a TCP connection to ``port`` (opened or refused) within ``timeout``.

    ``give_up`` is asked between attempts; when it says so the answer is True: the caller
    has another reason to move on (its master is gone) and must not stand aside for this one.
    """
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        try:
            socket.create_connection((addr, port), max(0.05, min(ATTEMPT, deadline - started))).close()
            return True
        except ConnectionRefusedError:
            return True
        except OSError:  # silent (timed out) or unreachable (ICMP): again, until the timeout
            pass
        if give_up():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(max(0.0, min(started + ATTEMPT, deadline) - time.monotonic()))


@dataclass(frozen=True)
class Aside:
    """Why this node left its round: the master (a node name; this node's own when it is the
    odd one out) of round ``number`` did not answer at ``addr:port``."""

    number: int
    master: str
    addr: str = ""
    port: int = 0


# The master's address in the store of round ``number`` (None when not written yet).
MasterOf = Callable[[int], "tuple[str, int] | None"]


class PeerCheck:
    """One node's reachability check of its rounds, and its wait while it stands aside."""

    def __init__(self, rounds: Rounds, master_of: MasterOf, probe_timeout: float, wait_limit: float):
        self._rounds = rounds
        self._master_of = master_of
        self.probe_timeout = probe_timeout  # 0: never probe, never stand aside
        self._wait_limit = wait_limit
        self._keys = rounds.keys

    @property
    def enabled(self) -> bool:
        return self.probe_timeout > 0

    # -- deciding ----------------------------------------------------------------

    def _markers(self, control: dict[str, bytes]) -> dict[str, dict]:
        prefix = self._keys.rdzv_asides
        return {k[len(prefix):]: json.loads(v) for k, v in control.items() if k.startswith(prefix)}

    def odd_one_out(self, control: dict[str, bytes]) -> bool:
        """At least two nodes, most of the others of a round I was master of, stand aside naming me."""
        me = self._rounds.node
        named: dict[int, int] = {}
        for node, marker in self._markers(control).items():
            if marker["master"] == me and node != me:
                named[marker["round"]] = named.get(marker["round"], 0) + 1
        for number, count in named.items():
            decision = control.get(self._keys.rdzv_decision(number))
            size = json.loads(decision)["size"] if decision is not None else count + 1
            if count >= 2 and 2 * count > size - 1:
                return True
        return False

    def check(self, formed: Round, addr: str, port: int) -> Aside | None:
        """After round ``formed``: why this node must stand aside from it, or None to go on."""
        if not self.enabled:
            return None
        if self.odd_one_out(self._rounds.control()):
            return Aside(formed.number, self._rounds.node)
        if formed.rank == 0 or reachable(addr, port, min(ATTEMPT, self.probe_timeout)):
            return None  # the usual answer: one connection, no etcd request
        master = self._master_node(formed)
        if master is None:
            return None  # the master is gone already: the restart for it is on its way
        # a master that merely moved on to the next round (another node stood aside) is alive:
        # probe on, so that this node's marker counts against it; a dead one's keys are all gone
        if reachable(addr, port, self.probe_timeout, give_up=lambda: self._gone(master, formed.number)):
            return None
        return Aside(formed.number, master, addr, port)

    def _master_node(self, formed: Round) -> str | None:
        if formed.first is not None:  # the decision names it
            return formed.first
        first = self._rounds.client.oldest(self._keys.rdzv_participants(formed.number), 1, formed.revision)
        return json.loads(first[0].value)["node"] if first else None

    # -- standing aside ----------------------------------------------------------

    def stand_aside(self, aside: Aside) -> None:
        """Leave the round with a marker saying why, and return once this node may join again.

        Raises RendezvousTimeoutError when that does not happen within the join timeout.
        """
        me = self._rounds.node
        if aside.master == me:
            log.warning("node %s stands aside: most nodes of round %d could not reach it; it joins again "
                        "once it reaches the master of a newer round", me, aside.number)
        else:
            log.warning("node %s stands aside: it reaches etcd but not the master of round %d at %s:%d "
                        "(no answer in %g s); the others go on without it, it joins again once it reaches "
                        "the newest round's master", me, aside.number, aside.addr, aside.port, self.probe_timeout)
        self._rounds.stand_aside(self._keys.rdzv_aside(me), json.dumps({"round": aside.number,
                                                                        "master": aside.master}))
        since = time.monotonic()
        while not self._may_rejoin(aside, since):
            if time.monotonic() - since > self._wait_limit:
                raise RendezvousTimeoutError(
                    f"node {me} stood aside for {self._wait_limit:g} s (the join timeout): it reaches etcd "
                    f"but not the master of round {aside.number} nor of any round after it")
            time.sleep(ATTEMPT)
        log.warning("node %s joins again after standing aside for %.0f s", me, time.monotonic() - since)

    def _may_rejoin(self, aside: Aside, since: float) -> bool:
        newest = self._newest(self._rounds.control())
        if newest > aside.number:
            address = self._master_of(newest)
            return address is not None and reachable(*address, self.probe_timeout)
        if aside.master == self._rounds.node:
            # no round formed without me: the others may need me to reach min_nodes; try again
            return time.monotonic() - since > 2 * self.probe_timeout

        def master_out() -> bool:  # it stands aside too (a marker in my watch: no request)
            return self._keys.rdzv_aside(aside.master) in self._rounds.control()

        if master_out() or self._gone(aside.master, aside.number):
            return True  # my master stands aside, or is gone: no reason left to stay out
        return reachable(aside.addr, aside.port, self.probe_timeout, give_up=master_out)

    def _newest(self, control: dict[str, bytes]) -> int:
        """The newest round decided (-1: none)."""
        prefix = self._keys.rdzv_decisions
        return max((int(k[len(prefix):]) for k in control if k.startswith(prefix)), default=-1)

    def _gone(self, node: str, first: int) -> bool:
        """``node`` holds no participant key from round ``first`` to the one after the newest
        decided: its lease is gone (a live node is in one of them, formed or forming)."""
        client, last = self._rounds.client, self._newest(self._rounds.control()) + 1
        return all(client.get(self._keys.rdzv_participant(n, node)) is None for n in range(first, last + 1))
