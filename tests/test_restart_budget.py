"""No endless loops (elasticft/agent/restart_budget.py): the counting rule on its own, the
job-wide record on a real etcd with several agents, the repeating fault, bad flags."""

import json
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from bench.launch import WORKERS
from elasticft.agent.decide import RestartReason
from elasticft.agent.events import EventLog
from elasticft.agent.restart_budget import (
    BudgetExhausted,
    Cycle,
    Limits,
    NoProgress,
    RestartBudget,
    made_progress,
    quote,
    report_cycle,
)
from elasticft.config import ConfigError, FTConfig, RestartConfig
from elasticft.contract.events import EventKind
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.faults import Fault, FaultKind, parse_faults
from elasticft.contract.restarts import Ending, ProgressMark, RestartRecord
from elasticft.worker.progress import ProgressWriter
from tests.test_eft_run import assert_one_line_error, eft_error

FAILED, HANG, MEMBERSHIP = RestartReason.WORKER_FAILED, RestartReason.HANG, RestartReason.MEMBERSHIP
LIMITS = Limits(job_restarts=100, no_progress=3)


def cycle(round_: int, reason=FAILED, reached: int | None = 8, checkpoint: int | None = None, agent="a:1",
          watched: bool = True) -> Cycle:
    return Cycle(round_, str(reason), ProgressMark(checkpoint, reached), watched, agent)


def run_cycles(cycles, limits=LIMITS, record=None) -> list[RestartRecord]:
    """The record after each report, in order."""
    record = record or RestartRecord()
    seen = []
    for c in cycles:
        record = report_cycle(record, c, limits)
        seen.append(record)
    return seen


# -- the rule ---------------------------------------------------------------------------------


def test_a_crash_at_the_same_iteration_ends_the_job_at_the_nth_cycle_without_progress():
    records = run_cycles([cycle(r, reached=8, checkpoint=5) for r in range(6)])
    # The first cycle sets the mark; each later one gets no further.
    assert [r.no_progress for r in records[:4]] == [0, 1, 2, 3]
    assert [r.ended for r in records[:4]] == [None, None, None, Ending.NO_PROGRESS]
    assert records[3].mark == ProgressMark(5, 8) and records[3].charged == 4
    assert records[5] == records[3]  # an ended job stays ended


@pytest.mark.parametrize("later, progress", [
    (ProgressMark(10, 8), True),  # a newer complete checkpoint
    (ProgressMark(5, 9), True),  # past the iteration where the previous cycle died
    (ProgressMark(5, 8), False),
    (ProgressMark(5, 7), False),  # died earlier: a worse cycle is no progress either
    (ProgressMark(None, None), False),  # died before its first step, no checkpoint
])
def test_progress_is_a_newer_checkpoint_or_a_further_iteration(later, progress):
    assert made_progress(ProgressMark(5, 8), later) is progress
    assert made_progress(None, later)  # the first judged cycle only sets the mark


def test_progress_in_between_starts_the_count_again():
    marks = [(8, None), (8, None), (8, None), (12, 10), (12, 10), (12, 10)]
    records = run_cycles([cycle(r, reached=reached, checkpoint=ckpt) for r, (reached, ckpt) in enumerate(marks)])
    assert [r.no_progress for r in records] == [0, 1, 2, 0, 1, 2]
    assert records[-1].ended is None


def test_several_agents_reporting_one_cycle_count_it_once():
    """Both agents of a round restart for one crash; whichever reports first, with whatever
    reason, the cycle is judged once and charged once."""
    for first, second in ((FAILED, MEMBERSHIP), (MEMBERSHIP, FAILED), (FAILED, FAILED), (HANG, FAILED)):
        records = run_cycles([
            cycle(0, first, agent="a:1"), cycle(0, second, agent="b:2"),
            cycle(1, second, agent="b:2"), cycle(1, first, agent="a:1"),
        ])
        assert [(r.charged, r.no_progress) for r in records] == [
            (int(first != MEMBERSHIP), 0), (1, 0),
            (1 + int(second != MEMBERSHIP), int(second != MEMBERSHIP)), (2, 1)], (first, second)
        assert records[-1].agents == ("a:1", "b:2")


