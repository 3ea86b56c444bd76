"""Periodic disk saves off the training path: the stall is the copy into host memory.

    saves = AsyncSaves(hook, CheckpointDir(args.save))    # after Hook(); synchronous without eft
    ...
    action = hook.step(iteration)
    saves.step()                                          # every iteration: finish a save all ranks wrote
    if iteration % args.save_interval == 0:
        memory.flush(); saves.start(iteration, state)     # every rank; returns at once
    if action.save or action.exit:
        saves.flush(); <a synchronous save, as before>    # an emergency save must be on storage now

The same machinery as the memory tier (``snapshot.py``): megatron-core's torch_dist save
split into a plan, a write and a finalization; the state copied into host buffers first,
the files written on threads of the worker, and the hook's vote telling every rank when all
writes are done, so all finalize at one iteration. Then rank 0 marks the directory complete
and moves the tracker (``CheckpointDir.commit``), and every rank calls ``hook.saved`` (the
ack to the agent). A save that failed on any rank is dropped on every rank, never marked
complete: the tracker keeps naming the previous complete checkpoint.

Under plain torchrun the hook is inert and there is no vote: ``start`` saves synchronously.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from elasticft.worker.snapshot import HostCopier, Snapshot, in_process_results_queue, save_strategy

log = logging.getLogger(__name__)

BUSY, FAILED = range(2)  # this ballot's slots in the hook's vote


class AsyncSaves:
    width = 2  # Ballot: BUSY, FAILED

    def __init__(self, hook, checkpoints):
        self.hook = hook
        self.checkpoints = checkpoints
        self.last_stall: float | None = None  # seconds the loop waited for the newest save
        self._pending: Snapshot | None = None
        self._finished: int | None = None  # a save finished at once (no vote) that step() has yet to report
        self._agreed = [0, 0]
        self._copier = HostCopier()
        self._strategy = save_strategy()
        self._validated = False
        in_process_results_queue()
        hook.add_ballot(self)  # inert hook: no ballot, and start() saves synchronously

    @property
    def pending(self) -> bool:
        """A save is being written: the memory tier takes no snapshot meanwhile (one results queue)."""
        return self._pending is not None

    # -- the vote (Ballot) -------------------------------------------------------------

    def mine(self, iteration: int) -> list[int]:
        pending = self._pending
        return [int(pending is not None and not pending.done), int(pending is not None and pending.failed)]

    def settle(self, agreed: list[int]) -> None:
        self._agreed = agreed

    def needs_vote(self, iteration: int) -> bool:
        """A save is being written: every rank started it at the same iteration."""
        return self._pending is not None

    # -- the loop's calls ----------------------------------------------------------------

    def start(self, iteration: int, state: dict) -> float:
        """Every rank: begin saving ``state`` as ``iteration``; returns the stall in seconds.
        A save still in flight is finished first (it is older)."""
        began = time.perf_counter()
        self.flush()
        path = self.checkpoints.path_for(iteration)
        if dist.get_rank() == 0:
            self.checkpoints.empty(iteration)  # a directory left by an abandoned timeline
        dist.barrier()
        self._pending = Snapshot.start(iteration, path, state, self._copier, self._strategy,
                                       validate=not self._validated)
        self._validated = True
        self.last_stall = self._pending.stall
        self.hook.stalled("disk", time.perf_counter() - began)
        if self.hook.inert:  # no vote to agree on: finish now, as a synchronous save would
            self._finished = self.flush()  # step() reports it, as it reports a background save
        return self.last_stall

    def step(self) -> int | None:
        """After ``hook.step``: finish the save every rank has written; its iteration, or None."""
        if self._finished is not None:
            finished, self._finished = self._finished, None
            return finished
        if self._pending is None or self._agreed[BUSY]:
            return None
        return self._finish(failed=bool(self._agreed[FAILED]))

    def flush(self) -> int | None:
        """Every rank, at the same iteration: wait for the save in flight and finish it."""
        if self._pending is None:
            return None
        self._pending.wait()
        failed = int(self._pending.failed)
        if not self.hook.inert:
            failed = self.hook.agree([failed])[0]
        return self._finish(failed=bool(failed))

    def _finish(self, failed: bool) -> int | None:
        save, self._pending = self._pending, None
        seconds, ok = (0.0, False) if failed else save.finalize()
        if failed or not ok:
            log.warning("checkpoint of iteration %d failed on some rank: not marked complete", save.iteration)
            return None
        if dist.get_rank() == 0:  # the finalization ended in a barrier: every rank's files are written
            self.checkpoints.commit(save.iteration)
        self.hook.saved(save.iteration, save.path, seconds)
        log.info("checkpoint of iteration %d complete (%.2f s, of which %.3f s stalled training)",
                 save.iteration, seconds, save.stall)
        return save.iteration
