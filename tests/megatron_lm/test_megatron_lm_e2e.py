"""An unmodified Megatron-LM script (pretrain_gpt.py's shape, megatron.training's own loop) under
eft-run: eft's saves are Megatron's saves, its exits eft's exit codes, its hangs eft's restarts;
under plain torchrun the same script trains as if eft did not exist.

Real parts: Megatron-LM's loop, torch_dist checkpoints, gloo ranks, an embedded etcd; the
CPU emulation (cpu_emulation.py) stands in for the GPU alone.

``every_minor``: the cases CI runs on every tested megatron-core minor (0.17 and 0.18 run only
those, ``-m every_minor``): a checkpoint request answered by Megatron's save, and a rank hung
inside a step, killed, and resumed from the memory tier through Megatron's load.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.launch import Launched, wait_for
from bench.megatron_lm import ENV, MODEL
from elasticft.contract.checkpoints import COMPLETE_MARKER, TRACKER, iteration_of

# Longer than the longest wait below (tests/test_waits.py): a late job fails with its own message.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).with_name("pretrain_gpt.py")
EFT_RUN = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", "--eft-health-source", "none"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# The agent's line at a restart: where the workers resumed from, and what they re-do.
RESUMED = re.compile(r"workers resumed from iteration (\w+) \((\w+)\); (\d+) iteration\(s\) re-done")
# Megatron's own log line of one iteration: its number and the step's gradient norm.
ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\| grad norm: ([0-9.]+) \|")


def start(tmp_path: Path, launcher: list[str], *args, name: str, env: dict | None = None) -> Launched:
    """The script under ``launcher``; every process of the job carries ``tmp_path`` in EFT_TEST_JOB."""
    return Launched([*launcher, str(SCRIPT), *MODEL, *map(str, args)], tmp_path / f"{name}.log",
                    env={**ENV, "EFT_TEST_JOB": str(tmp_path), **(env or {})})


def grad_norms(log: str) -> dict[int, float]:
    """Iteration -> grad norm, as Megatron logged them (a later generation's line wins)."""
    return {int(m.group(1)): float(m.group(2)) for m in ITERATION.finditer(log)}


def tensor_parallel_sizes(log: str) -> list[int]:
    """TP of each generation, from Megatron's own dump of its arguments (rank 0's)."""
    return [int(tp) for tp in re.findall(r"^\s*tensor_model_parallel_size \.+ (\d+)$", log, re.MULTILINE)]


def newest(job: Launched) -> int:
    return max(grad_norms(job.output()), default=0)


def complete(root: Path) -> list[int]:
    """The iterations of root whose save eft marked complete."""
    return sorted(i for p in root.glob("iter_*") if (i := iteration_of(p.name)) and (p / COMPLETE_MARKER).exists())


def leftovers(tmp_path: Path) -> list[str]:
    """The processes of the job started in ``tmp_path`` still alive (workers, their helpers)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.environ().get("EFT_TEST_JOB") == str(tmp_path):
                found.append(f"{process.pid} {' '.join(process.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def kill_leftovers(tmp_path: Path) -> None:
    """End the processes of the job started in ``tmp_path`` still alive."""
    for line in leftovers(tmp_path):
        try:
            psutil.Process(int(line.split()[0])).kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The script under plain torchrun: its grad norms are what eft's runs must reproduce."""
    tmp_path = tmp_path_factory.mktemp("plain")
    ckpt = tmp_path / "ckpt"
    job = start(tmp_path, TORCHRUN, "--train-iters", "4", "--save", ckpt, "--save-interval", "2", name="torchrun")
    assert job.wait(240) == 0, job.output()[-3000:]
    kill_leftovers(tmp_path)  # torchrun leaves the save's spawn helpers behind: not on this machine
    return job.output(), ckpt


def test_under_plain_torchrun_the_script_trains_as_if_eft_did_not_exist(plain):
    log, ckpt = plain
    assert sorted(grad_norms(log)) == [1, 2, 3, 4]
    assert "eft is in Megatron-LM's training loop" not in log
    assert (ckpt / TRACKER).read_text().strip() == "4"
    assert sorted(iteration_of(p.name) for p in ckpt.glob("iter_*")) == [2, 4]
    assert complete(ckpt) == []  # nobody but eft writes the marker


@pytest.mark.every_minor
def test_eft_ckpt_save_saves_through_megatron_and_the_job_goes_on_then_the_kill_switch_stops_it(tmp_path, plain):
    """`eft ckpt save`: every rank saves one iteration through Megatron's save, marked complete,
    and training goes on with plain torchrun's numbers; the kill switch: save, exit 0."""
    ckpt, stop_now = tmp_path / "ckpt", tmp_path / "stop-now"
    job = start(tmp_path, [*EFT_RUN, "--eft-kill-switch", stop_now],
                "--train-iters", "500", "--save", ckpt, "--save-interval", "1000", name="ckpt-save")
    wait_for(lambda: newest(job) >= 2 or job.proc.poll() is not None, 240, "iteration 2")
    endpoint, run_id = re.search(r"embedded etcd on (\S+) \(run id (\S+)\)", job.output()).groups()
    asked = subprocess.run([sys.executable, "-m", "launcher.cli", "ckpt", "save", "--endpoint", endpoint,
                            "--run-id", run_id], capture_output=True, text=True, timeout=60)
    assert asked.returncode == 0, asked.stderr
    (saved,) = wait_for(lambda: complete(ckpt), 120, "the requested checkpoint")
    wait_for(lambda: newest(job) >= saved + 2, 120, "training past the save")
    stop_now.touch()
    assert job.wait(120) == 0, job.output()[-3000:]
    log = job.output()
    last = newest(job)
    assert complete(ckpt) == [saved, last] and (ckpt / TRACKER).read_text().strip() == str(last)
    assert re.search(rf"checkpoint of iteration {saved} complete at .*iter_{saved:07d}", log)  # the agent's ack
    assert "eft: megatron-core's dataset helper is already compiled (helpers_cpp); not running make" in log
    norms, expected = grad_norms(log), grad_norms(plain[0])
    assert [round(norms[i], 3) for i in expected] == [round(expected[i], 3) for i in expected]
    assert leftovers(tmp_path) == []


def test_sigusr1_saves_one_iteration_and_exits_4_and_the_requeue_on_one_gpu_goes_on_at_tp1(tmp_path):
    """SIGUSR1 (SLURM's warning before the time limit): every rank saves the same iteration and
    eft-run exits 4 for a requeue. The requeued job gets one GPU: eft re-plans the TP2 layout to
    TP1, and Megatron's load reshards the checkpoint onto it, its distributed optimizer's state
    included (saved fully reshardable), and training goes on from the saved iteration."""
    ckpt = tmp_path / "ckpt"
    tp2 = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
           "--save", ckpt, "--load", ckpt, "--save-interval", "1000"]
    job = start(tmp_path, EFT_RUN, "--train-iters", "500", *tp2, name="usr1")
    wait_for(lambda: newest(job) >= 2 or job.proc.poll() is not None, 240, "iteration 2")
    assert len(leftovers(tmp_path)) >= 3  # eft-run and its two ranks: what the check below must not find
    os.kill(job.proc.pid, signal.SIGUSR1)
    assert job.wait(120) == 4, job.output()[-3000:]
    (saved,) = complete(ckpt)
    assert (ckpt / TRACKER).read_text().strip() == str(saved) and saved == newest(job)
    assert "the workers saved and stopped (signal): exit status 4, requeue to go on" in job.output()
    assert tensor_parallel_sizes(job.output()) == [2]
    assert leftovers(tmp_path) == []
    one_gpu = [*EFT_RUN]
    one_gpu[one_gpu.index("--nproc-per-node") + 1] = "1"
    stop_now = tmp_path / "stop-now"
    requeued = start(tmp_path, [*one_gpu, "--eft-kill-switch", stop_now], "--train-iters", "500", *tp2,
                     name="requeued")
    wait_for(lambda: newest(requeued) >= saved + 2 or requeued.proc.poll() is not None, 240, "2 iterations more")
    stop_now.touch()
    assert requeued.wait(120) == 0, requeued.output()[-3000:]
    log = requeued.output()
    assert tensor_parallel_sizes(log) == [1]
    assert re.search(rf"successfully loaded checkpoint from \S+/ckpt .*at iteration {saved}\b", log), log[-3000:]
    assert min(grad_norms(log)) == saved + 1 and complete(ckpt)[-1] == newest(requeued)
    assert leftovers(tmp_path) == []


