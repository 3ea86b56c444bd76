"""Heartbeats, section timeouts and learned timeouts: the pure parts, then real eft-run jobs."""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from bench.launch import read_jsonl, wait_for, worker_events
from elasticft.agent.auto_timeouts import (
    MIN_LEARNED,
    TIMEOUTS_FILE,
    SectionTimeouts,
    learned_timeouts,
)
from elasticft.agent.hangs import find_overruns
from elasticft.config import ConfigError, HangConfig
from elasticft.contract.argv import flag_value
from elasticft.contract.keys import RunKeys
from elasticft.contract.progress import ProgressRecord, read_progress, saved_and_stopped
from elasticft.worker.progress import ProgressWriter


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def heartbeat(tmp_path, local_rank=0) -> dict:
    return json.loads((tmp_path / "progress" / f"{local_rank}.json").read_text())


# -- the worker's heartbeat ----------------------------------------------------------------


def test_sections_step_times_and_longest(tmp_path):
    clock = Clock()
    writer = ProgressWriter(tmp_path, rank=3, local_rank=1, dump_signal=12, clock=clock, started=990.0)
    assert heartbeat(tmp_path, 1)["section"] == "setup" and heartbeat(tmp_path, 1)["since"] == 990.0
    clock.now = 1010.0
    writer.step(1)  # setup took 20 s (from the process's start)
    clock.now = 1012.0
    writer.step(2)  # a 2 s step, no compute() marked: wall time
    clock.now = 1013.0
    writer.add_work(0.5)
    writer.enter("checkpointing")
    clock.now = 1020.0
    writer.leave()  # 7 s of checkpointing inside the step: not the step's time
    clock.now = 1021.0
    writer.step(3)  # 8 s wall, 1 s without the save, 0.5 s of work
    record = ProgressRecord.from_json(heartbeat(tmp_path, 1))
    assert (record.rank, record.local_rank, record.iteration, record.section, record.since) == (3, 1, 3, "step", 1021.0)
    assert record.step_times == (2.0, 0.5)
    assert record.longest == {"setup": 20.0, "step": 2.0, "checkpointing": 7.0}
    assert record.dump_signal == 12 and record.pid == os.getpid()
    writer.close()
    assert heartbeat(tmp_path, 1)["section"] == "other"


def test_fast_steps_rewrite_the_heartbeat_at_most_every_50_ms(tmp_path):
    clock = Clock()
    writer = ProgressWriter(tmp_path, rank=0, local_rank=0, clock=clock)
    clock.now += 1.0
    writer.step(1)
    clock.now += 0.01
    writer.step(2)  # 10 ms later: not written
    assert heartbeat(tmp_path)["iteration"] == 1
    clock.now += 0.05
    writer.step(3)
    assert heartbeat(tmp_path)["iteration"] == 3 and heartbeat(tmp_path)["step_times"] == pytest.approx([0.01, 0.05])
    writer.enter("checkpointing")  # a section change is always written
    assert heartbeat(tmp_path)["section"] == "checkpointing"


def test_unknown_section_and_unreadable_heartbeats(tmp_path):
    writer = ProgressWriter(tmp_path, rank=0, local_rank=0)
    with pytest.raises(ValueError, match="unknown section 'eval'"):
        writer.enter("eval")
    (tmp_path / "progress" / "7.json").write_text("{not json")
    (tmp_path / "progress" / "8.json").write_text(json.dumps({"section": "nap"}))
    assert list(read_progress(tmp_path)) == [0]
    assert read_progress(tmp_path / "nothing-here") == {}


def record(section="step", since=0.0, pid=100, rank=0):
    return ProgressRecord(rank=rank, local_rank=rank, pid=pid, iteration=5, section=section, since=since,
                          time=since, longest={}, step_times=(), dump_signal=None)


