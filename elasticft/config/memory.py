"""``MemoryConfig``: the memory checkpoint tier (host memory, replicas on peers, failure domains)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class MemoryConfig:
    """The memory checkpoint tier (docs/memory-checkpoints.md): snapshots in host memory, replicated to peers."""

    mem_ckpt_interval: int = knob(0, "take a memory checkpoint every this many iterations (0: off)")
    mem_ckpt_overlap: bool = knob(
        True, "copy a memory checkpoint off the training tensors while the next iteration's forward and backward "
        "run; only the optimizer's update waits for it (off: training waits for the whole copy)")
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