@pytest.mark.every_minor
def test_an_ft_launcher_command_line_runs_with_its_section_timeouts_in_force(tmp_path, plain):
    """ft_launcher's flags and Megatron's --enable-ft-package, only the launcher renamed (the
    memory tier on through its EFT_* variable): a rank hung inside a step is caught by
    ft_launcher's step timeout, its stacks are logged, and the job resumes from the newest tier
    (memory, newer than the last disk save) with an uninterrupted run's numbers."""
    ckpt = tmp_path / "ckpt"
    ft_launcher = ["--ft-param-rank_section_timeouts=setup:600,step:10,checkpointing:420",
                   "--ft-param-rank_out_of_section_timeout=300", "--max-restarts", "1"]
    job = start(tmp_path, [*EFT_RUN, *ft_launcher, "--eft-inject", "rank_hung:1@5"],
                "--train-iters", "6", "--save", ckpt, "--save-interval", "3", "--load", ckpt,
                "--enable-ft-package", name="hang", env={"EFT_MEM_CKPT_INTERVAL": "1"})
    assert job.wait(300) == 0, job.output()[-3000:]
    log = job.output()
    assert "eft: --enable-ft-package: eft times Megatron's sections in place of NVRx's rank monitor" in log
    # The heartbeat is rewritten at most every 50 ms: at this model's 40 ms steps it may still name iteration 4.
    assert re.search(r"hang: rank 1 .*section 'step' for [0-9.]+ s, after iteration [45] \(timeout 10 s\)", log)
    assert re.search(r"stacks of rank 1 \(pid \d+\)|prints its stacks", log)
    assert "forward_backward_no_pipelining" in log  # hung inside the step: Megatron's schedule in its stack
    # Disk holds iteration 3; a snapshot waits while the last one is written, so memory holds 4 or 5.
    ((resumed, source, redone),) = RESUMED.findall(log)
    assert source == "memory" and int(resumed) in (4, 5) and int(redone) == 5 - int(resumed)
    assert complete(ckpt)[-1] == 6
    norms, expected = grad_norms(log), grad_norms(plain[0])
    assert [round(norms[i], 3) for i in expected] == [round(expected[i], 3) for i in expected]
    assert leftovers(tmp_path) == []


