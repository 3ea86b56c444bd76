"""eft inside Megatron-LM's own training loop, through the loop's call sites.

``MegatronLoop.attach()`` replaces four functions of ``megatron.training.training``
(through ``elasticft.megatron_seam``, the one place that knows their names) with
wrappers that call the originals:

* ``train``: the loop's start and end. All ranks make eft's ``Hook`` here (a
  collective, after Megatron's process groups, model, checkpoint and data are ready),
  and close it when the loop returns or exits;
* ``train_step``: keeps the step's reported loss (``lm loss`` on the last pipeline stage)
  and gradient norm for the numbers check;
* ``checkpoint_and_decide_exit``: the loop's per-iteration decision point. eft's vote
  (``hook.step``) runs first; a save it asks for is Megatron's own save, at the same
  iteration on every rank; a save-and-exit or a rollback returns True, so the loop
  leaves the way it does for ``--exit-interval`` and the process exits 0 (the agent
  reads why from the heartbeat: eft-run's exit codes). Then Megatron's own decision runs
  (periodic saves, its signal handler, its exit conditions);
* ``save_checkpoint_and_time``: before a save the loop makes on its own where the ranks did not
  vote (its final save after ``train``, its signal handler's, its exit duration's), they vote,
  and a bad-numbers verdict is not saved but rolled back (``worker/loop_duties.py``). Every save of the loop
  is timed as the ``checkpointing`` section, marked complete as ``CheckpointDir`` marks it
  (``.complete`` in the iteration's directory, once every rank has written), and acknowledged
  to the agent;
* ``load_checkpoint`` (the resume, before the loop): the Hook is made here, and the memory
  tier (``memory.py``) restores its newest iteration through it when that is the newest state.

After Megatron's decision, each iteration the memory tier takes its snapshot (``memory.py``);
its copy runs beside the next step's forward and backward, and the step's ``optimizer.step()``
(on the instance ``train`` was given) waits for it first.
The pipeline schedules' ``forward_step`` and ``backward_step`` are timed as the rank's own
work (``worker/step_work.py``), which the vote hands to the heartbeat for straggler detection.

What this loop shares with Megatron-Bridge's (the vote, the step's numbers, the decision, the
work timing) is ``worker/loop_duties.py``'s. Under plain torchrun nothing here runs: the agent arranges it
(``attach.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from elasticft import megatron_seam as seam
from elasticft.worker.loop_duties import LoopDuties, first_rank, mark_complete

log = logging.getLogger(__name__)


class MegatronLoop(LoopDuties):
    """eft's per-iteration duties (``worker/loop_duties.py``), fed by Megatron-LM's loop (one per worker process).
    The hook is made at the resume, or at train()'s start without --load."""

    def attach(self) -> "MegatronLoop":
        seam.replace("train", self._train)
        seam.replace("train_step", self._train_step)
        seam.replace("checkpoint_and_decide_exit", self._decide)
        seam.replace("save_checkpoint_and_time", self._save)
        seam.replace("load_checkpoint", self._load)
        seam.replace("forward_step", self._timed)
        seam.replace("backward_step", self._timed)
        return self

    # -- wrappers ----------------------------------------------------------------------

    def _train(self, original):
        def train(*args, **kwargs):
            self._start()
            self.memory.guard(seam.bound("train", args, kwargs)["optimizer"])  # the update waits for a copy
            return self._run(original, args, kwargs)
        return train

    def _load(self, original):
        def load_checkpoint(*args, **kwargs):
            call = seam.bound("load_checkpoint", args, kwargs)
            if self.hook is not None or call.get("load_arg", "load") != "load":
                return original(*args, **kwargs)  # not the resume (a reference model's load, ...)
            self._make_hook()
            result = self.memory.restore(original, args, kwargs)
            if self.hook.numerics is not None:  # eft judges re-runs: Megatron's pending one is dropped
                pending = seam.rerun_idle_after_resume(bool(result and result[0]))
                if pending is not None and first_rank():
                    log.warning("eft: Megatron's rerun state machine was loaded in state %s; eft's numbers check "
                                "re-runs the iteration and judges it instead", pending)
            return result
        return load_checkpoint

    def _train_step(self, original):
        def train_step(*args, **kwargs):
            call = seam.bound("train_step", args, kwargs)
            return self._step(original, args, kwargs, call, (call.get("iteration") or 0) + 1)
        return train_step

    def _decide(self, original):
        def checkpoint_and_decide_exit(*args, **kwargs):
            call = seam.bound("checkpoint_and_decide_exit", args, kwargs)
            return self._decision(call["iteration"], call, lambda: original(*args, **kwargs))
        return checkpoint_and_decide_exit

    def _after_decision(self, call: dict) -> None:
        self.memory.step(call)

    def _save(self, original):
        def save_checkpoint_and_time(*args, **kwargs):
            call = seam.bound("save_checkpoint_and_time", args, kwargs)
            iteration = call["iteration"]
            if iteration == self._saved:
                return None  # eft's vote saved this iteration a moment ago (Megatron's interval hit it too)
            if self._refuses_save():
                return None  # bad numbers held since the last vote: this state is not saved
            margs = seam.function(seam.GET_ARGS)()
            started = time.time()
            timed = contextlib.nullcontext() if self._saving or self.hook is None else self.hook.section("checkpointing")
            if self.memory is not None:
                self.memory.flush()  # the snapshot in flight first: both write through torch_dist
            with timed:
                result = original(*args, **kwargs)
            if self.hook is not None and _acknowledged(call, margs):
                path = Path(seam.function(seam.CHECKPOINT_NAME)(margs.save, iteration, return_base_dir=True))
                mark_complete(path, iteration)
                self.hook.saved(iteration, path, time.time() - started)
            return result
        return save_checkpoint_and_time

    # -- the parts -----------------------------------------------------------------------

    def _make_hook(self) -> None:
        """Every rank, once Megatron's process groups exist: the hook and the memory tier."""
        from elasticft.megatron_lm.memory import MegatronMemory
        from elasticft.worker.hook import Hook
        from elasticft.worker.vote_group import vote_group

        margs = seam.function(seam.GET_ARGS)()
        # The vote's own gloo group, connected on demand (worker/vote_group.py): no device sync per
        # vote on a GPU, and the same group on CPU, so that the CPU tests take the GPU's path.
        group = vote_group()
        # Where the loop saves and stops on its own, as Megatron computed them (not sys.argv's flags).
        self.hook = Hook(group=group, **seam.loop_ends(margs))
        self.memory = MegatronMemory(self.hook, margs)

    def _start(self) -> None:
        """Every rank, once the loop is about to begin: the hook (unless the resume made it)
        and the fault injector."""
        import torch.distributed as dist

        from elasticft.worker.inject import FaultInjector

        if self.hook is None:
            self._make_hook()
        margs = seam.function(seam.GET_ARGS)()
        loaded = getattr(margs, "iteration", 0) or None
        self.hook.last_saved_iteration = loaded
        self.injector = FaultInjector.from_env()
        skipped = sorted(self.hook.numerics.state.skipped) if self.hook.numerics is not None else []
        if skipped:  # batches the numbers check found bad twice: Megatron's own skip list drops them
            margs.iterations_to_skip = sorted(set(margs.iterations_to_skip or []) | set(skipped))
        if dist.get_rank() == 0:
            log.warning("eft is in Megatron-LM's training loop (resuming after iteration %s)", loaded or 0)

    def _save_now(self, call: dict, iteration: int) -> None:
        """The save eft's vote asked for: Megatron's own, through the loop's save function."""
        margs = seam.function(seam.GET_ARGS)()
        if not margs.save:
            log.warning("iteration %d: asked to save but there is no --save", iteration)
            return
        save = seam.function(seam.SITES["save_checkpoint_and_time"])
        self._saving = True
        try:
            save(iteration, call["model"], call["optimizer"], call["opt_param_scheduler"],
                 call["num_floating_point_operations_so_far"], call["checkpointing_context"],
                 train_data_iterator=call.get("train_data_iterator"))
        finally:
            self._saving = False
        self._saved = iteration


def _acknowledged(call: dict, margs) -> bool:
    """A save eft can call complete when the function returns: persistent and synchronous
    (an async save completes later, a non-persistent one lives outside --save)."""
    return bool(margs.save) and not call.get("non_persistent_ckpt") and not getattr(margs, "async_save", False)
