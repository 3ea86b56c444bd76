"""A real 3-member etcd cluster on loopback, for the chaos rows that lose a member.

Each member is the etcd binary eft's embedded server uses (``find_etcd``), on a client
and a peer port of its own, with ``--initial-cluster`` naming all of them; ``kill`` is a
crash (SIGKILL, data kept), ``restart`` brings the member back on the same ports and data,
``leader`` asks a live member which member leads. Every member dies with this process
(PR_SET_PDEATHSIG), as the embedded etcd does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from elasticft.store import StoreError, StoreOptions, connect, find_etcd, free_port
from elasticft.store.server import dies_with_this_process, stop_process


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """``size`` etcd members on loopback; use as a context manager."""

    def __init__(self, size: int = 3, start_timeout: float = 30.0):
        self.binary = find_etcd()
        self.start_timeout = start_timeout
        self.root = Path(tempfile.mkdtemp(prefix="eft-etcd-cluster-"))
        self.token = uuid.uuid4().hex  # members of another cluster on this host cannot join this one
        self.members = [Member(f"m{i}", free_port(), free_port(), self.root / f"m{i}") for i in range(size)]

    @property
    def endpoint(self) -> str:
        """What eft-run takes as ``--rdzv-endpoint``: every member, comma-separated."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> Self:
        for member in self.members:  # all at once: none is ready until a quorum has met
            self._launch(member)
        for member in self.members:
            self._wait_ready(member)
        return self

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crashed machine), keeping its data and ports."""
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, index: int) -> None:
        """Start member ``index`` again after ``kill``; it rejoins with its data."""
        self._launch(self.members[index])
        self._wait_ready(self.members[index])

    def alive(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.proc is not None and m.proc.poll() is None]

    def leader(self) -> int | None:
        """The index of the member that leads, as the first live member to answer says; None
        while none does (an election, no quorum)."""
        for index in self.alive():
            try:
                client = connect(StoreOptions(self.members[index].endpoint, timeout=2.0), probe=True)
            except StoreError:
                continue
            try:
                name = client.status().leader
            except StoreError:
                continue
            finally:
                client.close()
            return next((i for i, m in enumerate(self.members) if m.name == name), None)
        return None

    def _launch(self, member: Member) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        client_url = f"http://{member.endpoint}"
        member.data_dir.mkdir(parents=True, exist_ok=True)
        with open(member.data_dir / "etcd.log", "ab") as log_file:
            member.proc = subprocess.Popen(
                dies_with_this_process([self.binary, "--name", member.name, "--data-dir", str(member.data_dir / "data"),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.token, "--log-level", "error"]),
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_ready(self, member: Member) -> None:
        """Until the member answers a read, which needs a leader (a quorum)."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if member.proc.poll() is not None:
                break
            try:
                connect(StoreOptions(member.endpoint, timeout=1.0), probe=True).close()
                return
            except StoreError:
                time.sleep(0.05)
        log = (member.data_dir / "etcd.log").read_text(errors="replace")[-2000:]
        raise StoreError(f"etcd member {member.name} did not start: {log.strip()}")

    def stop(self) -> None:
        for member in self.members:
            if member.proc is not None:
                stop_process(member.proc, timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # a quick look: start, find the leader, kill it, find the next
    with EtcdCluster() as cluster:
        first = cluster.leader()
        print(f"members {cluster.endpoint}; leader m{first} (pid {os.getpid()})")
        cluster.kill(first)
        started = time.monotonic()
        while (second := cluster.leader()) in (None, first):
            time.sleep(0.05)
        print(f"after killing m{first}: leader m{second} within {time.monotonic() - started:.2f} s")
