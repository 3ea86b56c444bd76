"""Where a restart's seconds go at N nodes: CPU per phase, etcd's (shared) apart from the nodes'.

All N simulated nodes of ``bench/restart_scale.py`` share this host's cores, so past a few
dozen nodes a phase's wall time is mostly the CPU of every node's own work queued on 2 cores
(and, 128 nodes to a process, on one interpreter's lock), which on a cluster runs on N hosts at
once. ``CpuSampler`` reads the CPU time of etcd and of the harness's processes (``/proc/<pid>/stat``,
every thread of each) every ``INTERVAL`` during the restart; ``per_phase`` cuts it at the phases'
ends. ``cluster_model`` then takes each phase apart into per-unit costs, each measured:

- ``per_node``: one node's own CPU in the phase (the harness's CPU over N): parallel on a cluster,
  so a node pays its own, not N of them; its growth in N is per-node work that grows with the job;
- ``shared``: etcd's CPU in the phase, serial on a cluster too (an upper bound: etcd serves reads
  on several cores);
- ``latency``: what is neither at the smallest N measured: polls, timers, round trips (an upper
  bound: it is the wall time there less one node's CPU and etcd's, though several nodes shared
  the cores).

A cluster's phase is modelled as ``latency + per_node(N) + shared(N)``: every term measured at
the sizes run, beyond them fitted as work grows (constant, log N or N: ``restart_curve.fit_growth``,
over the sizes whose CPU figure is above the ticks' resolution) and marked modelled. Left
out, bounded apart: the round's TCPStore (``bench/store_connect.py``) and the two holders' shard
servers, which run in the first harness process and count here as per-node work.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from dataclasses import dataclass

from elasticft.goodput.restart_curve import Fit, fit_growth

INTERVAL = 0.01  # seconds between samples: the kernel counts CPU in ticks of 10 ms (USER_HZ 100)
TICK = 1.0 / os.sysconf("SC_CLK_TCK")
RESOLUTION = 2 * TICK  # CPU seconds below which a phase's figure is mostly the ticks' rounding: not fitted


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of every thread of ``pid`` so far; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK  # utime, stime: fields 14 and 15 of proc(5)


class CpuSampler:
    """CPU seconds of named groups of processes, sampled in a thread until ``stop``."""

    def __init__(self, groups: dict[str, list[int]], interval: float = INTERVAL):
        self.groups, self.interval = groups, interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._last: dict[int, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> "CpuSampler":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        totals = {}
        for name, pids in self.groups.items():
            for pid in pids:  # a process gone keeps its last figure: nothing is taken back
                seconds = cpu_seconds(pid)
                self._last[pid] = seconds if seconds is not None else self._last.get(pid, 0.0)
            totals[name] = sum(self._last.get(pid, 0.0) for pid in pids)
        self.samples.append((time.time(), totals))

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self._sample()

    def at(self, group: str, when: float) -> float:
        """The group's CPU seconds at ``when``, interpolated between the samples around it."""
        before = [(t, s[group]) for t, s in self.samples if t <= when]
        after = [(t, s[group]) for t, s in self.samples if t > when]
        if not before:
            return after[0][1] if after else 0.0
        if not after:
            return before[-1][1]
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0)

    def per_phase(self, begin: float, phases: dict[str, float]) -> dict[str, dict[str, float]]:
        """CPU seconds of each group in each phase, the phases laid end to end from ``begin``."""
        cut, at = {}, begin
        for phase, seconds in phases.items():
            cut[phase] = {group: max(0.0, self.at(group, at + seconds) - self.at(group, at))
                          for group in self.groups}
            at += seconds
        return cut


# etcd's own counters (its /metrics): what the restart asked of it, in units that add up across nodes
ETCD_COUNTERS = {
    "range": "etcd_mvcc_range_total", "put": "etcd_mvcc_put_total", "txn": "etcd_mvcc_txn_total",
    "delete": "etcd_mvcc_delete_total", "watch events sent": "etcd_debugging_mvcc_events_total",
    "watch requests": 'grpc_server_msg_received_total{grpc_method="Watch"',
    "keep-alives": 'grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"',
    "kB sent": "etcd_network_client_grpc_sent_bytes_total",
}