def test_a_later_report_of_a_judged_cycle_lends_it_its_mark():
    """Each agent sees its own workers: the cycle's mark is the furthest any of them got."""
    record = run_cycles([cycle(0, reached=7, agent="a:1"), cycle(0, reached=8, agent="b:2")])[-1]
    assert record.mark == ProgressMark(None, 8) and record.no_progress == 0
    assert report_cycle(record, cycle(1, reached=8), LIMITS).no_progress == 1  # 8 again: no further


def test_membership_changes_and_signal_saves_are_neither_charged_nor_judged():
    records = run_cycles([cycle(r, reason) for r, reason in
                          enumerate([MEMBERSHIP, RestartReason.SIGNAL_SAVE] * 3)])
    assert (records[-1].charged, records[-1].no_progress, records[-1].mark) == (0, 0, None)


def test_any_other_reason_is_judged_but_not_charged():
    """A rollback (workers exit 0 after marking a bad state) reloads the same state every time."""
    records = run_cycles([cycle(r, "rollback", reached=None, checkpoint=40) for r in range(4)])
    assert [(r.charged, r.no_progress) for r in records] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert records[-1].ended is Ending.NO_PROGRESS


def test_a_cycle_nothing_can_be_known_about_is_not_judged():
    """Workers without eft's hook and no checkpoint record: no evidence either way."""
    blind = [cycle(r, reached=None, watched=False) for r in range(5)]
    assert {(r.no_progress, r.ended) for r in run_cycles(blind)} == {(0, None)}
    crashed_in_setup = [cycle(r, reached=None, watched=True) for r in range(4)]
    assert run_cycles(crashed_in_setup)[-1].ended is Ending.NO_PROGRESS


def test_the_last_failure_is_quoted_with_its_error_files_message_and_without_torchs_boilerplate(tmp_path):
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"  # what torch's @record writes
    error_file.write_text(json.dumps({"message": {"message": "FileNotFoundError: no dataset index at /d/x.idx\n",
                                                  "extraInfo": {"py_callstack": "...", "timestamp": "5"}}}))
    recorded = ProcessFailure(local_rank=1, pid=41, exitcode=1, error_file=str(error_file))
    plain = ProcessFailure(local_rank=0, pid=40, exitcode=1, error_file=str(tmp_path / "none.json"))
    killed = ProcessFailure(local_rank=0, pid=42, exitcode=-9, error_file=str(tmp_path / "none.json"))
    assert quote(RunResult(WorkerState.FAILED, failures={3: recorded})) == (
        "rank 3 (local rank 1, pid 41) exited with code 1: FileNotFoundError: no dataset index at /d/x.idx")
    assert quote(RunResult(WorkerState.FAILED, failures={2: plain})) == "rank 2 (local rank 0, pid 40) exited with code 1"
    assert quote(RunResult(WorkerState.FAILED, failures={0: killed})) == "rank 0 (local rank 0, pid 42) killed by SIGKILL"
    assert quote(None) == "" and quote(RunResult(WorkerState.HEALTHY)) == ""


def test_the_job_wide_budget_counts_charged_cycles_against_the_limit():
    limits = Limits(job_restarts=2, no_progress=3)
    records = run_cycles([cycle(r, reached=10 * (r + 1)) for r in range(3)], limits)
    assert [(r.charged, r.ended) for r in records] == [(1, None), (2, None), (3, Ending.BUDGET)]
    # Zero restarts allowed: the first charged cycle ends the job.
    assert report_cycle(RestartRecord(), cycle(0), Limits(0, 3)).ended is Ending.BUDGET


