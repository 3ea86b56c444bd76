"""The etcd side of eft's agents, without workers: what each node holds in etcd, and what
a lost node costs the others, for one lease per node or two.

A simulated node is wired as eft's agent wires it (``AgentContext.join`` then the
rendezvous handler): its record under a lease, a membership watch on ``nodes/``, eft's
rendezvous handler, and, in the ``shared`` design, ``share_node_lease`` (issue 35:
one lease and one watch per node). ``two`` is the design before it: the handler's own
lease and its own watch on the round's participant keys. etcd's /metrics count.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.backend import create_handler, share_node_lease
from elasticft.rendezvous.membership import Membership, NodeLease
from elasticft.store import EtcdClient, StoreOptions, connect

DESIGNS = ("two", "shared")  # two leases and two member watches per node; one of each


def params(endpoint: str, run_id: str, nodes: int, lease_ttl: float, join_timeout: float) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=nodes,
                                max_nodes=nodes, local_addr="127.0.0.1", last_call_timeout="1",
                                join_timeout=str(int(join_timeout)), lease_ttl=str(lease_ttl))


@dataclass
class SimulatedNode:
    """One node's etcd footprint as eft's agent makes it (no workers, no other services)."""

    name: str
    design: str
    membership: Membership
    node: NodeLease
    handler: object

    @classmethod
    def join(cls, client: EtcdClient, endpoint: str, keys: RunKeys, name: str, nodes: int, design: str,
             lease_ttl: float = 3.0, join_timeout: float = 120.0) -> "SimulatedNode":
        """``client`` serves the record and the membership watch; the handler gets ``client`` too
        (a real agent has two connections: the bench shares them, as rdzv_sim does)."""
        membership = Membership(client, keys)
        return cls.with_record(register(client, keys, name, lease_ttl), membership, client, endpoint, keys, nodes,
                               design, lease_ttl, join_timeout)

    @classmethod
    def with_record(cls, node: NodeLease, membership: Membership, client: EtcdClient, endpoint: str, keys: RunKeys,
                    nodes: int, design: str, lease_ttl: float = 3.0, join_timeout: float = 120.0) -> "SimulatedNode":
        handler = create_handler(params(endpoint, keys.run_id, nodes, lease_ttl, join_timeout), client=client)
        if design == "shared":
            share_node_lease(handler, node, membership)
        return cls(node.record.node_id, design, membership, node, handler)

    def unplug(self) -> None:
        """As a node that lost power, first half: its watches go (etcd ends them a moment later)."""
        self.handler.rounds.stop_watching()
        self.membership.close()

    def expire(self) -> None:
        """Second half: etcd deletes its keys with its lease (revoked here: the same keys at one
        revision as an expiry, without waiting the TTL)."""
        self.node.lease.revoke()
        if self.design == "two":
            self.handler.rounds.leave()  # revokes the handler's own lease

    def leave(self) -> None:
        self.handler.rounds.leave()
        self.membership.close()
        self.node.close(clean=True)


def register(client: EtcdClient, keys: RunKeys, name: str, lease_ttl: float) -> NodeLease:
    return NodeLease(client, keys, NodeRecord(name, "127.0.0.1", "127.0.0.1", os.getpid()), ttl=lease_ttl)


def join_round(nodes: list[SimulatedNode]) -> list:
    """Every node's ``next_rendezvous()`` at once; their RendezvousInfo."""
    infos: list = [None] * len(nodes)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            infos[i] = nodes[i].handler.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return infos


def connect_to(endpoint: str) -> EtcdClient:
    return connect(StoreOptions(endpoint))


@dataclass
class Footprint:
    """One design at one size: what etcd holds and does for N nodes, and what a loss costs."""

    design: str
    nodes: int
    leases: float = 0.0  # leases granted for the N nodes
    watchers: float = 0.0  # watches open once the round formed and every node asked num_nodes_waiting
    keepalives_per_min: float = 0.0  # lease renewals etcd served per idle minute
    requests_per_min: float = 0.0  # every gRPC message etcd received per idle minute
    events_per_loss: float = 0.0  # watch events etcd sent for one lost node
    seen_loss_s: float = 0.0  # the lost node's death to the last survivor seeing it (waiting() > 0)
    error: str = ""