def test_a_nan_that_megatron_catches_is_rolled_back_re_run_and_the_job_finishes(tmp_path, plain):
    """A NaN injected once into a step's loss: Megatron's rerun state machine (on by default)
    re-runs the step in place, finds it not reproducible and exits asking to be resumed (17 from
    an in-place re-run, 16 after its own save); eft reads either as bad numbers, rolls back
    (uncharged: --max-restarts 0), the re-run is a transient fault, and the step's numbers are
    the uninterrupted run's. With Megatron's distributed optimizer, as production jobs run (two
    data-parallel ranks, each holding half of Adam's state; the rollback loads it back): its
    numbers are plain torchrun's with torch's Adam (the next case rolls back with torch's Adam)."""
    ckpt = tmp_path / "ckpt"
    job = start(tmp_path, [*EFT_RUN, "--eft-inject", "nan:0@3"], "--train-iters", "4", "--save", ckpt,
                "--save-interval", "2", "--load", ckpt, "--use-distributed-optimizer", name="nan")
    assert job.wait(300) == 0, job.output()[-3000:]
    log = job.output()
    assert re.search(r"iteration 3: Megatron's rerun state machine exits 1[67]; eft rolls back and re-runs it", log)
    assert "iteration 3 re-run is good: a transient fault" in log
    assert re.search(r"restart cycle of round \d+ \(rollback\)", log), log[-3000:]
    assert complete(ckpt)[-1] == 4
    norms, expected = grad_norms(log), grad_norms(plain[0])
    assert [round(norms[i], 3) for i in expected] == [round(expected[i], 3) for i in expected]
    assert leftovers(tmp_path) == []