def test_a_long_save_inside_a_step_is_not_counted_against_the_step_timeout(tmp_path):
    """A save the vote asks for runs inside the step (a first torch_dist save can take many
    seconds): once it returns, the heartbeat's step clock is the step's own time, so the save's
    seconds do not make the rest of the step look hung."""
    clock = Clock()
    writer = ProgressWriter(tmp_path, rank=0, local_rank=0, clock=clock)
    writer.step(6)
    clock.now = 1001.0
    writer.enter("checkpointing")
    clock.now = 1013.0  # a 12 s save
    writer.leave()
    clock.now = 1014.0  # 1 s more of the step (the loop's end: Bridge's clean-up, say)
    record = ProgressRecord.from_json(heartbeat(tmp_path))
    assert record.section == "step" and clock.now - record.since == 2.0
    assert find_overruns([record], alive={os.getpid()}, timeouts={"step": 10.0}, now=clock.now) == []
    writer.step(7)
    assert ProgressRecord.from_json(heartbeat(tmp_path)).longest == {"step": 2.0, "checkpointing": 12.0}


def test_a_node_whose_workers_got_past_their_stop_save_departs_and_one_mid_save_is_lost(tmp_path):
    """A pod deleted (SIGTERM): the job agreed to save and exit. Its node leaves before the other
    nodes' workers have exited; once its own workers are past the save, its going is a departure
    (they stop with the same save), but while one is still saving, a loss (the others' save hangs)."""
    writers = [ProgressWriter(tmp_path, rank=r, local_rank=r) for r in (0, 1)]
    assert not saved_and_stopped(read_progress(tmp_path))  # no stop agreed
    for writer in writers:
        writer.step(22)
        writer.stopping("signal")
        writer.enter("checkpointing")
    writers[0].leave()
    assert not saved_and_stopped(read_progress(tmp_path))  # rank 1 still saving
    writers[1].leave()
    assert saved_and_stopped(read_progress(tmp_path))
    assert not saved_and_stopped({})  # no eft hook in the script: nothing says it saved


def test_find_overruns():
    timeouts = {"setup": 600.0, "step": 10.0, "checkpointing": 0.0, "other": 300.0}
    records = [
        record("step", since=100.0, pid=1, rank=0),  # 12 s in a step: hung
        record("step", since=108.0, pid=2, rank=1),  # 4 s: fine
        record("checkpointing", since=0.0, pid=3, rank=2),  # no limit
        record("step", since=0.0, pid=4, rank=3),  # a dead process's heartbeat
        record("step", since=104.0, pid=5, rank=4),  # 8 s: under its timeout, but silent with rank 0
    ]
    found = find_overruns(records, alive={1, 2, 3, 5}, timeouts=timeouts, now=112.0)
    assert [(o.rank, o.section, o.seconds, o.timeout) for o in found] == [(0, "step", 12.0, 10.0),
                                                                        (4, "step", 8.0, 10.0)]
    assert "section 'step' for 12.0 s, after iteration 5 (timeout 10 s)" in found[0].describe()
    # no rank over its timeout: nobody is reported, however long silent
    assert find_overruns(records, alive={1, 2, 3, 5}, timeouts=timeouts, now=109.5) == []


# -- timeouts: configured and learned ----------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ("stp=3", "SECTION one of setup, step"),
    ("step=-1", "SECONDS >= 0"),
    ("step", "got 'step'"),
    ("step=soon", "got 'step=soon'"),
])
def test_timeouts_flag_rejects(spec, message):
    with pytest.raises(ConfigError, match="--eft-timeouts: .*" + message.replace("(", r"\(")):
        HangConfig(timeouts=spec)


def test_timeouts_flag_overrides_only_what_it_names():
    assert HangConfig(timeouts="step=30, other=0").section_timeouts() == {
        "setup": 600.0, "step": 30.0, "checkpointing": 420.0, "other": 0.0}
    with pytest.raises(ConfigError, match="--eft-stack-signal: unknown signal 'SIGNOPE'"):
        HangConfig(stack_signal="SIGNOPE")
    with pytest.raises(ConfigError, match="--eft-timeout-factor"):
        HangConfig(timeout_factor=0.5)