def _group(design, indices, n, endpoint, run_id, lease_ttl, per_connection, ready, commands, replies) -> None:
    """One process of simulated nodes: join, form one round, then obey ``commands``."""
    keys = RunKeys(run_id)
    pools = [connect_to(endpoint) for _ in range(-(-len(indices) // per_connection))]
    # every record first, then the membership watches: a watch made while the others register
    # hears N puts (N^2 events in all, which on this machine's 2 cores would measure the
    # machine); made after, it reads them once. The steady state and a loss cost the same.
    records = [register(pools[k // per_connection], keys, f"node{i}", lease_ttl) for k, i in enumerate(indices)]
    replies.put(("registered", None))
    ready.wait()
    nodes: list[SimulatedNode] = []
    try:
        nodes = [SimulatedNode.with_record(record, Membership(pools[k // per_connection], keys),
                                           pools[k // per_connection], endpoint, keys, n, design, lease_ttl)
                 for k, record in enumerate(records)]
        join_round(nodes)
        for node in nodes:
            node.handler.num_nodes_waiting()  # torch's monitor asks every interval: every watch made
        replies.put(("formed", None))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        replies.put(("error", f"{type(exc).__name__}: {exc}"))
    while True:
        command = commands.get()
        if command == "unplug":
            nodes[0].unplug()
            replies.put(("unplugged", None))
        elif command == "expire":
            nodes[0].expire()
            nodes = nodes[1:]
            replies.put(("died", time.monotonic()))
        elif command == "watch-loss":
            pending = list(nodes)
            while pending:
                pending = [node for node in pending if node.handler.num_nodes_waiting() == 0]
                time.sleep(0.005)  # the measurement's resolution; the survivors' watches run meanwhile
            replies.put(("seen", time.monotonic()))
        else:
            for node in nodes:
                node.leave()
            for client in pools:
                client.close()
            replies.put(("left", None))
            return


def measure(design: str, n: int, endpoint: str, lease_ttl: float = 3.0, per_process: int = 128,
            per_connection: int = 32, idle: float = 10.0, cap: float = 600.0) -> Footprint:
    """N simulated nodes of ``design`` in processes of ``per_process`` (threads): form one round,
    count what etcd holds, ``idle`` seconds of keep-alives, then one node dies."""
    from bench.launch import wait_for
    from bench.rdzv_sim import metric_totals

    result = Footprint(design, n)
    ctx = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    shares = [range(n)[p::-(-n // per_process)] for p in range(-(-n // per_process))]
    ready = ctx.Event()
    channels = [(ctx.Queue(), ctx.Queue()) for _ in shares]
    run_id = uuid.uuid4().hex
    before = metric_totals(endpoint)
    children = [ctx.Process(target=_group, daemon=True, args=(design, share, n, endpoint, run_id, lease_ttl,
                                                             per_connection, ready, commands, replies))
                for share, (commands, replies) in zip(shares, channels)]
    for child in children:
        child.start()

    def collect(kind: str) -> list:
        answers = [replies.get(timeout=cap) for _, replies in channels]
        errors = [value for what, value in answers if what == "error"]
        if errors:
            raise RuntimeError(errors[0])
        return [value for what, value in answers if what == kind]

    try:
        collect("registered")
        ready.set()
        collect("formed")
        now = metric_totals(endpoint)
        result.leases = now("etcd_debugging_lease_granted_total") - before("etcd_debugging_lease_granted_total")
        result.watchers = now("etcd_debugging_mvcc_watcher_total") - before("etcd_debugging_mvcc_watcher_total")
        time.sleep(idle)  # the measurement window itself
        later = metric_totals(endpoint)
        per_minute = 60.0 / idle
        result.keepalives_per_min = per_minute * (later("etcd_debugging_lease_renewed_total")
                                                  - now("etcd_debugging_lease_renewed_total"))
        result.requests_per_min = per_minute * (later("grpc_server_msg_received_total")
                                                - now("grpc_server_msg_received_total"))
        channels[0][0].put("unplug")
        channels[0][1].get(timeout=cap)
        watchers_of_one = result.watchers / n
        wait_for(lambda: metric_totals(endpoint)("etcd_debugging_mvcc_watcher_total")
                 <= now("etcd_debugging_mvcc_watcher_total") - watchers_of_one, 60, "the lost node's watches to end")
        sent = metric_totals(endpoint)("etcd_debugging_mvcc_events_total")
        channels[0][0].put("expire")
        died = channels[0][1].get(timeout=cap)[1]
        for commands, _ in channels:
            commands.put("watch-loss")
        result.seen_loss_s = max(collect("seen")) - died
        result.events_per_loss = metric_totals(endpoint)("etcd_debugging_mvcc_events_total") - sent
    except Exception as exc:  # noqa: BLE001 - a row of the table
        result.error = str(exc)[:80]
    finally:
        for commands, _ in channels:
            commands.put("leave")
        for child in children:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
    return result
