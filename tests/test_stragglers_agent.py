"""Stragglers in the agent and in real jobs: a straggling node leaving the job (its
membership, the agent's decision), then eft-run end to end."""

import json
import os
import signal
import time

import pytest

from bench.launch import generation, wait_for, worker_events
from elasticft.agent.events import EventLog
from elasticft.agent.exclusion import leave_if_straggler
from elasticft.agent.stragglers import StragglerMonitor
from elasticft.config import StragglerConfig
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership, NodeLease, running_nodes
from tests.test_stragglers import write_heartbeat

# -- leaving the job -------------------------------------------------------------------------


def test_an_excluded_node_is_lost_to_the_others_until_their_round_is_formed(etcd, run_keys):
    leases = {name: NodeLease(etcd, run_keys, NodeRecord(name, "h", "h", i), ttl=3) for i, name in enumerate("abc")}
    membership = Membership(etcd, run_keys)
    try:
        assert sorted(running_nodes(etcd, run_keys)) == ["a", "b", "c"]
        leases["a"].set_state("excluded")
        assert sorted(running_nodes(etcd, run_keys)) == ["b", "c"]  # what a second straggler would count
        leases["a"].close(clean=False)
        leases["a"].close(clean=False)  # a second close does nothing
        wait_for(membership.lost.is_set, 10, "the excluded node's departure")
        assert ("h", 0) in membership.lost_rdzv_identities()  # the rendezvous drops it at once
        membership.forget_non_members()
        assert not membership.lost.is_set() and membership.take_losses() == []
        leases["b"].close(clean=False)  # a node that dies is still a loss
        wait_for(membership.lost.is_set, 10, "the lost node")
        membership.forget_non_members()
        assert [r.node_id for r in membership.take_losses()] == ["b"]
    finally:
        membership.close()
        for lease in leases.values():
            lease.close(clean=True)


def test_a_straggler_whose_departure_is_seen_after_the_round_formed_without_it_is_no_loss(etcd, run_keys):
    # The survivors' round decision and the node records come through different watches: the
    # straggler's departure can arrive after its round formed (CI25: a second restart alone).
    leases = {name: NodeLease(etcd, run_keys, NodeRecord(name, "h", "h", i), ttl=3) for i, name in enumerate("ab")}
    membership = Membership(etcd, run_keys)
    try:
        leases["a"].set_state("excluded")  # it leaves instead of joining the next round
        _, formed_at = etcd.get_prefix(run_keys.nodes)  # the survivors' round forms without it
        membership.forget_non_members(formed_at)
        leases["a"].close(clean=False)
        wait_for(lambda: "a" not in membership.members(), 10, "the straggler's departure")
        assert not membership.lost.is_set() and membership.take_losses() == []
        # Marked excluded after the round formed: it was one of the round's members.
        leases["b"].set_state("excluded")
        leases["b"].close(clean=False)
        wait_for(membership.lost.is_set, 10, "the member's departure")
        assert [r.node_id for r in membership.take_losses()] == ["b"]
    finally:
        membership.close()
        for lease in leases.values():
            lease.close(clean=True)


class FakeHandler:
    """What leave_if_straggler uses of torch's rendezvous handler."""

    def __init__(self, min_nodes):
        self.settings = type("Settings", (), {"min_nodes": min_nodes})()
        self.heartbeats = True

    def _stop_heartbeats(self):
        self.heartbeats = False

    def shutdown(self):
        raise AssertionError("closing the rendezvous would end the job for the others")


def straggling_node(agent_context, tmp_path):
    """Node "me" with a straggler among its ranks, as the agent holds it at a restart."""
    for local_rank, seconds in enumerate([0.1, 0.1, 0.9]):
        write_heartbeat(tmp_path, local_rank, local_rank, [seconds] * 4)
    ctx = agent_context("me", tmp_path)
    monitor = StragglerMonitor(StragglerConfig(straggler_action="exclude"), ctx)
    monitor.check_once()
    return ctx, monitor


@pytest.mark.parametrize("min_nodes", [2, 3])
def test_a_straggling_node_stays_when_the_others_are_too_few(etcd, run_keys, agent_context, tmp_path, min_nodes):
    other = NodeLease(etcd, run_keys, NodeRecord("other", "h", "h", 2), ttl=3)
    ctx, monitor = straggling_node(agent_context, tmp_path)
    handler = FakeHandler(min_nodes)
    assert not leave_if_straggler(ctx, monitor, handler)  # the node stays
    assert handler.heartbeats
    assert sorted(running_nodes(etcd, run_keys)) == ["me", "other"]  # marked running again
    assert [e["kind"] for e in ctx.events.read()] == ["straggler"]
    other.close(clean=True)


def test_a_straggling_node_leaves_without_closing_the_rendezvous(etcd, run_keys, agent_context, tmp_path):
    other = NodeLease(etcd, run_keys, NodeRecord("other", "h", "h", 2), ttl=3)
    ctx, monitor = straggling_node(agent_context, tmp_path)
    handler = FakeHandler(1)
    assert leave_if_straggler(ctx, monitor, handler)
    assert not handler.heartbeats and handler.shutdown() is True
    assert etcd.get(run_keys.node("me")) is None and sorted(running_nodes(etcd, run_keys)) == ["other"]
    straggler, excluded = ctx.events.read()
    assert (excluded["kind"], excluded["ranks"], excluded["remaining_nodes"]) == ("node_excluded", [2], 1)
    other.close(clean=True)