def test_learned_timeouts():
    configured = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0, "other": 0.0}
    learned = learned_timeouts(configured, {"step": 2.0, "setup": 0.1, "other": 50.0}, factor=5)
    # observed sections: longest x 5, floored; unobserved keep theirs; 0 (off) stays off
    assert learned == {"setup": MIN_LEARNED, "step": 10.0, "checkpointing": 420.0, "other": 0.0}


def test_flag_value():
    assert flag_value(["--save", "a", "--load=b", "--save", "c"], "--save") == "c"
    assert flag_value(["--load=b"], "--load") == "b"
    assert flag_value(["--saved", "x"], "--save") is None


def test_learned_timeouts_kept_in_etcd_and_the_checkpoint_dir(etcd, run_keys, tmp_path):
    config = HangConfig(auto_timeouts=True, timeout_factor=4)
    first = SectionTimeouts.for_worker(config, ["--save", str(tmp_path)], etcd, run_keys)
    assert first.load() is None and first.current["step"] == 180.0
    assert first.observe({"step": 3.0, "setup": 4.0})
    first.persist()
    other_node = SectionTimeouts(config, etcd, run_keys)
    other_node.load()
    assert other_node.observe({"step": 5.0}) and other_node.current["step"] == 20.0
    other_node.persist()  # merges with the first node's record: setup survives
    assert json.loads(etcd.get(run_keys.timeouts).value)["longest"] == {"step": 5.0, "setup": 4.0}
    assert not first.observe({"step": 3.1})  # under 10% growth: not worth a write
    kept = json.loads((tmp_path / TIMEOUTS_FILE).read_text())
    assert kept["longest"] == {"step": 3.0, "setup": 4.0} and kept["timeouts"]["step"] == 12.0

    # The next run: a new run id, the same checkpoints.
    second = SectionTimeouts.for_worker(config, ["--load", str(tmp_path)], etcd, RunKeys(run_keys.run_id + "-next"))
    assert second.load() == str(tmp_path / TIMEOUTS_FILE)
    assert second.current == {"setup": 16.0, "step": 12.0, "checkpointing": 420.0, "other": 300.0}
    fixed = SectionTimeouts.for_worker(HangConfig(), ["--load", str(tmp_path)])
    assert fixed.load() is None and fixed.current["step"] == 180.0  # not asked to learn


# -- real jobs -----------------------------------------------------------------------------

RANKS = 2


@pytest.fixture
def start_job(eft_job, tmp_path):
    """``start_job(*eft_flags, iters=N)``: toy_train.py on RANKS ranks, output in tmp_path/out."""
    (tmp_path / "out").mkdir()

    def start(*extra: str, iters: int, iter_time: float = 0.05, run_id: str | None = None):
        return eft_job("toy_train.py", tmp_path / "out", "--save", tmp_path / "ckpt", "--iters", iters,
                       "--save-interval", "10", "--iter-time", iter_time,
                       nproc=RANKS, eft_flags=["--max-restarts", "1", *extra], run_id=run_id)

    return start


def finished(job, out: Path, iters: int) -> None:
    assert job.wait(120) == 0, job.output()[-3000:]
    saves = worker_events(out, "save")
    assert {s["rank"] for s in saves if s["iteration"] == iters} == set(range(RANKS)), "training did not finish"


