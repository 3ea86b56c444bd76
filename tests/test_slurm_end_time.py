"""One squeue per job, not per agent (launcher/slurm_end_time.py): agents of one SLURM
attempt share the time limit through the session's real etcd. ``squeue`` is a real script
first on PATH that notes each call in a file (this machine's SLURM is test_slurm.py's)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.launch import ROOT, wait_for
from elasticft.slurm.job import SlurmJob
from elasticft.store import StoreOptions, connect
from launcher.slurm_end_time import shared_end_time

pytestmark = pytest.mark.timeout(120)

END = "2031-05-06T07:08:09"  # what squeue prints: local time
JOB = SlurmJob.from_environ({"SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "1"})


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """``squeue(body)``: a squeue on PATH that notes its call in the file returned, then runs ``body``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def make(body: str) -> Path:
        calls = tmp_path / "squeue-calls"
        calls.touch()
        (bin_dir / "squeue").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n{body}\n')
        (bin_dir / "squeue").chmod(0o755)
        return calls

    return make


def ask_together(endpoint: str, keys, agents: int, wait: float) -> list:
    """``shared_end_time`` from ``agents`` threads at once, each with its own etcd client."""
    answers = [None] * agents
    start = threading.Barrier(agents)

    def agent(i: int) -> None:
        start.wait()
        answers[i] = shared_end_time(JOB, StoreOptions(endpoint), keys, wait, me=f"agent{i}")

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_six_agents_ask_squeue_once_and_all_get_its_time_limit(etcd_server, run_keys, squeue):
    calls = squeue(f"echo {END}")
    answers = ask_together(etcd_server.endpoint, run_keys, agents=6, wait=60)
    assert answers == [time.mktime(time.strptime(END, "%Y-%m-%dT%H:%M:%S"))] * 6
    assert calls.read_text().splitlines() == ["-h -o %e -j 812"]


def test_a_squeue_that_fails_is_asked_once_and_everyone_goes_on_without_a_limit(etcd_server, run_keys, squeue):
    calls = squeue("echo 'squeue: error: Unable to contact slurm controller' >&2; exit 1")
    started = time.monotonic()
    assert ask_together(etcd_server.endpoint, run_keys, agents=4, wait=60) == [None] * 4
    assert len(calls.read_text().splitlines()) == 1 and time.monotonic() - started < 30  # no one waited the bound


def test_the_asker_killed_in_squeue_leaves_the_others_waiting_only_their_bound(etcd_server, etcd, run_keys, squeue,
                                                                              caplog):
    """A real agent process claims the question and is killed while squeue hangs: the next
    agent waits --eft-slurm-end-time-wait (here 2 s), warns, and goes on without a limit."""
    calls = squeue("exec sleep 3600")  # a controller that never answers
    code = ("import sys; from elasticft.slurm.job import SlurmJob; from elasticft.contract.keys import RunKeys; "
            "from elasticft.store import StoreOptions; from launcher.slurm_end_time import shared_end_time; "
            f"shared_end_time(SlurmJob.from_environ({{'SLURM_JOB_ID': '812', 'SLURM_RESTART_COUNT': '1'}}), "
            f"StoreOptions(sys.argv[1]), RunKeys(sys.argv[2]), 60, me='doomed')")
    asker = subprocess.Popen([sys.executable, "-c", code, etcd_server.endpoint, run_keys.run_id], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        wait_for(calls.read_text, 60, "the asker's squeue")
    finally:
        os.killpg(asker.pid, signal.SIGKILL)  # the agent and its squeue
        asker.wait(30)
    assert etcd.get(run_keys.slurm_end_time_asker(JOB.attempt)).value == b"doomed"
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="elasticft"):
        assert shared_end_time(JOB, StoreOptions(etcd_server.endpoint), run_keys, 2.0, me="survivor") is None
    assert 2.0 <= time.monotonic() - started < 30
    assert "did not answer within --eft-slurm-end-time-wait 2 s" in caplog.text
    assert len(calls.read_text().splitlines()) == 1  # the survivor did not ask as well


def test_the_end_time_slurm_sets_needs_neither_etcd_nor_squeue(squeue):
    calls = squeue(f"echo {END}")
    job = SlurmJob.from_environ({"SLURM_JOB_ID": "812", "SLURM_JOB_END_TIME": "1800000000"})
    assert shared_end_time(job, StoreOptions("127.0.0.1:1"), None, 60) == 1_800_000_000
    assert calls.read_text() == ""


def test_an_etcd_that_never_answers_costs_the_bound_then_this_agent_asks_itself(squeue, run_keys):
    calls = squeue(f"echo {END}")
    started = time.monotonic()
    assert shared_end_time(JOB, StoreOptions("127.0.0.1:1", timeout=1), run_keys, 1.5) is not None
    assert time.monotonic() - started < 30 and len(calls.read_text().splitlines()) == 1


def test_a_requeued_attempt_asks_again_under_the_same_run_id(etcd_server, run_keys, squeue):
    calls = squeue(f"echo {END}")
    client = connect(StoreOptions(etcd_server.endpoint))
    try:
        for restart in ("1", "2"):
            job = SlurmJob.from_environ({"SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": restart})
            assert shared_end_time(job, StoreOptions(etcd_server.endpoint), run_keys, 60) is not None
            assert client.get(run_keys.slurm_end_time(job.attempt)) is not None
    finally:
        client.close()
    assert len(calls.read_text().splitlines()) == 2


@pytest.mark.parametrize("flag, env, needle", [
    (["--eft-slurm-end-time-wait", "-1"], {}, "--eft-slurm-end-time-wait: expected >= 0, got -1.0"),
    ([], {"EFT_SLURM_END_TIME_WAIT": "soon"}, "EFT_SLURM_END_TIME_WAIT: expected float, got 'soon'"),
])
def test_a_bad_wait_costs_one_line_naming_it(flag, env, needle):
    done = subprocess.run(["eft-run", *flag, "--standalone", "train.py"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 2 and done.stderr.strip() == f"eft-run: error: {needle}", done.stderr
