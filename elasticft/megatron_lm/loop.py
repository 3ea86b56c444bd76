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
* ``save_checkpoint_and_time``: every save of the loop is timed as the ``checkpointing``
  section, marked complete as ``CheckpointDir`` marks it (``.complete`` in the iteration's
  directory, once every rank has written), and acknowledged to the agent;
* ``load_checkpoint`` (the resume, before the loop): the Hook is made here, and the memory
  tier (``memory.py``) restores its newest iteration through it when that is the newest state.

After Megatron's decision, each iteration the memory tier takes its snapshot (``memory.py``);
its copy runs beside the next step's forward and backward, and the step's ``optimizer.step()``
(on the instance ``train`` was given) waits for it first.
The pipeline schedules' ``forward_step`` and ``backward_step`` are timed as the rank's own
work (``work.py``), which the vote hands to the heartbeat for straggler detection.

Under plain torchrun nothing here runs: the agent arranges it (``attach.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from elasticft import megatron_seam as seam
from elasticft.contract.checkpoints import COMPLETE_MARKER
from elasticft.contract.run_dir import write_atomically
from elasticft.megatron_lm.work import StepWork

log = logging.getLogger(__name__)

# Megatron's rerun state machine's exit statuses: resume to disambiguate, failed validation.
RERUN_EXIT_CODES = (16, 17)


class MegatronLoop:
    """eft's per-iteration duties, fed by Megatron's loop (one per worker process)."""

    def __init__(self):
        self.hook = None  # made by every rank at the resume, or at train()'s start without --load
        self.memory = None  # the memory tier (MegatronMemory), made with the hook
        self.injector = None  # --eft-inject faults that act between iterations
        self._loss: float | None = None  # the last train_step's, until the vote takes it
        self._grad_norm: float | None = None
        self._saved: int | None = None  # the iteration eft's vote just saved (no second save of it)
        self._saving = False  # inside a save the vote asked for (the hook timed it already)
        self._decided: int | None = None  # the iteration just decided on, until the next step's first micro batch
        self.work = StepWork()  # this rank's own work in the step in progress

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
            try:
                result = original(*args, **kwargs)
                self.memory.flush()  # the newest snapshot is not lost to a clean end
                return result
            except SystemExit:  # the loop's own exits: every rank at the same point
                self.memory.flush()
                raise
            finally:
                self.hook.close()
        return train

    def _timed(self, original):
        def timed(*args, **kwargs):
            if self.hook is None:  # evaluation before the loop, or plain torchrun
                return original(*args, **kwargs)
            if self._decided is not None:  # --eft-inject rank_hung: mid-step, once a step (its first micro batch)
                decided, self._decided = self._decided, None
                self.injector.in_step(decided)
            with self.work.block():
                return original(*args, **kwargs)
        return timed

    def _vote(self, iteration: int, **numbers):
        """The step's vote, with the rank's own work in it (the step's forward and backward blocks)."""
        worked = self.work.take()
        if worked is not None:
            self.hook.worked(worked)
        return self.hook.step(iteration, **numbers)

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
            step = (call.get("iteration") or 0) + 1  # the iteration this step makes
            if self.injector is not None and self.injector.acts_on_losses:  # --eft-inject nan/poison/corrupt
                args, kwargs = (), {**call, "forward_step_func": poisoned(self.injector, call["forward_step_func"], step)}
            result = list(original(*args, **kwargs))
            loss_dict, should_exit, exit_code, grad_norm = result[0], result[3], result[4], result[5]
            self._loss = scalar(loss_dict.get("lm loss")) if loss_dict else None
            self._grad_norm = scalar(grad_norm)
            if should_exit and exit_code in RERUN_EXIT_CODES:
                result[4] = self._rerun_verdict(step, exit_code)
            return tuple(result)
        return train_step

    def _rerun_verdict(self, step: int, exit_code: int) -> int:
        """Megatron's rerun state machine found bad numbers in the step that makes ``step`` and
        asks to be resumed (16: to disambiguate, after its own save; 17: it failed validation).
        Both are eft's bad numbers: the vote rolls back (the agent restarts the workers from the
        newest good state, uncharged, and judges a repeat: transient, bad data, bad GPU) and the
        process exits 0 instead of a status the agent would count as a crash."""
        action = self._vote(step, loss=float("nan"), vote=True)  # every rank: the state machine decides for all
        if not action.rollback:  # --no-eft-numerics-check: Megatron's status, a failure to the agent
            return exit_code
        log.warning("iteration %d: Megatron's rerun state machine exits %d; eft rolls back and re-runs it",
                    step, exit_code)
        return 0

    def _decide(self, original):
        def checkpoint_and_decide_exit(*args, **kwargs):
            call = seam.bound("checkpoint_and_decide_exit", args, kwargs)
            iteration = call["iteration"]
            action = self._vote(iteration, loss=self._loss, grad_norm=self._grad_norm)
            self._loss = self._grad_norm = None
            if action.rollback:  # bad numbers: no save of this state; the agent restarts from the last good one
                log.warning("iteration %d: bad numbers; stopping to re-run it from the last good state", iteration)
                return True
            if action.save:
                self._save_now(call)
            if action.exit:
                return True
            should_exit = original(*args, **kwargs)
            if not should_exit:
                self.memory.step(call)
                self.injector.after_iteration(iteration, in_step=True)
                self._decided = iteration
            return should_exit
        return checkpoint_and_decide_exit

    def _save(self, original):
        def save_checkpoint_and_time(*args, **kwargs):
            call = seam.bound("save_checkpoint_and_time", args, kwargs)
            iteration = call["iteration"]
            if iteration == self._saved:
                return None  # eft's vote saved this iteration a moment ago (Megatron's interval hit it too)
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
        import torch
        import torch.distributed as dist

        from elasticft.megatron_lm.memory import MegatronMemory
        from elasticft.worker.hook import Hook

        margs = seam.function(seam.GET_ARGS)()
        # On a GPU the vote goes over gloo, so it does not synchronise the device every iteration.
        group = dist.new_group(backend="gloo") if torch.cuda.is_available() else None
        self.hook = Hook(save_interval=margs.save_interval, group=group)
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

    def _save_now(self, call: dict) -> None:
        """The save eft's vote asked for: Megatron's own, through the loop's save function."""
        margs = seam.function(seam.GET_ARGS)()
        iteration = call["iteration"]
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


def poisoned(injector, forward_step, step: int):
    """``forward_step`` whose loss function's loss goes through the fault injector (--eft-inject)."""
    def forward_step_with_faults(*args, **kwargs):
        output, loss_func = forward_step(*args, **kwargs)

        def loss_with_faults(*largs, **lkwargs):
            result = loss_func(*largs, **lkwargs)
            return (injector.loss(step, result[0]), *result[1:])
        return output, loss_with_faults
    return forward_step_with_faults


def mark_complete(path: Path, iteration: int) -> None:
    """Rank 0, after the loop's save returned (Megatron's and Bridge's end with a barrier of all ranks):
    the iteration's directory is complete, as ``CheckpointDir`` marks it."""
    if first_rank() and path.is_dir():
        write_atomically(path / COMPLETE_MARKER, json.dumps({"iteration": iteration, "time": time.time()}),
                         durable=True)


def first_rank() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def _acknowledged(call: dict, margs) -> bool:
    """A save eft can call complete when the function returns: persistent and synchronous
    (an async save completes later, a non-persistent one lives outside --save)."""
    return bool(margs.save) and not call.get("non_persistent_ckpt") and not getattr(margs, "async_save", False)


def scalar(value) -> float | None:
    """A float from Megatron's reported value (a tensor, a (sum, count) pair, a number)."""
    if value is None:
        return None
    try:
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().float().cpu()
            if value.numel() == 2:  # (sum, token count): Megatron reports its average
                return float(value[0] / value[1]) if float(value[1]) else None
            return float(value.reshape(-1)[0])
        return float(value)
    except (TypeError, ValueError):
        return None

