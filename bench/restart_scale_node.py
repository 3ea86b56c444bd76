"""One simulated node of ``bench/restart_scale.py``: eft's agent's control plane and worker stand-ins.

The agent part runs eft's own code, wired as ``FTElasticAgent`` wires it: the node's record
under its lease (``NodeLease``), the membership watch (``Membership``), the etcd-v3 handler
sharing that lease and watch (``share_node_lease``), the planner (``RoundPlanner.assign``
through the round's store), the memory tier's restore preparation (``restart_plan``: the
index read once for the job; ``complete_iterations``, ``prepare_candidates``: the
checkpoint-wide files fetched from a holder's shard server), and the ``workers_stopped`` events with the restart phases (``StopRecorder``).
It polls the membership at torchrun's monitor interval (0.1 s), as torch's monitor loop does.

A worker stand-in is one gloo rank as a thread: what a Megatron worker does on the control
plane at a start and nothing else. ``process_group``: a TCPStore client of the round's
master (MASTER_ADDR/PORT from the round, torch's agent store) and the control-plane part of
NCCL's init (rank 0 puts an id in the store, every rank reads it); ``load``: the vote's gloo
group as the Megatron-LM mode makes it (eager full mesh, or lazily connected), the load's
agreement on the memory candidate (one tree vote) and a read of its own shard; ``first_step``:
one tree vote (``worker/tree_max.py``) and a heartbeat (``worker/progress.py``).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticft.agent.events import EventLog
from elasticft.agent.replan import RoundPlanner
from elasticft.agent.segments import StopRecorder
from elasticft.config import PlannerConfig
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.memory import RESTORE_FILE, RestorePlan
from elasticft.contract.phases import LoadTier, RestartPhase
from elasticft.contract.records import NodeRecord
from elasticft.contract.run_dir import write_atomically
from elasticft.memckpt.index import MemIndex, complete_iterations
from elasticft.memckpt.node_dir import NodeDir
from elasticft.memckpt.plan import restart_plan
from elasticft.memckpt.restore import prepare_candidates
from elasticft.rendezvous.backend import create_handler, rendezvous_revision, share_node_lease
from elasticft.rendezvous.membership import Membership, NodeLease
from elasticft.worker import tree_max
from elasticft.worker.progress import ProgressWriter

MONITOR_INTERVAL = 0.1  # torchrun's --monitor-interval default: how often torch's agent looks
GLOO_TIMEOUT = datetime.timedelta(seconds=60)


class _GroupDist:
    """``torch.distributed`` as ``tree_max_`` calls it, for a ``ProcessGroupGloo`` made directly:
    several ranks share this process, so no rank has the process-wide default group."""

    @staticmethod
    def get_rank(group):
        return group.rank()

    @staticmethod
    def get_world_size(group):
        return group.size()

    @staticmethod
    def get_global_rank(group, rank):
        return rank

    @staticmethod
    def send(tensor, dst, group=None, tag=0):
        group.send([tensor], dst, tag).wait()

    @staticmethod
    def recv(tensor, src, group=None, tag=0):
        group.recv([tensor], src, tag).wait()


def use_direct_groups() -> None:
    """eft's own tree (``tree_max_``) on directly made groups, in a process of the harness's own
    (``restart_scale_group._group``): never in one that imports this module for its names."""
    tree_max.dist = _GroupDist


def model_args(n: int, survivors: int) -> list[str]:
    """A small Megatron model whose batch divides both N and the survivors' ranks: every survivor
    gets a rank at the end (a generation in between may leave spare ranks)."""
    return ["--num-layers", "4", "--num-attention-heads", "8", "--hidden-size", "256", "--seq-length", "128",
            "--global-batch-size", str(n * survivors), "--micro-batch-size", "1"]


class _Heartbeat(ProgressWriter):
    """The rank's heartbeat file, with this rank's own phase ends (``worker/phases.py`` keeps them
    per process, and here several ranks share one)."""

    def __init__(self, run_dir, rank: int, started: float):
        self.stamps: dict[str, float] = {}
        self.load: tuple[str | None, int | None] = (None, None)
        super().__init__(run_dir, rank, 0, started=started)

    def stamp(self, phase: RestartPhase) -> None:
        self.stamps[str(phase)] = time.time()

    def record(self) -> dict:
        return {**super().record(), "phases": dict(self.stamps), "loaded_from": self.load[0],
                "loaded_bytes": self.load[1]}


class Worker:
    """A worker stand-in (one gloo rank, a thread). ``vote``: "eager" or "lazy" (the process's
    TORCH_GLOO_LAZY_INIT, set before torch made any group, says which the vote group is)."""

    def __init__(self, node: "SimNode", rank: int, world: int, master: tuple[str, int], step_time: float):
        self.node, self.rank, self.world, self.master = node, rank, world, master
        self.step_time = step_time
        self.stop = threading.Event()
        self.first_step = threading.Event()
        self.steps = 0
        self.error = ""
        self.groups: list = []
        self.thread = threading.Thread(target=self._run, name=f"worker-{rank}", daemon=True)

    def start(self) -> "Worker":
        self.thread.start()
        return self

    def _run(self) -> None:
        beat = _Heartbeat(self.node.run_dir, self.rank, time.time())
        try:
            beat.stamp(RestartPhase.IMPORTS)  # a thread imports nothing: the real cost is apart
            store = dist.TCPStore(self.master[0], self.master[1], is_master=False, timeout=GLOO_TIMEOUT)
            world = dist.PrefixStore(f"default_pg/{self.node.generation}/", store)
            if self.rank == 0:
                world.set("nccl_id", os.urandom(128))  # NCCL's id goes through the store; the rest is on the GPU
            world.get("nccl_id")
            beat.stamp(RestartPhase.PROCESS_GROUP)
            vote = dist.ProcessGroupGloo(dist.PrefixStore(f"vote/{self.node.generation}/", store), self.rank,
                                         self.world, GLOO_TIMEOUT)
            self.groups = [vote]
            plan = RestorePlan.from_json((Path(self.node.run_dir) / RESTORE_FILE).read_text())
            ready = next((c for c in plan.candidates if c.ready), None)
            agreed = torch.tensor([ready.iteration if ready else -1], dtype=torch.int64)
            tree_max.tree_max_(agreed, vote)  # the ranks agree on the newest candidate ready everywhere
            nbytes = self.node.read_own_shard(ready) if ready else 0
            beat.load = (str(LoadTier.MEMORY if ready else LoadTier.NONE), nbytes)
            beat.stamp(RestartPhase.LOAD)
            iteration = int(agreed.item()) + 1
            while not self.stop.is_set():
                ballot = torch.tensor([0, iteration], dtype=torch.int64)
                tree_max.tree_max_(ballot, vote)  # the hook's vote, every iteration
                if self.stop.is_set():
                    break  # stopped meanwhile: a killed process writes nothing more
                beat.step(iteration)
                self.steps += 1
                self.first_step.set()
                iteration += 1
                self.stop.wait(self.step_time)  # the training step itself (no model here)
        except Exception as exc:  # noqa: BLE001 - a peer gone: as a worker whose collective failed
            self.error = f"{type(exc).__name__}: {exc}"[:200]

    def kill(self) -> None:
        """As SIGKILL: no more heartbeats; a rank blocked in a collective stays there until its
        group's timeout (the process would be gone: nothing waits for it)."""
        self.stop.set()
        for group in self.groups:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort, as a dying process's sockets
                pass


