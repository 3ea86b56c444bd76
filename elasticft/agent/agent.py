"""FTElasticAgent: torchrun's LocalElasticAgent plus a node lease and fast re-plans.

What it changes, each through one of the agent's documented steps:

* ``run``: before the first rendezvous, write ``nodes/<node_id>`` under an etcd lease
  and start watching ``nodes/``; on the way out, leave (cleanly after success).
* ``_rendezvous``: forget losses that happened before this round started; with
  ``--eft-straggler-action exclude``, a node with a straggler leaves the job here
  instead of joining the next round (every restart passes through this step), and
  the others, once their round is formed, forget its departure.
* ``_monitor_workers``: a lost member (its lease expired) restarts the local workers
  through a new rendezvous at once, and is not charged to ``--max-restarts``. A worker
  failure is first given ``failure_grace`` seconds to be explained by a lost member:
  when a node dies its peers' collectives fail at once, but etcd only reports the
  death when the lease runs out, and that failure is not the survivors' fault. A rank
  that overran its section timeout (hang_agent.py) is a failure like a crashed one.
* ``_restart_workers``: every restart is a ``restart`` event with its reason.

With a rendezvous backend other than etcd-v3 there is no etcd to hold leases in, and
the agent behaves exactly like torchrun's.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from torch.distributed.elastic.agent.server.api import (
    _TERMINAL_STATE_SYNC_ID,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from elasticft.agent.auto_timeouts import SectionTimeouts
from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.events import EventLog
from elasticft.agent.exclusion import leave_if_straggler
from elasticft.agent.hang_monitor import HangMonitor
from elasticft.agent.notify import Notifier
from elasticft.agent.replan import RoundPlanner
from elasticft.agent.stragglers import StragglerMonitor
from elasticft.agent.watchdogs import Watchdogs, worker_activity
from elasticft.config import (
    CheckpointConfig,
    FTConfig,
    HangConfig,
    HealthConfig,
    NotifyConfig,
    PlannerConfig,
    RiskConfig,
    StragglerConfig,
    WatchdogConfig,
)
from elasticft.contract.faults import parse_faults
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import layout_record
from elasticft.health import (
    EtcdHealthPublisher,
    HealthSampler,
    RiskModel,
    RiskScore,
    make_source,
)
from elasticft.health.injected import InjectedGpuSource
from elasticft.rendezvous.membership import (
    Membership,
    NodeLease,
    NodeRecord,
    default_node_id,
)
from elasticft.store import StoreOptions, connect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EtcdTarget:
    """Where this run's keys live: endpoints (with TLS/auth) and the key prefix."""

    store: StoreOptions
    keys: RunKeys


@dataclass(frozen=True)
class AgentOptions:
    """Everything eft adds to torchrun's agent; ``etcd`` is None off the etcd-v3 backend."""

    ft: FTConfig
    health: HealthConfig
    risk: RiskConfig
    planner: PlannerConfig
    ckpt: CheckpointConfig
    etcd: EtcdTarget | None
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)


