"""eft inside Megatron-Bridge's own training loop, through the loop's call sites.

``BridgeLoop.attach()`` replaces Bridge's loop functions (through ``elasticft.bridge_seam``, the
one place that knows their names) with wrappers that call the originals, as
``megatron_lm.loop`` does for Megatron-LM's:

* ``pretrain``: the recipe's ConfigContainer, before Bridge reads it: the re-plan's TP and PP
  and eft's place of NVRx (``recipe.py``);
* ``train``: the loop's start and end. All ranks make eft's ``Hook`` here (a collective, after
  Bridge's setup made the process groups, the model, the optimizer and loaded the checkpoint),
  and close it when the loop returns or exits;
* ``train_step``: keeps the step's ``lm loss`` and gradient norm for the numbers check, and
  puts ``--eft-inject``'s loss faults into the step's loss function;
* ``checkpoint_and_decide_exit``: the per-iteration decision point. eft's vote (``hook.step``)
  runs first; a save it asks for is Bridge's own ``save_checkpoint_and_time``, at the same
  iteration on every rank; a save-and-exit or a rollback returns True, so the loop leaves the way
  it does for ``train.exit_interval`` (the agent reads why from the heartbeat). Then Bridge's own
  decision runs (periodic saves, its signal handler, its exit conditions);
* ``save_checkpoint_and_time``: before a save the loop makes on its own where the ranks did not
  vote (its final save at the loop's end, its signal handler's, ...), they vote, and a bad-numbers
  verdict is not saved but rolled back (``worker/loop_duties.py``). Every save of the loop is timed as the
  ``checkpointing`` section, marked complete (``.complete`` in the iteration's directory, once every rank has
  written) and acknowledged to the agent;
* setup's ``_should_load_checkpoint`` and ``load_checkpoint`` (the resume, before the loop): the
  hook is made at the first, and the memory tier (``memory.py``) restores its newest iteration
  through the second when that is the newest state (Bridge's setup is made to load when only
  memory holds one).

After the decision, each iteration the memory tier takes its snapshot (``memory.py``); its copy
runs beside the next step's forward and backward, and the step's ``optimizer.step()`` waits for it.

megatron-core's pipeline schedules' ``forward_step`` and ``backward_step``, which Bridge's step
runs, are timed as the rank's own work for straggler detection (``worker/step_work.py``), through
megatron-core's seam. Under plain torchrun nothing here runs: the agent arranges it (``mode.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from elasticft import bridge_seam as seam
from elasticft import megatron_seam
from elasticft.megatron_bridge import recipe
from elasticft.worker.loop_duties import LoopDuties, first_rank, mark_complete

log = logging.getLogger(__name__)


class BridgeLoop(LoopDuties):
    """eft's per-iteration duties (``worker/loop_duties.py``), fed by Bridge's loop (one per worker
    process). The hook is made when Bridge's setup decides whether to load a checkpoint."""

    def __init__(self):
        super().__init__()
        self._would_load = False  # Bridge's setup would have loaded on its own
        self._restored = False  # the resume went through the memory tier (it told the agent)

    def attach(self) -> "BridgeLoop":
        seam.replace("pretrain", self._pretrain)
        seam.replace("should_load", self._should_load)
        seam.replace("load_checkpoint", self._load)
        seam.replace("train", self._train)
        seam.replace("train_step", self._train_step)
        seam.replace("checkpoint_and_decide_exit", self._decide)
        seam.replace("save_checkpoint_and_time", self._save)
        megatron_seam.replace("forward_step", self._timed)
        megatron_seam.replace("backward_step", self._timed)
        return self

    # -- wrappers ----------------------------------------------------------------------

    def _pretrain(self, original):
        def pretrain(*args, **kwargs):
            recipe.apply(seam.bound("pretrain", args, kwargs)["config"])
            return original(*args, **kwargs)
        return pretrain

    def _should_load(self, original):
        def should_load(*args, **kwargs):
            self._would_load = bool(original(*args, **kwargs))
            if self.hook is None:
                self._make_hook(seam.bound("should_load", args, kwargs)["cfg"])
            return self._would_load or self.memory.ready()  # the same answer on every rank
        return should_load

    def _load(self, original):
        def load_checkpoint(*args, **kwargs):
            if self.hook is None or self._restored:
                return original(*args, **kwargs)  # not the resume
            self._restored = True
            return self.memory.restore(original, args, kwargs, self._would_load)
        return load_checkpoint

    def _train(self, original):
        def train(*args, **kwargs):
            call = seam.bound("train", args, kwargs)
            self._start(call["global_state"])
            self.memory.guard(call["optimizer"], seam.get(call["global_state"], seam.CONFIG))
            return self._run(original, args, kwargs)
        return train

    def _train_step(self, original):
        def train_step(*args, **kwargs):
            call = seam.bound("train_step", args, kwargs)
            return self._step(original, args, kwargs, call, seam.get(call["global_state"], seam.STEP) + 1)
        return train_step

    def _decide(self, original):
        def checkpoint_and_decide_exit(*args, **kwargs):
            call = seam.bound("checkpoint_and_decide_exit", args, kwargs)
            return self._decision(seam.get(call["state"], seam.STEP), call, lambda: original(*args, **kwargs))
        return checkpoint_and_decide_exit

    def _after_decision(self, call: dict) -> None:
        self.memory.step(call, seam.get(call["state"], seam.STEP))

    def _save(self, original):
        def save_checkpoint_and_time(*args, **kwargs):
            call = seam.bound("save_checkpoint_and_time", args, kwargs)
            state = call["state"]
            iteration = seam.get(state, seam.STEP)
            if iteration == self._saved:
                return None  # eft's vote saved this iteration a moment ago (Bridge's interval hit it too)
            if self._refuses_save():
                return None  # bad numbers held since the last vote: this state is not saved
            started = time.time()
            timed = contextlib.nullcontext() if self._saving or self.hook is None else self.hook.section("checkpointing")
            if self.memory is not None:
                self.memory.flush()  # the snapshot in flight first: both write through torch_dist
            with timed:
                result = original(*args, **kwargs)
            config = seam.get(state, seam.CONFIG)
            if self.hook is not None and _acknowledged(call, config):
                path = Path(seam.function(seam.CHECKPOINT_NAME)(seam.get(config, seam.SAVE_DIR), iteration))
                mark_complete(path, iteration)
                self.hook.saved(iteration, path, time.time() - started)
            return result
        return save_checkpoint_and_time

    # -- the parts -----------------------------------------------------------------------

    def _make_hook(self, config) -> None:
        """Every rank, once Bridge's process groups exist: the hook and the memory tier."""
        from elasticft.megatron_bridge.memory import BridgeMemory
        from elasticft.worker.hook import Hook
        from elasticft.worker.vote_group import vote_group

        # The vote's own gloo group, connected on demand (worker/vote_group.py): no device sync per
        # vote on a GPU, and the same group on CPU, so that the CPU tests take the GPU's path.
        group = vote_group()
        self.hook = Hook(save_interval=seam.get(config, seam.SAVE_INTERVAL), group=group,
                         exit_interval=seam.get(config, seam.EXIT_INTERVAL),
                         train_iters=seam.get(config, seam.TRAIN_ITERS),
                         non_persistent_save_interval=seam.get(config, seam.NON_PERSISTENT_INTERVAL))
        self.memory = BridgeMemory(self.hook, config)

    def _start(self, state) -> None:
        """Every rank, once the loop is about to begin: the hook (unless setup made it) and the
        fault injector."""
        from elasticft.worker.inject import FaultInjector

        config = seam.get(state, seam.CONFIG)
        if self.hook is None:
            self._make_hook(config)
        loaded = seam.get(state, seam.STEP) or None
        self.hook.last_saved_iteration = loaded
        self.injector = FaultInjector.from_env()
        if not self._restored:  # the memory tier's restore told the agent where the workers resumed
            self._resumed(config, loaded)
        if first_rank():
            log.warning("eft is in Megatron-Bridge's training loop (resuming after iteration %s)", loaded or 0)

    def _resumed(self, config, loaded: int | None) -> None:
        """Bridge's setup loaded ``loaded`` (None: a start from scratch) from its checkpoint directory:
        the load phase ends (eft report), and local rank 0 tells its agent where the workers resumed."""
        if self.hook.inert:
            return
        import os

        from elasticft.contract.run_dir import OutboxKind
        from elasticft.worker import phases
        from elasticft.worker.relay import Outbox

        load_dir = seam.get(config, seam.LOAD_DIR)
        path = str(seam.function(seam.CHECKPOINT_NAME)(load_dir, loaded)) if loaded and load_dir else None
        source = "disk" if loaded else "none"
        phases.loaded(source, path)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            Outbox(self.hook.run_dir).send({"type": OutboxKind.RESTORED, "iteration": loaded, "source": source,
                                            "path": path, "reached": None, "read": None})

    def _save_now(self, call: dict, iteration: int) -> None:
        """The save eft's vote asked for: Bridge's own, through the loop's save function."""
        config = seam.get(call["state"], seam.CONFIG)
        if not seam.get(config, seam.SAVE_DIR):
            log.warning("iteration %d: asked to save but the recipe has no checkpoint.save", iteration)
            return
        save = seam.function(seam.SITES["save_checkpoint_and_time"])
        self._saving = True
        try:
            save(call["state"], call["model"], call["optimizer"], call["opt_param_scheduler"],
                 call["num_floating_point_operations_so_far"], call["checkpoint_manager"],
                 train_data_iterator=call.get("train_data_iterator"))
        finally:
            self._saving = False
        self._saved = iteration


def _acknowledged(call: dict, config) -> bool:
    """A save eft can call complete when the function returns: persistent and synchronous."""
    return (bool(seam.get(config, seam.SAVE_DIR)) and not call.get("non_persistent_ckpt")
            and not seam.get(config, seam.ASYNC_SAVE))
