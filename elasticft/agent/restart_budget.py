"""No endless loops: a job-wide restart budget and the no-progress rule.

torch charges ``--max-restarts`` per agent: a job of eight nodes may restart eight times
as often as the flag says, and a job that crashes at the same iteration after every
restart loops until that runs out. eft keeps one record per run in etcd
(``contract.restarts.RestartRecord``, key ``restarts``) and every agent reports to it,
with compare-and-swap, each time its workers restart. A restart *cycle* is the end of
one rendezvous round; all agents of a round report the same round number, so a cycle is
counted once however many agents restart for it:

* charged cycles (a worker failed, a rank hung) count against ``--eft-max-job-restarts``
  (default: ``--max-restarts``); one more ends the job as a failure, as torch does;
* cycles that are not the job's doing (a node lost or joining, a signal-driven save) are
  neither charged nor judged; any other reason (a rollback, say) is judged, not charged;
* each judged cycle is compared with the previous one: progress is a newer complete
  checkpoint (disk ``ckpt/latest`` or the memory tier) or workers that got past the
  iteration where the previous cycle died (their heartbeats). ``--eft-max-no-progress-restarts``
  judged cycles in a row without progress end the job with ``ExitCode.NO_PROGRESS``, in one
  line that quotes the workers' last failure;
* a generation that left no heartbeat and ended within the ``setup`` section's timeout (the
  job's own bound from a worker's start to its first step) never reached a first step: a
  cycle that reached nothing (an import error, a missing file, a bad flag: the commonest
  endless loop). One that lived longer without a heartbeat is a script without eft's hook,
  whose progress eft cannot see: its cycles are not judged.

``report_cycle`` is the pure rule; ``RestartBudget`` is the agent's etcd-backed side.
The first agent to report a verdict records its event; every agent that reports the
same round (or finds the verdict after a failed rendezvous) ends the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticft.agent.context import AgentContext
from elasticft.agent.decide import RestartReason
from elasticft.agent.join_gate import newest_checkpoint
from elasticft.config import RestartConfig, flag_name
from elasticft.contract.events import EventKind
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.progress import read_progress
from elasticft.contract.restarts import Ending, ProgressMark, RestartRecord
from elasticft.memckpt.index import MemIndex
from elasticft.store import StoreError
from elasticft.torch_seam import write_error_file

log = logging.getLogger(__name__)

# Charged to the job-wide budget, as torch charges them to --max-restarts.
CHARGED_REASONS = frozenset({RestartReason.WORKER_FAILED, RestartReason.HANG})
# Not the job's doing: neither charged nor judged by the no-progress rule.
UNJUDGED_REASONS = frozenset({RestartReason.MEMBERSHIP, RestartReason.SIGNAL_SAVE, RestartReason.FENCED})
MAX_AGENTS = 64  # agent identities a record keeps (enough to tell a live launch from an old one)


@dataclass(frozen=True)
class Limits:
    job_restarts: int  # charged cycles allowed job-wide
    no_progress: int  # judged cycles in a row without progress that end the job (0: off)


@dataclass(frozen=True)
class Cycle:
    """One agent's report of a restart cycle: the round its workers leave, why, how far they got."""

    round: int
    reason: str  # a RestartReason value
    mark: ProgressMark
    watched: bool  # the workers kept heartbeats: "reached nothing" is a fact, not a blind spot
    agent: str  # host:pid


def made_progress(before: ProgressMark | None, now: ProgressMark) -> bool:
    """A newer complete checkpoint, or an iteration past where the previous cycle died.
    The first judged cycle has nothing to compare with: it sets the mark."""
    if before is None:
        return True
    newer = now.checkpoint is not None and (before.checkpoint is None or now.checkpoint > before.checkpoint)
    further = now.reached is not None and (before.reached is None or now.reached > before.reached)
    return newer or further


def report_cycle(record: RestartRecord, cycle: Cycle, limits: Limits) -> RestartRecord:
    """The record after ``cycle`` is reported; ``ended`` set when it ends the job.

    The first report of a round with a judged reason judges it, the first with a charged
    reason charges it; later reports of the same round only lend it their mark (each
    agent sees its own workers). A job that was ended stays ended.
    """
    if record.ended is not None or cycle.round < record.round:
        return record
    agents = record.agents if cycle.agent in record.agents else (*record.agents, cycle.agent)[-MAX_AGENTS:]
    if cycle.round > record.round:
        record = replace(record, round=cycle.round, round_judged=False, round_charged=False)
    record = replace(record, agents=agents)
    known = cycle.watched or cycle.mark.checkpoint is not None
    if record.round_judged:
        record = replace(record, mark=record.mark.merged(cycle.mark) if record.mark else cycle.mark)
    elif cycle.reason not in UNJUDGED_REASONS and known:
        progress = made_progress(record.mark, cycle.mark)
        record = replace(record, round_judged=True, mark=cycle.mark,
                         no_progress=0 if progress else record.no_progress + 1)
        if limits.no_progress and record.no_progress >= limits.no_progress:
            record = replace(record, ended=Ending.NO_PROGRESS)
    if cycle.reason in CHARGED_REASONS and not record.round_charged:
        record = replace(record, round_charged=True, charged=record.charged + 1)
        if record.ended is None and record.charged > limits.job_restarts:
            record = replace(record, ended=Ending.BUDGET)
    return record