class FTElasticAgent(LocalElasticAgent):
    def __init__(self, spec, logs_specs, *, options: AgentOptions, **kwargs):
        super().__init__(spec, logs_specs, **kwargs)
        self._options = options
        self._ft = options.ft
        self._etcd = options.etcd
        self._client = None
        self._node_lease: NodeLease | None = None
        self._membership: Membership | None = None
        self._events: EventLog | None = None
        self._sampler: HealthSampler | None = None
        self._notifier: Notifier | None = None
        self._watchdogs: Watchdogs | None = None
        self._hangs: HangMonitor | None = None
        self._stragglers: StragglerMonitor | None = None
        self._excluded = False  # this node left the job as a straggler
        self._planner = RoundPlanner.for_worker(spec.args, options.planner)
        self._ckpt = CheckpointCoordinator(options.ckpt, self._signal_workers)
        # How workers are stopped for a restart: torch's SIGTERM, except after a lost
        # node, when SIGTERM would only ask workers stuck in a dead collective to save.
        self._restart_signal = signal.SIGTERM
        self._restart_reason: str | None = None  # for the restart event; None: a worker failed
        self._rounds = 0
        self._degrade_seen = False
        self.membership_restarts = 0

    # -- lifecycle -----------------------------------------------------------------

    def run(self, role: str = "default") -> RunResult:
        clean = False
        stopped_by = None
        try:
            self._join_membership()
            # Workers inherit the agent's environment (torch copies os.environ).
            os.environ.update(self._ckpt.worker_environment(self._client, self._etcd.keys if self._etcd else None))
            os.environ["EFT_STACK_SIGNAL"] = self._options.hang.stack_signal
            if self._ft.inject:
                os.environ["EFT_INJECT"] = self._ft.inject
            if self._client is not None:
                node_id = self._node_lease.record.node_id
                self._start_notifier()
                self._ckpt.connect(self._client, self._etcd.keys, node_id, self._notifier)
                self._start_health_sampler(node_id)
                self._start_watchdogs(node_id)
                self._start_straggler_monitor(node_id)
            self._start_hang_monitor()
            self._ckpt.forward_exit_signals()
            result = super().run(role)
            if result is None and self._excluded:
                # torch's run returns nothing after the graceful exit _rendezvous raised.
                return RunResult(state=WorkerState.SUCCEEDED)
            clean = not result.is_failed()
            return result
        except BaseException as exc:
            stopped_by = type(exc).__name__
            raise
        finally:
            if self._watchdogs is not None:
                self._watchdogs.stop()
            if self._hangs is not None:
                self._hangs.close()
            if self._stragglers is not None:
                self._stragglers.stop()
            self._record_job_end(clean, stopped_by)
            self._ckpt.close()
            self._leave_membership(clean)
            if self._notifier is not None:
                self._notifier.close(timeout=10.0)

    def _start_notifier(self) -> None:
        sinks = self._options.notify.sinks()
        if not sinks:
            return
        notify = self._options.notify
        self._notifier = Notifier(sinks, notify.notify_rate_limit, notify.notify_window, run=self._etcd.keys.run_id)
        self._events.notifier = self._notifier

    def _start_watchdogs(self, node_id: str) -> None:
        sampler = self._sampler  # None: no GPU readings, no GPU memory check
        dogs = Watchdogs(
            self._options.watchdog,
            self._events.record,
            lambda trip: self._ckpt.request_for_watchdog(trip.requester(node_id), trip.message,
                                                         exit=trip.save_and_exit),
            read_gpus=(lambda: [s for s, _ in sampler.latest.values()]) if sampler is not None else None,
            # self._pcontext is read at each check: it is replaced at every restart.
            read_activity=lambda: worker_activity(self._ckpt.run_dir, self._pcontext),
        )
        if dogs.enabled:
            self._watchdogs = dogs.start()

    def _start_hang_monitor(self) -> None:
        """Section timeouts for the workers that keep a heartbeat (the eft hook)."""
        timeouts = SectionTimeouts.for_worker(self._options.hang, self._worker_group.spec.args,
                                              self._client, self._etcd.keys if self._etcd else None)
        record = self._events.record if self._events is not None else None
        self._hangs = HangMonitor(self._options.hang, timeouts, self._ckpt.run_dir, record)

    def _start_straggler_monitor(self, node_id: str) -> None:
        risk = self._sampler.model.set_straggler if self._sampler is not None else None
        monitor = StragglerMonitor(
            self._options.straggler, self._client, self._etcd.keys, node_id, self._ckpt.run_dir,
            self._events.record, lease=self._node_lease.lease, set_risk=risk, gpu_of=self._gpu_of,
            world_size=self._world_size,
        )
        if monitor.enabled:
            self._stragglers = monitor.start()

    def _gpu_of(self, local_rank: int) -> int:
        """The GPU index (as health records name it) that local rank ``local_rank`` uses.

        Workers use the local_rank-th visible device; NVML names it by its own index.
        """
        gpus = getattr(getattr(self._sampler, "source", None), "gpus", None)
        if isinstance(gpus, list) and local_rank < len(gpus) and isinstance(gpus[local_rank], tuple):
            return gpus[local_rank][0]
        return local_rank

    def _world_size(self) -> int | None:
        """The number of ranks in the current round (None between rounds or on a spare node)."""
        workers = self._worker_group.workers
        return workers[0].world_size if workers else None

    def _record_job_end(self, clean: bool, stopped_by: str | None) -> None:
        """The job's end: by the rank-0 node when it succeeded, by every node that failed.

        ``stopped_by``: the exception that ended the agent (SignalException for SIGTERM).
        A node that left as a straggler said so in its ``node_excluded`` event.
        """
        if self._events is None or self._excluded:
            return
        if clean:
            if self._worker_group.group_rank in (0, None):
                self._events.record("job_finished")
        else:
            self._events.record("job_failed", state=self._worker_group.state.name, stopped_by=stopped_by)

    def _signal_workers(self, signum: int) -> None:
        pcontext = self._pcontext
        for pid in pcontext.pids().values() if pcontext is not None else ():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def _join_membership(self) -> None:
        if self._etcd is None:
            return
        self._client = connect(self._etcd.store)
        record = NodeRecord(
            node_id=self._ft.node_id or default_node_id(),
            host=socket.gethostname(),
            # The address torch's rendezvous names this agent by (see NodeRecord).
            rdzv_addr=self._worker_group.spec.local_addr or socket.getfqdn(),
            pid=os.getpid(),
            gpus=list(range(self._worker_group.spec.local_world_size)),
        )
        self._membership = Membership(self._client, self._etcd.keys)
        self._node_lease = NodeLease(self._client, self._etcd.keys, record, self._ft.lease_ttl)
        self._events = EventLog(self._client, self._etcd.keys, record.node_id)
        self._events.record("node_joined", host=record.host, gpus=len(record.gpus))
        log.info("node %s joined run %s (lease TTL %g s)", record.node_id, self._etcd.keys.run_id, self._ft.lease_ttl)

    def _start_health_sampler(self, node_id: str) -> None:
        """Sample this node's GPUs and publish their risk under the node lease."""
        if any(f.kind == "gpu_degrade" for f in parse_faults(self._ft.inject)):
            # Injected GPU faults replace the real readings (see elasticft/contract/faults.py).
            source = InjectedGpuSource(node_id, self._worker_group.spec.local_world_size, self._ckpt.run_dir)
        else:
            source = make_source(self._options.health.health_source, node_id)
        if source is None:
            return
        publisher = EtcdHealthPublisher(self._client, self._etcd.keys, node_id, self._node_lease.lease)
        self._sampler = HealthSampler(
            source,
            RiskModel(self._options.risk),
            interval=self._options.health.health_interval,
            publish=publisher,
            on_trigger=self._on_gpu_at_risk,
        ).start()

    def _on_gpu_at_risk(self, score: RiskScore) -> None:
        """A GPU crossed the risk threshold: ask the whole job to save now."""
        self._ckpt.request_for_risk(f"{score.node}/gpu{score.gpu}", score.score)

    def _leave_membership(self, clean: bool) -> None:
        if clean and self._events is not None:
            self._events.record("node_left")
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler.source.close()
        if self._node_lease is not None:
            self._node_lease.close(clean)
        if self._membership is not None:
            self._membership.close()
        if self._client is not None:
            self._client.close()

    # -- overridden steps ------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self._leave_if_excluded(worker_group)
        if self._membership is not None:
            self._membership.take_losses()
            self._forget_master_address(worker_group)
        super()._rendezvous(worker_group)
        if self._membership is not None:
            self._membership.forget_excluded()
        if self._planner is None and worker_group.group_rank == 0 and self._client is not None:
            # No model to plan for: still tell `eft top` what this round looks like.
            self._rounds += 1
            world = worker_group.workers[0].world_size if worker_group.workers else 0
            self._client.put(self._etcd.keys.layout, layout_record(None, self._rounds, world))
        log.info(
            "rendezvous complete: node rank %s of %s, world size %s",
            worker_group.group_rank,
            worker_group.group_world_size,
            worker_group.workers[0].world_size if worker_group.workers else 0,
        )

    def _leave_if_excluded(self, worker_group: WorkerGroup) -> None:
        """``--eft-straggler-action exclude``: leave at this restart (see exclusion.py)."""
        if self._node_lease is None:
            return
        if leave_if_straggler(self._stragglers, self._node_lease, self._client, self._etcd.keys,
                              worker_group.spec.rdzv_handler, self._events.record):
            self._excluded = True
            raise RendezvousGracefulExitError(f"node {self._node_lease.record.node_id} left the job as a straggler")

    @staticmethod
    def _forget_master_address(worker_group: WorkerGroup) -> None:
        """Make torch publish this round's master address instead of the first round's.

        torch's dynamic rendezvous caches the workers' store address (hosted by the
        rank-0 agent) from its first round and rebuilds it only on a node that becomes
        rank 0. If the old rank 0 was the node we lost, the other survivors would send
        their workers to a dead store. Forgetting the cache makes every round build it
        anew: rank 0 starts a store, the others read its address from the rendezvous.
        """
        handler = worker_group.spec.rdzv_handler
        if hasattr(handler, "_bootstrap_store_info"):
            handler._bootstrap_store_info = None

    def _assign_worker_ranks(
        self, store, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        """With a Megatron model: ranks from the round's plan; spare ranks get no worker."""
        if self._planner is None:
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        share = self._planner.assign(store, group_rank, group_world_size, spec.local_world_size)
        chosen = share.plan
        self._rounds += 1
        if group_rank == 0 and self._client is not None:
            self._client.put(self._etcd.keys.layout, layout_record(chosen, self._rounds))
            self._events.record("layout", tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, used=chosen.used,
                                world_size=chosen.world, spare=chosen.spare)
        log.info(
            "layout TP%d x PP%d x DP%d on %d of %d GPUs; this node runs %d worker(s)%s",
            chosen.tp, chosen.pp, chosen.dp, chosen.used, chosen.world, share.local_workers,
            f"; spare ranks {chosen.spare}" if chosen.spare else "",
        )
        return [
            Worker(
                local_rank=i,
                global_rank=share.first_rank + i,
                role_rank=share.first_rank + i,
                world_size=chosen.used,
                role_world_size=chosen.used,
            )
            for i in range(share.local_workers)
        ]

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """Every restart is an event; torch has already charged a worker failure to --max-restarts."""
        reason = self._restart_reason or "worker_failed"
        if self._events is not None:
            self._events.record("restart", reason=reason, remaining_restarts=self._remaining_restarts,
                                max_restarts=worker_group.spec.max_restarts)
        try:
            super()._restart_workers(worker_group)
        finally:
            self._restart_reason = None
            self._restart_signal = signal.SIGTERM

    def _start_workers(self, worker_group: WorkerGroup) -> dict:
        self._ckpt.before_workers_start()
        if self._hangs is not None:
            self._hangs.forget_heartbeats()
        if self._planner is not None:
            worker_group.spec.args = self._planner.worker_args()
            os.environ.update(self._planner.worker_env())
        if not worker_group.workers:
            # A spare node: nothing to run until the next membership change.
            self._pcontext = None
            return {}
        return super()._start_workers(worker_group)

    def _spare_node_state(self) -> RunResult:
        """A spare node idles, and finishes when the working nodes reach torch's exit barrier."""
        try:
            finished = self._store.check([_TERMINAL_STATE_SYNC_ID + "/num_members"])
        except Exception:  # noqa: BLE001 - a store in trouble is the working nodes' problem
            finished = False
        return RunResult(state=WorkerState.SUCCEEDED if finished else WorkerState.HEALTHY)

    def _shutdown(self, death_sig=None, timeout: int = 30) -> None:
        """Stop the workers; after an exit signal, give them the grace period to save.

        torch calls this with the signal's number when the agent is signalled, and
        with no signal when it stops workers for a restart (torch's timeout then).
        """
        if death_sig is None:
            super()._shutdown(self._restart_signal, timeout)
        else:
            super()._shutdown(death_sig, self._ckpt.shutdown_timeout(death_sig, timeout))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        sampler = self._sampler
        if isinstance(getattr(sampler, "source", None), InjectedGpuSource) and not self._degrade_seen:
            if sampler.source.degraded_gpu() is not None:
                self._degrade_seen = True
                sampler.wake()  # an injected fault is a demo: show it at once, not in 10 s
        if worker_group.workers:
            result = super()._monitor_workers(worker_group)
        else:
            result = self._spare_node_state()
        if result.state == WorkerState.HEALTHY and worker_group.workers:
            hung = self._find_hung_ranks()
            if hung is not None:
                return hung
        if result.state == WorkerState.SUCCEEDED and self._ckpt.restart_after_signal_save:
            # --eft-ckpt-mode signal: the workers saved and exited because we asked.
            self._ckpt.restart_after_signal_save = False
            log.info("workers exited after their signal-driven save; restarting them")
            self._restart_reason = "signal_save"
            self._restart_workers(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state == WorkerState.SUCCEEDED:
            return result
        lost = self._membership_change(result.state, worker_group)
        if lost is None:
            return result
        self.membership_restarts += 1
        if lost:
            self._events.record("node_lost", nodes=[r.node_id for r in lost], restarts=self.membership_restarts)
            log.warning(
                "lost node(s) %s; restarting workers through a new rendezvous "
                "(a membership change, not charged to --max-restarts)",
                ", ".join(f"{r.node_id} ({r.host})" for r in lost),
            )
            # Workers with a dead peer cannot save; do not wait for them to try.
            self._restart_signal = signal.SIGKILL
        else:
            log.warning("workers failed while new nodes wait to join; restarting them "
                        "through a new rendezvous (not charged to --max-restarts)")
        self._restart_reason = "membership"
        self._restart_workers(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _find_hung_ranks(self) -> RunResult | None:
        """A failed result when a live rank overran its section timeout, else None.

        A lost node comes first: its peers' stalls are the membership change's to handle.
        torch then restarts the group as for a failed worker; the hung ranks get SIGKILL,
        since a rank stuck in a collective (or stopped) would not act on SIGTERM.
        """
        if self._hangs is None or (self._membership is not None and self._membership.lost.is_set()):
            return None
        pcontext = self._pcontext
        overruns = self._hangs.check(set(pcontext.pids().values()) if pcontext is not None else set())
        if not overruns:
            return None
        self._restart_reason = "hang"
        self._restart_signal = signal.SIGKILL
        return self._hangs.failure(overruns, self._worker_group)

    def _membership_change(self, state: WorkerState, worker_group: WorkerGroup) -> list[NodeRecord] | None:
        """The nodes lost ([] for a scale-up) if a membership change explains ``state``, else None.

        A lost node is reported by its lease. A worker failure waits up to the
        attribution window for such a report: peers of a dead node fail at once, its
        lease expires later. A failure while nodes wait to join is the scale-up that
        another agent already started (it stopped its workers, ours lost their peers).
        """
        membership = self._membership
        if state not in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            return membership.take_losses() if membership is not None and membership.lost.is_set() else None
        deadline = time.monotonic() + self._ft.attribution_window
        while True:
            if membership is not None and membership.lost.is_set():
                return membership.take_losses()
            # torch caches the rendezvous state for a second: ask again until the deadline.
            if worker_group.spec.rdzv_handler.num_nodes_waiting() > 0:
                return membership.take_losses() if membership is not None else []
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if membership is not None:
                membership.lost.wait(min(0.25, remaining))
            else:
                time.sleep(min(0.25, remaining))