def test_a_batch_that_fails_again_ends_in_megatron_exit_16_and_the_job_restarts_as_asked_and_finishes(tmp_path):
    """A NaN every time iteration 3's batch runs on rank 0 (--eft-inject poison): Megatron's
    rerun state machine re-runs the step in place, gets the NaN again, saves and exits 16
    ("resume to disambiguate"). eft restarts the workers from that state, uncharged; the same
    NaN at the same iteration again is bad data, so eft has Megatron skip that batch and the job
    finishes, never a crash loop."""
    ckpt = tmp_path / "ckpt"
    job = start(tmp_path, [*EFT_RUN, "--eft-inject", "poison:0@3"],
                "--train-iters", "5", "--save", ckpt, "--save-interval", "100", "--load", ckpt, name="exit16")
    assert job.wait(300) == 0, job.output()[-3000:]
    log = job.output()
    assert re.search(r"iteration 3: Megatron's rerun state machine exits 16; eft rolls back and re-runs it", log)
    assert re.search(r"successfully saved checkpoint from iteration\s+2 ", log)  # Megatron's save before its 16
    assert "loaded in state WILL_RERUN_FROM_CHECKPOINT; eft's numbers check re-runs the iteration" in log
    assert [r[0] for r in RESUMED.findall(log)] == ["2", "2"]  # where Megatron asked: the state before the step
    # eft's verdicts: the first NaN is unexplained, the same NaN on the re-run is the data's.
    assert re.findall(r"iteration 3: nan .*: rolling back \((\w+)\)", log) == ["unknown", "data"]
    assert re.search(r"iteration\s+4/\s*5 \| consumed samples:\s+16 \| skipped samples:\s+4 ", log)
    assert complete(ckpt)[-1] == 5 and newest(job) == 5
    assert leftovers(tmp_path) == []


def test_a_slow_rank_is_reported_as_the_straggler_and_its_peers_are_not(tmp_path):
    """Rank 1's every micro batch is 0.1 s slower. Its peer waits for it in the gradient
    all-reduce, so both ranks' wall step times are alike; the straggler check compares each
    rank's own work (Megatron's forward_step and backward_step), which names rank 1 alone.
    The relative score is what this test is about: on a shared 2-core machine a rank's own work
    time swings by half with the load, which the individual score (a rank against its own best,
    for a job-wide slowdown) would report, so that threshold is set out of the way."""
    job = Launched([*EFT_RUN, "--eft-straggler-interval", "2", "--eft-straggler-individual", "0.2", str(SCRIPT),
                    *MODEL, "--train-iters", "40"],
                   tmp_path / "job.log", env={**ENV, "EFT_TEST_JOB": str(tmp_path), "EFT_TEST_SLOW": "1:0.1"})
    try:
        assert job.wait(300) == 0, job.output()[-3000:]
        log = job.output()
    finally:
        job.stop()
    flagged = re.findall(r"rank (\d+) \(\S+, GPU \d+\) is a straggler: step ([0-9.]+) s vs the job's median", log)
    assert flagged and {rank for rank, _ in flagged} == {"1"}, log[-3000:]
    assert float(flagged[0][1]) >= 0.2  # its own work: two micro batches of at least 0.1 s each
