"""The worker's half of the memory checkpoint tier: snapshots into host memory, restores from it.

    memory = MemoryCheckpoints(hook)                       # after Hook(); inert without eft
    memory.guard(optimizer)                                # its step() waits for a copy in flight
    restored = memory.restore(load_fn, checkpoints)        # the newest of memory and disk
    ...
    action = hook.step(iteration)                          # the vote carries the tier's fields
    memory.step(iteration, lambda: sharded_state_dict)     # every iteration, on every rank
    memory.flush()                                         # before a disk save or the exit

Every ``--eft-mem-ckpt-interval`` iterations each rank copies its state into host memory
and writes it, on a thread, as torch_dist files into the directory its agent named
(``EFT_MEM_CKPT_WRITE_DIR``, tmpfs: it outlives the worker). The copy is the stall, or
with ``--eft-mem-ckpt-overlap`` (the default) and a loop that says where its update is
(``guard(optimizer)``, or ``before_update()`` before each update), it runs beside the next
iteration's forward and backward and only the update waits for what is left of it. The hook's vote
tells every rank when all writes are done; then all finalize at the same iteration and
local rank 0 tells its agent, which checksums the node's part and replicates it to other
nodes (``elasticft.memckpt``). docs/memory-checkpoints.md has the whole design.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elasticft.config import MemoryConfig, from_env
from elasticft.contract.checkpoints import iter_dir_name
from elasticft.contract.faults import COPY_SLOW_SECONDS
from elasticft.contract.memory import LAG_MARKER, PAUSE_MARKER, RESTORE_FILE, RestoreCandidate, RestorePlan
from elasticft.contract.run_dir import OutboxKind, WorkerEnv
from elasticft.worker import phases
from elasticft.worker.checkpoints import agreed_error
from elasticft.worker.inject import FaultInjector
from elasticft.worker.ranged_reads import ReadCounts, corrupt_ranges, ranged_reads
from elasticft.worker.relay import Outbox
from elasticft.worker.snapshot import (
    HostCopier,
    SaveRequest,
    Snapshot,
    in_process_results_queue,
    save_strategy,
)

log = logging.getLogger(__name__)

BUSY, FAILED, PAUSED = range(3)  # this tier's slots in the hook's vote


@dataclass(frozen=True)
class Restored:
    """Where the workers resumed: ``iteration`` None means from scratch."""

    iteration: int | None
    source: str  # "memory", "disk" or "none"
    path: str | None = None
    result: Any = None  # what load_fn returned


class MemoryCheckpoints:
    """See the module's docstring. ``interval`` overrides ``EFT_MEM_CKPT_INTERVAL``, ``overlap``
    ``EFT_MEM_CKPT_OVERLAP``; ``share_results_queue`` False where the process's disk saves
    are written by other processes (``snapshot.in_process_results_queue``)."""

    width = 3  # Ballot: BUSY, FAILED, PAUSED

    def __init__(self, hook, interval: int | None = None, share_results_queue: bool = True,
                 overlap: bool | None = None):
        self.hook = hook
        config = from_env(MemoryConfig)
        self.interval = config.mem_ckpt_interval if interval is None else interval
        # The copy overlaps the next iteration only once the loop has shown where its update is:
        # a loop that never calls before_update() keeps the copy on the training path.
        self.overlap = config.mem_ckpt_overlap if overlap is None else overlap
        self._update_point = False
        self.dir = os.environ.get(WorkerEnv.MEM_DIR, "")
        self.run_dir = Path(hook.run_dir) if hook.run_dir else None
        # Snapshots need eft-run, an interval and the agent's directory; restore() works without.
        self.inert = hook.inert or self.interval <= 0 or not self.dir
        self.last_stall: float | None = None  # seconds the loop waited for the newest complete snapshot
        self.last_complete: int | None = None
        self.last_seconds: float | None = None  # from the newest complete snapshot's start to its finalization
        self._pending: Snapshot | None = None
        self._agreed = [0, 0, 0]
        self._reporter = not hook.inert and int(os.environ.get("LOCAL_RANK", "0")) == 0  # tells the node's agent
        self._outbox = Outbox(self.run_dir) if self._reporter else None
        if self.inert:
            return
        if share_results_queue:  # the process's own torch_dist saves spawn no queue manager either
            in_process_results_queue()
        self._copier = HostCopier()
        self._slow_from = FaultInjector.from_env().copy_slow_from()  # --eft-inject copy_slow (tests)
        self._strategy = save_strategy()
        self._validated = False
        hook.add_ballot(self)

    # -- the vote (Ballot) -----------------------------------------------------------

    def mine(self, iteration: int) -> list[int]:
        pending = self._pending
        busy = int(pending is not None and not pending.done)
        failed = int(pending is not None and pending.failed)
        # Two stats, only when a snapshot is due: the agent pauses the tier when over budget, and
        # holds the next snapshot while a node's newest is still being replicated (a back-off
        # every node sees in the same vote: all skip the same iterations, none drops one).
        paused = int(self._due(iteration) and ((self.run_dir / PAUSE_MARKER).exists()
                                               or (self.run_dir / LAG_MARKER).exists()))
        return [busy, failed, paused]

    def settle(self, agreed: list[int]) -> None:
        self._agreed = agreed

    def needs_vote(self, iteration: int) -> bool:
        """A snapshot is due (paused or not, all must agree) or one is being written."""
        return self._pending is not None or self._due(iteration)

    # -- every iteration -------------------------------------------------------------

    def _due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def step(self, iteration: int, state_fn: Callable[[], dict | SaveRequest]) -> None:
        """After ``hook.step(iteration)``: finish the previous snapshot when every rank's
        write is done, and start this iteration's when it is due and none is in flight
        (``state_fn`` is called only then)."""
        if self.inert:
            return
        if self._pending is not None and not self._agreed[BUSY]:
            self._finish(failed=bool(self._agreed[FAILED]))
        if self._due(iteration) and self._pending is None and not self._agreed[PAUSED]:
            began = time.perf_counter()
            path = Path(self.dir) / iter_dir_name(iteration)
            slow = self._slow_from is not None and iteration >= self._slow_from
            self._copier.delay = COPY_SLOW_SECONDS if slow else 0.0
            self._pending = Snapshot.start(iteration, path, state_fn(), self._copier, self._strategy,
                                           validate=not self._validated, overlap=self.overlap and self._update_point,
                                           record_items=True)
            self._validated = True
            self._pending.stall = time.perf_counter() - began  # state_fn() included: the loop waited for it too
            self.hook.stalled("memory", self._pending.stall)

    def before_update(self) -> None:
        """Every rank, before each change of the state in place (the optimizer's update):
        wait for what is left of the copy of a snapshot in flight (a stall).

        Calling it is what lets the copy overlap the next iteration: from the first call on,
        a snapshot's copy runs beside the loop, which must call this before it changes a
        tensor of the state (``guard`` does it for an optimizer's ``step``).
        """
        self._update_point = True
        if self._pending is not None:
            waited = self._pending.wait_copy()
            if waited:
                self.hook.stalled("memory", waited)

    def guard(self, optimizer):
        """``optimizer`` (returned) with ``before_update`` run first by each call of its
        ``step``: the instance's method wrapped, once. Nothing changes when the tier is inert."""
        if self.inert or getattr(optimizer.step, "_eft_waits_for_snapshot", False):
            return optimizer
        step = optimizer.step

        @functools.wraps(step)
        def step_after_the_copy(*args, **kwargs):
            self.before_update()
            return step(*args, **kwargs)

        step_after_the_copy._eft_waits_for_snapshot = True
        optimizer.step = step_after_the_copy
        self._update_point = True
        return optimizer

    def flush(self) -> None:
        """Every rank, at the same iteration: wait for the snapshot in flight and finish it.

        Call it before a disk save (both use torch_dist's one results queue) and before
        the workers exit, so the newest snapshot is not lost to a clean end.
        """
        if self.inert or self._pending is None:
            return
        self._pending.wait()
        failed = self.hook.agree([int(self._pending.failed)])[0]
        self._finish(failed=bool(failed))

    def _finish(self, failed: bool) -> None:
        snapshot, self._pending = self._pending, None
        if failed:
            log.warning("memory snapshot of iteration %d failed on some rank: dropped", snapshot.iteration)
            return
        seconds, ok = snapshot.finalize()
        if not ok:
            return
        self.last_complete = snapshot.iteration
        self.last_seconds = seconds
        self.last_stall = snapshot.stall
        if self._reporter:
            self._outbox.send({"type": OutboxKind.MEM_SAVED, "iteration": snapshot.iteration,
                               "path": str(snapshot.path), "seconds": seconds, "stall": snapshot.stall,
                               "bytes": snapshot.bytes, "overlapped": snapshot.copying.overlapped,
                               "copy": snapshot.copying.seconds, "waited": snapshot.waited})

    # -- at the start ------------------------------------------------------------------

    def restore(self, load_fn: Callable[[str, int], Any], checkpoints=None) -> Restored:
        """Load the newest state the job has: memory when it is at least as new as disk.

        ``load_fn(path, iteration)`` loads a torch_dist checkpoint into the job's state; it
        may run again after it succeeded on this rank (another rank's load failed), and must
        then leave the second iteration's state. ``checkpoints`` is the disk's
        ``CheckpointDir`` (or None). A memory iteration is used only if every rank's agent
        prepared it and every rank loaded it; each rank reads only the byte ranges its load
        plan needs (``ranged_reads``). If loading it fails on any rank (a range no holder
        delivers intact, for one), the next older one, then the disk's newest complete
        checkpoint.
        """
        plan = self._plan()
        disk = checkpoints.complete_iterations() if checkpoints is not None else []
        newest_disk = disk[0] if disk else None
        restored, counts = None, None
        agreed = self._agreed_candidates(plan)
        for i, (iteration, candidate) in enumerate(agreed):
            if newest_disk is not None and iteration < newest_disk:
                log.warning("memory checkpoint %d is older than disk checkpoint %d: loading from disk",
                            iteration, newest_disk)
                break
            error: BaseException | None = None
            try:
                with ranged_reads(candidate, plan.run_id, plan.node) as reader:
                    result = load_fn(candidate.path, iteration)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure: the next candidate
                error = exc
            # A rank's reads can fail alone (a range only it reads, as megatron-core 0.19's loader
            # raises locally): every rank moves to the next candidate together, or none does.
            error = agreed_error(error, self.hook.agree)
            if error is None:
                restored = Restored(iteration, "memory", candidate.path, result)
                counts = reader.counts if reader is not None else ReadCounts()
                break
            later = next((k for k, _ in agreed[i + 1:] if newest_disk is None or k >= newest_disk), None)
            then = (f"iteration {later} from memory" if later is not None else
                    "the newest disk checkpoint" if newest_disk is not None else "a start from scratch")
            self._fell_back(iteration, error, then)
        if restored is None and checkpoints is not None:
            agree = None if self.hook.inert else self.hook.agree  # every rank falls back together
            iteration, result = checkpoints.load_latest(load_fn, agree=agree)
            if iteration is not None:
                restored = Restored(iteration, "disk", str(checkpoints.dir_of(iteration)), result)
        restored = restored or Restored(None, "none")
        phases.loaded(restored.source, restored.path)  # eft report: the load phase ends here
        read = self._node_counts(plan, counts) if restored.source == "memory" else None
        if self._reporter:
            self._outbox.send({"type": OutboxKind.RESTORED, "iteration": restored.iteration,
                               "source": restored.source, "path": restored.path,
                               "reached": plan.reached if plan else None, "read": read})
        return restored

    def ready_everywhere(self) -> list[int]:
        """The memory iterations every rank's agent prepared, newest first (one collective on every
        rank unless inert): for a loop that loads only when it knows of a checkpoint (Bridge's)."""
        return [iteration for iteration, _ in self._agreed_candidates(self._plan())]

    def _fell_back(self, iteration: int, exc: BaseException, then: str) -> None:
        """A memory iteration did not load (on every rank alike): say why, once for the job (global rank 0)."""
        corrupt = corrupt_ranges(exc)
        why = "; ".join(str(c) for c in corrupt) or (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        log.warning("memory checkpoint %d does not load (%s): falling back to %s", iteration, why, then)
        if not self._reporter or dist.get_rank() != 0:
            return
        for c in corrupt or [None]:
            message = {"type": OutboxKind.MEM_FALLBACK, "iteration": iteration, "then": then,
                       "why": c.why if c is not None else why}
            if c is not None:
                message.update(why=f"{c.file} bytes {c.start}-{c.end - 1}: {c.why}", file=c.file,
                               range=[c.start, c.end])
            self._outbox.send(message)

    def _node_counts(self, plan: RestorePlan | None, counts: ReadCounts | None) -> dict | None:
        """This node's ranks' read counts, summed (one collective, on every rank, after a memory restore)."""
        node = plan.node if plan else ""
        everyone: list = [None] * dist.get_world_size(self.hook.group)
        dist.all_gather_object(everyone, (node, asdict(counts or ReadCounts())), group=self.hook.group)
        mine = [c for n, c in everyone if n == node]
        return {key: sum(c[key] for c in mine) for key in asdict(ReadCounts())} | {"ranks": len(mine)}

    def _plan(self) -> RestorePlan | None:
        if self.inert:
            return None
        try:
            return RestorePlan.from_json((self.run_dir / RESTORE_FILE).read_text())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            log.warning("unreadable %s (%s): no memory restore", RESTORE_FILE, exc)
            return None

    def _agreed_candidates(self, plan: RestorePlan | None) -> list[tuple[int, RestoreCandidate]]:
        """The memory iterations every rank's agent has ready, newest first (one collective)."""
        if self.inert:
            return []  # the same on every rank: no collective
        mine = {c.iteration: c for c in (plan.candidates if plan else []) if c.ready}
        everyone: list = [None] * dist.get_world_size(self.hook.group)
        dist.all_gather_object(everyone, sorted(mine), group=self.hook.group)
        common = set(mine).intersection(*map(set, everyone))
        return [(iteration, mine[iteration]) for iteration in sorted(common, reverse=True)]