# -- eft-run end to end ----------------------------------------------------------------------

ITER_TIME, SLOW_EXTRA = 0.05, 0.3


def toy_nodes(eft_job, tmp_path, nnodes, nproc, iters, extra=(), slow_rank=1, worker_args=()):
    """Nodes node-a and node-b of one toy_train.py job, in which ``slow_rank`` is slowed down."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    nodes = {name: eft_job("toy_train.py", out, "--ckpt", tmp_path / "ckpt", "--iters", iters, "--iter-time", ITER_TIME,
                           "--slow", f"{slow_rank}:{SLOW_EXTRA}", *worker_args, nodes=nnodes, nproc=nproc, name=name,
                           eft_flags=["--eft-node-id", name, "--eft-health-source", "none", *extra])
             for name in ("node-a", "node-b")}
    return out, nodes


def events_of(etcd, keys, kind=None):
    events = EventLog(etcd, keys, "test").read()
    return [e for e in events if kind is None or e["kind"] == kind]


@pytest.mark.slow
def test_eft_run_reports_the_slowed_rank_with_its_scores_and_not_the_fast_ones(tmp_path, eft_job, etcd, run_keys):
    """Acceptance: rank 1 sleeps 0.3 s more per step; 2 nodes x 2 ranks; checks every 2 s."""
    _, nodes = toy_nodes(eft_job, tmp_path, "2", 2, iters=40, extra=["--eft-straggler-interval", "2"])
    wait_for(lambda: events_of(etcd, run_keys, "straggler"), 90, "a straggler event")
    for node in nodes.values():
        assert node.wait(120) == 0, node.output()
    stragglers = events_of(etcd, run_keys, "straggler")
    assert [e["rank"] for e in stragglers] == [1], stragglers  # once, and only the slowed rank
    event = stragglers[0]
    # Work times: 0.05 s for ranks 0, 2, 3 and 0.35 s for rank 1; the job's median of four
    # is 0.05 s, so rank 1's relative score is 0.05 / 0.35 = 0.143.
    expected = ITER_TIME / (ITER_TIME + SLOW_EXTRA)
    assert event["relative"] == pytest.approx(expected, abs=0.03)  # sleeps overshoot a little on a busy host
    assert event["relative"] == pytest.approx(event["job_median"] / event["step_time"], rel=1e-3)
    assert event["step_time"] == pytest.approx(ITER_TIME + SLOW_EXTRA, abs=0.03)
    assert event["job_median"] == pytest.approx(ITER_TIME, abs=0.01)
    assert event["individual"] > 0.9  # slow from the start: no slower than its own best
    assert (event["relative_threshold"], event["individual_threshold"], event["action"]) == (0.7, 0.7, "report")
    assert event["local_rank"] == 1 and event["gpu"] == 1 and event["node"] == event["source"]
    print(f"\nstraggler event: {json.dumps(event)}")
    assert [e["kind"] for e in events_of(etcd, run_keys, "node_excluded")] == []


def latest_pid(out, rank):
    return [r for r in worker_events(out, "resume") if r["rank"] == rank][-1]["pid"]


@pytest.mark.slow
@pytest.mark.parametrize("slow_rank", [1, 0])  # 0: the node that leaves hosts the round's store
def test_eft_run_exclude_leaves_the_straggler_node_out_at_the_next_restart(tmp_path, eft_job, etcd, run_keys,
                                                                            slow_rank):
    """2 nodes x 1 rank, one rank slowed; a worker failure restarts the job and the slow node leaves."""
    # Checkpoints every 5 iterations: the survivor (rank 0 of one) resumes instead of starting
    # over, which matters when it is rank 0 that was slowed, since it stays slow.
    out, nodes = toy_nodes(eft_job, tmp_path, "1:2", 1, iters=60,
                           extra=["--eft-straggler-interval", "1", "--eft-straggler-action", "exclude",
                                  "--max-restarts", "1"], slow_rank=slow_rank, worker_args=["--save-interval", "5"])
    event = wait_for(lambda: events_of(etcd, run_keys, "straggler"), 90, "a straggler event")[0]
    assert event["rank"] == slow_rank and event["action"] == "exclude"
    slow = nodes[event["node"]]
    fast = next(n for n in nodes.values() if n is not slow)
    started = time.time()
    os.kill(latest_pid(out, 1 - slow_rank), signal.SIGKILL)  # any restart will do: a worker dies
    assert slow.wait(60) == 0, slow.output()
    assert f"leaves the job: straggler rank(s) [{slow_rank}]" in slow.output()
    excluded, = events_of(etcd, run_keys, "node_excluded")
    assert (excluded["source"], excluded["ranks"], excluded["remaining_nodes"]) == (event["node"], [slow_rank], 1)
    wait_for(lambda: generation(out / "events.jsonl", 1, after=started), 60, "the job to go on alone")
    assert fast.wait(60) == 0, fast.output()
    kinds = [e["kind"] for e in events_of(etcd, run_keys)]
    assert "job_finished" in kinds and kinds.count("node_excluded") == 1
    # Its departure, seen while the new round formed, did not restart the survivor again.
    survivor_log = fast.log_path.read_text(errors="replace")
    after_exclusion = survivor_log.rpartition("of 2, world size 2")[2]
    assert after_exclusion.count("rendezvous complete: node rank 0 of 1") == 1, survivor_log
