"""What eft does inside a Megatron-style training loop, whoever owns the loop.

Megatron-LM's loop (``megatron.training``) and Megatron-Bridge's (``megatron.bridge.training``)
have the same call sites: a ``train_step`` returning the same 8-tuple, a per-iteration
``checkpoint_and_decide_exit``, megatron-core's schedules' ``forward_step`` and
``backward_step``. ``LoopDuties`` is eft's part at those sites, written once; a loop's class
(``megatron_lm.loop.MegatronLoop``, ``megatron_bridge.loop.BridgeLoop``) binds it to its
library's names through that library's seam and supplies the steps that differ:
``_save_now`` (the save eft's vote asks for, through the loop's own save function) and
``_after_decision`` (a turn for the memory tier); their save wrappers ask ``_refuses_save``
before each save the loop makes on its own.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from elasticft.contract.checkpoints import COMPLETE_MARKER
from elasticft.contract.run_dir import write_atomically
from elasticft.worker.step_work import StepWork

log = logging.getLogger(__name__)

# Megatron's rerun state machine's exit statuses: resume to disambiguate, failed validation.
RERUN_EXIT_CODES = (16, 17)
# The items of train_step's result eft reads, by position: the same in both loops (Bridge's seam
# checks at launch that the installed train() unpacks them under these names: TRAIN_STEP_READS).
LOSS_DICT, SHOULD_EXIT, EXIT_CODE, GRAD_NORM = 0, 3, 4, 5


class LoopDuties:
    """eft's per-iteration duties, fed by a Megatron-style loop (one per worker process)."""

    def __init__(self):
        self.hook = None  # made by every rank once the loop's state is loaded
        self.memory = None  # the loop's memory tier (flush()), made with the hook
        self.injector = None  # --eft-inject faults that act between iterations
        self._loss: float | None = None  # the last train_step's, until the vote takes it
        self._grad_norm: float | None = None
        self._saved: int | None = None  # the iteration eft's vote just saved (no second save of it)
        self._saving = False  # inside a save the vote asked for (the hook timed it already)
        self._decided: int | None = None  # the iteration just decided on, until the next step's first micro batch
        self._in_loop = False  # inside the loop's train()
        self._stop: str | None = None  # why the loop stops at its next decision (a vote before its own save)
        self.work = StepWork()  # this rank's own work in the step in progress

    # -- what a loop's class supplies ----------------------------------------------------

    def _save_now(self, call: dict, iteration: int) -> None:
        """The save eft's vote asked for at ``iteration``: the loop's own, through its save function."""
        raise NotImplementedError

    def _after_decision(self, call: dict) -> None:
        """After the loop decided to go on past the iteration (every rank): the memory tier's turn."""

    # -- the shared duties -----------------------------------------------------------------

    def _run(self, original, args: tuple, kwargs: dict):
        """The loop's ``train`` itself; then the newest snapshot is finished on every rank at the
        same point (a clean end, or one of the loop's own exits), and the hook closed."""
        self._in_loop = True
        try:
            result = original(*args, **kwargs)
            self.memory.flush()  # the newest snapshot is not lost to a clean end
        except SystemExit:  # the loop's own exits: every rank at the same point
            self.memory.flush()
            raise
        finally:
            self._in_loop = False
            self.hook.close()
        if self._stop == "rollback":  # the loop's own final save was refused (Bridge's is in train())
            raise SystemExit(0)
        return result

    def _timed(self, original):
        """megatron-core's ``forward_step``/``backward_step``: the rank's own work (stragglers), and
        where ``--eft-inject rank_hung`` hangs a rank mid-step."""
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

    def _step(self, original, args: tuple, kwargs: dict, call: dict, step: int) -> tuple:
        """Run the loop's ``train_step`` (``call``: its arguments by name) that makes ``step``:
        loss faults into its loss function, its ``lm loss`` and grad norm kept for the vote."""
        if self.injector is not None and self.injector.acts_on_losses:  # --eft-inject nan/poison/corrupt
            args, kwargs = (), {**call, "forward_step_func": poisoned(self.injector, call["forward_step_func"], step)}
        result = list(original(*args, **kwargs))
        loss_dict, should_exit = result[LOSS_DICT], result[SHOULD_EXIT]
        exit_code, grad_norm = result[EXIT_CODE], result[GRAD_NORM]
        self._loss = scalar(loss_dict.get("lm loss")) if loss_dict else None
        self._grad_norm = scalar(grad_norm)
        if should_exit and exit_code in RERUN_EXIT_CODES:
            result[EXIT_CODE] = self._rerun_verdict(step, exit_code)
        return tuple(result)

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

    def _refuses_save(self) -> bool:
        """Before a save the loop makes on its own (every rank, at the same point; not one eft's vote
        asked for): where the ranks did not vote at their newest step, they vote now
        (``Hook.vote_held``). True when that save must not be made: bad numbers (the state is bad).
        Then, or where the vote asks to exit, the loop stops at its next decision; after the loop
        (Megatron-LM's final save, after train() returned) the process exits 0 now, to re-run."""
        if self._saving or self.hook is None:
            return False
        action = self.hook.vote_held()
        if action is None or not (action.exit or action.rollback):
            return False
        self._stop = "rollback" if action.rollback else action.reason
        if action.rollback:
            log.warning("bad numbers found before the loop's own save: not saving; stopping to re-run from the "
                        "last good state")
            if not self._in_loop:
                raise SystemExit(0)
        return action.rollback

    def _decision(self, iteration: int, call: dict, loops_own) -> bool:
        """The loop's ``checkpoint_and_decide_exit`` at ``iteration``: eft's vote first (a save it
        asks for, a save-and-exit, a rollback), then ``loops_own()``, the loop's own decision."""
        if self._stop is not None:  # a vote before the loop's own save asked to stop (every rank)
            return True
        # A gradient norm that is not finite is the job's (every rank has the same): all vote now, as
        # the update it came with may have spoilt the weights the next step would run on.
        spoilt = self._grad_norm is not None and not math.isfinite(self._grad_norm)
        action = self._vote(iteration, loss=self._loss, grad_norm=self._grad_norm, vote=spoilt)
        self._loss = self._grad_norm = None
        if action.rollback:  # bad numbers: no save of this state; the agent restarts from the last good one
            log.warning("iteration %d: bad numbers; stopping to re-run it from the last good state", iteration)
            return True
        if action.save:
            self._save_now(call, iteration)
        if action.exit:
            return True
        should_exit = loops_own()
        if not should_exit:
            self._after_decision(call)
            self.injector.after_iteration(iteration, in_step=True)
            self._decided = iteration
        return should_exit


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
