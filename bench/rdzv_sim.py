"""N simulated rendezvous agents (threads of this process, no workers) against one etcd.

Each agent is a real rendezvous handler, built as torchrun builds it, calling
``next_rendezvous()``; the round counts as formed when every one has returned with a
distinct rank in a world of N. etcd's own /metrics say what the round cost it.

Designs: ``keys`` (eft's handler), ``blob`` (the pickled-state backend eft used
before), ``c10d`` (torch's own, on a TCPStore: nothing reaches etcd).
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)

from elasticft.rendezvous.backend import create_handler
from elasticft.rendezvous.blob import create_blob_handler
from elasticft.store import StoreOptions, connect, free_port

# agents share gRPC connections in pools of this size: thousands of channels in one
# process would measure Python, not the rendezvous
AGENTS_PER_CONNECTION = 32


@dataclass
class EtcdCounters:
    """etcd's cumulative counters, read from its /metrics page."""

    received_bytes: float = 0.0
    requests: float = 0.0
    cpu_seconds: float = 0.0
    db_bytes: float = 0.0
    revision: int = 0
    sent_bytes: float = 0.0  # what etcd sent: answers and watch events (N nodes each reading N keys is N^2)
    events: float = 0.0  # watch events etcd delivered (N watchers of every put is N^2)
    kv_requests: float = 0.0  # reads and writes (Range, Txn, Put, DeleteRange): no keep-alive, no watch

    FIELDS = ("received_bytes", "requests", "cpu_seconds", "db_bytes", "revision", "sent_bytes", "events",
              "kv_requests")

    def minus(self, before: EtcdCounters) -> EtcdCounters:
        return EtcdCounters(*(getattr(self, f) - getattr(before, f) for f in self.FIELDS))


