"""What eft-run reads from SLURM's variables: the run id, the node count, the deadline,
the signal warning, and the rank variables each worker gets. Pure functions, fed the
variables SLURM 22.05 sets (docs/slurm-facts.md); the real cluster is test_slurm.py's."""

import argparse
import os
import subprocess
import time

import pytest

from elasticft.slurm.defaults import derive, signal_warning
from elasticft.slurm.etcd_members import endpoint, job_port, members
from elasticft.slurm.job import SlurmJob, end_time, parse_end_time
from elasticft.slurm.worker_env import slurm_worker_env, stale_variables

BATCH = {"SLURM_JOB_ID": "812", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1"}
STEP = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_GTIDS": "1"}


def torchrun_args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"rdzv_id": "none", "nnodes": "1:1", "node_rank": 0, "rdzv_backend": "static",
                                 **given})


def test_outside_slurm_there_is_no_job():
    assert SlurmJob.from_environ({"HOME": "/root"}) is None


@pytest.mark.parametrize("env, run_id", [
    (BATCH, "slurm-812-r0"),
    ({**BATCH, "SLURM_RESTART_COUNT": "2"}, "slurm-812-r2"),  # a requeued attempt: its own run
    ({**BATCH, "SLURM_JOB_ID": "815", "SLURM_ARRAY_JOB_ID": "812", "SLURM_ARRAY_TASK_ID": "3"}, "slurm-812_3-r0"),
])
def test_each_attempt_of_each_job_gets_its_own_run_id(env, run_id):
    args = torchrun_args()
    derive(args, SlurmJob.from_environ(env), env)
    assert args.rdzv_id == run_id


def test_an_srun_step_sets_the_node_count_and_rank_a_flag_wins():
    args = torchrun_args()
    derived = derive(args, SlurmJob.from_environ(STEP), STEP)
    assert (args.nnodes, args.node_rank) == ("2", 1)
    assert derived.flags == {"rdzv_id": "slurm-812-r0", "nnodes": "2", "node_rank": "1"}
    mine = torchrun_args(rdzv_id="mine", nnodes="1:2", rdzv_backend="etcd-v3")
    assert derive(mine, SlurmJob.from_environ(STEP), STEP).flags == {}  # a dynamic rendezvous ranks nodes itself
    assert (mine.rdzv_id, mine.nnodes) == ("mine", "1:2")
    by_env = torchrun_args()
    derive(by_env, SlurmJob.from_environ(STEP), {**STEP, "PET_NNODES": "1:1"})
    assert by_env.nnodes == "1:1"  # PET_NNODES=1:1 is the user's choice, though it equals the default


def test_the_batch_script_is_one_agent_whatever_the_allocation():
    args = torchrun_args()
    derive(args, SlurmJob.from_environ(BATCH), BATCH)
    assert args.nnodes == "1:1"


def test_the_end_time_is_squeues_local_time_and_none_without_a_limit():
    job = SlurmJob.from_environ(BATCH)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(1_800_000_000))
    assert end_time(job, run=lambda cmd: f"{stamp}\n") == 1_800_000_000
    assert end_time(job, run=lambda cmd: "NONE\n") is None
    assert parse_end_time("Unknown") is None and parse_end_time("garbage") is None

    def unreachable(cmd):
        raise OSError("squeue: error: Unable to contact slurm controller")
    assert end_time(job, run=unreachable) is None


def test_a_child_of_the_batch_shell_is_warned_an_exec_or_srun_is_not():
    batch = SlurmJob.from_environ(BATCH)
    warning = signal_warning(batch, "slurm_script", "/bin/bash /var/spool/slurmd/job00812/slurm_script")
    assert "exec eft-run" in warning
    assert signal_warning(batch, "slurmstepd", "slurmstepd: [812.batch]") is None  # exec'd
    assert signal_warning(SlurmJob.from_environ(STEP), "bash", "/bin/bash ./slurm_script") is None  # srun
    assert signal_warning(batch, "bash", "bash") is None  # an interactive shell (salloc)


def test_a_worker_sees_its_own_rank_in_slurms_variables():
    worker = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
              "LOCAL_WORLD_SIZE": "4"}
    env = slurm_worker_env(worker, STEP)
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NTASKS"], env["SLURM_NODEID"]) == ("5", "1", "8", "1")
    assert (env["SLURM_NNODES"], env["SLURM_NTASKS_PER_NODE"]) == ("2", "4")
    assert stale_variables(STEP) == ["SLURM_GTIDS"]
    assert slurm_worker_env(worker, {}) == {} and stale_variables({"SLURM_GTIDS": "0"}) == []


def test_etcd_members_sit_on_the_first_nodes_with_ports_apart_by_index():
    answers = {("scontrol", "show", "hostnames", "n[1-4]"): "n1\nn2\nn3\nn4\n"}

    def scontrol(cmd):
        if cmd[:3] == ["scontrol", "-o", "show"]:
            return f"NodeName={cmd[-1]} Arch=x86_64 NodeAddr=10.0.0.{cmd[-1][1:]} NodeHostName={cmd[-1]}"
        return answers[tuple(cmd)]

    chosen = members("n[1-4]", 3, 20000, run=scontrol, resolve=lambda addr: addr)
    assert endpoint(chosen) == "10.0.0.1:20000,10.0.0.2:20002,10.0.0.3:20004"
    assert [m.peer_url for m in chosen][-1] == "http://10.0.0.3:20005"
    with pytest.raises(ValueError, match="--members 5: the allocation has 4 node"):
        members("n[1-4]", 5, 20000, run=scontrol, resolve=lambda addr: addr)
    assert job_port("812") != job_port("813") and job_port("none") == 2379


@pytest.mark.parametrize("args, env, needle", [
    (["--members", "2"], {}, "--members: expected 1, 3 or 5, got 2"),
    (["--slurm"], {"SLURM_JOB_NODELIST": ""}, "--slurm: SLURM_JOB_NODELIST is not set"),
])
def test_eft_etcd_refuses_bad_input_in_one_line(args, env, needle):
    done = subprocess.run(["eft", "etcd", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 2 and done.stderr.strip().startswith(f"eft etcd: {needle}"), done.stderr
    assert "Traceback" not in done.stderr


def test_the_end_time_slurm_sets_in_the_environment_is_taken_without_asking_the_controller():
    job = SlurmJob.from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "1800000000"})

    def squeue(command):
        raise AssertionError(f"asked the controller: {command}")
    assert end_time(job, run=squeue) == 1_800_000_000
    unset = SlurmJob.from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "0"})
    assert unset.end_time is None and end_time(unset, run=lambda cmd: "NONE\n") is None
