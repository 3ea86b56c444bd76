"""The chaos table's rows (issue 15, item 7): each fault, and what the job must still do.

A row is declarative: the fault (a function of the running job and its etcd), how many
nodes and etcd members it needs, and its limits: the world size the job must train at
afterwards, the iterations it may re-do, whether its workers may restart at all, the
longest stall allowed where that is part of the promise. bench/chaos.py runs the rows
and prints the table; tests/test_chaos.py asserts each row against its limits.

The partition rows run each node, and etcd, in a network namespace of its own
(bench/netns.py); the fault cuts one node off there, silently (no RST), for a while.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil

from bench.chaos_job import SAVE_INTERVAL, ChaosJob
from bench.launch import wait_for
from bench.netns import unavailable_reason

OUTLIVE_LIMIT = 2.0  # seconds a worker may outlive its SIGKILLed agent (tests/test_orphans.py)
FREEZE_SECONDS = 10.0
PARTITION_SECONDS = 20.0
REJOIN_TIMEOUT = 90.0  # seconds a healed node may take to be back in a round


@dataclass
class FaultReport:
    destroyed: set[int] = field(default_factory=set)  # committed iterations the fault itself ruined
    problems: list[str] = field(default_factory=list)  # what went wrong that the figures do not show
    detail: str = ""  # what exactly the fault did, where it chose (which member, ...)


Fault = Callable[[ChaosJob, object], FaultReport]


@dataclass(frozen=True)
class Row:
    name: str
    fault: Fault | None
    world_after: int  # the world size the job must train at afterwards
    max_redone: int  # iterations the job may re-do
    restart_allowed: bool = True  # False: the workers must train through (one start in all)
    max_stall: float | None = None  # seconds without a step allowed, where the row promises it
    nodes: int = 2
    etcd_members: int = 1
    small_disk: bool = False  # the checkpoints go to a small tmpfs of their own
    network: bool = False  # each node (and etcd) in a network namespace of its own (bench/netns.py)
    flags: tuple[str, ...] = ()  # the row's own eft-run flags
    needs: Callable[[], str] = lambda: ""  # why the row cannot run here ("" : it can)
    # a test that runs this very fault on a job of its own (the world size after, no work or
    # checkpoint lost): tests/test_chaos.py leaves the row to it; the bench still runs every row
    tested_by: str = ""


# -- faults ----------------------------------------------------------------------------


def kill_worker(job: ChaosJob, etcd) -> FaultReport:
    os.kill(job.worker_pids(job.other_node())[0], signal.SIGKILL)
    return FaultReport()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped: holds nothing
    except psutil.NoSuchProcess:
        return True


def kill_agent(job: ChaosJob, etcd) -> FaultReport:
    """SIGKILL the agent alone: its workers must not be orphaned (--eft-die-with-agent)."""
    victim = job.other_node()
    node, workers = job.nodes[victim], job.worker_pids(victim)
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait()
    deadline = time.monotonic() + OUTLIVE_LIMIT
    while not all(map(_gone, workers)) and time.monotonic() < deadline:
        time.sleep(0.02)
    orphans = [pid for pid in workers if not _gone(pid)]
    for pid in orphans:  # the row says so; they must not disturb the rest of it
        os.kill(pid, signal.SIGKILL)
    return FaultReport(problems=[f"workers {orphans} outlived their SIGKILLed agent by {OUTLIVE_LIMIT:g} s"]
                       if orphans else [])


def kill_node(job: ChaosJob, etcd) -> FaultReport:
    job.nodes[job.other_node()].kill_node()
    return FaultReport()


def kill_two_nodes(job: ChaosJob, etcd) -> FaultReport:
    """Rank 0's node and another, one right after the other (milliseconds apart)."""
    victims = [job.nodes[job.rank0_node()], job.nodes[job.other_node()]]
    for node in victims:
        node.kill_node()
    return FaultReport()


def freeze_node(job: ChaosJob, etcd) -> FaultReport:
    """SIGSTOP a node's agent and workers for FREEZE_SECONDS (a VM paused, a machine
    swapping), then SIGCONT: its lease expires meanwhile."""
    node = job.nodes[job.other_node()]
    node.signal_node(signal.SIGSTOP)
    time.sleep(FREEZE_SECONDS)  # the fault: frozen this long
    node.signal_node(signal.SIGCONT)
    return FaultReport()