def test_no_progress_wins_over_the_budget_and_zero_turns_it_off():
    both = run_cycles([cycle(r) for r in range(4)], Limits(job_restarts=3, no_progress=3))
    assert both[-1].ended is Ending.NO_PROGRESS  # "stop" says more than "failed" to a requeue script
    off = run_cycles([cycle(r) for r in range(20)], Limits(job_restarts=100, no_progress=0))
    assert off[-1].ended is None and off[-1].no_progress == 19


def test_a_late_report_of_an_older_round_changes_nothing():
    record = run_cycles([cycle(3), cycle(4)])[-1]
    assert report_cycle(record, cycle(3, agent="c:3"), LIMITS) == record


def test_the_record_survives_json_and_a_new_launch_keeps_only_the_progress_count():
    record = run_cycles([cycle(r, checkpoint=5) for r in range(3)])[-1]
    assert RestartRecord.from_json(record.to_json()) == record
    fresh = record.for_new_launch()
    assert (fresh.charged, fresh.round, fresh.agents, fresh.ended) == (0, -1, (), None)
    assert (fresh.no_progress, fresh.mark) == (2, ProgressMark(5, 8))
    assert Ending.NO_PROGRESS == EventKind.NO_PROGRESS and Ending.BUDGET == EventKind.RESTART_BUDGET_EXHAUSTED


def test_the_job_wide_budget_defaults_to_max_restarts():
    assert RestartConfig().job_restarts(max_restarts=3) == 3
    assert RestartConfig(max_job_restarts=5).job_restarts(max_restarts=3) == 5
    assert RestartConfig(max_job_restarts=0).job_restarts(max_restarts=3) == 0
    for bad in ({"max_job_restarts": -2}, {"max_no_progress_restarts": -1}):
        with pytest.raises(ConfigError, match="--eft-max-"):
            RestartConfig(**bad)


# -- the record in etcd, several agents ----------------------------------------------------------


def beat(run_dir: Path, iteration: int | None) -> None:
    """A worker's heartbeat as eft's hook writes it, having reached ``iteration``."""
    writer = ProgressWriter(run_dir, rank=0, local_rank=0)
    if iteration is not None:
        writer.step(iteration)
        writer.write()


