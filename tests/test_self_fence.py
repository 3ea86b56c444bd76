"""Self-fencing's decision (agent/fence.py): real beacons on real sockets, silences set by the test.

A node's silence is how long ago etcd last confirmed its lease. The rule under test: a
node fences itself only when a peer heard from etcd more than a refresh period after it
did, or when the peers that answered it before give no sign at all (it is cut from etcd
and from them), and its own lease is about to expire; an etcd down for everyone (every
silence grows alike), peers whose host refuses, or peers it never reached (a firewall)
never stop a worker. A peer cut off = its port taken by a real listener that never
accepts (SYNs dropped). The whole path on real hosts (a node cut from etcd, or from
everything, in a network namespace): tests/test_partitions.py.
"""

from __future__ import annotations

import socket

import pytest

from bench.launch import wait_for
from elasticft.agent.fence import Beacon, FenceWatch, NoAnswer, PeerView, ask

TTL = 3.0


def silent_at(port: int) -> list[socket.socket]:
    """A listener on loopback ``port`` that never answers (listen(0), and its one slot taken)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port's old connections linger
    server.bind(("127.0.0.1", port))
    server.listen(0)
    return [server, socket.create_connection(("127.0.0.1", port), 1)]


@pytest.fixture
def cut():
    """Cuts a beacon off: it stops, and its port gives no sign any more."""
    made = []

    def make(beacon: Beacon) -> None:
        beacon.close()
        made.extend(silent_at(int(beacon.address.rpartition(":")[2])))

    yield make
    for sock in made:
        sock.close()


class Silence:
    """A silence the test sets (and, for a peer, when etcd came back to it after a gap)."""

    def __init__(self, seconds: float, resumed: float | None = None):
        self.seconds = seconds
        self.resumed = resumed

    def __call__(self) -> float:
        return self.seconds

    def report(self) -> dict:
        return {"silence": self.seconds, "resumed": self.resumed}


@pytest.fixture
def peers():
    made = []

    def make(*silences: Silence) -> list[Beacon]:
        for silence in silences:
            beacon = Beacon("127.0.0.1")
            beacon.report = silence.report
            made.append(beacon)
        return made

    yield make
    for beacon in made:
        beacon.close()


@pytest.fixture
def watch():
    made = []

    def make(mine: Silence, beacons: list[Beacon], confirm=lambda timeout: False) -> FenceWatch:
        made.append(FenceWatch(mine, TTL, lambda: [b.address for b in beacons], confirm=confirm))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_a_beacon_answers_with_its_silence_and_a_peer_without_one_says_why(peers, cut):
    beacon, closed, gone = peers(Silence(1.25, resumed=0.5), Silence(0.1), Silence(0.1))
    assert ask(beacon.address, 1.0) == PeerView(1.25, 0.5)
    closed.close()
    assert ask(closed.address, 1.0) is NoAnswer.REFUSED  # its host is there, its agent gone
    cut(gone)
    assert ask(gone.address, 0.5) is NoAnswer.CUT  # no sign at all


def test_a_node_cut_off_from_etcd_alone_fences_itself_before_its_lease_expires(peers, watch):
    beacons = peers(Silence(0.4), Silence(0.7))  # the peers' refreshes still reach etcd
    mine = Silence(TTL / 2 + 0.1)
    fence = watch(mine, beacons)
    wait_for(lambda: fence.asked >= 1, 10, "the peers to be asked")
    assert not fence.must_fence()  # half the TTL gone: asked, but not yet
    mine.seconds = fence.deadline
    wait_for(fence.must_fence, 10, "the fence")
    assert fence.deadline < TTL
    mine.seconds = 0.2  # etcd confirmed the lease again: nothing to fence
    assert not fence.must_fence()


@pytest.mark.parametrize("answers", [pytest.param("all", id="etcd-down-for-all"),
                                     pytest.param("refused", id="peer-host-refuses"),
                                     pytest.param("never", id="peer-never-reached")])
def test_an_etcd_down_for_everyone_or_no_answer_fences_no_one(peers, watch, cut, answers):
    mine = Silence(TTL + 1)
    if answers == "all":
        # etcd went away for all at once: a peer's last refresh is at most one refresh period
        # (TTL/3) younger than this node's, so its silence is at least this node's less TTL/3
        beacons = peers(Silence(mine.seconds - TTL / 3 + 0.05), Silence(mine.seconds + 0.2))
    else:
        beacons = peers(Silence(0.1))
        # nobody listens there any more, or (a firewall) it never gave a sign to this node
        beacons[0].close() if answers == "refused" else cut(beacons[0])
    fence = watch(mine, beacons)
    wait_for(lambda: fence.asked >= 2, 10, "two rounds of asking")
    assert not fence.must_fence()


def test_etcd_back_for_a_peer_first_gives_this_node_time_to_reconnect(peers, watch):
    """After an etcd restart the first client back answers fresh: the others' leases were
    renewed when etcd came back, so a node still reconnecting is not cut off yet."""
    peer = Silence(0.1, resumed=0.1)  # it had a gap too, which just ended
    beacons = peers(peer)
    mine = Silence(TTL + 4)  # this node's own gap goes on
    fence = watch(mine, beacons)
    wait_for(lambda: fence.asked >= 1, 10, "the peer to be asked")
    assert not fence.must_fence()
    peer.resumed = None  # the peer's gap was long ago (or never): etcd is up, this node is cut off
    wait_for(fence.must_fence, 10, "the fence")


def test_a_node_cut_from_etcd_and_from_the_peers_it_reached_fences_itself(peers, watch, cut):
    beacons = peers(Silence(0.3), Silence(0.5))
    mine = Silence(0.2)  # all is well: it meets its peers
    fence = watch(mine, beacons)
    wait_for(lambda: fence.reached == {b.address for b in beacons}, 10, "both peers to be reached")
    for beacon in beacons:
        cut(beacon)
    mine.seconds = TTL / 2 + 0.1  # etcd is silent too now
    wait_for(lambda: fence.asked >= 2, 10, "two rounds of asking")
    assert not fence.must_fence()  # cut off, but the lease may still be refreshed
    mine.seconds = fence.deadline
    wait_for(fence.must_fence, 10, "the fence")


def test_a_node_whose_own_keep_alive_still_reaches_etcd_does_not_fence(peers, watch):
    """A leader killed, or the member this node's keep-alive stream waited on: its peers
    heard from etcd sooner, but a keep-alive of its own, sent now, is confirmed (a new
    leader renewed every lease). That node is late, not cut off: its workers train on."""
    beacons = peers(Silence(0.4), Silence(0.7))
    mine = Silence(TTL / 2 + 0.1)
    confirmations = []

    def confirm(timeout: float) -> bool:
        confirmations.append(timeout)
        return True

    fence = watch(mine, beacons, confirm)
    wait_for(lambda: len(confirmations) >= 2, 10, "its own keep-alive to be tried")
    mine.seconds = fence.deadline + 0.1
    wait_for(lambda: len(confirmations) >= 4, 10, "more rounds of asking")
    assert not fence.must_fence()
    assert all(0 < timeout <= TTL / 6 for timeout in confirmations)  # the fence's clock is not held up
