"""A worker failure that no lost node can explain is restarted at once, not after the grace.

``--eft-failure-grace`` (default: lease TTL + 1) lets a worker failure wait for the lost-node
event that explains it: peers of a dead node fail at once, its lease expires later. But on
a job of one node there is no peer node to lose, and a worker that died of its own crash or a
kill (SIGKILL, SIGSEGV, ...) was not failed by a vanished peer: both restart at once. The
grace here is 60 s, longer than each job's whole wait: before, each waited it out.
"""

from __future__ import annotations

import pytest

from bench.launch import worker_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

GRACE = ["--eft-failure-grace", "60", "--max-restarts", "1", "--eft-inject", "rank_killed:1@3"]


def train(tmp_path):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return out, ["toy_train.py", out, "--ckpt", tmp_path / "ckpt", "--iters", "8"]


def test_a_one_node_job_restarts_a_crashed_worker_without_waiting_the_grace(tmp_path, eft_job):
    out, command = train(tmp_path)
    job = eft_job(*command, nproc=2, eft_flags=GRACE)
    assert job.wait(45) == 0, job.output()[-3000:]
    assert len(worker_events(out, "resume")) == 4  # two ranks, twice: the kill cost one restart


def test_a_worker_killed_on_one_of_two_nodes_restarts_the_job_without_waiting_the_grace(tmp_path, eft_job):
    out, command = train(tmp_path)
    nodes = [eft_job(*command, nodes="2", eft_flags=GRACE) for _ in range(2)]
    assert [node.wait(45) for node in nodes] == [0, 0], nodes[0].output()[-2000:] + nodes[1].output()[-2000:]
    assert len(worker_events(out, "resume")) == 4