def test_agents_of_one_round_count_it_once_and_all_end_with_no_progress(agent_context, etcd, run_keys):
    agents = [agent_context(f"n{i}") for i in range(2)]
    budgets = [RestartBudget(ctx, RestartConfig(max_no_progress_restarts=2), max_restarts=100).start()
               for ctx in agents]
    etcd.put(run_keys.ckpt_latest, json.dumps({"iteration": 5, "path": "/ckpt/iter_0000005"}))
    for ctx in agents:
        beat(ctx.run_dir, 8)  # every generation dies at iteration 8
    ended, stopped, firsts = [], [], []

    def report(budget, reason):
        try:
            firsts.append(budget.before_restart(reason, lambda: stopped.append(budget)))
        except NoProgress as exc:
            ended.append(exc)

    for round_ in range(2):  # both agents leave the round at once: one charged, one for the other's rendezvous
        for budget in budgets:
            budget.joined(round_)
        threads = [threading.Thread(target=report, args=(b, r)) for b, r in zip(budgets, (FAILED, MEMBERSHIP))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not ended and not stopped
        assert sorted(firsts) == [False, True]  # one agent's restart is the job's (eft_job_restarts_total)
        firsts.clear()
    # The third: the agent whose worker crashed charges it, the other reports it after.
    for budget in budgets:
        budget.joined(2)
    report(budgets[0], FAILED)
    report(budgets[1], MEMBERSHIP)
    record = RestartRecord.from_json(etcd.get(run_keys.restarts).value)
    assert (record.charged, record.no_progress, record.ended) == (3, 2, Ending.NO_PROGRESS)
    assert len(ended) == 2 and stopped == budgets  # every agent stops its workers and ends
    assert ended[0].exit_code == ExitCode.NO_PROGRESS == 3
    assert str(ended[0]) == ("no progress in 2 restart cycles in a row (--eft-max-no-progress-restarts 2): "
                             "the workers reached iteration 8, the newest checkpoint is iteration 5; "
                             "ending the job with exit code 3 (do not requeue)")
    events = [e for e in EventLog(etcd, run_keys, "test").read() if e["kind"] == EventKind.NO_PROGRESS]
    assert [(e["cycles"], e["limit"], e["reached"], e["checkpoint"]) for e in events] == [(2, 2, 8, 5)]


def test_an_agent_that_left_for_the_next_round_first_ends_when_its_rendezvous_fails(agent_context, etcd, run_keys):
    """It restarted for a membership change before the verdict: it learns of it after its
    rendezvous fails (its peers never come) and exits the same way."""
    contexts = [agent_context(f"n{i}") for i in range(2)]
    early, late = (RestartBudget(ctx, RestartConfig(max_no_progress_restarts=1), max_restarts=100).start()
                   for ctx in contexts)
    for ctx in contexts:
        beat(ctx.run_dir, 8)  # no further than the round before
    etcd.put(run_keys.restarts, RestartRecord(round=0, round_judged=True, no_progress=0,
                                              mark=ProgressMark(None, 8)).to_json())
    for budget in (early, late):
        budget.joined(1)
    early.raise_ending()  # nothing ended yet: its rendezvous error stays what it was
    early.before_restart(MEMBERSHIP, lambda: None)  # restarts: this cycle is not its to judge
    with pytest.raises(NoProgress):
        late.before_restart(FAILED, lambda: None)
    with pytest.raises(NoProgress):
        early.raise_ending()


def test_the_budget_is_job_wide_and_ends_every_agent_as_failed(agent_context, etcd, run_keys):
    agents = [agent_context(f"n{i}") for i in range(3)]
    budgets = [RestartBudget(ctx, RestartConfig(max_job_restarts=2), max_restarts=100).start() for ctx in agents]
    outcomes = []
    for round_ in range(3):
        culprit = budgets[round_]  # a different node fails each time: each charges only once
        beat(agents[round_].run_dir, 10 * (round_ + 1))
        for budget in budgets:
            budget.joined(round_)
        for budget in [culprit] + [b for b in budgets if b is not culprit]:
            try:
                budget.before_restart(FAILED if budget is culprit else MEMBERSHIP, lambda: None)
                outcomes.append((round_, "restart"))
            except BudgetExhausted as exc:
                outcomes.append((round_, "failed"))
                message = str(exc)
    assert outcomes == [(0, "restart")] * 3 + [(1, "restart")] * 3 + [(2, "failed")] * 3
    assert message == "3 restarts job-wide, more than --eft-max-job-restarts 2 allows; ending the job as failed"
    events = [e for e in EventLog(etcd, run_keys, "test").read() if e["kind"] == EventKind.RESTART_BUDGET_EXHAUSTED]
    assert [(e["restarts"], e["limit"]) for e in events] == [(3, 2)]


def test_a_new_launch_of_the_run_gets_a_fresh_budget(agent_context, etcd, run_keys):
    old = RestartRecord(round=7, round_judged=True, charged=2, no_progress=1, mark=ProgressMark(5, 8),
                        ended=Ending.BUDGET, agents=("gone-host:123",))
    etcd.put(run_keys.restarts, old.to_json())
    RestartBudget(agent_context("n0"), RestartConfig(), max_restarts=3).start()
    # ... and states its limits (--max-restarts 3, 3 cycles without progress) for viewers.
    assert RestartRecord.from_json(etcd.get(run_keys.restarts).value) == replace(
        old.for_new_launch(), job_restarts_limit=3, no_progress_limit=3)
    # A node joining a launch whose agents are alive changes nothing.
    live = agent_context("n1")
    running = RestartRecord(round=2, charged=1, agents=(f"{live.node.record.host}:{live.node.record.pid}",),
                            job_restarts_limit=3, no_progress_limit=3)
    etcd.put(run_keys.restarts, running.to_json())
    RestartBudget(agent_context("n2"), RestartConfig(), max_restarts=3).start()
    assert RestartRecord.from_json(etcd.get(run_keys.restarts).value) == running


# -- the repeating fault, and bad flags --------------------------------------------------------------


def test_parse_repeating_faults():
    assert parse_faults("rank_killed:1@8*, rank_hung:0@3*") == [
        Fault(FaultKind.RANK_KILLED, 1, 8, repeat=True), Fault(FaultKind.RANK_HUNG, 0, 3, repeat=True)]
    assert parse_faults("rank_killed:1@8") == [Fault(FaultKind.RANK_KILLED, 1, 8, repeat=False)]
    for bad, needle in (("rank_killed:1@8**", "KIND:TARGET@ITERATION[*]"), ("node_lost:1@8*", "can repeat")):
        with pytest.raises(ConfigError, match=r"--eft-inject.*" + needle.replace("[", r"\[").replace("*", r"\*")):
            FTConfig(inject=bad)


INJECTED = """
import sys
from elasticft.contract.faults import parse_faults
from elasticft.worker.inject import FaultInjector
injector = FaultInjector(parse_faults(sys.argv[1]), sys.argv[2], rank=1, local_rank=0, group_rank=0)
for iteration in range(1, 6):
    injector.after_iteration(iteration)
"""


@pytest.mark.parametrize("spec, fates", [("rank_killed:1@3*", [-9, -9, -9]), ("rank_killed:1@3", [-9, 0, 0])])
def test_a_repeating_fault_kills_its_rank_after_every_restart(tmp_path, spec, fates):
    """Three generations of one rank on one node: the repeating fault fires in each."""
    runs = [subprocess.run([sys.executable, "-c", INJECTED, spec, str(tmp_path)], timeout=60) for _ in fates]
    assert [r.returncode for r in runs] == fates


@pytest.mark.parametrize("args, needle", [
    (["--eft-max-job-restarts", "-2"], "--eft-max-job-restarts"),
    (["--eft-max-job-restarts", "many"], "--eft-max-job-restarts"),
    (["--eft-max-no-progress-restarts", "-1"], "--eft-max-no-progress-restarts"),
    (["--eft-inject", "rank_killed:1@8**"], "--eft-inject"),
    (["--eft-inject", "gpu_degrade:1@8*"], "--eft-inject"),
])
def test_bad_restart_flags_give_one_line_naming_the_flag(tmp_path, args, needle):
    result = eft_error(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", *args,
                        str(WORKERS / "env_probe.py"), str(tmp_path)])
    assert_one_line_error(result, needle)