@pytest.mark.seam
@pytest.mark.slow
def test_hung_rank_is_dumped_and_the_group_restarts(tmp_path, start_job):
    """A rank sleeping forever inside its step: found within timeout + 2 s, py-spy or
    faulthandler stacks in the log, a charged restart, training resumes to the end."""
    job = start_job("--eft-timeouts", "step=3", "--eft-inject", "rank_hung:1@15",
                    "--eft-notify", f"file:{tmp_path / 'notes.jsonl'}", iters=40)
    finished(job, tmp_path / "out", 40)
    hangs = [e for e in read_jsonl(tmp_path / "notes.jsonl") if e["kind"] == "hang"]
    hung = [h for h in hangs if h["rank"] == 1]
    assert hung and hung[0]["section"] == "step" and hung[0]["iteration"] == 15 and hung[0]["timeout"] == 3
    assert 3 <= hung[0]["seconds"] <= 3 + 2  # rounded to 0.01 s in the event
    assert "_rank_hung" in job.output()  # its stack, by py-spy ("FaultInjector._rank_hung") or faulthandler
    restarts = [e for e in read_jsonl(tmp_path / "notes.jsonl") if e["kind"] == "restart"]
    assert [(r["reason"], r["remaining_restarts"]) for r in restarts] == [("hang", 0)]
    resumes = worker_events(tmp_path / "out", "resume")
    assert sorted(r["iteration"] for r in resumes) == [0, 0, 10, 10]  # the second generation resumed


@pytest.mark.slow
def test_stopped_rank_prints_its_stacks_through_faulthandler(tmp_path, start_job):
    """SIGSTOP one rank: the faulthandler dumper continues it so that it can print its stacks."""
    out, notes = tmp_path / "out", tmp_path / "notes.jsonl"
    job = start_job("--eft-timeouts", "step=3", "--eft-stack-dumper", "faulthandler",
                    "--eft-stack-signal", "SIGUSR2", "--eft-notify", f"file:{notes}", iters=100000)
    wait_for(lambda: len(worker_events(out, "resume")) == RANKS, 120, "the ranks to start")
    wait_for(lambda: worker_events(out, "save"), 60, "a first save")
    victim = [r["pid"] for r in worker_events(out, "resume") if r["rank"] == 1][0]
    os.kill(victim, signal.SIGSTOP)
    wait_for(lambda: len(worker_events(out, "resume")) == 2 * RANKS, 30, "the restarted ranks")
    hangs = [e for e in read_jsonl(notes) if e["kind"] == "hang"]
    assert {h["stacks"] for h in hangs} == {"faulthandler"} and 1 in {h["rank"] for h in hangs}
    assert all(h["seconds"] <= 3 + 2 for h in hangs)
    # faulthandler's format ("Current thread 0x..." or "Thread 0x...", then File lines)
    assert re.search(r'File ".*toy_train\.py", line \d+ in <module>', job.output())
    assert not psutil_alive(victim)


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_second_run_starts_with_the_timeouts_the_first_learned(tmp_path, start_job, run_keys):
    first = start_job("--eft-auto-timeouts", iters=10, iter_time=1.2)
    finished(first, tmp_path / "out", 10)
    kept = json.loads((tmp_path / "ckpt" / TIMEOUTS_FILE).read_text())
    learned_step = kept["timeouts"]["step"]
    assert 1.2 * 5 <= learned_step < 2.0 * 5  # longest step ~1.2 s, times the default factor 5

    # The second run is a new job (a new run id, so nothing learned in etcd) on the same
    # checkpoints; a rank hangs: it is caught after the learned step timeout, not the default 180 s.
    notes = tmp_path / "notes.jsonl"
    second = start_job("--eft-auto-timeouts", "--eft-inject", "rank_hung:0@14", "--eft-notify", f"file:{notes}",
                       iters=30, run_id=run_keys.run_id + "-second")
    finished(second, tmp_path / "out", 30)
    assert f"section timeouts learned before, from {tmp_path / 'ckpt' / TIMEOUTS_FILE}" in second.output()
    hangs = [h for h in read_jsonl(notes) if h["kind"] == "hang" and h["rank"] == 0]
    assert hangs and hangs[0]["timeout"] == pytest.approx(learned_step)
