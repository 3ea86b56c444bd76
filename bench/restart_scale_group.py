"""One whole restart of N simulated nodes (``restart_scale_node.SimNode``) against one etcd.

Nodes run as threads in processes of ``per_process`` (spawned: gRPC does not survive fork),
contiguous slices, so nodes 0 and 1 (the holders of the checkpoint-wide files, whose shard
servers every other survivor fetches them from) share the first. etcd, the round's TCPStore
(hosted by the rank-0 agent, as torch's agent store) and the two shard servers are the shared
parts; everything per node (its agent, its watch, its workers) runs in parallel, which on a
cluster it is: here it shares 2 cores, so a measured time is an upper bound of a node's own.

The measurement: the job forms (round 0, every worker's first step), node ``victim`` dies
(``SimNode.die``), and the survivors restart into round 1. The phases are ``eft report``'s
(``goodput.phases.restart_spans``) over the events the agents recorded in etcd.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
import zlib
from pathlib import Path

from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.memory import DCP_METADATA, MemPart
from elasticft.goodput.phases import restart_spans
from elasticft.memckpt.index import MemIndex
from elasticft.memckpt.node_dir import NodeDir, iter_name
from elasticft.store import StoreOptions, connect, free_port

PER_CONNECTION = 32  # simulated agents per gRPC connection, as rdzv_sim.py shares them
ITERATION = 100  # the memory checkpoint every node holds when the node is lost
SHARD_BYTES = 64 << 10


def write_memory(n: int, run_id: str, mem_root: Path, addresses: dict[int, str]) -> list[MemPart]:
    """Every node's part of one memory iteration on tmpfs, one replica on the next node: its shard;
    node 0's also the checkpoint-wide files (.metadata names every shard: O(N) bytes, as DCP's)."""
    from restart_scale_node import node_name, shard_name

    parts = []
    shards = [shard_name(i) for i in range(n)]
    for i in range(n):
        files = {shard_name(i): os.urandom(SHARD_BYTES)}
        if i == 0:
            files[DCP_METADATA] = "\n".join(shards).encode() * 2
            files["common.pt"] = os.urandom(4096)
        holders = [i, (i + 1) % n]
        for holder in holders:
            node_dir = NodeDir(mem_root / run_id / node_name(holder))
            node_dir.create()
            where = (node_dir.own / "g1" if holder == i else node_dir.held / node_name(i)) / iter_name(ITERATION)
            where.mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                (where / name).write_bytes(data)
        names = [node_name(h) for h in holders]
        parts.append(MemPart(node=node_name(i), iteration=ITERATION, address=addresses.get(i, "127.0.0.1:9"),
                             files={k: [len(v), zlib.crc32(v)] for k, v in files.items()}, holders=names,
                             addresses={node_name(h): addresses.get(h, "127.0.0.1:9") for h in holders},
                             world_size=n, replicas=1, needs=shards + [DCP_METADATA, "common.pt"] if i == 0 else None,
                             time=time.time()))
    return parts


def _group(indices, n, survivors, endpoint, run_id, work, mem_root, lease_ttl, step_time, vote, ports, commands,
           replies):
    """One process of simulated nodes; obeys ``commands`` (see ``measure``)."""
    # torch looks up the peer's name at every TCPStore connect, client and server side (see
    # bench/store_connect.py): here all nodes' workers send that burst of DNS queries from one host, and
    # this machine's resolver drops some over UDP, each dropped one 5 s (glibc's timeout) of one phase.
    # Over TCP (use-vc) it refuses them at once; torch then prints the address. RES_OPTIONS= keeps UDP.
    os.environ.setdefault("RES_OPTIONS", "use-vc")
    if vote == "lazy":
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read as each group is made: before any is
    from restart_scale_node import SimNode, node_name, use_direct_groups

    use_direct_groups()

    from elasticft.memckpt.node_dir import NodeDir
    from elasticft.memckpt.server import ShardServer

    keys = RunKeys(run_id)
    pools = [connect(StoreOptions(endpoint)) for _ in range(-(-len(indices) // PER_CONNECTION))]
    servers = [ShardServer(NodeDir(Path(mem_root) / run_id / node_name(i)), node_name(i), run_id, "127.0.0.1",
                           ports[i]).start() for i in ports if i in indices]
    nodes = [SimNode(i, n, pools[k // PER_CONNECTION], endpoint, keys, Path(work), Path(mem_root), lease_ttl,
                     step_time, survivors) for k, i in enumerate(indices)]
    by_index = {node.index: node for node in nodes}
    replies.put(("registered", None))

    def all_nodes(step, of=None) -> None:
        threads = [threading.Thread(target=step, args=(node,), daemon=True) for node in (of or nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    while True:
        command, arg = commands.get()
        try:
            if command == "connect":
                for node in nodes:
                    node.connect()
                replies.put(("connected", None))
            elif command == "start":
                all_nodes(SimNode.start_generation)
                all_nodes(lambda node: [w.first_step.wait(120) for w in node.workers])
                for node in nodes:
                    threading.Thread(target=node.monitor, daemon=True).start()
                replies.put(("running", all(w.steps for node in nodes for w in node.workers)))
            elif command == "kill":
                victim = by_index[arg]
                nodes.remove(victim)
                replies.put(("killed", victim.die()))
            elif command == "wait":
                settled = {}
                all_nodes(lambda node: settled.__setitem__(node.name, node.settled(arg)))
                replies.put(("restarted", {node.name: dict(node.result, restarted=settled[node.name])
                                           for node in nodes}))
            elif command == "finish":
                all_nodes(SimNode.finish)
                for server in servers:
                    server.close()
                for client in pools:
                    client.close()
                replies.put(("finished", None))
                return
        except Exception as exc:  # noqa: BLE001 - the row says what failed
            replies.put(("error", f"{command}: {type(exc).__name__}: {exc}"[:300]))


def measure(n: int, endpoint: str, work: Path, mem_root: Path, vote: str = "lazy", per_process: int = 128,
            lease_ttl: float = 3.0, step_time: float = 0.2, cap: float = 300.0, kills: int = 1,
            during: bool = False, etcd_pid: int | None = None) -> dict:
    """One restart at ``n`` nodes: the phases (seconds), the total, each survivor's new rank, and
    the CPU seconds etcd (``etcd_pid``) and the nodes' processes spent in each phase (``cpu``).
    ``kills`` nodes die at once; ``during``: one more dies once the survivors have stopped their
    workers (inside the restart), so the restart runs again before the job trains on."""
    from restart_scale_cpu import CpuSampler, etcd_counts
    from restart_scale_node import node_name

    run_id = uuid.uuid4().hex
    keys = RunKeys(run_id)
    ports = {0: free_port(), 1: free_port()}
    client = connect(StoreOptions(endpoint))
    index = MemIndex(client, keys)
    for part in write_memory(n, run_id, mem_root, {i: f"127.0.0.1:{p}" for i, p in ports.items()}):
        index.write(part.node, [part])
    processes = -(-n // per_process)
    size = -(-n // processes)
    shares = [list(range(n))[p * size:(p + 1) * size] for p in range(processes)]
    # Neither a holder of the checkpoint-wide files (nodes 0, 1) nor the round's rank 0.
    victims = [n // 2 + i for i in range(kills + during)]
    if victims[-1] >= n or n - len(victims) < max(1, n // 2):  # the handler's min_nodes is n // 2
        raise ValueError(f"{n} nodes cannot lose {len(victims)} and keep training: use more nodes")
    survivors = n - len(victims)
    ctx = multiprocessing.get_context("spawn")
    channels = [(ctx.Queue(), ctx.Queue()) for _ in shares]
    children = [ctx.Process(target=_group, daemon=True, args=(share, n, survivors, endpoint, run_id, str(work), str(mem_root),
                                                             lease_ttl, step_time, vote, ports, commands, replies))
                for share, (commands, replies) in zip(shares, channels)]
    for child in children:
        child.start()

    def ask(command, arg=None, only=None) -> list:
        chosen = [channels[only]] if only is not None else channels
        for commands, _ in chosen:
            commands.put((command, arg))
        answers = [replies.get(timeout=cap) for _, replies in chosen]
        errors = [value for kind, value in answers if kind == "error"]
        if errors:
            raise RuntimeError(errors[0])
        return [value for _, value in answers]

    result = {"nodes": n, "vote": vote, "processes": processes, "lease_ttl": lease_ttl}
    try:
        for _, replies in channels:
            kind, value = replies.get(timeout=cap)
            if kind == "error":
                raise RuntimeError(value)
        ask("connect")
        formed = time.time()
        if not all(ask("start")):
            raise RuntimeError("a worker took no first step in round 0")
        result["first_start_s"] = time.time() - formed
        sampler = CpuSampler({"etcd": [etcd_pid] if etcd_pid else [], "nodes": [c.pid for c in children]}).start()
        asked = etcd_counts(endpoint)
        beats = [ask("kill", victim, only=victim // size)[0] for victim in victims[:kills]]
        if during:
            _await_a_stop(client, keys, min(beats))
            ask("kill", victims[-1], only=victims[-1] // size)
        settled = {}
        for part in ask("wait", cap):
            settled.update(part)
        sampler.stop()
        result["etcd"] = {k: v - asked[k] for k, v in etcd_counts(endpoint).items()}
        ask("finish")
        result.update(spans(client, keys, min(beats), settled, survivors), kills=kills, during=during)
        result["cpu"] = sampler.per_phase(min(beats), result["phases"])
    except Exception as exc:  # noqa: BLE001 - a row of the table
        result["error"] = str(exc)[:200]
        for commands, _ in channels:
            commands.put(("finish", None))
    finally:
        for child in children:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
        client.close()
    return result


def _await_a_stop(client, keys: RunKeys, since: float, timeout: float = 120.0) -> None:
    """Until a survivor has stopped its workers for the restart (its ``workers_stopped`` event):
    a node killed then dies inside the restart."""
    import json

    stopped = threading.Event()

    def seen(values) -> None:
        for value in values:
            record = json.loads(value) if value else {}
            if record.get("kind") == EventKind.WORKERS_STOPPED and record.get("why") == "restart" \
                    and record.get("time", 0) >= since:
                stopped.set()

    items, revision = client.get_prefix(keys.events)
    seen([item.value for item in items])
    cancel = client.watch_prefix(keys.events, lambda events: seen([e.value for e in events if not e.deleted]),
                                 start_revision=revision + 1)
    try:
        if not stopped.wait(timeout):
            raise RuntimeError(f"no survivor stopped its workers within {timeout:g} s")
    finally:
        cancel()


def spans(client, keys: RunKeys, begin: float, survivors: dict, expected: int) -> dict:
    """``eft report``'s phases of the restart, from the events the agents recorded."""
    from elasticft.agent.events import EventLog

    events = [e for e in EventLog(client, keys, "bench").read() if e.get("time", 0) >= begin]
    stopped = [e for e in events if e["kind"] == EventKind.WORKERS_STOPPED and e.get("why") == "restart"]
    following = [e for e in events if e["kind"] == EventKind.WORKERS_STOPPED and e.get("why") == "finished"]
    acted = [e["time"] for e in events if e["kind"] in (EventKind.NODE_LOST, EventKind.RESTART)]
    firsts = [e["first_step"] for e in following if e.get("first_step")]
    if len(firsts) != expected or not acted:
        raise RuntimeError(f"{len(firsts)} of {expected} survivors reported a first step")
    end = max(firsts)  # every survivor's first step
    phases = restart_spans(begin, end, True, min(acted), stopped, following)
    return {"total_s": end - begin, "phases": {span.name: span.seconds for span in phases},
            "merged": {span.name: [str(p) for p in span.merged] for span in phases if span.merged},
            "memory_prepare_s": max(r.get("memory_prepare_s", 0.0) for r in survivors.values()),
            "worlds": sorted({r.get("world") for r in survivors.values()}),
            "ranks": sorted(r.get("rank", -1) for r in survivors.values()),
            "all_first_steps": all(r.get("restarted") and r.get("first_steps") and all(r["first_steps"])
                                   for r in survivors.values()),
            "survivors": len(survivors)}
