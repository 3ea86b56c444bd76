"""Where a job's own etcd runs in a SLURM allocation: members on its first nodes.

Pure but for the one question the controller answers (a node name's address), so that
every agent can compute the endpoint from the allocation alone, before etcd is up, and
the batch script needs no file passed around: ``eft etcd --slurm --endpoint-only``.
Member ``i`` serves clients on ``port + 2i`` and peers on ``port + 2i + 1``: members that
share a host (a one-host test cluster, a small allocation) never collide.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from typing import Callable

Runner = Callable[[list[str]], str]


@dataclass(frozen=True)
class Member:
    index: int
    name: str  # the SLURM node it runs on
    address: str  # how the others reach it (the node's NodeAddr)
    client_port: int
    peer_port: int

    @property
    def etcd_name(self) -> str:
        return f"eft{self.index}"

    @property
    def client_url(self) -> str:
        return f"http://{self.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.address}:{self.peer_port}"


def job_port(job_id: str) -> int:
    """A client port for the job's etcd from its id: in [20000, 60000), 8 apart, so that
    jobs sharing a node (and their up to 3 members' client and peer ports) do not collide."""
    return 20000 + (int(job_id) % 5000) * 8 if job_id.isdigit() else 2379


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout


def node_names(nodelist: str, run: Runner = _run) -> list[str]:
    """A SLURM node list (``n[1-4]``) as names, the way SLURM expands it."""
    return run(["scontrol", "show", "hostnames", nodelist]).split()


def node_address(name: str, run: Runner = _run) -> str:
    """The node's NodeAddr (what its name resolves to for SLURM itself), else the name."""
    for field in run(["scontrol", "-o", "show", "node", name]).split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or name
    return name


def members(nodelist: str, count: int, port: int, run: Runner = _run,
            resolve: Callable[[str], str] = socket.gethostbyname) -> list[Member]:
    """The ``count`` members of the job's etcd, on the first nodes of ``nodelist``, by IP
    address (etcd binds to an IP, and the agents then need no name service)."""
    names = node_names(nodelist, run)
    if count > len(names):
        raise ValueError(f"--members {count}: the allocation has {len(names)} node(s)")
    return [Member(i, name, resolve(node_address(name, run)), port + 2 * i, port + 2 * i + 1)
            for i, name in enumerate(names[:count])]


def endpoint(chosen: list[Member]) -> str:
    """What eft-run takes as ``--rdzv-endpoint``: every member, comma-separated."""
    return ",".join(f"{m.address}:{m.client_port}" for m in chosen)


def initial_cluster(chosen: list[Member]) -> str:
    return ",".join(f"{m.etcd_name}={m.peer_url}" for m in chosen)
