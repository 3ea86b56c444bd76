"""The agent's checkpoint duties, kept out of agent.py's lifecycle code.

* a node-local run directory and the ``EFT_*`` variables that tell the worker hook
  where it is, which switch files to watch and which signals mean "save and exit";
* the relay between ``ckpt/request`` in etcd and the workers (``relay.py``);
* forwarding exit signals that torch's agent does not handle itself (SIGUSR1, the
  usual SLURM preemption warning) to the workers instead of dying of them;
* ``--eft-ckpt-mode signal``: for unmodified Megatron-LM, a request becomes SIGTERM to
  the workers (``--exit-signal-handler`` saves and exits) and the agent restarts them.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

from elasticft.agent.ckpt_protocol import CheckpointProtocol, CheckpointRequest
from elasticft.agent.context import AgentContext
from elasticft.agent.relay import CheckpointRelay
from elasticft.config import CheckpointConfig
from elasticft.contract.keys import RunKeys
from elasticft.contract.run_dir import WorkerEnv
from elasticft.store import EtcdClient

log = logging.getLogger(__name__)

# Signals torch's agent turns into its own shutdown (--signals-to-handle's default).
_TORCH_HANDLED_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class CheckpointCoordinator:
    def __init__(self, config: CheckpointConfig, signal_workers: Callable[[int], None], run_dir: Path):
        self.config = config
        self._signal_workers = signal_workers
        self.run_dir = run_dir
        self.protocol: CheckpointProtocol | None = None
        self._relay: CheckpointRelay | None = None
        self.restart_after_signal_save = False
        self._previous_handlers: dict[int, object] = {}

    def worker_environment(self, client: EtcdClient | None, keys: RunKeys | None) -> dict[str, str]:
        """The variables the worker hook reads."""
        return {
            WorkerEnv.RUN_DIR: str(self.run_dir),
            "EFT_SAVE_SWITCH": os.path.abspath(self.config.save_switch) if self.config.save_switch else "",
            "EFT_KILL_SWITCH": os.path.abspath(self.config.kill_switch) if self.config.kill_switch else "",
            "EFT_EXIT_SIGNALS": self.config.exit_signals,
            "EFT_EXIT_DURATION_MINS": str(self.config.exit_duration_mins),
            WorkerEnv.START_TIME: str(self._job_start_time(client, keys)),
            "EFT_CKPT_GAP": str(self.config.ckpt_gap),
            "EFT_VOTE_BUDGET": str(self.config.vote_budget),
        }

    @staticmethod
    def _job_start_time(client: EtcdClient | None, keys: RunKeys | None) -> float:
        """The same start time on every node (the first agent's), for --eft-exit-duration-mins."""
        now = time.time()
        if client is None:
            return now
        client.create(keys.started, str(now))
        return float(client.get(keys.started).value)

    def connect(self, ctx: AgentContext) -> None:
        """Relay ``ckpt/request`` to the workers and their answers back (etcd-v3 only)."""
        self.protocol = CheckpointProtocol(ctx.client, ctx.keys, ctx.node_id, self.config.ckpt_request_timeout,
                                           ctx.events)
        self._relay = CheckpointRelay(ctx.client, ctx.keys, self.protocol, self.run_dir, self._on_request).start()

    def on_outbox(self, kind: str, handler: Callable[[dict], None]) -> None:
        """Hand the workers' outbox messages of ``kind`` to ``handler`` (on the relay's thread)."""
        if self._relay is not None:
            self._relay.handlers[kind] = handler

    def before_workers_start(self) -> None:
        if self._relay is not None:
            self._relay.forget_answered_request()

    def _on_request(self, request: CheckpointRequest) -> None:
        if self.config.ckpt_mode == "signal":
            self.restart_after_signal_save = not request.exit
            log.info("sending SIGTERM to the workers for Megatron's --exit-signal-handler to save")
            self._signal_workers(signal.SIGTERM)

    def take_signal_save(self) -> bool:
        """Whether the workers just exited after a ``--eft-ckpt-mode signal`` save (asked once)."""
        taken, self.restart_after_signal_save = self.restart_after_signal_save, False
        return taken

    def request_for_risk(self, requester: str, risk: float) -> None:
        if self.protocol is not None:
            request, created = self.protocol.request("risk", requester, risk=risk)
            log.warning("%s emergency checkpoint request %s (risk %.2f)",
                        "made" if created else "joined", request.id, risk)

    def request_for_watchdog(self, requester: str, why: str, exit: bool = True) -> None:
        """A watchdog asks the job to save and exit (host memory about to run out) or,
        with ``exit=False``, to save and go on (a GPU short of memory)."""
        if self.protocol is not None:
            request, created = self.protocol.request("watchdog", requester, exit=exit)
            log.warning("%s %s request %s: %s", "made" if created else "joined",
                        "save-and-exit" if exit else "save", request.id, why)

    def forward_exit_signals(self) -> None:
        """Exit signals torch does not handle go to the workers, who save and exit."""
        torch_handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _TORCH_HANDLED_DEFAULT)
        handled = {int(signal.Signals[n.strip()]) for n in torch_handled.split(",") if n.strip() in signal.Signals.__members__}
        for sig in self.config.signals():
            if sig not in handled:
                self._previous_handlers[sig] = signal.signal(sig, self._forward)

    def _forward(self, signum, _frame) -> None:
        log.warning("received %s: asking the workers to save and exit", signal.Signals(signum).name)
        self._signal_workers(signum)

    def shutdown_timeout(self, death_sig: int, timeout: float) -> float:
        """Workers stopped by an exit signal get the grace period to save first."""
        return max(timeout, self.config.shutdown_grace) if death_sig in self.config.signals() else timeout

    def close(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        if self._relay is not None:
            self._relay.stop()
