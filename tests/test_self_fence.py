"""Self-fencing's decision (agent/fence.py): real beacons on real sockets, silences set by the test.

A node's silence is how long ago etcd last confirmed its lease. The rule under test: a
node fences itself only when a peer heard from etcd more than a refresh period after it
did, and its own lease is about to expire; an etcd down for everyone (every silence
grows alike) or peers that do not answer never stop a worker. The whole path on real
hosts (a node cut from etcd in a network namespace): tests/test_partitions.py.
"""

from __future__ import annotations

import socket

import pytest

from bench.launch import wait_for
from elasticft.agent.fence import Beacon, FenceWatch, PeerView, ask

TTL = 3.0


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

    def make(mine: Silence, beacons: list[Beacon]) -> FenceWatch:
        made.append(FenceWatch(mine, TTL, lambda: [b.address for b in beacons]))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_a_beacon_answers_with_its_silence_and_a_silent_peer_is_none(peers):
    beacon, = peers(Silence(1.25, resumed=0.5))
    assert ask(beacon.address, 1.0) == PeerView(1.25, 0.5)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{unused.getsockname()[1]}"
    assert ask(nobody, 1.0) is None


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


@pytest.mark.parametrize("answers", [pytest.param(True, id="etcd-down-for-all"),
                                     pytest.param(False, id="no-peer-answers")])
def test_an_etcd_down_for_everyone_or_no_answer_fences_no_one(peers, watch, answers):
    mine = Silence(TTL + 1)
    if answers:
        # etcd went away for all at once: a peer's last refresh is at most one refresh period
        # (TTL/3) younger than this node's, so its silence is at least this node's less TTL/3
        beacons = peers(Silence(mine.seconds - TTL / 3 + 0.05), Silence(mine.seconds + 0.2))
    else:
        beacons = peers(Silence(0.1))
        beacons[0].close()  # nobody listens there any more
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