def etcd_counts(endpoint: str) -> dict[str, float]:
    """etcd's counters of ``ETCD_COUNTERS`` now (a counter it does not report counts 0)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    counts = dict.fromkeys(ETCD_COUNTERS, 0.0)
    for line in text.splitlines():
        for name, metric in ETCD_COUNTERS.items():
            if line.startswith(metric + (" " if "{" not in metric else "")):
                counts[name] += float(line.rsplit(" ", 1)[1]) / (1000 if name == "kB sent" else 1)
    return counts


@dataclass(frozen=True)
class PhaseModel:
    """One phase on a cluster: ``latency + per_node(N) + shared(N)`` (see the module's docstring)."""

    latency: float
    per_node: Fit
    shared: Fit
    measured: dict[int, tuple[float, float]]  # N -> (per_node, shared) CPU seconds as measured

    def parts(self, n: int) -> tuple[float, float]:
        """(per node, shared) CPU seconds at ``n``: measured where it was, else fitted."""
        return self.measured.get(n) or (self.per_node.at(n), self.shared.at(n))

    def cluster(self, n: int) -> float:
        return self.latency + sum(self.parts(n))


def cluster_model(rows: list[dict]) -> dict[str, PhaseModel]:
    """Each phase's model from the measured rows (``measure``'s, each with ``cpu``), in their order."""
    rows = sorted(rows, key=lambda r: r["nodes"])
    sizes = [r["nodes"] for r in rows]
    models = {}
    for phase in rows[0]["phases"]:
        per_node = [r["cpu"][phase]["nodes"] / r["nodes"] for r in rows]
        shared = [r["cpu"][phase]["etcd"] for r in rows]
        latency = max(0.0, rows[0]["phases"][phase] - per_node[0] - shared[0])
        models[phase] = PhaseModel(latency, _fitted(sizes, per_node, [u * n for u, n in zip(per_node, sizes)]),
                                   _fitted(sizes, shared, shared),
                                   {n: (u, s) for n, u, s in zip(sizes, per_node, shared)})
    return models


def _fitted(sizes: list[int], values: list[float], cpu: list[float]) -> Fit:
    """``values``' growth over the sizes whose ``cpu`` is above the resolution (all when under two are)."""
    kept = [(n, v) for n, v, c in zip(sizes, values, cpu) if c >= RESOLUTION]
    if len(kept) < 2:
        kept = list(zip(sizes, values))
    return fit_growth(tuple(n for n, _ in kept), tuple(v for _, v in kept))


def busy(row: dict, cores: int) -> dict[str, float]:
    """The share of this host's cores the harness and etcd kept busy in each phase: near 1, the
    phase's wall time here is CPU queued behind the other nodes' work."""
    return {phase: (row["cpu"][phase]["nodes"] + row["cpu"][phase]["etcd"]) / (seconds * cores)
            if seconds > 0 else 0.0 for phase, seconds in row["phases"].items()}


def model_rows(rows: list[dict], beyond: list[int], cores: int) -> tuple[list[str], list[list[str]], dict]:
    """The cluster model as a table (headers, lines) and as figures: ``{"phases": {phase: {N: s}},
    "total": {N: s}, "growth": {phase: (per node, shared)}}`` at the measured sizes and ``beyond``."""
    models = cluster_model(rows)
    sizes = sorted(r["nodes"] for r in rows)
    at = sizes + [n for n in beyond if n > sizes[-1]]
    last = max(rows, key=lambda r: r["nodes"])
    loaded = busy(last, cores)
    headers = (["phase", "latency"] + [f"N={n}" + (" (modelled)" if n not in sizes else "") for n in at]
               + ["one node's CPU", "etcd's CPU", f"busy here, N={last['nodes']}"])
    lines, figures = [], {"phases": {}, "total": {}, "growth": {}}
    for phase, m in models.items():
        values = {n: m.cluster(n) for n in at}
        figures["phases"][phase] = values
        figures["growth"][phase] = (m.per_node.growth, m.shared.growth)
        lines.append([phase, f"{m.latency:.3f}"] + [f"{values[n]:.3f}" for n in at]
                     + [m.per_node.growth, m.shared.growth, f"{loaded[phase]:.0%}"])
    figures["total"] = {n: sum(v[n] for v in figures["phases"].values()) for n in at}
    lines.append(["total", f"{sum(m.latency for m in models.values()):.3f}"]
                 + [f"{figures['total'][n]:.3f}" for n in at] + ["", "", ""])
    return headers, lines, figures
