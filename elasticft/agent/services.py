"""The node agent's services: notifier, checkpoint relay, health sampler, watchdogs, stragglers,
etcd housekeeping.

They run beside torch's agent loop from the first rendezvous to the agent's exit, each
on its own thread, and all reach the run through the one ``AgentContext``. The agent
starts them in ``run()`` and stops them, newest first, on the way out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.context import AgentContext
from elasticft.agent.housekeeping import EtcdHousekeeper
from elasticft.agent.notify import Notifier
from elasticft.agent.stragglers import StragglerMonitor
from elasticft.agent.watchdogs import Watchdogs, worker_activity
from elasticft.config import Settings
from elasticft.contract.faults import FaultKind, parse_faults
from elasticft.health import (
    EtcdHealthPublisher,
    HealthSampler,
    RiskModel,
    RiskScore,
    make_source,
)
from elasticft.health.injected import InjectedGpuSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerProbe:
    """What the services may ask the agent about its workers (read at each check: the
    process context is replaced at every restart)."""

    local_world_size: int
    pcontext: Callable[[], Any]  # torch's process context of the running workers, or None
    world_size: Callable[[], int | None]  # ranks in the current round; None between rounds


class AgentServices:
    """Started services, by name; None where a service is off or has nothing to watch."""

    def __init__(self) -> None:
        self.notifier: Notifier | None = None
        self.sampler: HealthSampler | None = None
        self.watchdogs: Watchdogs | None = None
        self.stragglers: StragglerMonitor | None = None
        self.housekeeper: EtcdHousekeeper | None = None
        self._injected_fault_seen = False

    def start(self, ctx: AgentContext, settings: Settings, ckpt: CheckpointCoordinator,
              workers: WorkerProbe) -> "AgentServices":
        self.notifier = self._notifier(ctx, settings)
        ckpt.connect(ctx)
        self.sampler = self._sampler(ctx, settings, ckpt, workers)
        self.watchdogs = self._watchdogs(ctx, settings, ckpt, workers)
        self.stragglers = self._stragglers(ctx, settings, workers)
        housekeeper = EtcdHousekeeper(settings.housekeeping, ctx, settings.housekeeping.archive_path(
            settings.ft.events_file, ctx.keys.run_id))
        self.housekeeper = housekeeper.start() if housekeeper.enabled else None
        return self

    @staticmethod
    def _notifier(ctx: AgentContext, settings: Settings) -> Notifier | None:
        notify = settings.notify
        sinks = notify.sinks()
        if not sinks:
            return None
        notifier = Notifier(sinks, notify.notify_rate_limit, notify.notify_window, run=ctx.keys.run_id)
        ctx.events.notifier = notifier
        return notifier

    @staticmethod
    def _sampler(ctx: AgentContext, settings: Settings, ckpt: CheckpointCoordinator,
                 workers: WorkerProbe) -> HealthSampler | None:
        """Sample this node's GPUs and publish their risk under the node lease."""
        if any(f.kind is FaultKind.GPU_DEGRADE for f in parse_faults(settings.ft.inject)):
            # Injected GPU faults replace the real readings (see elasticft/contract/faults.py).
            source = InjectedGpuSource(ctx.node_id, workers.local_world_size, ctx.run_dir)
        else:
            source = make_source(settings.health.health_source, ctx.node_id)
        if source is None:
            return None

        def on_gpu_at_risk(score: RiskScore) -> None:
            """A GPU crossed the risk threshold: ask the whole job to save now."""
            ckpt.request_for_risk(f"{score.node}/gpu{score.gpu}", score.score)

        publisher = EtcdHealthPublisher(ctx.client, ctx.keys, ctx.node_id, ctx.lease)
        return HealthSampler(source, RiskModel(settings.risk), interval=settings.health.health_interval,
                             publish=publisher, on_trigger=on_gpu_at_risk).start()

    def _watchdogs(self, ctx: AgentContext, settings: Settings, ckpt: CheckpointCoordinator,
                   workers: WorkerProbe) -> Watchdogs | None:
        sampler = self.sampler  # None: no GPU readings, no GPU memory check
        dogs = Watchdogs(
            settings.watchdog,
            ctx.record,
            lambda trip: ckpt.request_for_watchdog(trip.requester(ctx.node_id), trip.message,
                                                   exit=trip.save_and_exit),
            read_gpus=(lambda: [s for s, _ in sampler.latest.values()]) if sampler is not None else None,
            read_activity=lambda: worker_activity(ctx.run_dir, workers.pcontext()),
        )
        return dogs.start() if dogs.enabled else None

    def _stragglers(self, ctx: AgentContext, settings: Settings, workers: WorkerProbe) -> StragglerMonitor | None:
        sampler = self.sampler
        monitor = StragglerMonitor(
            settings.straggler, ctx, set_risk=sampler.model.set_straggler if sampler is not None else None,
            gpu_of=self.gpu_of, world_size=workers.world_size,
        )
        return monitor.start() if monitor.enabled else None

    def gpu_of(self, local_rank: int) -> int:
        """The GPU index (as health records name it) that local rank ``local_rank`` uses.

        Workers use the local_rank-th visible device; NVML names it by its own index.
        """
        gpus = getattr(getattr(self.sampler, "source", None), "gpus", None)
        if isinstance(gpus, list) and local_rank < len(gpus) and isinstance(gpus[local_rank], tuple):
            return gpus[local_rank][0]
        return local_rank

    def show_injected_fault(self) -> None:
        """An injected GPU fault is a demo: sample at once when it fires, not in 10 s."""
        source = getattr(self.sampler, "source", None)
        if isinstance(source, InjectedGpuSource) and not self._injected_fault_seen:
            if source.degraded_gpu() is not None:
                self._injected_fault_seen = True
                self.sampler.wake()

    def stop(self) -> None:
        """Stop the monitors, newest first (the notifier stays: see ``close_notifier``)."""
        for service in (self.housekeeper, self.stragglers, self.watchdogs, self.sampler):
            if service is not None:
                service.stop()
        if self.sampler is not None:
            self.sampler.source.close()

    def close_notifier(self) -> None:
        """Last of all, so that it still delivers the events of the agent's exit."""
        if self.notifier is not None:
            self.notifier.close(timeout=10.0)
