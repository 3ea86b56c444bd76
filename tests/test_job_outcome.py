"""The job's outcome (contract/outcome.py): who writes it, what a batch script's `eft outcome`
exits with. The rule is pure; its etcd side runs on the session's real etcd, and `eft outcome`
as the command a batch script runs. The real SLURM job is test_slurm.py's."""

import os
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec, WorkerState

from elasticft.agent.outcome import record_outcome, write_once
from elasticft.contract.exit_codes import REQUEUE_REASONS, ExitCode
from elasticft.contract.outcome import JobOutcome, decide_outcome, job_status
from elasticft.contract.restarts import Ending, RestartRecord

REASONS = [None, *sorted(REQUEUE_REASONS), "kill_switch", "manual"]


@pytest.mark.parametrize("group_rank0, finished, stop_reason, ending, status", [
    (True, True, None, None, ExitCode.OK),  # rank 0's workers trained to the end
    (True, True, "kill_switch", None, ExitCode.OK),  # a person stopped it: done
    (True, True, "deadline", None, ExitCode.REQUEUE),  # saved before the time limit
    (True, False, "signal", None, ExitCode.REQUEUE),  # SIGTERM during the save: still saved
    (True, False, None, None, None),  # failed: srun's status says how
    (True, False, "kill_switch", None, None),  # not clean: never 0
    (False, True, None, None, None),  # another node: rank 0's node decides
    (False, False, None, Ending.NO_PROGRESS, ExitCode.NO_PROGRESS),  # the restart rule's verdict, any node
    (False, False, None, Ending.BUDGET, ExitCode.FAILED),
    (True, True, None, Ending.NO_PROGRESS, ExitCode.NO_PROGRESS),  # a verdict outranks a 0
])
def test_the_agent_that_decides_the_end_writes_the_training_s_status(group_rank0, finished, stop_reason, ending,
                                                                     status):
    assert decide_outcome(group_rank0=group_rank0, finished=finished, stop_reason=stop_reason,
                          ending=ending) == status


@given(group_rank0=st.booleans(), finished=st.booleans(), stop_reason=st.sampled_from(REASONS),
       ending=st.sampled_from([None, *Ending]), srun_status=st.integers(0, 255))
def test_nothing_lost_a_job_whose_training_did_not_finish_is_never_0(group_rank0, finished, stop_reason, ending,
                                                                     srun_status):
    written = decide_outcome(group_rank0=group_rank0, finished=finished, stop_reason=stop_reason, ending=ending)
    record = None if written is None else JobOutcome(written, "812.r0", "n1")
    status, _ = job_status(record, "812.r0", srun_status)
    trained_to_the_end = group_rank0 and finished and ending is None and stop_reason not in REQUEUE_REASONS
    if status == 0:
        assert trained_to_the_end or (record is None and srun_status == 0)  # srun's 0: every task exited 0


def test_the_batch_job_exits_with_this_attempt_s_record_else_with_srun_s_status():
    finished = JobOutcome(ExitCode.OK, "812.r1", "n1", 1_800_000_000)
    status, line = job_status(finished, "812.r1", 137)
    assert status == 0 and line.startswith("the training finished (recorded by node n1 at ")
    assert line.endswith(": exit status 0 (srun's was 137)")
    assert job_status(finished, "812.r2", 137) == (
        137, "the recorded outcome is attempt 812.r1's, not 812.r2's: exit status 137, srun's")
    assert job_status(None, "812.r1", 4) == (4, "no outcome recorded in etcd: exit status 4, srun's")
    assert job_status(finished, "", 1)[0] == 1  # outside SLURM no record is trusted: it may be a relaunch's
    assert JobOutcome.from_json(finished.to_json()) == finished


def group(rank: int | None, state: WorkerState) -> WorkerGroup:
    made = WorkerGroup(WorkerSpec("default", 1, rdzv_handler=None, entrypoint="train.py"))
    made.group_rank, made.state = rank, state
    return made


def outcome(etcd, run_keys) -> JobOutcome | None:
    current = etcd.get(run_keys.outcome)
    return None if current is None else JobOutcome.from_json(current.value)


