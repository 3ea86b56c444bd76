"""``CheckpointConfig``: emergency checkpoints (requests through etcd), switches, preemption."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob, signal_number


@dataclass
class CheckpointConfig:
    """Emergency checkpoints: requests through etcd, switches, preemption signals."""

    ckpt_gap: float = knob(
        0.25,
        "a risk-driven save is skipped unless this fraction of --save-interval has passed "
        "since the last save (manual and preemption saves always run)",
    )
    ckpt_mode: str = knob(
        "hook",
        "hook: workers save through elasticft.worker.Hook; signal: send SIGTERM to workers "
        "(Megatron-LM's --exit-signal-handler) and restart them",
    )
    ckpt_request_timeout: float = knob(
        300.0, "seconds a request stays open (later requests join it) when no save acknowledges it"
    )
    save_switch: str = knob("", "file whose presence makes all ranks save once and continue")
    kill_switch: str = knob("", "file whose presence makes all ranks save and exit; present at start: exit at once")
    exit_signals: str = knob("SIGTERM,SIGUSR1", "signals that make workers save and exit (SLURM preemption)")
    shutdown_grace: float = knob(120.0, "seconds workers get to save and exit after a signal before SIGKILL")
    exit_duration_mins: float = knob(0.0, "save and exit this many minutes after the job started (0: never)")
    deadline_margin_mins: float = knob(
        5.0, "under SLURM, save and exit this many minutes before the job's time limit (0: never)")
    vote_budget: float = knob(
        0.01, "the most of training time the ranks' votes on saving and exiting may take: they vote every "
        "iteration while that costs less, else every few (and at each --save-interval); 0: every iteration")

    def __post_init__(self) -> None:
        if self.ckpt_mode not in ("hook", "signal"):
            raise ConfigError(f"{flag_name('ckpt_mode')}: expected hook or signal, got {self.ckpt_mode!r}")
        if not 0 <= self.ckpt_gap <= 1:
            raise ConfigError(f"{flag_name('ckpt_gap')}: expected a fraction in [0, 1], got {self.ckpt_gap}")
        for name in ("ckpt_request_timeout", "shutdown_grace", "exit_duration_mins", "deadline_margin_mins",
                     "vote_budget"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag_name(name)}: expected >= 0, got {getattr(self, name)}")
        self.signals()  # validates the names

    def signals(self) -> list[int]:
        return [signal_number(name, "exit_signals") for name in self.exit_signals.split(",") if name.strip()]

    def kill_switch_present(self) -> bool:
        """The kill switch file exists: save and exit (a job starting with it does not start)."""
        return bool(self.kill_switch) and os.path.exists(self.kill_switch)