class SimNode:
    """One node's agent: register, connect, then start generations and restart on a loss."""

    def __init__(self, index: int, n: int, client, endpoint: str, keys: RunKeys, work: Path, mem_root: Path,
                 lease_ttl: float, step_time: float, survivors: int):
        self.index, self.n, self.client, self.endpoint, self.keys = index, n, client, endpoint, keys
        self.survivors = survivors  # the world the job ends the measurement at
        self.name = node_name(index)
        self.step_time = step_time
        self.run_dir = work / self.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.node_dir = NodeDir(mem_root / keys.run_id / self.name)
        self.node = NodeLease(client, keys, NodeRecord(self.name, "127.0.0.1", "127.0.0.1", os.getpid()),
                              ttl=lease_ttl)
        self.events = EventLog(client, keys, self.name)
        self.index_reader = MemIndex(client, keys)
        self.lease_ttl = lease_ttl
        self.generation = 0
        self.workers: list[Worker] = []
        self.exit = threading.Event()
        self.restarted = threading.Condition()  # notified after each restart's first steps
        self.result: dict = {}
        self.membership = self.handler = self.stops = self.planner = None

    def connect(self) -> None:
        """The membership watch and the handler (after every node registered: see rdzv_agents)."""
        self.membership = Membership(self.client, self.keys)
        params = RendezvousParameters(backend="etcd-v3", endpoint=self.endpoint, run_id=self.keys.run_id,
                                      min_nodes=max(1, self.n // 2), max_nodes=self.n, local_addr="127.0.0.1",
                                      last_call_timeout="1", join_timeout="600", lease_ttl=str(self.lease_ttl))
        self.handler = create_handler(params, client=self.client)
        share_node_lease(self.handler, self.node, self.membership)
        self.stops = StopRecorder(self.events.record, self.run_dir)
        self.planner = RoundPlanner.for_worker(tuple(model_args(self.n, self.survivors)), PlannerConfig())

    # -- the agent's steps ----------------------------------------------------------

    def start_generation(self) -> None:
        """torch's _initialize_workers as eft's agent overrides it: rendezvous, plan, start."""
        self.membership.take_losses()
        info = self.handler.next_rendezvous()
        self.stops.stamp(RestartPhase.RENDEZVOUS)  # torch calls _assign_worker_ranks as the round forms
        share = self.planner.assign(info.store, info.rank, info.world_size, 1)
        self.membership.forget_non_members(rendezvous_revision(self.handler))
        self.stops.stamp(RestartPhase.REPLAN)
        began = time.time()
        self.prepare_restore()
        self.result["memory_prepare_s"] = time.time() - began
        self.generation += 1
        self.stops.started()
        store = info.bootstrap_store_info
        self.workers = [Worker(self, share.first_rank + i, share.plan.used, (store.master_addr, store.master_port),
                               self.step_time).start() for i in range(share.local_workers)]
        self.stops.stamp(RestartPhase.SPAWN)
        self.result.update(world=share.plan.used, rank=info.rank, round=self.handler.round.number,
                           nodes=info.world_size)

    def prepare_restore(self) -> None:
        """``MemoryTier.prepare_start`` less its generation bookkeeping: the restart's plan (the
        index read once for the job, by the planning agent: ``memckpt/plan.py``), the iterations
        the members complete, the candidates (checkpoint-wide files fetched)."""
        alive = set(self.membership.members()) | {self.name}
        parts = restart_plan(self.index_reader, self.name, alive, since=rendezvous_revision(self.handler)).parts
        complete = complete_iterations(parts, alive)
        self.node_dir.clear_restore()
        candidates = prepare_candidates(self.node_dir, self.name, self.keys.run_id, complete, self.events.record,
                                        30.0, parts)
        plan = RestorePlan(candidates=candidates, generation=self.generation, run_id=self.keys.run_id, node=self.name)
        write_atomically(self.run_dir / RESTORE_FILE, plan.to_json())

    def read_own_shard(self, candidate) -> int:
        entry = candidate.files.get(shard_name(self.index))
        if entry is None or not entry.local:
            return 0
        return len((Path(candidate.path) / entry.name).read_bytes())

    def monitor(self) -> None:
        """torch's monitor loop as far as a lost member goes: look every interval; on a loss,
        record it, stop the workers, and start the next generation (a loss during a restart, as
        ``--kill-during-restart`` makes, is the next turn's); note the generation's first steps."""
        while not self.exit.wait(MONITOR_INTERVAL):
            if not self.membership.lost.is_set():
                with self.restarted:
                    if self.result.get("first_steps") is None and all(w.first_step.is_set() for w in self.workers):
                        self.result["first_steps"] = [w.steps > 0 for w in self.workers]
                        self.restarted.notify_all()
                continue
            lost = [r.node_id for r in self.membership.lost_nodes().values()]
            self.events.record(EventKind.NODE_LOST, nodes=lost, restarts=1)  # announce()
            self.events.record(EventKind.RESTART, reason="membership", remaining_restarts=3, max_restarts=3)
            for worker in self.workers:
                worker.kill()
            self.stops.stopped("restart")
            with self.restarted:
                self.result["first_steps"] = None  # the next generation's, once its workers step
                self.result["restarts"] = self.result.get("restarts", 0) + 1
            self.start_generation()

    def settled(self, timeout: float) -> bool:
        """Whether this node restarted into the job's last world (every survivor's rank) and its
        workers took their first step there, within ``timeout``."""
        with self.restarted:
            # The round's nodes, not the plan's ranks: a round in between (a node about to die in it)
            # can plan as many ranks as the last one, leaving a node spare.
            return self.restarted.wait_for(lambda: self.result.get("nodes") == self.survivors
                                           and self.result.get("first_steps") is not None, timeout)

    def die(self) -> float:
        """As a node SIGKILLed: its workers and watches go, then its lease (revoked: the same keys at
        one revision as an expiry, without the TTL). Returns its workers' last heartbeat."""
        self.exit.set()
        for worker in self.workers:
            worker.kill()
        self.handler.rounds.stop_watching()
        self.membership.close()
        last = json.loads((self.run_dir / "progress" / "0.json").read_text())["time"]
        self.node.lease.revoke()
        return last

    def finish(self) -> None:
        """The job ends: the new generation's workers_stopped event (its phases), then leave."""
        for worker in self.workers:
            worker.kill()
        self.stops.stopped("finished")
        self.exit.set()
        self.handler.rounds.leave()
        self.membership.close()
        self.node.close(clean=True)


def node_name(index: int) -> str:
    return f"node{index:04d}"


def shard_name(index: int) -> str:
    return f"__{index}_0.distcp"
