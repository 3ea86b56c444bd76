"""Emergency checkpoints end to end: eft-run, the relay, the worker hook, eft ckpt."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.launch import wait_for, worker_events
from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.agent.events import EventLog
from elasticft.contract.exit_codes import ExitCode

pytestmark = pytest.mark.slow

RANKS = 4


@pytest.fixture
def start_job(eft_job):
    """``start_job(tmp, *eft_flags, ...)``: toy_train.py on RANKS ranks, writing under ``tmp``."""
    def start(tmp: Path, *extra: str, iters: int = 100000, save_interval: int = 0, save_delay: float = 0.0,
              run_id: str | None = None):
        (tmp / "out").mkdir(exist_ok=True)
        return eft_job("toy_train.py", tmp / "out", "--ckpt", tmp / "ckpt", "--iters", iters,
                       "--save-interval", save_interval, "--save-delay", save_delay,
                       nproc=RANKS, eft_flags=extra, run_id=run_id)

    return start


def wait_started(out: Path) -> None:
    wait_for(lambda: len(worker_events(out, "resume")) >= RANKS, 120, f"{RANKS} ranks to start")


def saves_at(out: Path, count: int) -> list[dict]:
    """The ``count``-th save of every rank, once all ranks have made it."""
    def ready():
        saves = worker_events(out, "save")
        per_rank = {r: [s for s in saves if s["rank"] == r] for r in range(RANKS)}
        return [per_rank[r][count - 1] for r in range(RANKS)] if all(len(v) >= count for v in per_rank.values()) else None

    return wait_for(ready, 60, f"save number {count} on every rank")


def eft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.seam
def test_manual_save_then_stop(tmp_path, start_job, etcd_server, run_keys):
    out = tmp_path / "out"
    job = start_job(tmp_path)
    wait_started(out)
    where = ["--endpoint", etcd_server.endpoint, "--run-id", run_keys.run_id]
    assert eft("ckpt", "save", *where).returncode == 0
    first = saves_at(out, 1)
    assert len({s["iteration"] for s in first}) == 1, first  # every rank saved the same iteration
    status = json.loads(eft("ckpt", "status", *where, "--json").stdout)
    # from the request's creation in etcd (the command's own start, seconds on a loaded machine, aside)
    assert max(s["time"] for s in first) - status["request"]["time"] < 5
    assert status["latest"]["iteration"] == first[0]["iteration"]
    assert status["acks"][0]["request_id"] == status["request"]["id"] == first[0]["request_id"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(first[0]["iteration"])

    assert eft("ckpt", "stop", *where).returncode == 0
    assert job.wait(60) == 0, job.output()
    second = saves_at(out, 2)
    exits = worker_events(out, "exit")
    assert len({s["iteration"] for s in second}) == 1 and len(exits) == RANKS
    assert second[0]["iteration"] > first[0]["iteration"]  # training went on in between
    assert len(worker_events(out, "resume")) == RANKS  # and the agent did not restart it


def test_concurrent_risk_requests_make_one_save_and_the_gap_filters_a_late_one(tmp_path, start_job, etcd, run_keys):
    out = tmp_path / "out"
    start_job(tmp_path, save_interval=1000)
    wait_started(out)
    agents = [CheckpointProtocol(etcd, run_keys, f"node{i}") for i in range(2)]
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=lambda a=a: (barrier.wait(), a.request("risk", a.events._source, risk=1.0)))
               for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saves_at(out, 1)  # nothing saved before: the gap rule lets it through
    wait_for(lambda: etcd.get(run_keys.ckpt_latest), 10, "the ack")
    # A second risk request right after that save is inside the gap (0.25 * 1000).
    late, _ = agents[0].request("risk", "node0/gpu1", risk=1.0)
    log = EventLog(etcd, run_keys, "test")
    filtered = wait_for(lambda: [e for e in log.read() if e["kind"] == "ckpt_filtered"], 30, "the filtered event")
    assert filtered[0]["request_id"] == late.id and "gap" in filtered[0]["why"]
    manual, _ = agents[1].request("manual", "operator")
    second = saves_at(out, 2)
    assert second[0]["request_id"] == manual.id
    assert len(worker_events(out, "save")) == 2 * RANKS  # one save for the two risk requests, none for the late one


def test_kill_switch_saves_and_exits_and_at_start_exits_at_once(tmp_path, start_job, run_keys):
    out = tmp_path / "out"
    switch = tmp_path / "STOP"
    job = start_job(tmp_path, "--eft-kill-switch", switch)
    wait_started(out)
    switch.touch()
    assert job.wait(60) == 0, job.output()
    saves = saves_at(out, 1)
    assert len({s["iteration"] for s in saves}) == 1 and len(worker_events(out, "exit")) == RANKS
    assert len(worker_events(out, "resume")) == RANKS

    again = tmp_path / "again"
    again.mkdir()
    started = time.monotonic()
    # A new job (the first one's run is over) started with the switch still there.
    job = start_job(again, "--eft-kill-switch", switch, run_id=run_keys.run_id + "-again")
    assert job.wait(60) == 0
    assert time.monotonic() - started < 30
    assert not (again / "out" / "events.jsonl").exists()


@pytest.mark.seam
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_to_eft_run_saves_and_exits_within_the_grace(tmp_path, start_job, sig):
    out = tmp_path / "out"
    job = start_job(tmp_path, "--eft-shutdown-grace", "60")
    wait_started(out)
    signalled = time.monotonic()
    job.proc.send_signal(sig)
    code = job.wait(90)
    assert time.monotonic() - signalled < 60
    saves = saves_at(out, 1)
    assert len({s["iteration"] for s in saves}) == 1
    assert len(worker_events(out, "exit")) == RANKS
    # SIGUSR1 is a warning the agent forwards; SIGTERM stops the agent itself (torch's
    # behaviour). Either way the workers saved first: "requeue me", not "finished".
    assert code == ExitCode.REQUEUE, job.output()
    assert f"exit status {int(ExitCode.REQUEUE)}, requeue to go on" in job.output()


def test_signal_mode_turns_a_request_into_sigterm_and_restarts_the_workers(tmp_path, eft_job, etcd_server, run_keys):
    out = tmp_path / "out"
    out.mkdir()
    job = eft_job("toy_train.py", out, "--ckpt", tmp_path / "ckpt", "--iters", "100000", "--exit-signal-handler",
                  nproc=2, eft_flags=["--eft-ckpt-mode", "signal"])
    wait_for(lambda: len(worker_events(out, "resume")) >= 2, 120, "2 ranks to start")
    assert eft("ckpt", "save", "--endpoint", etcd_server.endpoint, "--run-id", run_keys.run_id).returncode == 0
    saved = wait_for(lambda: worker_events(out, "save")[:2] if len(worker_events(out, "save")) >= 2 else None,
                     60, "both ranks to save on SIGTERM")
    assert len({s["iteration"] for s in saved}) == 1
    resumed = wait_for(lambda: worker_events(out, "resume")[2:] if len(worker_events(out, "resume")) >= 4 else None,
                       120, "the agent to restart the workers")
    assert {r["iteration"] for r in resumed} == {saved[0]["iteration"]}
    assert job.proc.poll() is None  # still training


def test_rank0_killed_mid_save_leaves_latest_at_the_previous_checkpoint(tmp_path, start_job):
    out = tmp_path / "out"
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    job = start_job(tmp_path, "--max-restarts", "1", save_interval=5, save_delay=3.0, iters=12)
    wait_started(out)
    wait_for(lambda: tracker.exists(), 60, "the first complete checkpoint")
    assert tracker.read_text().strip() == "5"
    second = tmp_path / "ckpt" / "iter_0000010"
    wait_for(lambda: len(list(second.glob("rank*.pt"))) == RANKS, 60, "every rank's shard of iteration 10")
    rank0 = next(e["pid"] for e in worker_events(out, "resume") if e["rank"] == 0)
    os.kill(rank0, signal.SIGKILL)  # rank 0 is stalled before committing iteration 10
    assert tracker.read_text().strip() == "5"
    resumed = wait_for(lambda: [e for e in worker_events(out, "resume")[RANKS:]], 120, "the restarted ranks")
    assert {e["iteration"] for e in resumed} == {5}
    assert job.wait(120) == 0, job.output()
