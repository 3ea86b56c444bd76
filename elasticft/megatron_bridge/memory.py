"""The memory tier inside Megatron-Bridge's loop: what Bridge's own save would write, kept in host memory.

A snapshot is the state Bridge's ``save_checkpoint`` builds for a torch_dist save (model,
optimizer, scheduler, RNG, rerun state, the content metadata its load reads back), taken where
Bridge hands it to megatron-core's ``dist_checkpointing.save``: eft runs Bridge's save with that
one call intercepted (none of Bridge's files is written) and gives the state to the memory tier
(``elasticft.worker.memory``), as ``megatron_lm/memory.py`` does for Megatron-LM. Bridge's load
also reads two files its rank 0 writes after the tensors, ``train_state.pt`` (the loop's
counters: step, consumed samples, FLOPs) and ``run_config.yaml`` (the TP and PP the load checks
against): global rank 0 writes both into the snapshot, where the tier carries them as
checkpoint-wide files (``contract.memory.GLOBAL_FILES``).

A restart loads it with Bridge's own ``load_checkpoint``, pointed at the iteration the node
agents prepared (``checkpoint.load`` its directory's parent and ``checkpoint.ckpt_step`` its
iteration, for the call), so Bridge reshards it to the new layout and restores everything it
restores from disk. Bridge's setup loads only when ``checkpoint.load`` holds a checkpoint: eft
makes it load when every rank's agent has a memory iteration ready too. The newer of memory and
disk (``checkpoint.load``'s tracker, Bridge's global non-persistent checkpoints) wins; a memory
checkpoint that does not load falls back to the next older one, then to Bridge's own load.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from elasticft import bridge_seam as seam
from elasticft import megatron_seam
from elasticft.megatron_lm.memory import SNAPSHOT_FORMAT, Captured, restore_through, tracked
from elasticft.worker.memory import MemoryCheckpoints
from elasticft.worker.snapshot import SaveRequest

log = logging.getLogger(__name__)

# Recipe fields under which Bridge changes a tensor of the saved state in place between one
# iteration's update and the next one's: the copy of a snapshot must not run meanwhile.
_CHANGED_BEFORE_THE_UPDATE = {
    "ddp.reuse_grad_buf_for_mxfp8_param_ag": lambda v: bool(v),  # the param buffer is the grad buffer
    "model.moe_router_enable_expert_bias": lambda v: bool(v),  # updated in finalize_model_grads
    "model.moe_router_load_balancing_type": lambda v: "quantile_balancing" in (v or ()),  # in the forward
}


class BridgeMemory:
    """The memory tier of one worker in Bridge's loop; every rank makes one, with the hook."""

    def __init__(self, hook, config):
        interval = None
        fmt = seam.get(config, seam.CKPT_FORMAT)
        if fmt != SNAPSHOT_FORMAT:
            interval = 0
            if not hook.inert and _wanted() and _rank() == 0:
                log.warning("memory checkpoints need the recipe's checkpoint.ckpt_format=%s (this one saves %s): "
                            "none taken", SNAPSHOT_FORMAT, fmt)
        # Bridge's async saves write from other processes: they need its own results queue.
        self.tier = MemoryCheckpoints(hook, interval=interval, share_results_queue=not seam.get(config, seam.ASYNC_SAVE))
        self._context: dict = {}  # the checkpointing_context of the snapshots' saves: theirs, not the loop's
        self._run_config: bytes | None = None  # run_config.yaml, written once (the recipe does not change)

    # -- in the loop -----------------------------------------------------------------------

    def guard(self, optimizer, config) -> None:
        """The loop's optimizer: its ``step`` waits for a snapshot's copy, which then runs beside
        the next forward and backward; not where the state changes before the update."""
        early = [field for field, on in _CHANGED_BEFORE_THE_UPDATE.items() if on(_field(config, field))]
        if early:
            if not self.tier.inert and self.tier.overlap and _rank() == 0:
                log.warning("memory checkpoints: with %s Bridge changes the state before the optimizer's update; "
                            "the snapshots' copy stalls training instead of overlapping it", ", ".join(early))
            return
        self.tier.guard(optimizer)

    def step(self, call: dict, iteration: int) -> None:
        """After the loop's decision at ``iteration`` (on every rank): the tier's turn."""
        self.tier.step(iteration, lambda: self._capture(call, iteration))

    def flush(self) -> None:
        """Every rank, at the same point: before a disk save, and when the loop ends."""
        self.tier.flush()

    def _capture(self, call: dict, iteration: int) -> SaveRequest:
        """What Bridge's save of this iteration would hand to ``dist_checkpointing.save``, and
        the train state and config its rank 0 would write beside it."""
        state = call["state"]
        config = seam.get(state, seam.CONFIG)
        model, optimizer = call["model"], call["optimizer"]
        if seam.function(seam.NEEDS_PARAM_SYNC)(seam.get(config, seam.MEGATRON_FSDP),
                                                 seam.get(config, seam.DISTRIBUTED_OPTIMIZER),
                                                 seam.get(config, seam.OVERLAP_PARAM_GATHER)):
            seam.function(seam.PARAM_SYNC)(model, optimizer=optimizer)  # the parameters are behind

        def intercept(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            options = {k: kwargs[k] for k in seam.SNAPSHOT_OPTIONS if kwargs.get(k) is not None}
            raise Captured(sharded_state_dict, options)

        request = None
        # Bridge's save names its directory after checkpoint.save (rank 0 creates it): the snapshot's.
        with seam.overridden(config, {seam.SAVE_DIR: self.tier.dir, seam.ASYNC_SAVE: False}), \
                megatron_seam.swapped(seam.DIST_SAVE, intercept), contextlib.redirect_stdout(io.StringIO()):
            try:
                seam.function(seam.SAVE_CHECKPOINT)(
                    state, model, optimizer, call["opt_param_scheduler"],
                    call["num_floating_point_operations_so_far"], self._context,
                    train_data_iterator=call.get("train_data_iterator"))
            except Captured as captured:
                request = captured.request
        if request is None:
            raise seam.BridgeSeamError(f"{seam.SAVE_CHECKPOINT} returned without calling "
                                       f"{seam.DIST_SAVE}; eft's Bridge seam needs updating")
        if _rank() == 0:
            self._write_train_state(state, config, call["num_floating_point_operations_so_far"],
                                    Path(seam.function(seam.CHECKPOINT_NAME)(self.tier.dir, iteration)))
        return request

    def _write_train_state(self, state, config, flops, path: Path) -> None:
        """train_state.pt and run_config.yaml, as Bridge's rank 0 writes them after a save."""
        import torch

        path.mkdir(parents=True, exist_ok=True)
        train_state = seam.get(state, seam.TRAIN_STATE_DICT)()
        train_state["floating_point_operations_so_far"] = torch.tensor(flops, dtype=torch.float32)
        torch.save(train_state, seam.function(seam.TRAIN_STATE_FILE)(str(path)))
        run_config = Path(seam.function(seam.RUN_CONFIG_FILE)(str(path)))
        if self._run_config is None:
            getattr(config, seam.TO_YAML)(str(run_config))
            self._run_config = run_config.read_bytes()
        else:
            run_config.write_bytes(self._run_config)

    # -- at the start -------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether every rank's agent has a memory iteration ready (one collective, every rank)."""
        return bool(self.tier.ready_everywhere())

    def restore(self, load, args: tuple, kwargs: dict, wanted: bool):
        """Bridge's resume (``load_checkpoint``, every rank): from memory when the tier has an
        iteration at least as new as what Bridge would load; ``wanted``: Bridge's setup would
        have loaded on its own (``checkpoint.load`` holds a checkpoint)."""
        call = seam.bound("load_checkpoint", args, kwargs)
        config = seam.get(call["state"], seam.CONFIG)
        scheduler = call.get("opt_param_scheduler")  # a fallback loads again into the same scheduler
        disk = _BridgeDisk(load, args, kwargs, config, scheduler, wanted)

        def pointed_at(parent: str, iteration: int):
            return seam.overridden(config, {seam.LOAD_DIR: parent, seam.CKPT_STEP: iteration,
                                            seam.NON_PERSISTENT_TYPE: None, seam.PRETRAINED: None,
                                            seam.FINETUNE: False, seam.LOAD_OPTIM: True, seam.LOAD_RNG: True})

        restored = restore_through(self.tier, lambda: load(*args, **kwargs), pointed_at, scheduler, disk)
        if restored.result is not None:
            return restored.result
        return disk.result if disk.result is not None else (0, 0)


class _BridgeDisk:
    """What Bridge would resume from on its own, in the shape ``MemoryCheckpoints.restore`` asks of a disk tier."""

    def __init__(self, load, args: tuple, kwargs: dict, config, scheduler, wanted: bool):
        self._load, self._args, self._kwargs = load, args, kwargs
        self._config, self._scheduler, self._wanted = config, scheduler, wanted
        self.result = None  # Bridge's own load's return value, once it ran

    def complete_iterations(self) -> list[int]:
        """The newest iteration Bridge's own load would pick (persistent or global non-persistent);
        none where it would not load, or would start a fine-tuning over at iteration 0."""
        config = self._config
        if not self._wanted or seam.get(config, seam.FINETUNE):
            return []
        load = seam.get(config, seam.LOAD_DIR)
        roots = [load] if load else []
        if seam.get(config, seam.NON_PERSISTENT_TYPE) == "global":
            roots.append(seam.get(config, seam.NON_PERSISTENT_DIR) or os.path.join(load or "", "non_persistent"))
        found = [i for i in (tracked(Path(root)) for root in roots if root) if i is not None]
        if seam.get(config, seam.CKPT_STEP):
            found.append(seam.get(config, seam.CKPT_STEP))
        return [max(found)] if found else []

    def load_latest(self, _load_fn, agree=None):  # Bridge's load agrees itself (or a rank fails)
        if not self._wanted:
            return None, None
        megatron_seam.rewind_scheduler(self._scheduler)  # after a memory iteration that did not load
        self.result = self._load(*self._args, **self._kwargs)
        iteration = self.result[0] if self.result else 0
        return (iteration or None), self.result

    def dir_of(self, iteration: int) -> str:
        return str(seam.function(seam.CHECKPOINT_NAME)(seam.get(self._config, seam.LOAD_DIR), iteration))


def _field(config, dotted: str):
    try:
        return seam.get(config, dotted)
    except AttributeError:
        return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _wanted() -> bool:
    from elasticft.config import MemoryConfig, from_env

    return from_env(MemoryConfig).mem_ckpt_interval > 0