def partition(side: str) -> Fault:
    """Cut a node that is not rank 0's off from ``side`` (etcd, or its peers) for
    PARTITION_SECONDS, then heal: frames dropped silently both ways, as a network split does."""

    def fault(job: ChaosJob, network) -> FaultReport:
        victim = job.other_node()
        network.cut(victim, from_=side)
        time.sleep(PARTITION_SECONDS)  # the fault: apart this long
        network.heal()
        healed = time.time()
        report = FaultReport(detail=f"node{victim} cut from {side} for {PARTITION_SECONDS:g} s")
        # Healed, the cut node's requests still wait out their timeout (10 s) before they are
        # sent again: the row is over when the job is whole again, not at the first saves after.
        try:
            wait_for(lambda: any(world == job.nnodes for _, world, _ in job.starts(after=healed)), REJOIN_TIMEOUT,
                     "the cut node to rejoin")
        except AssertionError as err:
            report.problems.append(str(err))
        return report

    fault.__name__ = f"partition_{side}"
    return fault


def etcd_outage(seconds: float) -> Fault:
    def fault(job: ChaosJob, etcd) -> FaultReport:
        etcd.kill()
        time.sleep(seconds)  # the fault: etcd away this long
        etcd.restart()
        return FaultReport()

    fault.__name__ = f"etcd_outage_{seconds:g}s"
    return fault


def _leader(cluster) -> int:
    # wait_for wants a truthy value, and member 0 is falsy: the index goes in a list
    return wait_for(lambda: [leader] if (leader := cluster.leader()) is not None else None, 30, "an etcd leader")[0]


def _connected(job: ChaosJob, port: int) -> int:
    """How many agents hold a connection to ``port`` (a member's client port)."""
    count = 0
    for index in job.running():
        try:
            connections = psutil.Process(job.nodes[index].proc.pid).net_connections()
        except psutil.NoSuchProcess:
            continue
        count += any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in connections)
    return count


def kill_member(job: ChaosJob, cluster, member: int, role: str) -> FaultReport:
    connected = _connected(job, cluster.members[member].client_port)
    cluster.kill(member)
    return FaultReport(detail=f"killed {cluster.members[member].name} ({role}), "
                              f"which {connected} of {len(job.running())} agents talked to")


def lose_follower(job: ChaosJob, cluster) -> FaultReport:
    """Kill the follower most agents talk to (each etcd client picks a member at random):
    they must fail over to another."""
    leader = _leader(cluster)
    followers = [i for i in cluster.alive() if i != leader]
    member = max(followers, key=lambda i: _connected(job, cluster.members[i].client_port))
    return kill_member(job, cluster, member, "a follower")


def kill_leader(job: ChaosJob, cluster) -> FaultReport:
    """Kill the leader: an election, and a fail-over for the agents that talked to it."""
    return kill_member(job, cluster, _leader(cluster), "the leader")


def fill_disk(job: ChaosJob, etcd) -> FaultReport:
    """Fill the checkpoints' disk, so that the next save fails (ENOSPC); once the workers
    have restarted for it, free the space (an operator cleaning up)."""
    filler = job.save_dir / "filler"
    starts = len(job.starts())
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    try:
        wait_for(lambda: len(job.starts()) > starts, 120, "the workers to restart after the failed save")
    finally:
        filler.unlink()
    return FaultReport()


def corrupt_latest(job: ChaosJob, etcd) -> FaultReport:
    """Truncate the newest committed checkpoint (a torn file, bad bytes at rest), then make
    the job load it: SIGKILL a worker. Training is frozen meanwhile, so that the
    corrupted checkpoint is still the latest when the restart looks."""
    workers = [pid for i in range(len(job.nodes)) for pid in job.worker_pids(i)]
    victim = job.worker_pids(job.other_node())[0]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    latest = job.tracked_iteration()
    model = job.model_file(latest)
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    os.kill(victim, signal.SIGKILL)
    for pid in workers:
        if pid != victim:
            os.kill(pid, signal.SIGCONT)
    return FaultReport(destroyed={latest})


