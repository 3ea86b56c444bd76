"""Self-fencing: a node cut off from etcd stops its workers before the others go on without it.

etcd lets a node's lease expire a TTL after the last refresh that reached it, and the
others then restart without the node. Its workers must be stopped by then: they hold
GPUs, ports and a place in collectives the new round no longer expects. But an etcd
that is down for everyone must stop no one (the workers never need etcd to train), and
a node cannot tell the two apart by itself. Its peers can: every agent answers, on a
small TCP port named in its node record (``NodeRecord.beacon``), how long ago etcd last
confirmed its lease, and how long ago etcd came back to it after a gap. A node whose
lease is unconfirmed for half its TTL asks a few peers. When one heard from etcd a
whole refresh period after this node last did, etcd is up and this node is cut off:
once its lease is about to expire (its TTL less a margin), it fences itself
(``Observer.look``; ``decide`` stops the workers with SIGKILL, uncharged) and joins again
through a new rendezvous when it reaches etcd. A peer that had a gap too means etcd was
down for all: etcd renews every lease when it comes back (a new leader does), so the
lease's clock restarts then, and the node is given the time to reconnect. Peers that
answer but heard from etcd no later: an outage of etcd itself; the workers train on.

A node cut from etcd *and* from its peers hears nobody. It fences itself too when the
peers it reached before (it asks a few while all is well) now give no sign at all, twice
in a row: no answer, no refusal, no connection (a refusal or a connection that opens
means the network is there). Peers it never reached (a firewall in the way of the
beacons) prove nothing, so they never fence a node.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)

PEERS_ASKED = 3  # a few peers are enough: one that hears etcd settles it
SLACK = 0.2  # seconds of keep-alive latency allowed for when comparing silences
SILENT_ROUNDS = 2  # rounds of asking in which no peer gives a sign before a node takes itself for cut off
NEVER = 1e9  # the silence of a node etcd never confirmed


class Beacon:
    """Answers every TCP connection with one JSON line: this node's ``report()``."""

    def __init__(self, host: str):
        # set once the lease exists; until then: never heard from etcd, as far as a peer should know
        self.report: Callable[[], dict] = lambda: {"silence": NEVER}
        self._server = socket.create_server(("", 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="eft-beacon", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(json.dumps(self.report()).encode() + b"\n")
                except OSError:
                    pass  # the asker went away: its problem

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone would leave it listening)
        except OSError:
            pass
        self._server.close()
        self._thread.join(timeout=2)


@dataclass(frozen=True)
class PeerView:
    """What a peer's beacon said: seconds since etcd confirmed its lease, and since etcd came
    back to it after a gap (None: no gap seen)."""

    silence: float
    resumed: float | None = None


class NoAnswer(Enum):
    """Why a peer's beacon gave no report."""

    CUT = "cut"  # no sign at all: no connection, no refusal (the path to it is cut, or its host is gone)
    # Its host is there and nothing listens on the port: the agent is gone (its beacon listens for
    # all its life; a frozen agent's kernel still accepts the connection).
    REFUSED = "refused"
    CLOSED = "closed"  # its host is there and the connection opened, but it said nothing useful


def ask(address: str, timeout: float) -> PeerView | NoAnswer:
    """A peer's answer, or why there is none within ``timeout``."""
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout, all_errors=True)
    except ExceptionGroup as failed:  # one error per address the name has (localhost: ::1 and 127.0.0.1)
        # refused at every address: its host is up and nothing listens; else some path is cut
        refused = all(isinstance(e, ConnectionRefusedError) for e in failed.exceptions)
        return NoAnswer.REFUSED if refused else NoAnswer.CUT
    except (OSError, ValueError):  # the name does not resolve, the port is no number
        return NoAnswer.CUT
    with conn:  # create_connection left ``timeout`` on the socket for the read too
        try:
            raw = json.loads(conn.makefile("rb").readline())
            resumed = raw.get("resumed")
            return PeerView(float(raw["silence"]), float(resumed) if resumed is not None else None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return NoAnswer.CLOSED


class FenceWatch:
    """Watches this node's lease on its own thread; ``must_fence`` says when to stop the workers."""

    def __init__(self, silence: Callable[[], float], ttl: float, peers: Callable[[], list[str]],
                 confirm: Callable[[float], bool] = lambda timeout: False):
        self._silence = silence
        self._confirm = confirm  # one keep-alive of this node's lease on its own: True when etcd confirmed it
        self._ttl = ttl
        self._peers = peers  # the beacons of the other nodes (the last membership etcd showed)
        self.deadline = ttl - min(0.5, ttl / 6)  # fence this long after the lease's clock last restarted
        self._cut_off_at: float | None = None  # when the peers last showed etcd answers them, not this node
        self._clock_from = 0.0  # when etcd came back after a gap for a peer (all leases renewed then)
        self._resumed_at: float | None = None  # when etcd came back to this node after a gap
        self.reached: set[str] = set()  # beacons that answered this node at some time
        self._silent_rounds = 0  # rounds of asking in a row in which no peer gave a sign
        self.asked = 0  # rounds of asking the peers while etcd was silent, so far
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(PEERS_ASKED, thread_name_prefix="eft-fence-ask")
        self._thread = threading.Thread(target=self._watch, name="eft-fence", daemon=True)
        self._thread.start()

    def report(self) -> dict:
        """This node's answer to a peer (``Beacon.report``)."""
        resumed = self._resumed_at
        return {"silence": round(self._silence(), 3),
                "resumed": round(time.monotonic() - resumed, 3) if resumed is not None else None}

    def must_fence(self) -> bool:
        """etcd answers a peer but not this node, or no one answers it, and its lease is about to expire."""
        cut_off_at, now = self._cut_off_at, time.monotonic()
        last_heard = now - self._silence()
        return (cut_off_at is not None and now - cut_off_at < self._ttl
                and now - max(last_heard, self._clock_from) >= self.deadline)

    def _watch(self) -> None:
        asked_at, before = 0.0, 0.0
        while not self._stopped.wait(0.1):
            silent = self._silence()
            if silent < before and before > self._ttl / 2:
                self._resumed_at = time.monotonic() - silent  # a gap ended: etcd answers me again
            before = silent
            if silent < self._ttl / 2:
                self._cut_off_at, self._silent_rounds = None, 0
                if time.monotonic() - asked_at >= self._ttl:  # all is well: learn which peers answer
                    asked_at = time.monotonic()
                    self._meet_a_peer()
                continue
            # every TTL/6 while the lease may still expire, then every 2 s (an outage of etcd for
            # everyone has every node ask; a few connections each, no more)
            if time.monotonic() - asked_at < (self._ttl / 6 if silent < 2 * self._ttl else 2.0):
                continue
            asked_at = time.monotonic()
            self._ask_peers(silent)
            self.asked += 1

    def _meet_a_peer(self) -> None:
        """Ask one peer not reached yet, while fewer than a few are known to answer."""
        peers = self._peers()
        unknown = [address for address in peers if address not in self.reached]
        if unknown and len(self.reached.intersection(peers)) < PEERS_ASKED:
            address = random.choice(unknown)
            if isinstance(ask(address, self._ttl / 6), PeerView):
                self.reached.add(address)

    def _ask_peers(self, silent: float) -> None:
        """Did a peer hear from etcd a refresh period after this node last did (had etcd been up
        for this node, one of its own refreshes would have reached it), and did etcd come back
        to a peer after a gap of its own (then every lease was renewed when it did)? Or did the
        peers that answered before give no sign at all?"""
        peers = self._peers()
        known = [address for address in peers if address in self.reached]
        asked = random.sample(known, min(PEERS_ASKED, len(known)))
        others = [address for address in peers if address not in self.reached]
        asked += random.sample(others, min(PEERS_ASKED - len(asked), len(others)))
        now = time.monotonic()
        answers = list(self._pool.map(lambda address: ask(address, self._ttl / 6), asked))
        views = {address: answer for address, answer in zip(asked, answers) if isinstance(answer, PeerView)}
        self.reached.update(views)
        for view in views.values():
            if view.resumed is not None and view.resumed < silent:
                self._clock_from = max(self._clock_from, now - view.resumed)
        no_sign = bool(known) and all(answer is NoAnswer.CUT for answer in answers)
        self._silent_rounds = self._silent_rounds + 1 if no_sign else 0
        if any(view.silence < silent - self._ttl / 3 - SLACK for view in views.values()):
            if self._confirm(self._ttl / 6):
                # etcd answers this node too: the keeper's stream was waiting on a member that died
                # or on an election (a new leader renews every lease), not cut off
                return
            why = "but answers its peers: this node is cut off from etcd"
        elif self._silent_rounds >= SILENT_ROUNDS:
            why = "and no peer gives a sign: this node is cut off from etcd and its peers"
        else:
            return
        if self._cut_off_at is None:
            log.warning("etcd has not confirmed this node's lease for %.1f s %s", silent, why)
        self._cut_off_at = now

    def close(self) -> None:
        self._stopped.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
