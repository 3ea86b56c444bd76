"""Simulated hosts in Linux network namespaces, one IP each on a private bridge, for partitions.

    with NetnsCluster(nodes=2, workdir=tmp_path) as cluster:   # needs root and `ip netns` (etcd=False: no etcd)
        cluster.etcd_endpoint                   # "10.231.X.2:PORT": a real etcd in its own namespace
        node = cluster.launch(0, [...eft-run...], log_path)   # bench.launch.Launched, inside node 0's namespace
        cluster.run(0, ["ip", "addr"])          # to its end: a subprocess.CompletedProcess
        cluster.node_ip(0)                      # the address to pass as --local-addr
        cluster.cut(0, from_="etcd")            # or "peers", "all", or another node's index
        cluster.heal()                          # every cut undone
        cluster.link_down(0); cluster.link_up(0)   # node 0's cable pulled, and plugged back

``unavailable_reason()`` says why it cannot run here (None when it can): call it and skip.

Layout: a "switch" namespace holds the bridge; etcd and every node get a namespace with
one interface, ``eth0``, cabled to it by a veth pair. The namespace running the test gets
a port too (``10.231.X.1``), so that it can talk to etcd, but is never cut.

A cut drops frames silently in both directions, as a partitioned network does (no RST, no
ICMP): each side's neighbour entry for the other names a MAC address no one owns, so the
frames leave, the bridge floods them and every port discards them. It needs nothing but
iproute2: the machine this was written on had neither iptables nor nft, and its kernel
had no tc drop action (act_gact). ``link_down`` sets the switch's end of a node's cable down: the
node's ``eth0`` keeps its address and routes, its packets vanish.

Names carry the creating process's pid (``eft-<pid>-<seq>-<role>``): ``close`` removes them
even after a failure, and the next harness removes those whose creator died (kill -9).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from bench.launch import ROOT, Launched
from elasticft.store import EmbeddedEtcd

_SUBNET = "10.231"
_NOBODY_MAC = "02:ef:7d:00:00:01"  # locally administered; no interface of ours has it
_NAME = re.compile(r"^eft-(\d+)-(\d+)-")
_sequence = itertools.count()


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "no `ip` (iproute2) on PATH"
    probe = f"eft-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    prefix = ["ip", "-n", ns] if ns else ["ip"]
    done = subprocess.run([*prefix, *args], check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(prefix + list(args))}: {done.stderr.strip()}")
    return done


def _await_operstate_up(ns: str, ifname: str, timeout: float = 10.0) -> None:
    """Return once ``ifname`` in ``ns`` is operationally up (polled: the kernel offers no wait)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = json.loads(_ip("-j", "link", "show", "dev", ifname, ns=ns).stdout)
        if shown and shown[0].get("operstate") == "UP":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ifname} in {ns}: not up {timeout:.0f} s after its link was set up")
        time.sleep(0.02)


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in ``ns`` (ours: only this harness starts processes there)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove the namespaces (and with them their cables and bridge) of harnesses whose process died."""
    removed = []
    for ns in namespaces():
        match = _NAME.match(ns)
        if match and not psutil.pid_exists(int(match.group(1))):
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            removed.append(ns)
    return removed


def _free_subnet() -> str:
    """A 10.231.X.0/24 that no address of this namespace is in (two harnesses may run at once)."""
    taken = _ip("-4", "-o", "addr").stdout
    start = os.getpid() % 250
    for x in itertools.chain(range(start, 250), range(start)):
        if f" {_SUBNET}.{x}." not in taken:
            return f"{_SUBNET}.{x}"
    raise RuntimeError(f"every {_SUBNET}.X.0/24 is in use")


class NetnsCluster:
    """A bridge, one namespace for etcd and one per node; use as a context manager."""

    def __init__(self, nodes: int, workdir: Path, etcd: bool = True):
        self.nodes = nodes
        self.with_etcd = etcd  # False: no etcd of the harness's (the caller runs its own in a node's namespace)
        self.workdir = Path(workdir)
        self.prefix = f"eft-{os.getpid()}-{next(_sequence)}"
        self.switch = f"{self.prefix}-sw"
        self.etcd_ns = f"{self.prefix}-etcd"
        self.node_ns = [f"{self.prefix}-n{i}" for i in range(nodes)]
        self.subnet = ""
        self._own_port = f"eft{os.getpid()}o{self.prefix.rsplit('-', 1)[1]}"  # at most 15 characters
        self.etcd: EmbeddedEtcd | None = None
        self.launched: list[Launched] = []
        self._cuts: set[tuple[str, str]] = set()  # (namespace, neighbour's IP) entries pointed at nobody

    # -- addresses ---------------------------------------------------------------------

    @property
    def etcd_ip(self) -> str:
        return f"{self.subnet}.2"

    def node_ip(self, node: int) -> str:
        return f"{self.subnet}.{10 + node}"

    @property
    def etcd_endpoint(self) -> str:
        return self.etcd.endpoint

    # -- life --------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        sweep_stale()
        self.subnet = _free_subnet()
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        # The test's own port: a veth into this namespace, addressed, never cut.
        self._cable(None, self._own_port, f"{self.subnet}.1", port="obs")
        self._cable(self.etcd_ns, "eth0", self.etcd_ip, port="etcd")
        for i, ns in enumerate(self.node_ns):
            self._cable(ns, "eth0", self.node_ip(i), port=f"n{i}")
        if self.with_etcd:
            self.etcd = EmbeddedEtcd(host=self.etcd_ip, wrapper=["ip", "netns", "exec", self.etcd_ns]).start()

    def _cable(self, ns: str | None, ifname: str, address: str, port: str) -> None:
        """A veth from the bridge (its end named ``port``) to ``ifname`` in ``ns`` (None: here)."""
        if ns is not None:
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
        # Made in the switch, then one end moved: names only need to be unique there.
        _ip("link", "add", port, "type", "veth", "peer", "name", f"{port}-x", ns=self.switch)
        _ip("link", "set", port, "master", "br0", "up", ns=self.switch)
        target = ["netns", ns if ns else str(os.getpid())]  # a pid: that process's namespace
        _ip("link", "set", f"{port}-x", *target, "name", ifname, ns=self.switch)
        _ip("addr", "add", f"{address}/24", "dev", ifname, ns=ns)
        _ip("link", "set", ifname, "up", ns=ns)

    def close(self) -> None:
        """Stop everything started inside, then remove every namespace (cables and bridge go with them)."""
        for node in self.launched:
            node.stop()
        if self.etcd is not None:
            self.etcd.stop()
        # Namespaces are destroyed in the background: the cable in this one would linger a moment.
        _ip("link", "del", self._own_port, check=False)
        for ns in [*self.node_ns, self.etcd_ns, self.switch]:
            if ns in namespaces():
                _kill_inside(ns)
                _ip("netns", "del", ns, check=False)

    # -- running -----------------------------------------------------------------------

    def launch(self, node: int, cmd: list[str], log_path: Path, env: dict | None = None) -> Launched:
        """``cmd`` in node ``node``'s namespace, in a session of its own, output to ``log_path``."""
        launched = Launched(self.wrap(node, cmd), log_path, env={**self.node_env(), **(env or {})})
        self.launched.append(launched)
        return launched

    def wrap(self, node: int, cmd: list[str]) -> list[str]:
        """``cmd`` as run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node_ns[node], *cmd]

    @staticmethod
    def node_env() -> dict[str, str]:
        """What a node's processes need: gloo told to use ``eth0`` (it would pick the hostname's
        address, not reachable from the other namespaces), and the repository this harness is
        in first on the path, so that a git worktree runs its own code."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": str(ROOT)}

    def run(self, node: int, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """``cmd`` in node ``node``'s namespace, to its end; its output captured as text."""
        return subprocess.run(["ip", "netns", "exec", self.node_ns[node], *cmd], check=False, capture_output=True,
                              text=True, timeout=timeout)

    # -- faults ------------------------------------------------------------------------

    def _members(self, node: int, from_: str | int) -> list[tuple[str, str]]:
        """(namespace, IP) of what node ``node`` is to be cut from."""
        etcd = [(self.etcd_ns, self.etcd_ip)]
        peers = [(self.node_ns[i], self.node_ip(i)) for i in range(self.nodes) if i != node]
        if isinstance(from_, int):
            return [(self.node_ns[from_], self.node_ip(from_))]
        return {"etcd": etcd, "peers": peers, "all": etcd + peers}[from_]

    def cut(self, node: int, from_: str | int = "all") -> None:
        """Drop every frame between node ``node`` and ``from_`` ("etcd", "peers", "all" or a node), both ways."""
        for ns, address in self._members(node, from_):
            for side, neighbour in ((self.node_ns[node], address), (ns, self.node_ip(node))):
                _ip("neigh", "replace", neighbour, "lladdr", _NOBODY_MAC, "nud", "permanent", "dev", "eth0", ns=side)
                self._cuts.add((side, neighbour))

    def heal(self) -> None:
        """Undo every cut: the neighbours are learnt again by ARP."""
        for side, neighbour in sorted(self._cuts):
            _ip("neigh", "del", neighbour, "dev", "eth0", ns=side, check=False)
        self._cuts.clear()

    def link_down(self, node: int) -> None:
        """Pull node ``node``'s cable at the switch: its frames vanish, it is told nothing."""
        _ip("link", "set", f"n{node}", "down", ns=self.switch)

    def link_up(self, node: int) -> None:
        """Plug node ``node``'s cable back; return once both ends carry frames again.

        The kernel reports a carrier change up to a second late (linkwatch), and an ARP
        request sent while the cable was out leaves an unresolved neighbour entry whose
        failure, seconds later, would fail the next connection with "no route to host":
        so wait for both ends to be up, then forget the unresolved entries (as a host
        does when its link comes back)."""
        _ip("link", "set", f"n{node}", "up", ns=self.switch)
        _await_operstate_up(self.switch, f"n{node}")
        _await_operstate_up(self.node_ns[node], "eth0")
        _ip("neigh", "flush", "dev", "eth0", "nud", "incomplete", "nud", "failed", ns=self.node_ns[node], check=False)
