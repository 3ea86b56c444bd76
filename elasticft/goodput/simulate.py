"""A discrete-event simulation of a job's goodput under failures, one policy at a time.

Events are failures, predictions, false alarms, recoveries and node returns: O(failures),
never O(iterations). Between two events the job trains through a fixed cycle, so what it
did is computed in closed form (``_Cycle``): ``save_interval`` of training then a disk save
of ``save_seconds``; with a memory tier, a memory save of ``memory_save_seconds`` after every
``memory_interval`` of training inside that span. A failure loses the training since the
newest checkpoint it can resume from (rework), then costs detection, an optional wait for a
node, restart and load. Every paid GPU-second ends in ``Result.productive`` or one of
``policies.LOSSES``; they add up to the paid GPU-time.

``replay`` runs the same code on a given failure list: what a real run would have done.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

from elasticft.goodput.costs import JobCosts, young_daly_interval
from elasticft.goodput.failures import FailureTrace
from elasticft.goodput.policies import EFT, Cluster, Policy, Result


class _Cycle:
    """Closed form of the training/save cycle from fresh clocks (just after a save or a restart)."""

    def __init__(self, save_interval: float, save: float, memory_interval: float, memory_save: float):
        self.tau, self.save = save_interval or math.inf, save
        self.tm, self.msave = memory_interval or math.inf, memory_save
        # Memory saves strictly inside one disk span; the disk save stands for the last one.
        self.m = math.ceil(self.tau / self.tm) - 1 if math.isfinite(self.tau) and math.isfinite(self.tm) else 0
        self.length = self.tau + self.save + self.m * self.msave

    def at(self, w: float) -> tuple[float, float, float, float, float]:
        """After ``w`` wall seconds: (trained, disk stall, memory stall, trained since the
        last complete disk save, trained since the last complete memory or disk save)."""
        tm, msave = self.tm, self.msave
        if math.isinf(self.tau):
            if math.isinf(tm):
                return w, 0.0, 0.0, w, w
            j = math.floor(w / (tm + msave))
            q = w - j * (tm + msave)
            if q < tm:
                return j * tm + q, 0.0, j * msave, j * tm + q, q
            return (j + 1) * tm, 0.0, j * msave + q - tm, (j + 1) * tm, tm
        n = math.floor(w / self.length)
        r = w - n * self.length
        span = tm + msave
        disk = 0.0
        if self.m and r < self.m * span:
            j = math.floor(r / span)
            q = r - j * span
            if q < tm:
                trained, memory, since_memory = j * tm + q, j * msave, q
            else:
                trained, memory, since_memory = (j + 1) * tm, j * msave + q - tm, tm
        else:
            before = self.m * tm if self.m else 0.0  # training in the memory spans (0 * inf is NaN)
            q = r - self.m * span if self.m else r
            last = self.tau - before
            memory = self.m * msave
            if q < last:
                trained, since_memory = before + q, q
            else:
                trained, disk, since_memory = self.tau, q - last, last
        return (n * self.tau + trained, n * self.save + disk, n * self.m * msave + memory,
                trained, min(trained, since_memory))

    def next_save_end(self, w: float) -> float:
        """Wall seconds from fresh clocks to the end of the first disk save after ``w``."""
        return (math.floor(w / self.length) + 1) * self.length


class _Run:
    def __init__(self, costs: JobCosts, policy: Policy, cluster: Cluster, trace: FailureTrace,
                 record: bool):
        self.costs, self.policy, self.cluster, self.trace = costs, policy, cluster, trace
        self.memory = policy.memory and costs.has_memory_tier
        self.cycle = _Cycle(costs.save_interval_seconds, costs.save_seconds,
                            costs.memory_interval_seconds if self.memory else 0.0,
                            costs.memory_save_seconds if self.memory else 0.0)
        self.detection = cluster.torchrun_detection_seconds if policy.torchrun else costs.detection_seconds
        self.restart = cluster.torchrun_restart_seconds if policy.torchrun else costs.restart_seconds
        spares = 0 if policy.replan else cluster.spare_nodes
        self.spare_gpus = spares * cluster.gpus_per_node
        n = cluster.gpus
        self.result = Result(policy.name, n, trace.seconds, paid=(n + self.spare_gpus) * trace.seconds,
                             progress=[(0.0, 0.0)] if record else None)
        self.pool = [0.0] * spares  # when each spare node is (again) available
        self.down: list[float] = []  # return times of nodes away (replan)
        self.events: list = []
        self.order = itertools.count()
        self.capacity = n
        self.mode = "train"
        self.done = 0.0  # training so far, in whole-job seconds (for the picture)
        self._begin_segment(0.0, 0.0, 0.0, 0.0)
        self.recovery_id = 0

    # -- events -------------------------------------------------------------------------
    def _push(self, time: float, kind: str, data=None) -> None:
        heapq.heappush(self.events, (time, next(self.order), kind, data))

    def run(self) -> Result:
        trace, save = self.trace, self.costs.save_seconds
        for index, (time, node) in enumerate(zip(trace.times, trace.nodes)):
            self._push(float(time), "fail", (int(node), trace.loses_memory(index)))
        if self.policy.proactive:
            for time, lead in zip(trace.times, trace.leads):
                if lead > save and time - lead >= 0:  # NaN (not predicted) compares False
                    self._push(float(time - lead), "predict")
            for time in trace.alarms:
                self._push(float(time), "predict")
        while self.events and self.events[0][0] <= trace.seconds:
            time, _, kind, data = heapq.heappop(self.events)
            self.down = [back for back in self.down if back > time]
            getattr(self, "_on_" + kind)(time, data)
        self._finish(trace.seconds)
        return self.result

    def _on_fail(self, t: float, failure: tuple[int, bool]) -> None:
        node, loses_memory = failure
        self.result.failures += 1
        if self.mode == "train":
            since_disk, since_memory = self._close_segment(t)
            self.incident = {"disk": since_disk, "memory": since_memory, "gpus": self.capacity,
                             "nodes": set(), "ready": t, "planned": False, "memory_lost": False}
        else:
            self._account_recovery(t)
            self.incident["planned"] = False
        self.incident["nodes"].add(node)
        self.incident["memory_lost"] |= loses_memory
        self._node_away(t)
        self._start_recovery(t, self.detection)

    def _on_predict(self, t: float, _=None) -> None:
        if self.mode != "train" or t < self.seg_t0 + self.seg_stall:
            return  # recovering (nothing new to save) or already saving
        since_disk, since_memory = self._close_segment(t)
        self.result.proactive_saves += 1
        self._begin_segment(t, self.costs.save_seconds, since_disk, since_memory)

    def _on_recovered(self, t: float, recovery_id: int) -> None:
        if recovery_id != self.recovery_id:
            return
        self._account_recovery(t)
        self._charge_rework(t)
        self.capacity = self.recovery_gpus
        self._begin_segment(t, 0.0, 0.0, 0.0)

    def _on_return(self, t: float, _=None) -> None:
        if self.mode == "train":
            self._schedule_grow(t)

    def _on_grow(self, t: float, segment_id: int) -> None:
        """A node is back (replan): at the end of a save, restart on more GPUs."""
        if self.mode != "train" or segment_id != self.segment_id:
            return
        self._close_segment(t)
        self.incident = {"disk": 0.0, "memory": 0.0, "gpus": self.capacity, "nodes": set(),
                         "ready": t, "planned": True, "memory_lost": False}
        self._start_recovery(t, 0.0)

    # -- training -------------------------------------------------------------------------
    def _begin_segment(self, t: float, stall: float, carry: float, carry_memory: float) -> None:
        """Training from ``t`` after an optional save stall; ``carry``: training at risk during it."""
        self.mode = "train"
        self.seg_t0, self.seg_stall, self.carry, self.carry_memory = t, stall, carry, carry_memory
        self.segment_id = getattr(self, "segment_id", 0) + 1
        self._schedule_grow(t)

    def _schedule_grow(self, t: float) -> None:
        if not self.policy.replan or self._gpus_up(t) <= self.capacity:
            return
        w = t - self.seg_t0 - self.seg_stall
        at = self.seg_t0 + self.seg_stall + (0.0 if w < 0 or math.isinf(self.cycle.length)
                                             else self.cycle.next_save_end(w))
        self._push(max(at, t), "grow", self.segment_id)

    def _close_segment(self, t: float) -> tuple[float, float]:
        """Account training from the segment's start to ``t``; the training at risk then."""
        elapsed, gpus = t - self.seg_t0, self.capacity
        if elapsed <= self.seg_stall:
            trained, stall, since_disk, since_memory = 0.0, elapsed, self.carry, self.carry_memory
        else:
            trained, disk, memory, since_disk, since_memory = self.cycle.at(elapsed - self.seg_stall)
            stall = self.seg_stall + disk + memory
        losses = self.result.losses
        self.result.productive += trained * gpus
        losses["saves"] += stall * gpus
        losses["reduced_capacity"] += elapsed * (self.cluster.gpus - gpus)
        self._record(t, trained * gpus)
        return since_disk, since_memory

    def _record(self, t: float, gpu_seconds: float) -> None:
        self.done += gpu_seconds / self.cluster.gpus
        if self.result.progress is not None:
            self.result.progress.append((t, self.done / self.trace.seconds))

    # -- recovery -------------------------------------------------------------------------
    def _node_away(self, t: float) -> None:
        back = t + self.cluster.repair_seconds
        if self.policy.replan:
            if back > t:
                self.down.append(back)
                self._push(back, "return")
            return
        if self.pool:
            available = heapq.heappop(self.pool)
            heapq.heappush(self.pool, back)
        else:  # no spares: wait for the node itself
            available = back
        self.incident["ready"] = max(self.incident["ready"], available)

    def _gpus_up(self, t: float) -> int:
        """GPUs usable at ``t`` (replan: whole replicas of the nodes not away)."""
        cluster = self.cluster
        up = cluster.gpus - cluster.gpus_per_node * sum(1 for back in self.down if back > t)
        return max(up, 0) // cluster.replica * cluster.replica

    def _start_recovery(self, t: float, detection: float) -> None:
        nodes, count = self.incident["nodes"], self.cluster.nodes
        # The replica of a node's part lies on the next node (ring order): both lost, no memory.
        self.from_memory = self.memory and not self.incident["memory_lost"] \
            and not any((node + 1) % count in nodes for node in nodes)
        load = (self.costs.memory_load_seconds or self.costs.load_seconds) if self.from_memory \
            else self.costs.load_seconds
        ready = self.incident["ready"]
        if self.policy.replan:
            ready = t + detection
            for back in sorted(self.down):  # too few survivors: wait for returns
                if self._gpus_up(ready) > 0:
                    break
                ready = back
        wait = max(0.0, ready - (t + detection))
        self.recovery_gpus = self._gpus_up(t + detection + wait) if self.policy.replan else self.cluster.gpus
        reshard = self.costs.reshard_seconds if self.recovery_gpus != self.incident["gpus"] else 0.0
        self.chunks = (("detection", detection), ("waiting", wait), ("restart", self.restart + load + reshard))
        self.mode, self.recovery_t0 = "recover", t
        self.recovery_id += 1
        self._push(t + sum(d for _, d in self.chunks), "recovered", self.recovery_id)

    def _account_recovery(self, t: float) -> None:
        left = t - self.recovery_t0
        for name, duration in self.chunks:
            part = min(duration, max(left, 0.0))
            self.result.losses[name] += part * self.cluster.gpus
            left -= duration

    def _charge_rework(self, t: float) -> None:
        incident = self.incident
        if not incident["planned"]:
            if self.from_memory:
                self.result.memory_recoveries += 1
            else:
                self.result.disk_recoveries += 1
        lost = (incident["memory"] if self.from_memory else incident["disk"]) * incident["gpus"]
        self.result.productive -= lost
        self.result.losses["rework"] += lost
        self._record(t, -lost)

    def _finish(self, end: float) -> None:
        if self.mode == "train":
            self._close_segment(end)
        else:
            self._account_recovery(end)
            self._charge_rework(end)
        self.result.losses["idle_spares"] += self.spare_gpus * end


