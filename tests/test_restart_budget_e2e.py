"""No endless loops, end to end: two eft-run agents (two nodes on loopback) on the session's
etcd, toy_train.py workers, and a rank that crashes on cue."""

import re

import pytest

from bench.launch import read_jsonl, worker_events
from elasticft.agent.events import EventLog
from elasticft.contract.events import EventKind
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.restarts import RestartRecord

# Longer than the longest wait below (tests/test_waits.py): a late job fails with its own message.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def two_nodes(eft_job, tmp_path):
    """``two_nodes(*eft_flags)``: toy_train.py on two agents of one job, one rank each,
    a checkpoint every 5 iterations, output in tmp_path/out."""
    (tmp_path / "out").mkdir()

    def start(*flags: str):
        return [eft_job("toy_train.py", tmp_path / "out", "--ckpt", tmp_path / "ckpt", "--iters", "100000",
                        "--save-interval", "5", "--iter-time", "0.1", nodes="2",
                        eft_flags=["--eft-failure-grace", "1", "--eft-notify", f"file:{tmp_path / 'notes.jsonl'}",
                                   *flags])
                for _ in range(2)]

    return start


def generations(out) -> list[list[int]]:
    """The iteration each generation of workers resumed from, per rank."""
    resumes = worker_events(out, "resume")
    return [[r["iteration"] for r in resumes if r["rank"] == rank] for rank in (0, 1)]


def events_of(etcd, run_keys, kind) -> list[dict]:
    return [e for e in EventLog(etcd, run_keys, "test").read() if e["kind"] == kind]


def test_a_rank_that_crashes_at_the_same_iteration_every_time_ends_the_job_as_no_progress(
        tmp_path, two_nodes, etcd, run_keys):
    """Acceptance: with --max-restarts 100, the job ends after 3 cycles without progress (4
    generations), with exit code 3 and one line on both nodes and one no_progress event."""
    nodes = two_nodes("--max-restarts", "100", "--eft-inject", "rank_killed:1@8*")
    codes = [node.wait(300) for node in nodes]
    assert codes == [ExitCode.NO_PROGRESS] * 2, [node.output()[-3000:] for node in nodes]
    for node in nodes:
        output = node.output()
        own = [line for line in output.splitlines() if not line.startswith("[rank")]  # the workers' are theirs
        assert not [line for line in own if "Traceback" in line], output[-3000:]
        last = output.strip().splitlines()[-1]
        # Each node quotes its own workers' last failure: the killed rank, its peer failing in a collective.
        assert re.fullmatch(r"eft-run: no progress in 3 restart cycles in a row \(--eft-max-no-progress-restarts 3\): "
                            r"the workers reached iteration 8, the newest checkpoint is iteration 5"
                            r"(; the workers' last failure: rank [01] \(local rank 0, pid \d+\) "
                            r"(killed by SIGKILL|exited with code 1))?; "
                            r"ending the job with exit code 3 \(do not requeue\)", last), output[-3000:]
    # Generation 1 trained from scratch, saved 5 and died at 8; the next three resumed from 5.
    assert generations(tmp_path / "out") == [[0, 5, 5, 5]] * 2
    ended = events_of(etcd, run_keys, EventKind.NO_PROGRESS)
    assert [(e["cycles"], e["limit"], e["reached"], e["checkpoint"]) for e in ended] == [(3, 3, 8, 5)]
    record = RestartRecord.from_json(etcd.get(run_keys.restarts).value)
    assert (record.charged, record.no_progress) == (4, 3)
    assert EventKind.NO_PROGRESS in {e["kind"] for e in read_jsonl(tmp_path / "notes.jsonl")}  # a person is told


def test_crashes_that_make_progress_stop_at_the_job_wide_budget_not_per_agent(tmp_path, two_nodes, etcd, run_keys):
    """Crashes at iterations 6, 12, 18 (a newer checkpoint each time) with torch's
    --max-restarts 100 per agent: the job fails after 2 restarts job-wide."""
    nodes = two_nodes("--max-restarts", "100", "--eft-max-job-restarts", "2",
                      "--eft-inject", "rank_killed:1@6,rank_killed:1@12,rank_killed:1@18")
    codes = [node.wait(300) for node in nodes]
    assert codes == [ExitCode.FAILED] * 2, [node.output()[-3000:] for node in nodes]
    assert len(generations(tmp_path / "out")[1]) == 3  # two restarts, then the end
    ended = events_of(etcd, run_keys, EventKind.RESTART_BUDGET_EXHAUSTED)
    assert [(e["restarts"], e["limit"]) for e in ended] == [(3, 2)]
    assert not events_of(etcd, run_keys, EventKind.NO_PROGRESS)
    assert any("more than --eft-max-job-restarts 2 allows" in node.output() for node in nodes)


def test_workers_that_die_before_their_first_step_end_the_job_as_no_progress_quoting_their_error(
        tmp_path, eft_job):
    """A script that fails two seconds into every start (a missing data file) under
    --max-restarts 10: each generation reached no step, so each cycle is one without progress;
    the job ends after 3 of them (4 generations, not 11) with exit code 3 and one line quoting
    the workers' error."""
    missing = tmp_path / "data" / "train.idx"
    node = eft_job("fails_at_start.py", missing, standalone=True, eft_flags=["--max-restarts", "10"])
    assert node.wait(240) == ExitCode.NO_PROGRESS, node.output()[-3000:]
    output = node.output()
    last = output.strip().splitlines()[-1]
    assert last.startswith("eft-run: no progress in 3 restart cycles in a row (--eft-max-no-progress-restarts 3): "
                           "the workers reached no iteration, there is no checkpoint; the workers' last failure: "
                           "rank 0 (local rank 0, pid "), last
    assert f"exited with code 1: FileNotFoundError: no dataset index at {missing}" in last, last
    assert output.count("restart cycle of round") == 3, output[-3000:]  # 3 restarts: 4 generations