class JobEnded(Exception):
    """The restart rule ended the job; raised from the agent's restart step."""

    def __init__(self, record: RestartRecord, limits: Limits, last_failure: str = ""):
        self.record = record
        self.limits = limits
        self.last_failure = last_failure  # the workers' last failure, quoted (this node's; "" elsewhere)
        super().__init__(self.describe())

    def describe(self) -> str:
        raise NotImplementedError


class NoProgress(JobEnded):
    """eft-run exits with ``exit_code`` and this one line on every node."""

    exit_code = ExitCode.NO_PROGRESS

    def describe(self) -> str:
        mark = self.record.mark or ProgressMark()
        reached = f"the workers reached iteration {mark.reached}" if mark.reached is not None \
            else "the workers reached no iteration"
        newest = f"the newest checkpoint is iteration {mark.checkpoint}" if mark.checkpoint is not None \
            else "there is no checkpoint"
        quoted = f"; the workers' last failure: {self.last_failure}" if self.last_failure else ""
        return (f"no progress in {self.record.no_progress} restart cycles in a row "
                f"({flag_name('max_no_progress_restarts')} {self.limits.no_progress}): {reached}, {newest}"
                f"{quoted}; ending the job with exit code {int(self.exit_code)} (do not requeue)")


class BudgetExhausted(JobEnded):
    """The agent fails as torch does when ``--max-restarts`` runs out."""

    def describe(self) -> str:
        return (f"{self.record.charged} restarts job-wide, more than {flag_name('max_job_restarts')} "
                f"{self.limits.job_restarts} allows; ending the job as failed")


ENDINGS: dict[Ending, type[JobEnded]] = {Ending.NO_PROGRESS: NoProgress, Ending.BUDGET: BudgetExhausted}


