"""eft under a real SLURM: the example batch scripts submitted with sbatch to a private
one-host cluster (tests/slurm_cluster.py, nodes n1..n4), judged from the checkpoints,
the job's output and SLURM's own record of the job."""

import os
import re
import shutil
import signal
import textwrap
from pathlib import Path

import pytest

from bench.launch import ROOT, wait_for, worker_events
from elasticft.contract.exit_codes import ExitCode

# Longer than the longest wait below (tests/test_waits.py): a late job fails with its own message.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]

TRAIN = ROOT / "examples" / "slurm" / "train.sbatch"
ARRAY = ROOT / "examples" / "slurm" / "array.sbatch"
LOOP = ROOT / "examples" / "minimal_train.py"
TOY = ROOT / "tests" / "workers" / "toy_train.py"  # the loop that runs --eft-inject's faults
# Under SLURM's KillWait (10 s on the test cluster): a SIGTERM save must end before SIGKILL.
GRACE = ("--eft-shutdown-grace", "8")


def loop(ckpt: Path, steps: int, step_seconds: float = 0.05, save_interval: int = 10) -> list[str]:
    return [str(LOOP), "--steps", str(steps), "--step-seconds", str(step_seconds), "--save", str(ckpt),
            "--save-interval", str(save_interval)]


def text(out: Path) -> str:
    return out.read_text(errors="replace") if out.exists() else ""


