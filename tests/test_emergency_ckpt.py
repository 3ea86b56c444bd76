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

from bench.launch import WORKERS, Launched, eft_run, read_jsonl, wait_for
from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.agent.events import EventLog
from elasticft.store import RunKeys, StoreOptions, connect

pytestmark = pytest.mark.slow

RANKS = 4


def start_job(tmp: Path, *extra: str, iters: int = 100000, save_interval: int = 0, save_delay: float = 0.0) -> Launched:
    (tmp / "out").mkdir(exist_ok=True)
    cmd = [*eft_run(), "--standalone", "--nproc-per-node", str(RANKS), *extra,
           str(WORKERS / "toy_train.py"), str(tmp / "out"), "--ckpt", str(tmp / "ckpt"),
           "--iters", str(iters), "--save-interval", str(save_interval), "--save-delay", str(save_delay)]
    return Launched(cmd, tmp / "eft-run.log")


def events(tmp: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(tmp / "out" / "events.jsonl") if e["event"] == kind]


def wait_started(tmp: Path, generation: int = 1) -> dict:
    wait_for(lambda: len(events(tmp, "resume")) >= RANKS * generation, 120, f"{RANKS} ranks to start")
    return json.loads((tmp / "out" / "run.json").read_text())


def saves_at(tmp: Path, count: int) -> list[dict]:
    """The ``count``-th save of every rank, once all ranks have made it."""
    def ready():
        saves = events(tmp, "save")
        per_rank = {r: [s for s in saves if s["rank"] == r] for r in range(RANKS)}
        return [per_rank[r][count - 1] for r in range(RANKS)] if all(len(v) >= count for v in per_rank.values()) else None

    return wait_for(ready, 60, f"save number {count} on every rank")


def eft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=60)


def test_manual_save_then_stop(tmp_path):
    job = start_job(tmp_path)
    try:
        run = wait_started(tmp_path)
        where = ["--endpoint", run["endpoint"], "--run-id", run["run_id"]]
        requested = time.time()
        assert eft("ckpt", "save", *where).returncode == 0
        first = saves_at(tmp_path, 1)
        assert len({s["iteration"] for s in first}) == 1, first  # every rank saved the same iteration
        assert max(s["time"] for s in first) - requested < 5
        status = json.loads(eft("ckpt", "status", *where, "--json").stdout)
        assert status["latest"]["iteration"] == first[0]["iteration"]
        assert status["acks"][0]["request_id"] == status["request"]["id"] == first[0]["request_id"]
        assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(first[0]["iteration"])

        assert eft("ckpt", "stop", *where).returncode == 0
        assert job.wait(60) == 0, job.output()
        second = saves_at(tmp_path, 2)
        exits = events(tmp_path, "exit")
        assert len({s["iteration"] for s in second}) == 1 and len(exits) == RANKS
        assert second[0]["iteration"] > first[0]["iteration"]  # training went on in between
        assert len(events(tmp_path, "resume")) == RANKS  # and the agent did not restart it
    finally:
        job.stop()


def test_concurrent_risk_requests_make_one_save_and_the_gap_filters_a_late_one(tmp_path):
    job = start_job(tmp_path, save_interval=1000)
    try:
        run = wait_started(tmp_path)
        client = connect(StoreOptions(run["endpoint"]))
        keys = RunKeys(run["run_id"])
        agents = [CheckpointProtocol(client, keys, f"node{i}") for i in range(2)]
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=lambda a=a: (barrier.wait(), a.request("risk", a.events._source, risk=1.0)))
                   for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        saves_at(tmp_path, 1)  # nothing saved before: the gap rule lets it through
        wait_for(lambda: client.get(keys.ckpt_latest), 10, "the ack")
        # A second risk request right after that save is inside the gap (0.25 * 1000).
        late, _ = agents[0].request("risk", "node0/gpu1", risk=1.0)
        log = EventLog(client, keys, "test")
        filtered = wait_for(lambda: [e for e in log.read() if e["kind"] == "ckpt_filtered"], 30, "the filtered event")
        assert filtered[0]["request_id"] == late.id and "gap" in filtered[0]["why"]
        manual, _ = agents[1].request("manual", "operator")
        second = saves_at(tmp_path, 2)
        assert second[0]["request_id"] == manual.id
        assert len(events(tmp_path, "save")) == 2 * RANKS  # one save for the two risk requests, none for the late one
    finally:
        job.stop()


