"""A node waiting to join a job that ends leaves with the job (issue 35), not at its join timeout.

It waits in the next round (the round it would join is full: it is torch's redundancy list)
when the members end the job: by finishing, or by saving and stopping on the scheduler's
SIGTERM (a signal leaves torch's rendezvous open, for other nodes to scale into). eft's
agents close the rendezvous when the job as a whole ended, before their leases go (the
waiting node's keys share a lease with its record), so the waiting node learns it from its
watch: it leaves within a second, exit 0, with one line, and never starts a worker.
"""

from __future__ import annotations

import signal
import time

import pytest

from bench.launch import generation, read_jsonl, wait_for
from elasticft.contract.exit_codes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOIN_TIMEOUT = 150  # what the waiting node would otherwise wait: far longer than any wait below
LEFT = "the job ended while this node waited to join"


def waiting_in_next_round(etcd, run_keys) -> bool:
    return etcd.get(run_keys.rdzv_waiting(1)) is not None


def test_a_node_waiting_when_the_job_finishes_leaves_at_once_without_training(tmp_path, eft_job, etcd, run_keys):
    starts = tmp_path / "starts.jsonl"
    member = eft_job("allreduce_loop.py", tmp_path, nodes="1:1", eft_flags=["--max-restarts", "0"])
    wait_for(lambda: generation(starts, 1), 120, "the member's worker")
    late = eft_job("allreduce_loop.py", tmp_path, nodes="1:1",
                   eft_flags=["--max-restarts", "0", "--rdzv-conf", f"join_timeout={JOIN_TIMEOUT}"])
    wait_for(lambda: waiting_in_next_round(etcd, run_keys), 60, "the late node to wait in the next round")
    (tmp_path / "finish").touch()
    assert member.wait(60) == 0, member.output()
    ended = time.monotonic()
    assert late.wait(30) == 0, late.output()
    assert time.monotonic() - ended < 15, late.output()[-2000:]
    assert LEFT in late.output() and late.output().count(LEFT) == 1
    assert len(read_jsonl(starts)) == 1  # the finished job was not trained again by the late node


def test_a_node_waiting_when_the_scheduler_stops_the_job_leaves_at_once(tmp_path, eft_job, etcd, run_keys):
    out = tmp_path / "out"
    out.mkdir()
    train = ["toy_train.py", out, "--ckpt", tmp_path / "ckpt", "--iters", "100000"]
    members = [eft_job(*train, nodes="2:2") for _ in range(2)]
    wait_for(lambda: len(read_jsonl(out / "events.jsonl")) >= 2, 120, "both members' ranks to start")
    late = eft_job(*train, nodes="2:2", eft_flags=["--rdzv-conf", f"join_timeout={JOIN_TIMEOUT}"])
    wait_for(lambda: waiting_in_next_round(etcd, run_keys), 60, "the late node to wait in the next round")
    for member in members:  # scancel, a time limit, a preemption: every node of the job gets SIGTERM
        member.proc.send_signal(signal.SIGTERM)
    assert [m.wait(90) for m in members] == [ExitCode.REQUEUE] * 2, members[0].output()[-3000:]
    ended = time.monotonic()
    assert late.wait(30) == 0, late.output()[-3000:]
    assert time.monotonic() - ended < 15, late.output()[-2000:]
    assert LEFT in late.output()
