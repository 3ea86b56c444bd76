"""The SLURM test cluster itself: multi-node steps, exit codes, requeue (tests/slurm_cluster.py)."""
import textwrap

import pytest


def batch_script(tmp_path, name, body):
    script = tmp_path / name
    script.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    return script


def test_two_node_job_runs_a_task_per_node(slurm_cluster, tmp_path):
    script = batch_script(tmp_path, "hosts.sh", """\
        srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME"'
        """)
    job_id = slurm_cluster.sbatch(script, nodes=2, ntasks_per_node=1, output=tmp_path / "hosts.out")
    job = slurm_cluster.wait(job_id, timeout=30)
    assert (job["JobState"], job["ExitCode"], job["NumNodes"]) == ("COMPLETED", "0:0", "2")
    lines = sorted((tmp_path / "hosts.out").read_text().splitlines())
    assert [line.rsplit(" ", 1)[0] for line in lines] == ["task 0 of 2 on", "task 1 of 2 on"]
    assert len({line.rsplit(" ", 1)[1] for line in lines}) == 2  # one task on each of two nodes


def test_exit_status_of_the_batch_script_is_the_job_exit_code(slurm_cluster, tmp_path):
    job_id = slurm_cluster.sbatch(batch_script(tmp_path, "exit3.sh", "exit 3\n"), output="/dev/null")
    job = slurm_cluster.wait(job_id, timeout=30)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "3:0")


@pytest.mark.slow  # a requeued job waits out the credential lifetime (10 s) before it runs again
def test_self_requeued_job_runs_again_with_the_same_id_and_a_restart_count(slurm_cluster, tmp_path):
    # The first attempt requeues itself; the second (SLURM_RESTART_COUNT=1) completes.
    script = batch_script(tmp_path, "requeue.sh", """\
        echo "attempt ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID"
        [ -z "$SLURM_RESTART_COUNT" ] && scontrol requeue "$SLURM_JOB_ID" && sleep 30
        exit 0
        """)
    out = tmp_path / "requeue.out"
    job_id = slurm_cluster.sbatch(script, requeue=True, open_mode="append", output=out)
    job = slurm_cluster.wait(job_id, timeout=60)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1")
    assert out.read_text().count(f"of job {job_id}") == 2
