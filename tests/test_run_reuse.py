"""A run id used again: an ended attempt is reset by the next, a live job's is refused."""

import json
import threading

import pytest

from bench.launch import ROOT, Launched, eft_run, read_jsonl, wait_for
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.outcome import JobOutcome
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import NodeLease
from elasticft.rendezvous.reuse import RunInUse, attempt_outcome, prepare_run
from elasticft.store import EmbeddedEtcd


def node(etcd, run_keys, name: str, attempt: str = "") -> NodeLease:
    return NodeLease(etcd, run_keys, NodeRecord(name, "host", "host", 1, attempt=attempt), ttl=30)


def test_an_ended_attempt_is_reset_once_and_keeps_its_history(etcd, run_keys):
    etcd.put(run_keys.rdzv_closed, "1")
    etcd.put(run_keys.rdzv_participant(3, "old"), "x")
    etcd.put(run_keys.started, "1.0")
    etcd.put(run_keys.ckpt_request, json.dumps({"id": "stop", "exit": True}))
    etcd.put(run_keys.ckpt_latest, json.dumps({"iteration": 40}))
    etcd.put(run_keys.event("0001"), json.dumps({"kind": "job_finished"}))
    results = []
    barrier = threading.Barrier(4)

    def agent():
        barrier.wait()
        results.append(prepare_run(etcd, run_keys, "", linger=0))

    threads = [threading.Thread(target=agent) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]  # one agent reset it, in one transaction
    for gone in (run_keys.rdzv_closed, run_keys.rdzv_participant(3, "old"), run_keys.started, run_keys.ckpt_request):
        assert etcd.get(gone) is None, gone
    assert json.loads(etcd.get(run_keys.ckpt_latest).value) == {"iteration": 40}
    assert etcd.get(run_keys.event("0001")) is not None


def test_a_run_that_never_closed_is_left_alone(etcd, run_keys):
    member = node(etcd, run_keys, "a")
    etcd.put(run_keys.started, "1.0")
    assert prepare_run(etcd, run_keys, "", linger=0) is False  # nodes joining a job that goes on
    assert etcd.get(run_keys.started) is not None
    member.close(clean=True)


def test_a_run_held_by_another_slurm_job_is_refused_by_name(etcd, run_keys):
    other = node(etcd, run_keys, "n1-agent", attempt="4211.r0")
    with pytest.raises(RunInUse, match=f"--rdzv-id {run_keys.run_id} is in use by another job: n1-agent .*4211.r0"):
        prepare_run(etcd, run_keys, "4300.r0", linger=0)
    assert prepare_run(etcd, run_keys, "4211.r0", linger=0) is False  # its own nodes join
    other.close(clean=True)


def test_an_ended_run_waits_for_its_last_nodes_then_resets(etcd, run_keys):
    etcd.put(run_keys.rdzv_closed, "1")
    lingering = node(etcd, run_keys, "slow-to-exit")
    with pytest.raises(RunInUse, match="that job ended but slow-to-exit on host still hold it"):
        prepare_run(etcd, run_keys, "", linger=0)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(prepare_run(etcd, run_keys, "", linger=60)))
    waiter.start()
    lingering.close(clean=True)  # its lease goes: the run is free
    waiter.join(30)
    assert outcome == [True]


@pytest.mark.slow
def test_the_same_run_id_twice_in_a_row_trains_twice(tmp_path, eft_job, run_keys, etcd):
    """The requeue case outside SLURM: same --rdzv-id, the first job over; the second trains
    (it used to exit 2 at once: "the rendezvous was closed")."""
    for attempt in ("first", "second"):
        out = tmp_path / attempt
        out.mkdir()
        job = eft_job("toy_train.py", out, "--ckpt", tmp_path / "ckpt", "--iters", "6", "--save-interval", "3",
                      name=attempt)
        assert job.wait(120) == 0, job.output()
    resumed = [e for e in read_jsonl(tmp_path / "second" / "events.jsonl") if e["event"] == "resume"]
    assert resumed and resumed[0]["iteration"] == 6
    assert "previous attempt ended; starting a new one" in job.output()


@pytest.mark.slow
def test_a_second_job_without_a_run_id_is_refused_in_one_line(tmp_path):
    """torchrun's default --rdzv-id is 'none': a second job left at it used to wait as a
    spare of the first, silently, then exit 0 without having trained."""
    with EmbeddedEtcd() as server:
        def job(name: str, steps: int) -> Launched:
            return Launched([*eft_run(), "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", server.endpoint,
                             str(ROOT / "examples/minimal_train.py"), "--steps", str(steps), "--step-seconds", "0.05",
                             "--save", str(tmp_path / name)], tmp_path / f"{name}.log")
        first = job("first", 100000)
        try:
            wait_for(lambda: "starting at step 0" in first.output(), 60, "the first job to train")
            second = job("second", 5)
            assert second.wait(60) == ExitCode.USAGE
            last = second.output().strip().splitlines()[-1]
            assert last.startswith("eft-run: error: --rdzv-id none is in use by another job"), second.output()
            assert "Traceback" not in second.output()
        finally:
            first.stop()


def test_the_outcome_of_this_attempt_is_found_and_no_other(etcd, run_keys):
    """What a node that did not train to the end reads (a JobSet pod replaced after the others
    finished, a spare): this attempt's record only, and only for a named attempt."""
    assert attempt_outcome(etcd, run_keys, "gpt.0f9e8d7c.r0") is None  # nothing recorded yet
    etcd.put(run_keys.outcome, JobOutcome(ExitCode.REQUEUE, "gpt.0f9e8d7c.r0", "n0").to_json())
    assert attempt_outcome(etcd, run_keys, "gpt.0f9e8d7c.r0").status is ExitCode.REQUEUE
    etcd.put(run_keys.outcome, JobOutcome(ExitCode.OK, "gpt.0f9e8d7c.r0", "n0").to_json())
    assert attempt_outcome(etcd, run_keys, "gpt.0f9e8d7c.r0").node == "n0"
    assert attempt_outcome(etcd, run_keys, "gpt.0f9e8d7c.r1") is None  # the JobSet restarted: a new attempt
    assert attempt_outcome(etcd, run_keys, "") is None