def latest(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


def started_at(out: Path) -> list[tuple[int, int]]:
    """(world size, step) of every start of the loop, in order."""
    return [(int(w), int(s)) for w, s in re.findall(r"world size (\d+), starting at step (\d+)", text(out))]


def saves(out: Path, attempt: int | None = None) -> list[int]:
    """The steps saved (by every attempt, or by attempt ``attempt``: the n-th start's)."""
    log = text(out)
    if attempt is not None:
        log = re.split(r"^world size \d+, starting at step", log, flags=re.M)[attempt + 1]
    return [int(s) for s in re.findall(r"^step (\d+) loss .* \(saved", log, re.M)]


def submit_train(cluster, tmp_path: Path, *eft_args: str, nodes: int = 2, **opts) -> tuple[str, Path]:
    out = tmp_path / "train.out"
    job = cluster.sbatch(TRAIN, *GRACE, *eft_args, nodes=nodes, output=out, chdir=tmp_path, **opts)
    return job, out


def test_usr1_to_the_batch_shell_saves_stops_with_4_and_the_requeued_attempt_resumes(slurm_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    # USR1 comes at the first save (step 10): the requeued attempt trains the rest
    job, out = submit_train(slurm_cluster, tmp_path, *loop(ckpt, 250))
    wait_for(lambda: saves(out), 120, "the first save")
    slurm_cluster.scancel(job, "--signal=USR1", "-b")  # what #SBATCH --signal=B:USR1@N does
    done = slurm_cluster.wait(job, until=lambda j: j["JobState"] == "COMPLETED", timeout=240)
    log = text(out)
    stopped = int(re.search(r"stopped at step (\d+): signal", log).group(1))
    assert f"job exit status {int(ExitCode.REQUEUE)} (attempt 0," in log, log[-3000:]
    assert started_at(out) == [(2, 0), (2, stopped)]  # the requeued attempt resumed where the save was
    assert "job exit status 0 (attempt 1," in log and latest(ckpt) == 250
    assert done["Restarts"] == "1" and done["ExitCode"] == "0:0"
    # each attempt its own run id, derived from the job without a flag
    assert f"--rdzv-id slurm-{job}-r0, --nnodes 2" in log and f"--rdzv-id slurm-{job}-r1, --nnodes 2" in log


def test_scontrol_requeue_resumes_from_the_save_in_the_sigterm_grace_on_an_external_etcd(slurm_cluster, tmp_path,
                                                                                        etcd_server):
    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    script = tmp_path / "external.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --requeue
        #SBATCH --open-mode=append
        exec eft-run --rdzv-backend etcd-v3 --rdzv-endpoint {etcd_server.endpoint} {' '.join(GRACE)} \\
             --nproc-per-node 2 {' '.join(loop(ckpt, 250))}
        """))
    job = slurm_cluster.sbatch(script, output=out, chdir=tmp_path)
    wait_for(lambda: saves(out), 120, "the first save")
    slurm_cluster.requeue(job)  # SIGTERM to every process of the job, then it runs again
    done = slurm_cluster.wait(job, until=lambda j: j["JobState"] == "COMPLETED", timeout=240)
    log = text(out)
    stopped = int(re.search(r"stopped at step (\d+): signal", log).group(1))
    assert started_at(out) == [(2, 0), (2, stopped)], log[-3000:]  # resumed from the save SIGTERM made
    assert saves(out, attempt=0)[-1] == stopped and latest(ckpt) == 250
    assert f"--rdzv-id slurm-{job}-r0" in log and f"--rdzv-id slurm-{job}-r1" in log
    assert done["Restarts"] == "1" and done["ExitCode"] == "0:0"


def test_a_job_requeueing_itself_under_its_job_id_as_run_id_resumes_every_time(slurm_cluster, tmp_path,
                                                                               etcd_server):
    """The case that failed: --rdzv-id $SLURM_JOB_ID on a long-lived etcd. A requeued attempt
    found the last one's closed rendezvous and exited 2, and its `started` key made
    --eft-exit-duration-mins fire at the first step."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    script = tmp_path / "self.sbatch"
    # 180 steps of 0.1 s: as long as an attempt (0.3 min), startup included, so one stop at least;
    # the attempt trains what its startup leaves, and two or three attempts finish on a slow machine
    # as on a fast one (a 9 s attempt of which startup took 8 s made CI requeue ten times; with
    # 0.2 min attempts a loaded machine's startups left none of them time to train)
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --requeue
        #SBATCH --open-mode=append
        eft-run --rdzv-backend etcd-v3 --rdzv-endpoint {etcd_server.endpoint} --rdzv-id "$SLURM_JOB_ID" \\
             --eft-exit-duration-mins 0.3 --nproc-per-node 2 {' '.join(loop(ckpt, 180, 0.1))} &
        TRAIN=$!; wait $TRAIN; status=$?
        echo "eft-run exit status $status (attempt ${{SLURM_RESTART_COUNT:-0}})"
        [ $status -eq 4 ] && scontrol requeue "$SLURM_JOB_ID"
        exit $status
        """))
    job = slurm_cluster.sbatch(script, output=out, chdir=tmp_path)
    done = slurm_cluster.wait(job, until=lambda j: j["JobState"] == "COMPLETED", timeout=400)
    log = text(out)
    stops = [int(s) for s in re.findall(r"stopped at step (\d+): exit_duration", log)]
    starts = [step for _, step in started_at(out)]
    assert len(stops) >= 1 and starts == [0, *stops], log[-3000:]  # each attempt went on from the last
    assert log.count("previous attempt ended; starting a new one") == len(stops)  # the run id reset each time
    assert int(done["Restarts"]) == len(stops) and latest(ckpt) == 180


def test_an_array_chains_each_task_saving_before_its_time_limit(slurm_cluster, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "array-%a.out"
    # each task trains until 0.75 min before its 1 min limit: about 15 s, startup included
    job = slurm_cluster.sbatch(ARRAY, "--eft-deadline-margin-mins", "0.75", "--nproc-per-node", "2",
                               *loop(ckpt, 100000), time="1", output=out, chdir=tmp_path)
    slurm_cluster.wait(job, until=lambda j: len(tasks_over(slurm_cluster, job)) == 3, timeout=400)
    outs = [tmp_path / f"array-{task}.out" for task in range(3)]
    stops = [int(re.search(r"stopped at step (\d+): deadline", text(o)).group(1)) for o in outs]
    assert [started_at(o)[0][1] for o in outs] == [0, *stops[:2]]  # each task starts where the last stopped
    assert stops[0] < stops[1] < stops[2] == latest(ckpt)
    assert all(f"exit status {int(ExitCode.REQUEUE)}, requeue to go on" in text(o) for o in outs)
    assert {t["ExitCode"] for t in tasks_over(slurm_cluster, job)} == {f"{int(ExitCode.REQUEUE)}:0"}


def tasks_over(cluster, job: str) -> list[dict]:
    return [t for t in cluster.jobs(job) if t["JobState"] in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED")]


def test_two_jobs_at_once_each_train_their_own_run(slurm_cluster, tmp_path):
    jobs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        jobs.append(submit_train(slurm_cluster, tmp_path / name, *loop(tmp_path / name / "ckpt", 150)))
    for job, out in jobs:
        done = slurm_cluster.wait(job, timeout=180)
        assert done["ExitCode"] == "0:0", text(out)[-3000:]
        assert started_at(out) == [(2, 0)] and latest(out.parent / "ckpt") == 150
        assert f"--rdzv-id slurm-{job}-r0" in text(out)
    assert jobs[0][0] != jobs[1][0]


def test_workers_see_their_own_rank_in_slurms_variables(slurm_cluster, tmp_path):
    probes = tmp_path / "env"
    probes.mkdir()
    job, out = submit_train(slurm_cluster, tmp_path, "--nproc-per-node", "2",
                            str(ROOT / "tests" / "workers" / "env_probe.py"), str(probes))
    assert slurm_cluster.wait(job, timeout=120)["ExitCode"] == "0:0", text(out)[-3000:]
    import json
    envs = [json.loads(p.read_text()) for p in sorted(probes.glob("env-*.json"))]
    assert len(envs) == 4
    for env in envs:
        assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NODEID"]) == \
            (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"])
        assert (env["SLURM_NTASKS"], env["SLURM_NNODES"], env["SLURM_NTASKS_PER_NODE"]) == ("4", "2", "2")
        assert "SLURM_GTIDS" not in env and env["SLURM_JOB_ID"] == job


def test_a_lost_node_leaves_the_other_training_at_the_new_size_and_the_finished_job_exits_0(
        slurm_cluster, tmp_path):
    """srun exits with its tasks' highest status: 137 for the killed one. The job exits with
    the training's outcome, recorded in etcd by the survivor that ran rank 0 to the end: 0.
    And the time limit was asked of squeue by one of the two agents, not by both."""
    ckpt = tmp_path / "ckpt"
    questions = counting_squeue(tmp_path)
    # srun starts the two agents up to seconds apart on a loaded machine: a last call longer than
    # the default 1 s lets the first round take both, as the first start below asserts.
    job, out = submit_train(slurm_cluster, tmp_path, "--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=5",
                            *loop(ckpt, 300), export=f"ALL,PATH={questions.parent}:{os.environ['PATH']}")
    wait_for(lambda: saves(out), 120, "the first save")
    killed = kill_node(slurm_cluster, job, "n2")
    assert killed, "no process of the job on n2"
    done = slurm_cluster.wait(job, timeout=240)
    starts = started_at(out)
    assert starts[0] == (2, 0) and starts[-1][0] == 1, text(out)[-3000:]
    assert starts[-1][1] == saves(out, attempt=0)[-1]  # the survivor resumed from the newest checkpoint
    assert latest(ckpt) == 300
    assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), text(out)[-3000:]
    assert job_status_line(out) == (0, 137)  # srun's: the killed task's
    assert len(questions.read_text().splitlines()) == 1, questions.read_text()


def test_a_job_without_progress_exits_3_though_a_lost_node_made_srun_say_otherwise(slurm_cluster, tmp_path):
    """Rank 1 dies at iteration 8 after every restart (the newest checkpoint is 5) and a
    node's task is killed on the way: the survivor's restart rule ends the job for no
    progress, and the job exits 3 (a person must look), not srun's status, and never 0."""
    (tmp_path / "out").mkdir()
    job, out = submit_train(slurm_cluster, tmp_path, "--nnodes", "1:2", "--nproc-per-node", "2",
                            "--max-restarts", "20", "--eft-inject", "rank_killed:1@8*", str(TOY), tmp_path / "out",
                            "--ckpt", tmp_path / "ckpt", "--iters", "100000", "--save-interval", "5")
    wait_for(lambda: worker_events(tmp_path / "out", "resume"), 120, "the first start")
    assert kill_node(slurm_cluster, job, "n2"), "no process of the job on n2"
    done = slurm_cluster.wait(job, timeout=300)
    log = text(out)
    assert "no progress in 3 restart cycles in a row" in log, log[-3000:]
    assert worker_events(tmp_path / "out", "resume")[-1]["world_size"] == 2  # the survivor alone
    assert (done["ExitCode"], done["Restarts"]) == (f"{int(ExitCode.NO_PROGRESS)}:0", "0"), log[-3000:]
    assert job_status_line(out) == (int(ExitCode.NO_PROGRESS), 137)  # srun's: the killed task's


def job_status_line(out: Path) -> tuple[int, int]:
    """(the job's exit status, srun's) from train.sbatch's last line."""
    found = re.findall(r"^job exit status (\d+) \(attempt \d+, srun's status (\d+)\)$", text(out), re.M)
    assert found, text(out)[-3000:]
    return int(found[-1][0]), int(found[-1][1])


def counting_squeue(tmp_path: Path) -> Path:
    """A ``squeue`` first on the job's PATH that notes each call in the file returned, then runs SLURM's."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "bin" / "squeue-calls"
    bin_dir.mkdir()
    wrapper = bin_dir / "squeue"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {shutil.which("squeue")} "$@"\n')
    wrapper.chmod(0o755)
    calls.touch()
    return calls


def kill_node(cluster, job: str, node: str) -> list[int]:
    """SIGKILL every process of ``job`` on ``node`` (its agent and workers): the node is gone.
    Job ids start at 1 in every cluster: another test run's cluster on this machine has a
    job of the same id, told apart by its SLURM_CONF."""
    mine = (f"SLURM_JOB_ID={job}".encode(), f"SLURMD_NODENAME={node}".encode(), f"SLURM_CONF={cluster.conf}".encode())
    killed = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if all(mark in env for mark in mine):
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except ProcessLookupError:
                pass
    return killed


def test_eft_run_under_the_batch_shell_warns_that_batch_signals_miss_it(slurm_cluster, tmp_path):
    out = tmp_path / "noexec.out"
    script = tmp_path / "noexec.sbatch"
    script.write_text(f"#!/bin/bash\neft-run --standalone {' '.join(loop(tmp_path / 'ckpt', 3))}\n")
    slurm_cluster.wait(slurm_cluster.sbatch(script, output=out, chdir=tmp_path), timeout=120)
    # (not the exit status: gloo's teardown in a one-rank job aborts now and then, a torch matter)
    assert "eft-run runs under the batch shell (no `exec`)" in text(out) and started_at(out) == [(1, 0)], text(out)