def metric_totals(endpoint: str) -> Callable[[str], float]:
    """etcd's /metrics now: ``total(name)`` sums the samples of ``name`` over its labels."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()

    def total(name: str, where: str = "") -> float:
        pattern = re.compile(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.MULTILINE)
        return sum(float(v) for labels, v in pattern.findall(text) if where in labels)

    return total


def read_counters(endpoint: str, client) -> EtcdCounters:
    total = metric_totals(endpoint)

    return EtcdCounters(
        received_bytes=total("etcd_network_client_grpc_received_bytes_total"),
        # unary calls and streamed messages (keep-alives, watch creates) alike
        requests=total("grpc_server_msg_received_total"),
        cpu_seconds=total("process_cpu_seconds_total"),
        db_bytes=total("etcd_mvcc_db_total_size_in_bytes"),
        revision=client.revision(),
        sent_bytes=total("etcd_network_client_grpc_sent_bytes_total"),
        events=total("etcd_debugging_mvcc_events_total"),
        kv_requests=total("grpc_server_handled_total", 'grpc_service="etcdserverpb.KV"'),
    )


@dataclass
class RoundResult:
    design: str
    agents: int
    seconds: float | None  # None: no round within the cap
    round: EtcdCounters = field(default_factory=EtcdCounters)
    idle_per_minute: EtcdCounters = field(default_factory=EtcdCounters)
    cas_losses: int | None = None
    agents_cpu: float = 0.0  # CPU seconds the simulated agents' processes spent on the round (this host's share)
    error: str = ""


class _CountingCas:
    """Counts compare-and-swaps that lost (a shared connection wraps its client's method)."""

    def __init__(self, client):
        self.losses = 0
        self._cas = client.compare_and_swap
        client.compare_and_swap = self

    def __call__(self, *args, **kwargs):
        swapped, current = self._cas(*args, **kwargs)
        if not swapped:
            self.losses += 1
        return swapped, current


def _params(design: str, n: int, run_id: str, endpoint: str, cap: float, lease_ttl: float) -> RendezvousParameters:
    config = {"join_timeout": str(int(cap)), "last_call_timeout": "1"}
    if design != "c10d":
        config["lease_ttl"] = str(lease_ttl)
    return RendezvousParameters(backend="etcd-v3" if design != "c10d" else "c10d", endpoint=endpoint,
                                run_id=run_id, min_nodes=n, max_nodes=n, local_addr="127.0.0.1", **config)


class AgentGroup:
    """Simulated agents ``indices`` of one round, as threads of this process sharing a few connections."""

    def __init__(self, design: str, indices: range, n: int, run_id: str, endpoint: str, cap: float, lease_ttl: float):
        self.design = design
        connections = 0 if design == "c10d" else -(-len(indices) // AGENTS_PER_CONNECTION)
        self.pools = [connect(StoreOptions(endpoint)) for _ in range(connections)]
        self.counters = [_CountingCas(c) for c in self.pools]
        self.handlers = []
        for k, _ in enumerate(indices):
            params = _params(design, n, run_id, endpoint, cap, lease_ttl)
            if design == "c10d":
                self.handlers.append(rendezvous_handler_registry.create_handler(params))
            else:
                make = create_handler if design == "keys" else create_blob_handler
                self.handlers.append(make(params, client=self.pools[k // AGENTS_PER_CONNECTION]))
        # (rank, world size, time.monotonic() when done: one clock for every process of the host)
        self.results: list[tuple[int, int, float] | None] = [None] * len(indices)
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, go) -> None:
        """Start every agent; each calls next_rendezvous() once ``go()`` returns."""

        def agent(i: int) -> None:
            go()
            try:
                info = self.handlers[i].next_rendezvous()
                self.results[i] = (info.rank, info.world_size, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - reported in the table
                self.errors.append(f"{type(exc).__name__}: {exc}")

        self.threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(len(self.handlers))]
        for t in self.threads:
            t.start()

    def wait(self, until: float) -> None:
        for t in self.threads:
            t.join(timeout=max(0.0, until - time.monotonic()))

    def cas_losses(self) -> int:
        return sum(c.losses for c in self.counters) + sum(
            getattr(getattr(h, "rounds", None), "cas_losses", 0) for h in self.handlers)

    def stop(self) -> None:
        _stop(self.design, self.handlers, self.threads)
        for client in self.pools:
            client.close()


def _group_process(design, indices, n, run_id, endpoint, cap, lease_ttl, go, results, stop) -> None:
    """One process of simulated agents (``simulate_round`` with ``processes`` > 1)."""
    group = AgentGroup(design, indices, n, run_id, endpoint, cap, lease_ttl)
    here = threading.Event()  # the agents wait on it; this thread alone takes part in the processes' barrier
    group.start(here.wait)
    go.wait()
    cpu = time.process_time()
    here.set()
    group.wait(time.monotonic() + cap)
    results.put((group.results, group.errors, group.cas_losses(), time.process_time() - cpu))
    stop.wait()
    group.stop()


def simulate_round(design: str, n: int, etcd_endpoint: str, cap: float = 60.0, idle: float = 10.0,
                   lease_ttl: float = 3.0, processes: int = 1) -> RoundResult:
    """Form one round of ``n`` agents of ``design``; measure it and ``idle`` seconds after it.

    With ``processes`` > 1 the agents are spread over that many processes (keys and blob
    designs): at a thousand agents one process's lock on Python, not etcd, would set the pace.
    """
    run_id = uuid.uuid4().hex
    probe = connect(StoreOptions(etcd_endpoint))
    endpoint = f"127.0.0.1:{free_port()}" if design == "c10d" else etcd_endpoint
    processes = 1 if design == "c10d" else max(1, processes)
    shares = [range(n)[p::processes] for p in range(processes)]
    group = None
    if processes == 1:
        group = AgentGroup(design, shares[0], n, run_id, endpoint, cap, lease_ttl)
        go = threading.Barrier(len(shares[0]) + 1)
        group.start(go.wait)
    else:
        ctx = multiprocessing.get_context("spawn")  # gRPC does not survive fork
        go, results, stop = ctx.Barrier(processes + 1), ctx.Queue(), ctx.Event()
        children = [ctx.Process(target=_group_process, daemon=True,
                                args=(design, share, n, run_id, endpoint, cap, lease_ttl, go, results, stop))
                    for share in shares]
        for child in children:
            child.start()
    before = read_counters(etcd_endpoint, probe)
    go.wait()
    began, cpu = time.monotonic(), time.process_time()
    if group is not None:
        group.wait(began + cap)
        outcomes, errors, cas_losses = group.results, group.errors, group.cas_losses()
        agents_cpu = time.process_time() - cpu
    else:
        outcomes, errors, cas_losses, agents_cpu = [], [], 0, 0.0
        for _ in children:
            part, part_errors, part_losses, part_cpu = results.get(timeout=cap + 120)
            outcomes += part
            errors += part_errors
            cas_losses += part_losses
            agents_cpu += part_cpu
    result = RoundResult(design, n, None, agents_cpu=agents_cpu)
    result.round = read_counters(etcd_endpoint, probe).minus(before)
    if design != "c10d":
        result.cas_losses = cas_losses
    if all(o is not None for o in outcomes):
        ranks = sorted(o[0] for o in outcomes)
        if ranks != list(range(n)) or {o[1] for o in outcomes} != {n}:
            result.error = f"bad ranks: {ranks[:8]}... sizes {sorted({o[1] for o in outcomes})}"
        else:
            result.seconds = max(o[2] for o in outcomes) - began
            idle_before = read_counters(etcd_endpoint, probe)
            time.sleep(idle)  # the measurement window itself, not a wait for an event
            result.idle_per_minute = _scaled(read_counters(etcd_endpoint, probe).minus(idle_before), 60.0 / idle)
    else:
        result.error = errors[0] if errors else f"no round within {cap:g} s"
    if group is not None:
        group.stop()
    else:
        stop.set()
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    probe.close()
    return result


def _scaled(c: EtcdCounters, k: float) -> EtcdCounters:
    return EtcdCounters(*(getattr(c, f) * k for f in EtcdCounters.FIELDS[:4]), int(c.revision * k),
                        *(getattr(c, f) * k for f in EtcdCounters.FIELDS[5:]))


def _stop(design: str, handlers: list, threads: list[threading.Thread]) -> None:
    """Close the rendezvous (waiters give up) and let every agent go."""
    try:
        handlers[0].set_closed()
    except Exception:  # noqa: BLE001 - a storm may still be raging; the join timeout ends it
        pass
    for t in threads:
        t.join(timeout=5)
    for h in handlers:
        try:
            if design == "keys":
                h.rounds.leave()
            elif design == "blob":
                h.eft_membership.close()
                h.shutdown()
            else:
                h.shutdown()
        except Exception:  # noqa: BLE001 - best effort
            pass