def test_a_bad_restart_variable_names_it(tmp_path):
    result = eft_error(["--standalone", str(WORKERS / "env_probe.py"), str(tmp_path)],
                       env={"EFT_MAX_NO_PROGRESS_RESTARTS": "three"})
    assert_one_line_error(result, "EFT_MAX_NO_PROGRESS_RESTARTS")


def test_eft_status_and_top_show_where_the_job_stands_against_its_restart_rules(
        agent_context, etcd, etcd_server, run_keys):
    """The first agent states the limits in the record; two crashes at the same place later,
    an operator sees 2 of 10 restarts charged and 1 of 3 cycles without progress."""
    from typer.testing import CliRunner

    from launcher.cli import app

    ctx = agent_context("n0")
    budget = RestartBudget(ctx, RestartConfig(max_job_restarts=10, max_no_progress_restarts=3), 100).start()
    etcd.put(run_keys.ckpt_latest, json.dumps({"iteration": 5, "path": "/ckpt/iter_0000005"}))
    beat(ctx.run_dir, 8)
    for round_ in range(2):
        budget.joined(round_)
        budget.before_restart(FAILED, lambda: None)
    for command in (["status"], ["top", "--once"]):
        result = CliRunner().invoke(app, [*command, "--endpoint", etcd_server.endpoint, "--run-id", run_keys.run_id],
                                    env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "(2 of 10 charged, 1 of 3 in a row without progress)" in result.output, result.output
