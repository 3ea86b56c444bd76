"""No orphans (issue 15, item 3): a worker does not outlive its agent, even a SIGKILLed one.

The shim (elasticft/pdeathsig_exec.py) is tested under a stand-in agent, then end
to end under eft-run. A worker counts as gone once it has exited: a zombie waiting for
a reaper holds no GPU and no port.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec

from bench.launch import WORKERS, agent_of, read_jsonl, wait_for
from elasticft.agent.orphans import SHIM, guarded_command, workers_die_with_agent

# The requirement: no worker outlives its agent by more than a second or two.
OUTLIVE_LIMIT = 2.0

# A stand-in agent: starts one worker as torch does (Popen, a session of its own), through
# the shim when given its command prefix (JSON; the agent's own pid goes after it), prints
# the worker's pid and waits to be killed.
STAND_IN_AGENT = """
import json, os, subprocess, sys, time
prefix, program = json.loads(sys.argv[1]), sys.argv[2:]
command = [*prefix, str(os.getpid()), *program] if prefix else program
worker = subprocess.Popen(command, start_new_session=True)
print(worker.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def seconds_until_gone(pids: list[int], limit: float) -> float | None:
    """How long until every pid has exited (polled); None if one still runs after ``limit``."""
    start = time.monotonic()
    while not all(gone(pid) for pid in pids):
        if time.monotonic() - start > limit:
            return None
        time.sleep(0.02)
    return time.monotonic() - start


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def shim_prefix() -> list[str]:
    """The agent's command up to the agent pid: interpreter, its flags, the shim."""
    entrypoint, args = guarded_command("PROGRAM", (), 0)
    return [entrypoint, *args[:-2]]


def stand_in_agent(*program: str, guarded: bool = True) -> tuple[subprocess.Popen, int]:
    """A stand-in agent running ``program`` as its worker; returns it and the worker's pid."""
    agent = subprocess.Popen([sys.executable, "-c", STAND_IN_AGENT, json.dumps(shim_prefix() if guarded else []),
                              *program], stdout=subprocess.PIPE, text=True)
    return agent, int(agent.stdout.readline())


def test_a_guarded_worker_dies_with_its_sigkilled_agent():
    agent, worker = stand_in_agent("sleep", "600")
    try:
        wait_for(lambda: psutil.Process(worker).name() == "sleep", 10, "the shim to exec the worker")
        assert psutil.Process(worker).ppid() == agent.pid  # the pid the agent tracks is the worker's
        agent.kill()
        agent.wait()
        assert seconds_until_gone([worker], OUTLIVE_LIMIT) is not None, "the worker outlived its agent"
    finally:
        agent.kill()
        kill_all([worker])


def test_the_shim_does_not_run_the_worker_once_its_agent_is_gone():
    """The agent died between fork and prctl: its pid is no longer the shim's parent."""
    marker = f"/tmp/eft-orphan-{os.getpid()}"
    result = subprocess.run([*shim_prefix(), "1", "touch", marker], timeout=30, check=False)
    assert result.returncode == -signal.SIGKILL
    assert not os.path.exists(marker)


def test_the_worker_gets_the_same_argv_environment_and_signals():
    """What the worker sees through the shim is what it sees without: argv, the whole
    environment (the shim's interpreter adds LC_CTYPE under the C locale: not passed on),
    its ignored signals."""
    # Not Python: a Python probe would add LC_CTYPE itself and hide the shim's.
    probe = 'printf "<%s>\\n" "$0" "$@"; env | sort; grep SigIgn /proc/$$/status'
    program = ["sh", "-c", probe, "argv0", "an arg", "--flag=${x}"]
    env = {"PATH": os.environ["PATH"], "LANG": "C", "EFT_PROBE": "é"}
    direct = subprocess.run(program, env=env, capture_output=True, text=True, check=True).stdout
    shimmed = subprocess.run([*shim_prefix(), str(os.getpid()), *program], env=env, capture_output=True, text=True,
                             check=True).stdout
    assert "<an arg>" in direct and "EFT_PROBE=é" in direct
    assert shimmed == direct


def test_a_missing_program_is_status_127_with_its_name():
    result = subprocess.run([*shim_prefix(), str(os.getpid()), "no-such-program-eft"], check=False,
                            capture_output=True, text=True)
    assert result.returncode == 127 and "no-such-program-eft" in result.stderr


def test_the_shim_goes_in_front_for_one_start_and_no_longer():
    spec = WorkerSpec(role="r", local_world_size=1, rdzv_handler=None, entrypoint=sys.executable, args=("-u", "x"))
    with workers_die_with_agent(spec, enabled=True):
        assert spec.entrypoint == sys.executable
        assert spec.args[-3:] == (sys.executable, "-u", "x") and str(SHIM) in spec.args
        assert str(os.getpid()) in spec.args
    assert (spec.entrypoint, spec.args) == (sys.executable, ("-u", "x"))
    with workers_die_with_agent(spec, enabled=False):
        assert spec.args == ("-u", "x")
    missing = WorkerSpec(role="r", local_world_size=1, rdzv_handler=None, entrypoint="no-such-program-eft", args=())
    with workers_die_with_agent(missing, enabled=True):  # torch's own error, as under torchrun
        assert missing.entrypoint == "no-such-program-eft"


def test_workers_die_within_seconds_of_a_sigkilled_eft_run(tmp_path, eft_job):
    """SIGKILL eft-run's agent alone: both its workers are gone within OUTLIVE_LIMIT.
    (Without the shim, ``EFT_DIE_WITH_AGENT=0``, they go on all-reducing with each other.)"""
    out = tmp_path / "out"
    out.mkdir()
    node = eft_job("allreduce_loop.py", out, nproc=2)
    starts = wait_for(lambda: len(read_jsonl(out / "starts.jsonl")) == 2 and read_jsonl(out / "starts.jsonl"),
                      90, "both workers to start")
    workers = [start["pid"] for start in starts]
    try:
        for pid in workers:
            # The script runs in the process torch started (and tracks), with torchrun's argv.
            assert agent_of(pid) == node.proc.pid
            worker = psutil.Process(pid)
            assert worker.cmdline()[1:] == ["-u", str(WORKERS / "allreduce_loop.py"), str(out)]
            assert worker.exe() == psutil.Process(node.proc.pid).exe()  # the agent's Python
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait()
        outlived = seconds_until_gone(workers, OUTLIVE_LIMIT)
        assert outlived is not None, f"workers {workers} outlived their agent by more than {OUTLIVE_LIMIT:g} s"
        print(f"workers gone {outlived:.3f} s after the agent's SIGKILL")
    finally:
        kill_all(workers)


def test_what_a_worker_started_ends_at_its_restart_and_at_the_jobs_end(tmp_path, eft_job):
    """A helper a worker leaves in its session (a torch_dist save's spawn helpers) does not
    outlive the worker's generation: not the restart after its crash, not the job's end."""
    out = tmp_path / "out"
    out.mkdir()
    node = eft_job("leaves_helper.py", out, eft_flags=["--max-restarts", "1"])
    assert node.wait(120) == 0, node.output()[-2000:]
    assert json.loads((out / "seen-1").read_text()) == {"helper_0_alive": False}
    last = int((out / "helper-1").read_text())
    wait_for(lambda: gone(last), OUTLIVE_LIMIT, "the last generation's helper to end with the job")