def run_policy(costs: JobCosts, policy: Policy, cluster: Cluster, trace: FailureTrace,
               record: bool = False) -> Result:
    """One policy over one failure trace (the costs' intervals as given)."""
    return _Run(costs, policy, cluster, trace, record).run()


def with_young_daly(costs: JobCosts, job_mtbf_seconds: float, disk: bool = True,
                    memory: bool = True) -> JobCosts:
    """The costs with their save intervals set to Young–Daly's for the job's MTBF."""
    changes = {}
    if disk:
        changes["save_interval_seconds"] = young_daly_interval(job_mtbf_seconds, costs.save_seconds)
    if memory and costs.memory_save_seconds > 0:
        changes["memory_interval_seconds"] = max(young_daly_interval(job_mtbf_seconds, costs.memory_save_seconds),
                                                 costs.iteration_seconds)
    return dataclasses.replace(costs, **changes)


def replay(costs: JobCosts, failure_times, wall_seconds: float, gpus: int, gpus_per_node: int = 8,
           policy: Policy = EFT, nodes=None, spare_nodes: int = 0, repair_seconds: float = 0.0,
           record: bool = False) -> Result:
    """The goodput a given failure sequence yields: failures at ``failure_times`` (seconds
    from the start) on ``nodes`` (default: node i mod node count), the costs' intervals as
    measured, a failed node replaced at once unless ``repair_seconds``. Deterministic."""
    cluster = Cluster(gpus, gpus_per_node, spare_nodes=spare_nodes, repair_seconds=repair_seconds)
    trace = FailureTrace.fixed(failure_times, wall_seconds, nodes=nodes, node_count=cluster.nodes)
    return run_policy(costs, policy, cluster, trace, record)