def preempt(job: ChaosJob, etcd) -> FaultReport:
    """SIGTERM every agent (a scheduler's preemption): each must exit 4 (requeue) after its
    workers saved; then the job is launched again, as a requeue would."""
    for node in job.nodes:
        node.proc.send_signal(signal.SIGTERM)
    statuses = [node.wait(120) for node in job.nodes]
    for index in range(len(job.nodes)):
        job.launch(index)
    wrong = [s for s in statuses if s != 4]
    return FaultReport(problems=[f"preempted agents exited {statuses}, not 4 (requeue)"] if wrong else [])


# -- where a row cannot run --------------------------------------------------------------


def tmpfs_unavailable() -> str:
    """Why a small tmpfs cannot be mounted here ("" if it can): the disk-full row needs one."""
    with tempfile.TemporaryDirectory() as probe:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True, check=False)
        if mounted.returncode != 0:
            return f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}"
        subprocess.run(["umount", probe], check=True)
    return ""


class SmallDisk:
    """A 4 MiB tmpfs mounted on ``path`` (a disk the row can fill), unmounted on exit."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> Self:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(self.path)], check=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", "--lazy", str(self.path)], check=False)


def netns_unavailable() -> str:
    return unavailable_reason() or ""


# -- the rows ----------------------------------------------------------------------------

ETCD_STALL = 5.0  # the workers never wait for etcd: a stall this long means they did

ROWS = [
    Row("worker SIGKILL", kill_worker, world_after=2, max_redone=SAVE_INTERVAL),
    Row("agent SIGKILL", kill_agent, world_after=1, max_redone=SAVE_INTERVAL),
    Row("whole node SIGKILL", kill_node, world_after=1, max_redone=SAVE_INTERVAL),
    # A node that wakes rejoins the job at the next round: the world is whole again.
    Row("node SIGSTOP 10 s", freeze_node, world_after=2, max_redone=SAVE_INTERVAL),
    Row("etcd restart 5 s", etcd_outage(5), world_after=2, max_redone=0, restart_allowed=False, max_stall=ETCD_STALL,
        tested_by="tests/test_etcd_outage.py::test_the_workers_train_on_through_an_etcd_restart"),
    Row("etcd down 60 s", etcd_outage(60), world_after=2, max_redone=0, restart_allowed=False, max_stall=ETCD_STALL),
    Row("1 of 3 etcd members lost", lose_follower, world_after=2, max_redone=0, restart_allowed=False,
        max_stall=ETCD_STALL, etcd_members=3),
    Row("etcd leader killed", kill_leader, world_after=2, max_redone=0, restart_allowed=False, max_stall=ETCD_STALL,
        etcd_members=3),
    # Cut from etcd: the others go on without it; healed, it registers again and rejoins.
    Row("partition node<->etcd", partition("etcd"), world_after=2, max_redone=SAVE_INTERVAL, network=True,
        needs=netns_unavailable,
        tested_by="tests/test_partitions.py::test_training_survives_a_partition_of_one_node[etcd-healed-soon]"),
    # Cut from its peer (both still reach etcd): the step hangs until the step timeout restarts
    # it; the new round waits in setup until the heal, then the two train on.
    Row("partition node<->peers", partition("peers"), world_after=2, max_redone=SAVE_INTERVAL, network=True,
        flags=("--eft-timeouts", "step=10"), needs=netns_unavailable),
    Row("disk full during a save", fill_disk, world_after=2, max_redone=SAVE_INTERVAL, small_disk=True,
        needs=tmpfs_unavailable),
    # The newest checkpoint is unreadable: the one before it, SAVE_INTERVAL older, is loaded.
    Row("corrupt latest checkpoint", corrupt_latest, world_after=2, max_redone=2 * SAVE_INTERVAL),
    # The workers save at the signal: the relaunch resumes where they stopped.
    Row("SIGTERM preemption", preempt, world_after=2, max_redone=0),
    Row("two nodes lost at once", kill_two_nodes, world_after=1, max_redone=SAVE_INTERVAL, nodes=3),
]


def slug(name: str) -> str:
    """A row's name as a test id and a --rows key: "etcd restart 5 s" -> "etcd-restart-5-s"."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
