"""FTElasticAgent: torchrun's LocalElasticAgent plus a node lease and fast re-plans.

What it changes, each through one of the agent's steps:

* ``run``: before the first rendezvous, join the run (``AgentContext``: the node's record under an
  etcd lease, a watch on everyone's) and start the services (``services.py``); on the way out, stop
  them and leave (cleanly after success).
* ``_rendezvous``: forget earlier losses; a straggler's node may leave here (``--eft-straggler-action``).
* ``_assign_worker_ranks``: with Megatron's model arguments, ranks from the round's
  plan (``replan.py``); spare ranks get no worker.
* ``_monitor_workers``: one look at the workers, the membership and the heartbeats (``observe.py``),
  and ``decide`` (``decide.py``) says what it calls for: a lost member restarts the workers at once,
  not charged to ``--max-restarts``; a hung rank is a failure like a crashed one. A worker failure
  is first given ``failure_grace`` seconds to be explained by a lost member: when a node dies its
  peers' collectives fail at once, but etcd only reports the death when the lease runs out.
* ``_start_workers``: each worker dies with the agent, even a SIGKILLed one (``orphans.py``).
* ``_stop_workers``: the decision's signal (SIGKILL for ranks that could not act on
  SIGTERM: a peer is dead or hung, ``dead_peers.py``), after the hung ranks' stacks are in the log.
* ``_restart_workers``: every restart is a ``restart`` event with its reason, counted once per
  cycle job-wide (``restart_budget.py``): a job-wide budget and a no-progress rule may end the job.

With a rendezvous backend other than etcd-v3 there is no etcd to hold leases in, and the agent
behaves exactly like torchrun's. Private torch names are reached only through ``elasticft.torch_seam``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError, RendezvousGracefulExitError

from elasticft import torch_seam
from elasticft.agent.announce import announce
from elasticft.agent.auto_timeouts import SectionTimeouts
from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.context import AgentContext, EtcdTarget
from elasticft.agent.dead_peers import current_round, stop_decision, tell_peers
from elasticft.agent.decide import (
    FENCED,
    REPORT,
    Decision,
    RestartReason,
    Verdict,
    decide,
    restart_reason,
)
from elasticft.agent.exclusion import why_leaving
from elasticft.agent.hang_monitor import HangMonitor
from elasticft.agent.job_end import close_before_leaving, record_job_end, why_left
from elasticft.agent.join_gate import JoinGate
from elasticft.agent.memory import MemoryService
from elasticft.agent.metrics import AgentParts, MetricsService
from elasticft.agent.numerics import NumericsWatch
from elasticft.agent.observe import Observer
from elasticft.agent.orphans import helpers_exited, kill_sessions, workers_die_with_agent
from elasticft.agent.outcome import record_outcome
from elasticft.agent.replan import RoundPlanner
from elasticft.agent.restart_budget import BudgetExhausted, RestartBudget, failed_result
from elasticft.agent.segments import StopRecorder
from elasticft.agent.services import AgentServices, WorkerProbe
from elasticft.agent import spares
from elasticft.agent.warm_pool import WarmPool
from elasticft.config import Settings, env_name
from elasticft.contract.events import EventKind
from elasticft.contract.phases import RestartPhase
from elasticft.contract.progress import read_progress, saved_and_stopped
from elasticft.contract.records import layout_record
from elasticft.contract.run_dir import TrainingLoop, WorkerEnv
from elasticft.rendezvous.backend import hold_joins, rendezvous_revision, rendezvous_round, stand_aside_if_cut
from elasticft.slurm.worker_env import slurm_worker_env

log = logging.getLogger(__name__)


class FTElasticAgent(LocalElasticAgent):
    def __init__(self, spec, logs_specs, *, settings: Settings, etcd: EtcdTarget | None, **kwargs):
        super().__init__(spec, logs_specs, **kwargs)
        self._settings = settings
        self._etcd = etcd
        self._run_dir = Path(tempfile.mkdtemp(prefix="eft-run-"))
        self._ctx: AgentContext | None = None  # None off the etcd-v3 backend
        self._services = AgentServices()
        self._hangs: HangMonitor | None = None
        self._observer: Observer | None = None  # made in run(), with the hang monitor
        self._memory: MemoryService | None = None  # the memory checkpoint tier (etcd-v3 only)
        self._metrics: MetricsService | None = None  # /metrics (etcd-v3 only; --eft-metrics-port)
        self._stops = StopRecorder(None, self._run_dir)  # workers_stopped events (etcd-v3 only; made in _start)
        self._budget: RestartBudget | None = None  # job-wide restart counts (etcd-v3 only)
        self._failed: RunResult | None = None  # the workers' last failure, for a job the budget ends
        self._excluded = False  # this node left the job (a straggler, or suspect)
        self._numerics: NumericsWatch | None = None  # made in run(), once the node id is known
        bridge = os.environ.get(WorkerEnv.TRAINING_LOOP) == TrainingLoop.MEGATRON_BRIDGE  # set by eft-run (mode.py)
        self._planner = RoundPlanner.for_worker(spec.args, settings.planner, bridge=bridge)
        self._warm = WarmPool(settings.start, self._run_dir, settings.ft.die_with_agent)  # --eft-warm-workers
        self._ckpt = CheckpointCoordinator(settings.ckpt, self._signal_workers, self._run_dir)
        # The monitor's last decision that stops the workers: read by the stop and
        # restart steps torch calls after it (a hang's restart comes a loop later).
        self._pending: Decision = REPORT
        self._rounds = 0
        self._sessions: set[int] = set()  # this generation's session ids (workers' pids): what they leave ends with them
        self._leftovers: list = []  # what the last stop killed in those sessions, awaited before the next start
        self.membership_restarts = 0
        # Why this node's workers agreed to save and exit (None: they did not): eft-run's exit status.
        self.stop_reason: str | None = None

    # -- lifecycle -----------------------------------------------------------------

    def run(self, role: str = "default") -> RunResult:
        clean = False
        stopped_by = None
        try:
            self._start()
            try:
                result = super().run(role)
            except BudgetExhausted as ended:  # fail as torch does when --max-restarts runs out
                result = failed_result(ended, self._failed, self.get_worker_group(), self._run_dir)
            except RendezvousError as exc:  # left waiting for peers that ended the job: end the same way
                if self._budget is not None:
                    self._budget.raise_ending()
                if not isinstance(exc, RendezvousClosedError):
                    raise
                result = None  # the others ended the job while this node waited to join: so does it
            if result is None:
                # torch's run returns nothing after a graceful rendezvous exit: ours, after
                # this node left as a straggler, or torch's, for a node on the redundancy
                # list of a rendezvous that closed. Nothing failed on this node.
                log.info(why_left(self.get_worker_group().spec.rdzv_handler, self._excluded))
                result = RunResult(state=WorkerState.SUCCEEDED)
            clean = not result.is_failed()
            return result
        except BaseException as exc:
            stopped_by = type(exc).__name__
            raise
        finally:
            self._finish(clean, stopped_by)

    def _start(self) -> None:
        spec = self.get_worker_group().spec
        if self._etcd is not None:
            host = spec.local_addr or socket.getfqdn()
            self._metrics = MetricsService(self._settings.metrics, host)  # before joining: its address is in the record
            MemoryService.before_joining(self._settings.memory)  # imports that would starve the lease's keep-alives
            self._ctx = AgentContext.join(
                self._etcd, self._settings.ft.node_id, host, spec.local_world_size, self._settings.ft.lease_ttl,
                self._run_dir, self._settings.memory.domain(), self._metrics.address,
                self._settings.segments.node_segment())
            self._ctx.record(EventKind.NODE_JOINED, host=self._ctx.node.record.host, gpus=spec.local_world_size)
            spares.attach(spec.rdzv_handler, self._ctx, self._services, self._settings.segments)  # spares say so
            hold_joins(spec.rdzv_handler, JoinGate.for_agent(self._settings, self._ctx, spec.args))  # --eft-join-at
            self._ctx.client.outage.on_recovered(lambda seconds, failed: self._ctx.record(
                EventKind.ETCD_UNAVAILABLE, seconds=round(seconds, 1), failed_requests=failed))
            self._budget = RestartBudget(self._ctx, self._settings.restarts, spec.max_restarts,
                                         self._settings.hang.section_timeouts()["setup"]).start()
        # Workers inherit the agent's environment (torch copies os.environ).
        ctx = self._ctx
        os.environ.update(self._ckpt.worker_environment(ctx.client if ctx else None, ctx.keys if ctx else None))
        os.environ[env_name("stack_signal")] = self._settings.hang.stack_signal
        if self._settings.ft.inject:
            os.environ[WorkerEnv.INJECT] = self._settings.ft.inject
        self._numerics = NumericsWatch(self._settings.numerics, self._run_dir, ctx.node_id if ctx else socket.getfqdn())
        os.environ.update(self._numerics.worker_environment())
        if ctx is not None:
            probe = WorkerProbe(spec.local_world_size, lambda: torch_seam.worker_processes(self),
                                self._world_size)
            self._services.start(ctx, self._settings, self._ckpt, probe)
            self._numerics.connect(ctx, self._ckpt.on_outbox)  # after the relay started
            self._memory = MemoryService(self._settings.memory, ctx, spec.local_addr or socket.getfqdn(),
                                         self._run_dir, self._holds_rank0, self._settings.ft.inject,
                                         self._settings.replication.mem_ckpt_max_lag).start(self._ckpt)
            os.environ.update(MemoryService.worker_environment(self._settings.memory))
            self._metrics.connect(AgentParts(ctx, self._services, self._memory.tier, lambda: self._stops,
                                             self._world_size, lambda: len(torch_seam.worker_pids(self)),
                                             self._holds_rank0))
        timeouts = SectionTimeouts.for_worker(self._settings.hang, spec.args,
                                              ctx.client if ctx else None, ctx.keys if ctx else None)
        self._stops = StopRecorder(ctx.record if ctx else None, self._run_dir)
        self._hangs = HangMonitor(self._settings.hang, timeouts, self._run_dir, ctx.record if ctx else None)
        self._observer = Observer(ctx.membership if ctx else None, ctx.node if ctx else None, self._hangs, self._ckpt,
                                  self._settings.ft.attribution_window,
                                  lambda: set(torch_seam.worker_pids(self).values()), self._numerics,
                                  ctx.fence.must_fence if ctx and ctx.fence else lambda: False,
                                  lambda: current_round(spec.rdzv_handler), ctx.end_gone_neighbours if ctx else None)
        self._ckpt.forward_exit_signals()
        self._warm.stand_ready(spec.entrypoint, spec.args, spec.local_world_size)  # imports while the round forms

    def _finish(self, clean: bool, stopped_by: str | None) -> None:
        helpers_exited([*self._leftovers, *kill_sessions(self._sessions)])  # what the workers left (orphans.py)
        self._warm.close()
        if self._stops is not None:
            self._stops.stopped("finished" if clean else "failed")
        if self._metrics is not None:  # first: a scrape reads the services and the memory tier
            self._metrics.close()
        self._services.stop()
        if self._memory is not None:
            self._memory.close()
        if self._hangs is not None:
            self._hangs.close()
        group = self.get_worker_group()
        record_job_end(self._ctx, group, self._settings, clean, self._excluded, stopped_by)
        beats = read_progress(self._run_dir)
        self.stop_reason = next((r.stop_reason for r in beats.values() if r.stop_reason), None)
        decided = record_outcome(self._ctx, group, clean and not self._excluded, self.stop_reason)
        self._ckpt.close()
        if self._ctx is not None:
            close_before_leaving(group, self._excluded, stopped_by, job_ended=decided is not None)
            if clean:
                self._ctx.record(EventKind.NODE_LEFT)
            self._ctx.leave(clean or saved_and_stopped(beats))  # a job-wide save and stop: a departure
        self._services.close_notifier()
        shutil.rmtree(self._run_dir, ignore_errors=True)

    def _holds_rank0(self) -> bool:
        return any(w.global_rank == 0 for w in self.get_worker_group().workers)

    def _world_size(self) -> int | None:
        """The number of ranks in the current round (None between rounds or on a spare node)."""
        workers = self.get_worker_group().workers
        return workers[0].world_size if workers else None

    def _signal_workers(self, signum: int) -> None:
        for pid in torch_seam.worker_pids(self).values():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    # -- overridden steps ------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        ctx = self._ctx
        if ctx is not None:
            ctx.rejoin_if_fenced(self._settings.ft.etcd_outage_limit)
            why = why_leaving(ctx, self._services, self._numerics, worker_group)  # --eft-*-action exclude
            if why:
                self._excluded = True
                raise RendezvousGracefulExitError(why)
            # (eft's handler builds each round's store address anew: no cached address of a lost rank 0)
            ctx.membership.take_losses()
        super()._rendezvous(worker_group)
        while stand_aside_if_cut(worker_group.spec.rdzv_handler):  # reaches etcd, not the round's master
            super()._rendezvous(worker_group)
        if self._budget is not None:
            self._budget.joined(rendezvous_round(worker_group.spec.rdzv_handler))
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        if ctx is not None:
            # A node that left as a straggler left before this round: its departure,
            # seen while the round formed, calls for no further restart.
            handler = worker_group.spec.rdzv_handler
            ctx.membership.forget_non_members(rendezvous_revision(handler), rendezvous_round(handler))
            if self._planner is None and worker_group.group_rank == 0:
                # No model to plan for: still tell `eft top` what this round looks like.
                self._rounds += 1
                ctx.publish(ctx.keys.layout, layout_record(None, self._rounds, world))
        self._stops.stamp(RestartPhase.REPLAN)  # eft report's restart phases (segments.py)
        log.info("rendezvous complete: node rank %s of %s, world size %s",
                 worker_group.group_rank, worker_group.group_world_size, world)

    def _assign_worker_ranks(
        self, store, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        """With a Megatron model: ranks from the round's plan; spare ranks get no worker."""
        self._stops.stamp(RestartPhase.RENDEZVOUS)  # torch calls this step as the round forms
        if self._planner is None:
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        share = self._planner.assign(store, group_rank, group_world_size, spec.local_world_size)
        chosen = share.plan
        self._rounds += 1
        if group_rank == 0 and self._ctx is not None:
            self._ctx.publish(self._ctx.keys.layout, layout_record(chosen, self._rounds))
            self._ctx.record(EventKind.LAYOUT, tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, used=chosen.used,
                             world_size=chosen.world, spare=chosen.spare)
        log.info(
            "layout TP%d x PP%d x DP%d on %d of %d GPUs; this node runs %d worker(s)%s",
            chosen.tp, chosen.pp, chosen.dp, chosen.used, chosen.world, share.local_workers,
            f"; spare ranks {chosen.spare}" if chosen.spare else "",
        )
        return [
            Worker(local_rank=i, global_rank=share.first_rank + i, role_rank=share.first_rank + i,
                   world_size=chosen.used, role_world_size=chosen.used)
            for i in range(share.local_workers)
        ]

    def _start_workers(self, worker_group: WorkerGroup) -> dict:
        self._ckpt.before_workers_start()
        self._numerics.forget_rollback()
        if self._memory is not None and worker_group.workers:
            round_revision = rendezvous_revision(worker_group.spec.rdzv_handler)
            os.environ.update(self._memory.before_workers_start(worker_group.group_rank, round_revision))
        self._hangs.forget_heartbeats()
        if self._stops is not None and worker_group.workers:
            self._stops.started()
        if self._planner is not None:
            worker_group.spec.args = self._planner.worker_args()
            os.environ.update(self._planner.worker_env())
        helpers_exited(self._leftovers)  # killed at the stop; their exit overlapped the rendezvous
        self._leftovers = []
        if not worker_group.workers:
            # A spare node: nothing to run until the next membership change.
            torch_seam.forget_worker_processes(self)
            return {}
        # Under SLURM each worker's SLURM_PROCID etc. become its own, not its agent's.
        with workers_die_with_agent(worker_group.spec, self._settings.ft.die_with_agent), self._warm.handlers(), \
                torch_seam.worker_envs_filled(lambda env, _: env.update(slurm_worker_env(env, os.environ))):
            pids = super()._start_workers(worker_group)
        self._sessions = set(pids.values())
        self._stops.stamp(RestartPhase.SPAWN)
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the workers with the signal the last decision chose (SIGTERM by default).

        torch calls this step before every restart and when it gives up; the hung ranks'
        stacks are taken first, since a killed rank has none to show.
        """
        if self._hangs is not None:
            self._hangs.wait_for_stacks()
        super()._shutdown(self._pending.stop_signal)
        self._leftovers += kill_sessions(self._sessions)  # what they started; exits awaited at the next start
        self._sessions = set()  # ids reused later are not ours
        if self._stops is not None:
            self._stops.stopped("restart")

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """Every restart is an event; torch has already charged a worker failure to --max-restarts.
        The job-wide count comes first: it may end the job instead (the workers stop as for a restart)."""
        if self._pending is REPORT and self._observer.fenced():  # torch's own restart, on a fenced node
            self._pending = FENCED
            announce(FENCED, self._ctx, self.membership_restarts)
        if self._pending.reason is RestartReason.FENCED:  # now: the report below may wait for etcd
            super()._shutdown(self._pending.stop_signal)
        self._pending = stop_decision(worker_group, self._pending, self._observer)  # dead peers: SIGKILL
        reason = restart_reason(self._pending, worker_group.state)
        opened = self._budget is not None and self._budget.before_restart(
            reason, lambda: self._stop_workers(worker_group), self._failed)  # the cycle's first report: the job's
        if self._ctx is not None:
            self._ctx.record(EventKind.RESTART, reason=reason, job_restart=opened,
                             remaining_restarts=torch_seam.remaining_restarts(self),
                             max_restarts=worker_group.spec.max_restarts)
            tell_peers(self._ctx, worker_group, reason)  # after the event: the peers' restarts follow it
        try:  # torch's restart calls _stop_workers, which reads the pending decision
            super()._restart_workers(worker_group)
        finally:
            self._pending = REPORT
            self._failed = None  # a new generation: its own failures are the ones to report

    def _shutdown(self, death_sig=None, timeout: int = 30) -> None:
        """Stop the workers when the agent ends; after an exit signal, give them the grace
        period to save. torch calls this with the signal's number when the agent is
        signalled, with none when the agent ends otherwise (and, from torch 2.12 on, with its own
        timeout; before, never: this default is the grace then)."""
        if death_sig is None:
            torch_seam.shutdown(super()._shutdown, self, signal.SIGTERM, timeout)
        else:
            torch_seam.shutdown(super()._shutdown, self, death_sig, self._ckpt.shutdown_timeout(death_sig, timeout))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._services.show_injected_fault()
        self._warm.tick()
        if worker_group.workers:
            with torch_seam.failure_kills_the_rest(self):  # a worker failed: the rest are stuck (dead_peers.py)
                result = super()._monitor_workers(worker_group)
            self._failed = result if result.is_failed() else self._failed
        else:  # a spare node idles, and finishes when the working nodes reach torch's exit barrier
            result = RunResult(state=WorkerState.SUCCEEDED if self._working_nodes_finished() else WorkerState.HEALTHY)
        seen = self._observer.look(result.state, worker_group, result.failures)
        decision = decide(seen)
        if decision.verdict is Verdict.REPORT:
            return result
        self._pending = decision
        if decision.verdict is Verdict.HANG:
            # torch restarts the group as for a failed worker, charged to --max-restarts.
            self._failed = self._hangs.failure(list(seen.overruns), worker_group)
            return self._failed
        if decision.reason is RestartReason.MEMBERSHIP:
            self.membership_restarts += 1
        announce(decision, self._ctx, self.membership_restarts)
        self._restart_workers(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _working_nodes_finished(self) -> bool:
        """A spare node's view of the job: have the working nodes reached torch's exit barrier?"""
        try:
            return torch_seam.exit_barrier_reached(torch_seam.rendezvous_store(self))
        except Exception as exc:  # noqa: BLE001 - a store in trouble is the working nodes' problem
            log.debug("spare node cannot read the exit barrier: %s", exc)
            return False
