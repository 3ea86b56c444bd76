"""eft-run's defaults in a JobSet pod: what a pod spec would otherwise spell out on every
launch line, derived from the pod's variables (``pod.py``), and printed once.

As under SLURM (``elasticft/slurm/defaults.py``), only what the user left at torchrun's
default (no flag, no ``PET_*`` variable) is derived; a flag always wins. So the pod's
launch line is ``eft-run --nproc-per-node 8 pretrain_gpt.py ...`` and nothing more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from elasticft.contract.argv import user_set
from elasticft.kubernetes.pod import JobSetPod


@dataclass
class Derived:
    """What eft-run took from the pod: flag -> value, and eft's node id ("" when not derived)."""

    flags: dict[str, str] = field(default_factory=dict)
    node_id: str = ""

    def describe(self, pod: JobSetPod) -> str:
        parts = [f"--{name.replace('_', '-')} {value}" for name, value in self.flags.items()]
        if self.node_id:
            parts.append(f"node id {self.node_id}")
        what = ", ".join(parts) or "nothing to derive (flags given)"
        index = f" Job {pod.job_index}" if pod.job_index is not None else ""
        return f"JobSet {pod.jobset}{index} attempt {pod.restart_attempt}: {what}"


def derive(args, pod: JobSetPod, node_id_set: bool, environ: Mapping[str, str] = os.environ) -> Derived:
    """Set the flags the user left at torchrun's defaults from ``pod``; what was set.

    ``node_id_set``: the user named this node (``--eft-node-id``): the pod's name is not taken."""
    derived = Derived()

    def take(name: str, value: str | None) -> None:
        if value and not user_set(args, name, environ):
            setattr(args, name, value)
            derived.flags[name] = value

    take("rdzv_id", pod.run_id)
    if pod.replicas:
        take("nnodes", str(pod.replicas))
    # One etcd for the JobSet: a Service's name, not the embedded one of a one-host run.
    if not user_set(args, "rdzv_endpoint", environ) and args.rdzv_backend in ("static", "etcd-v3"):
        take("rdzv_backend", "etcd-v3")
        take("rdzv_endpoint", pod.etcd_endpoint)
    # The pod's address, not its hostname: peers reach it before its DNS name is published.
    take("local_addr", pod.pod_ip)
    if pod.pod_name and not node_id_set:
        derived.node_id = pod.pod_name  # a replacement pod is another node: its name differs
    return derived