def test_rank_0_s_node_records_a_finish_and_the_first_end_of_an_attempt_stands(agent_context, etcd, run_keys):
    rank1, rank0 = agent_context("n2"), agent_context("n1")
    record_outcome(rank1, group(1, WorkerState.SUCCEEDED), clean=True, stop_reason=None)
    assert outcome(etcd, run_keys) is None  # not rank 0's node: it does not decide
    record_outcome(rank0, group(0, WorkerState.FAILED), clean=False, stop_reason=None)
    assert outcome(etcd, run_keys) is None  # failed: srun's status tells
    record_outcome(rank0, group(0, WorkerState.SUCCEEDED), clean=True, stop_reason="deadline")
    assert (outcome(etcd, run_keys).status, outcome(etcd, run_keys).node) == (ExitCode.REQUEUE, "n1")
    assert not write_once(etcd, run_keys.outcome, JobOutcome(ExitCode.OK, "", "n2"))  # the same attempt's first end
    assert write_once(etcd, run_keys.outcome, JobOutcome(ExitCode.OK, "812.r1", "n2"))  # another attempt's replaces
    assert outcome(etcd, run_keys).attempt == "812.r1"


def test_the_restart_rule_s_verdict_is_recorded_by_the_node_it_ended(agent_context, etcd, run_keys):
    etcd.put(run_keys.restarts, RestartRecord(no_progress=3, ended=Ending.NO_PROGRESS).to_json())
    record_outcome(agent_context("n2"), group(1, WorkerState.FAILED), clean=False, stop_reason=None)
    assert outcome(etcd, run_keys).status == ExitCode.NO_PROGRESS


def slurm_env(attempt: int = 0) -> dict:
    return {**os.environ, "SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": str(attempt), "SLURM_JOB_NUM_NODES": "2"}


def eft_outcome(srun_status: int, *eft_run_args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["eft", "outcome", "--srun-status", str(srun_status), "--", *eft_run_args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.slow
def test_eft_outcome_exits_with_the_record_of_the_run_eft_run_named(etcd_server, etcd):
    """The same arguments as eft-run: the run id SLURM's default (slurm-812-r0), the prefix
    from --rdzv-conf, as eft-run resolves them."""
    from elasticft.contract.keys import RunKeys

    keys = RunKeys("slurm-812-r0", "/outcome-test")
    run = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-conf",
           "key_prefix=/outcome-test", "--nnodes", "1:2", "train.py", "--steps", "9"]
    etcd.delete(keys.outcome)
    done = eft_outcome(137, *run, env=slurm_env())
    assert done.returncode == 137 and "no outcome recorded in etcd: exit status 137, srun's" in done.stderr
    etcd.put(keys.outcome, JobOutcome(ExitCode.OK, "812.r0", "n1").to_json())
    done = eft_outcome(137, *run, env=slurm_env())
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("eft outcome: the training finished (recorded by node n1 at ")
    assert eft_outcome(137, *run, env=slurm_env(attempt=1)).returncode == 137  # a requeued attempt's own
    run_elsewhere = [*run[:3], "127.0.0.1:1", *run[4:]]
    done = eft_outcome(4, *run_elsewhere, env=slurm_env())
    assert done.returncode == 4, done.stderr
    assert done.stderr.startswith("eft outcome: could not read the outcome (etcd at 127.0.0.1:1 is unreachable)")


@pytest.mark.parametrize("args, needle", [
    (["--srun-status", "256", "--", "train.py"], "--srun-status: expected an exit status 0..255"),
    (["--srun-status", "0"], "expected eft-run's arguments after --"),
    (["--", "train.py"], "--srun-status: required"),
    (["--srun-status", "0", "--", "--nnodes", "3:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "h:1", "t.py"],
     "--nnodes: expected 0 < MIN <= MAX"),
    (["--srun-status", "0", "--", "--help"], "expected those of a launch, got --help"),  # never a 0
])
def test_eft_outcome_refuses_bad_input_in_one_line(args, needle):
    done = subprocess.run(["eft", "outcome", *args], capture_output=True, text=True, timeout=60, env=slurm_env())
    assert done.returncode == 2 and done.stderr.startswith("eft outcome: error: ") and needle in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout, done.stderr