def test_kill_switch_saves_and_exits_and_at_start_exits_at_once(tmp_path):
    switch = tmp_path / "STOP"
    job = start_job(tmp_path, "--eft-kill-switch", str(switch))
    try:
        wait_started(tmp_path)
        switch.touch()
        assert job.wait(60) == 0, job.output()
        saves = saves_at(tmp_path, 1)
        assert len({s["iteration"] for s in saves}) == 1 and len(events(tmp_path, "exit")) == RANKS
        assert len(events(tmp_path, "resume")) == RANKS
    finally:
        job.stop()
    again = tmp_path / "again"
    again.mkdir()
    started = time.monotonic()
    job = start_job(again, "--eft-kill-switch", str(switch))
    try:
        assert job.wait(60) == 0
        assert time.monotonic() - started < 30
        assert not (again / "out" / "events.jsonl").exists()
    finally:
        job.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_to_eft_run_saves_and_exits_within_the_grace(tmp_path, sig):
    job = start_job(tmp_path, "--eft-shutdown-grace", "60")
    try:
        wait_started(tmp_path)
        signalled = time.monotonic()
        job.proc.send_signal(sig)
        code = job.wait(90)
        assert time.monotonic() - signalled < 60
        saves = saves_at(tmp_path, 1)
        assert len({s["iteration"] for s in saves}) == 1
        assert len(events(tmp_path, "exit")) == RANKS
        # SIGUSR1 is a warning the agent forwards: the workers finish and so does the job.
        # SIGTERM stops the agent itself (torch's behaviour), after the workers saved.
        assert code == (0 if sig == signal.SIGUSR1 else 128 + signal.SIGTERM), job.output()
    finally:
        job.stop()


def test_signal_mode_turns_a_request_into_sigterm_and_restarts_the_workers(tmp_path):
    (tmp_path / "out").mkdir()
    job = Launched([*eft_run(), "--standalone", "--nproc-per-node", "2", "--eft-ckpt-mode", "signal",
                    str(WORKERS / "toy_train.py"), str(tmp_path / "out"), "--ckpt", str(tmp_path / "ckpt"),
                    "--iters", "100000", "--exit-signal-handler"], tmp_path / "eft-run.log")
    try:
        wait_for(lambda: len(events(tmp_path, "resume")) >= 2, 120, "2 ranks to start")
        run = json.loads((tmp_path / "out" / "run.json").read_text())
        assert eft("ckpt", "save", "--endpoint", run["endpoint"], "--run-id", run["run_id"]).returncode == 0
        saved = wait_for(lambda: events(tmp_path, "save")[:2] if len(events(tmp_path, "save")) >= 2 else None,
                         60, "both ranks to save on SIGTERM")
        assert len({s["iteration"] for s in saved}) == 1
        resumed = wait_for(lambda: events(tmp_path, "resume")[2:] if len(events(tmp_path, "resume")) >= 4 else None,
                           120, "the agent to restart the workers")
        assert {r["iteration"] for r in resumed} == {saved[0]["iteration"]}
        assert job.proc.poll() is None  # still training
    finally:
        job.stop()


def test_rank0_killed_mid_save_leaves_latest_at_the_previous_checkpoint(tmp_path):
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    job = start_job(tmp_path, "--max-restarts", "1", save_interval=5, save_delay=3.0, iters=12)
    try:
        wait_started(tmp_path)
        wait_for(lambda: tracker.exists(), 60, "the first complete checkpoint")
        assert tracker.read_text().strip() == "5"
        second = tmp_path / "ckpt" / "iter_0000010"
        wait_for(lambda: len(list(second.glob("rank*.pt"))) == RANKS, 60, "every rank's shard of iteration 10")
        rank0 = next(e["pid"] for e in events(tmp_path, "resume") if e["rank"] == 0)
        os.kill(rank0, signal.SIGKILL)  # rank 0 is stalled before committing iteration 10
        assert tracker.read_text().strip() == "5"
        resumed = wait_for(lambda: [e for e in events(tmp_path, "resume")[RANKS:]], 120, "the restarted ranks")
        assert {e["iteration"] for e in resumed} == {5}
        assert job.wait(120) == 0, job.output()
    finally:
        job.stop()
