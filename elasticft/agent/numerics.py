"""The agent's half of the numbers check (``elasticft.worker.numerics`` is the workers').

* Workers that stop for a rollback exit 0 and leave ``ROLLBACK_FILE``: torch would take
  that for the end of training; ``take_rollback`` tells the monitor to restart them
  instead (``decide``: ``RestartReason.ROLLBACK``).
* Rank 0 reports each verdict through the outbox; its agent records it as an event.
* A node the workers found suspect: its agent pins its GPUs' risk at 1.0 and, with
  ``--eft-suspect-action exclude``, leaves at the restart (``exclusion.leave_job``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from elasticft.agent.context import AgentContext
from elasticft.agent.exclusion import leave_job
from elasticft.contract.events import EventKind
from elasticft.contract.numerics import NUMERICS_FILE, ROLLBACK_FILE, NumericsState
from elasticft.contract.run_dir import OutboxKind, WorkerEnv
from elasticft.config import NumericsConfig

log = logging.getLogger(__name__)

VERDICTS = frozenset({EventKind.ROLLBACK, EventKind.TRANSIENT_FAULT, EventKind.DATA_SKIPPED, EventKind.NODE_SUSPECT})


class NumericsWatch:
    def __init__(self, config: NumericsConfig, run_dir: Path, node_id: str):
        self.config = config
        self._run_dir = Path(run_dir)
        self._node_id = node_id
        self._suspect_seen = False

    def worker_environment(self) -> dict[str, str]:
        return {WorkerEnv.NODE_ID: self._node_id, **self.config.worker_environment()}

    def connect(self, ctx: AgentContext, on_outbox) -> None:
        """Record rank 0's verdicts as events (``on_outbox``: the checkpoint relay's registry)."""

        def record(message: dict) -> None:
            fields = {k: v for k, v in message.items() if k not in ("type", "event")}
            try:
                kind = EventKind(message.get("event"))
            except ValueError:
                log.warning("ignoring a numbers-check message of unknown kind: %s", message)
                return
            if kind in VERDICTS:
                ctx.record(kind, **fields)

        on_outbox(OutboxKind.NUMERICS, record)

    def take_rollback(self) -> bool:
        """Whether the workers stopped for a rollback (and forget that they did)."""
        try:
            (self._run_dir / ROLLBACK_FILE).unlink()
        except FileNotFoundError:
            return False
        return True

    def forget_rollback(self) -> None:
        """Before workers start: a marker left by a generation that then failed means nothing."""
        (self._run_dir / ROLLBACK_FILE).unlink(missing_ok=True)

    def newly_suspect(self) -> bool:
        """True the first time the workers' state names this node suspect."""
        if self._suspect_seen:
            return False
        try:
            state = NumericsState.from_json((self._run_dir / NUMERICS_FILE).read_text())
        except FileNotFoundError:
            return False
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable %s: %s", NUMERICS_FILE, exc)
            return False
        self._suspect_seen = self._node_id in state.suspects
        if self._suspect_seen:
            log.warning("this node (%s) is suspect: implicated in %d numeric faults; its GPUs' risk is 1.0%s",
                        self._node_id, state.implicated.get(self._node_id, 0),
                        "; it leaves the job" if self.wants_exclusion else "")
        return self._suspect_seen

    @property
    def wants_exclusion(self) -> bool:
        return self._suspect_seen and self.config.suspect_action == "exclude"

    def at_restart(self, ctx: AgentContext, risk_model, rdzv_handler, ranks: list[int]) -> bool:
        """Before the next round: a newly suspect node's GPUs go to risk 1.0 (``risk_model``:
        the sampler's, None without one); True when the node has left the job (exclude)."""
        if self.newly_suspect() and risk_model is not None:
            risk_model.set_suspect(self._node_id, "numeric faults (node_suspect)")
        return self.wants_exclusion and leave_job(ctx, rdzv_handler, ranks, "suspect")