class RestartBudget:
    """The agent's side: report each restart cycle to ``restarts``, raise the verdict."""

    def __init__(self, ctx: AgentContext, config: RestartConfig, max_restarts: int, setup_timeout: float = 0.0):
        self._ctx = ctx
        self.limits = Limits(config.job_restarts(max_restarts), config.max_no_progress_restarts)
        self._me = f"{ctx.node.record.host}:{ctx.node.record.pid}"  # as the membership names it
        self._round: int | None = None
        self._setup_timeout = setup_timeout  # the setup section's bound (0: none): start to first step
        self._started: float | None = None  # when this round's workers started (monotonic)

    def start(self) -> "RestartBudget":
        """A new launch of a run (every agent of the record's launch is gone) gets a fresh budget."""
        live = {f"{r.host}:{r.pid}" for r in self._ctx.membership.members().values()} | {self._me}

        def fresh_launch(record: RestartRecord) -> RestartRecord:
            stale = record.agents and not set(record.agents) & live
            record = record.for_new_launch() if stale else record
            if record.job_restarts_limit is None:  # the first agent of the launch states the limits
                record = replace(record, job_restarts_limit=self.limits.job_restarts,
                                 no_progress_limit=self.limits.no_progress)
            return record

        try:
            self._change(fresh_launch)
        except StoreError as exc:
            log.warning("cannot read the job-wide restart record (%s); it is read again at the first restart", exc)
        log.info("job-wide restart budget %d (%s)%s", self.limits.job_restarts, flag_name("max_job_restarts"),
                 f"; the job ends after {self.limits.no_progress} restart cycle(s) in a row without progress"
                 if self.limits.no_progress else "")
        return self

    def joined(self, round_: int) -> None:
        """The rendezvous round this agent's workers now run in (they start now)."""
        self._round = round_
        self._started = time.monotonic()

    def before_restart(self, reason: str, stop_workers: Callable[[], None], failed: RunResult | None = None) -> bool:
        """Report the cycle that ends now; if the job must end instead, ``stop_workers`` (as the
        restart would have: the hung ranks' stacks first, their signal) and raise ``JobEnded``,
        quoting ``failed`` (the workers' last failure).

        True: this report was the cycle's first, so this node's restart is the one that counts it as
        the job's (eft_job_restarts_total: once per cycle, however many nodes restart for it).
        etcd out of reach does not stop a restart: the cycle goes uncounted.
        """
        if self._round is None:
            return False
        try:
            mark, watched = self._progress_mark()
            cycle = Cycle(self._round, str(reason), mark, watched, self._me)
            before, after = self._change(lambda record: report_cycle(record, cycle, self.limits))
        except StoreError as exc:
            log.warning("restart not counted job-wide: etcd is out of reach (%s)", exc)
            return False
        if after.ended is None:
            log.info("restart cycle of round %d (%s): %d of %d restarts charged job-wide, %d cycle(s) in a row "
                     "without progress", cycle.round, reason, after.charged, self.limits.job_restarts,
                     after.no_progress)
            return before.round < cycle.round == after.round
        ended = ENDINGS[after.ended](after, self.limits, quote(failed))
        log.error("%s", ended)
        if before.ended is None:  # this report decided it: one event for the job
            self._record(after)
        stop_workers()
        raise ended

    def raise_ending(self) -> None:
        """After a failed rendezvous: if the rule ended this launch meanwhile, raise its
        ``NoProgress`` (a node left waiting for peers that ended the job exits as they do)."""
        try:
            record = self._read()[0]
        except StoreError:
            return
        if record.ended is Ending.NO_PROGRESS:
            raise NoProgress(record, self.limits)
        if record.ended is not None:
            log.error("%s", ENDINGS[record.ended](record, self.limits))

    def _record(self, record: RestartRecord) -> None:
        mark = record.mark or ProgressMark()
        if record.ended is Ending.NO_PROGRESS:
            self._ctx.record(EventKind.NO_PROGRESS, cycles=record.no_progress, limit=self.limits.no_progress,
                             reached=mark.reached, checkpoint=mark.checkpoint)
        else:
            self._ctx.record(EventKind.RESTART_BUDGET_EXHAUSTED, restarts=record.charged, limit=self.limits.job_restarts)

    def _progress_mark(self) -> tuple[ProgressMark, bool]:
        """This node's view: the newest complete checkpoint and its workers' highest iteration,
        and whether that iteration is known (heartbeats, or a generation that ended too soon to
        have reached a first step)."""
        beats = read_progress(self._ctx.run_dir)
        reached = max((b.iteration for b in beats.values() if b.iteration is not None), default=None)
        return ProgressMark(self._newest_checkpoint(), reached), bool(beats) or self._ended_in_setup()

    def _ended_in_setup(self) -> bool:
        lived = time.monotonic() - self._started if self._started is not None else None
        return lived is not None and 0 < self._setup_timeout and lived < self._setup_timeout

    def _newest_checkpoint(self) -> int | None:
        client, keys = self._ctx.client, self._ctx.keys
        latest = client.get(keys.ckpt_latest)
        alive = set(self._ctx.membership.members()) | {self._ctx.node_id}
        return newest_checkpoint(latest.value if latest else None, MemIndex(client, keys).parts(), alive)

    def _read(self):
        current = self._ctx.client.get(self._ctx.keys.restarts)
        return _parse(current), current

    def _change(self, change) -> tuple[RestartRecord, RestartRecord]:
        """Apply ``change`` with compare-and-swap, retried from what etcd holds after a lost race."""
        client, key = self._ctx.client, self._ctx.keys.restarts
        before, current = self._read()
        while True:
            after = change(before)
            if after == before and current is not None:
                return before, after
            swapped, now = client.compare_and_swap(key, current.mod_revision if current else None, after.to_json())
            if swapped:
                return before, after
            current, before = now, _parse(now)


def failed_result(ended: JobEnded, failed: RunResult | None, worker_group: WorkerGroup,
                  run_dir: Path) -> RunResult:
    """The failed result torch's launcher reports (exit 1, its failure table): the workers' last
    failure, or, when this node's workers did not fail, one saying why the job ended."""
    if failed is not None and failed.failures:
        return RunResult(state=WorkerState.FAILED, failures=failed.failures)
    error_file = write_error_file(Path(run_dir) / "restart-budget.json", f"RestartBudgetExhausted: {ended}")
    workers = worker_group.workers or []
    rank = workers[0].global_rank if workers else 0
    return RunResult(state=WorkerState.FAILED,
                     failures={rank: ProcessFailure(local_rank=0, pid=-1, exitcode=1, error_file=error_file)})


def quote(failed: RunResult | None) -> str:
    """The workers' first failure in one line: which rank, how it ended, and the message of
    its error file (torch's ``@record``) when it wrote one."""
    if failed is None or not failed.failures:
        return ""
    rank, failure = min(failed.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}")
    message = failure.message  # torch gives an error file's record as it is: {"message": ..., "extraInfo": ...}
    message = str(message.get("message", "")) if isinstance(message, dict) else str(message or "")
    first = message.strip().splitlines()[0] if message.strip() else ""
    said = f": {first[:300]}" if first and "pytorch.org/docs" not in first and "received by PID" not in first else ""
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}{said}"


def _parse(current) -> RestartRecord:
    if current is None:
        return RestartRecord()
    try:
        return RestartRecord.from_json(current.value)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("the job-wide restart record is malformed (%s); starting it afresh", exc)
        return RestartRecord()