# With a memory tier, disk saves only guard against the failures memory cannot recover
# from; at least this share of failures is assumed to be such (Titan's causes are unknown).
MIN_MEMORY_LOSS_SHARE = 0.05


def simulate_job(costs: JobCosts, cluster: Cluster, trace: FailureTrace, policies: list[Policy],
                 job_mtbf_seconds: float, young_daly_disk: bool = True, young_daly_memory: bool = True,
                 record: bool = False) -> tuple[dict[str, JobCosts], list[Result]]:
    """Every policy over the same trace; the costs each used, and the results.

    Save intervals are Young–Daly's unless the costs' own are kept: the disk interval for
    the job's MTBF, or, for a policy with memory checkpoints, for the MTBF of the failures
    memory cannot recover from (``trace.memory_loss_share()``, at least
    ``MIN_MEMORY_LOSS_SHARE``); the memory interval for the job's MTBF."""
    plain = with_young_daly(costs, job_mtbf_seconds, young_daly_disk, young_daly_memory)
    share = max(trace.memory_loss_share(), MIN_MEMORY_LOSS_SHARE)
    layered = dataclasses.replace(plain, save_interval_seconds=young_daly_interval(
        job_mtbf_seconds / share, costs.save_seconds)) if young_daly_disk else plain
    used = {policy.name: layered if policy.memory and plain.has_memory_tier else plain for policy in policies}
    return used, [run_policy(used[policy.name], policy, cluster, trace, record) for policy in policies]
