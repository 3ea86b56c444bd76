"""The memory tier inside Megatron-LM's loop: what Megatron's own save would write, kept in host memory.

A snapshot is the state Megatron's ``save_checkpoint`` builds for a torch_dist save (model,
optimizer, scheduler, RNG, rerun state machine, arguments, iteration, the content metadata
its load reads back), taken at the moment Megatron hands it to ``dist_checkpointing.save``:
eft runs Megatron's save with that one call intercepted, so none of Megatron's files is
written, and gives the state to the memory tier (``elasticft.worker.memory``), which copies
it off the training tensors and writes it to the node's tmpfs on a thread.

A restart loads it with Megatron's own ``load_checkpoint``, pointed at the iteration the node
agents prepared (``--load`` the candidate's directory and ``--ckpt-step`` its iteration, for
the call), so Megatron reshards it to the new layout and restores everything it restores
from a disk checkpoint; its torch_dist reader reads only each rank's byte ranges
(``elasticft.worker.ranged_reads``). The newer of memory and disk (``--load``'s tracker, and Megatron's
non-persistent checkpoints) wins; a memory checkpoint that does not load falls back to the
next older one, then to Megatron's own load.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from elasticft import megatron_seam as seam
from elasticft.contract.checkpoints import TRACKER
from elasticft.worker.memory import MemoryCheckpoints
from elasticft.worker.snapshot import SaveRequest

log = logging.getLogger(__name__)

# Memory checkpoints are torch_dist files; Megatron writes its state that way only in this format.
SNAPSHOT_FORMAT = "torch_dist"


class Captured(BaseException):
    """Raised from the intercepted ``dist_checkpointing.save``: Megatron's (or Bridge's) save stops there.

    A BaseException, as KeyboardInterrupt and SystemExit are, not an Exception: it is not an error
    but the way out of a save eft runs to take its state, and it must reach ``_capture``'s
    ``except Captured`` through whatever lies between. A broad ``except Exception`` in the
    library's save path (a logging wrapper, a fallback, a release that adds one) would otherwise
    swallow it: the save would return as if done, and every snapshot would fail in mid-training.
    eft's own ``except BaseException`` handlers never see it: they are on the snapshot's copy and
    write threads and the resume's loads, none of them inside the intercepted save.
    """

    def __init__(self, state: dict, options: dict):
        super().__init__("captured")
        self.request = SaveRequest(state, options)


class MegatronMemory:
    """The memory tier of one worker in Megatron-LM's loop; every rank makes one."""

    def __init__(self, hook, margs):
        interval = None
        if margs.ckpt_format != SNAPSHOT_FORMAT:
            interval = 0
            if not hook.inert and _wanted() and _rank() == 0:
                log.warning("memory checkpoints need Megatron's --ckpt-format %s (this job saves %s): none taken",
                            SNAPSHOT_FORMAT, margs.ckpt_format)
        # Megatron's --async-save writes from other processes: they need its own results queue.
        self.tier = MemoryCheckpoints(hook, interval=interval, share_results_queue=not margs.async_save)
        self._context: dict = {}  # the checkpointing_context of the snapshots' saves: theirs, not the loop's
        if not self.tier.inert and not margs.load and _rank() == 0:
            log.warning("memory checkpoints are taken, but without --load Megatron resumes from nothing at a restart")

    # -- in the loop -----------------------------------------------------------------------

    def guard(self, optimizer) -> None:
        """The loop's optimizer (``train``'s, the one ``train_step`` steps): its ``step`` waits
        for a snapshot's copy, which then runs beside the next forward and backward. Not where
        Megatron changes the state in place before the update: there the copy stays blocking."""
        margs = seam.function(seam.GET_ARGS)()
        early = [flag for flag, on in _CHANGED_BEFORE_THE_UPDATE.items() if on(margs)]
        if early:
            if not self.tier.inert and self.tier.overlap and _rank() == 0:
                log.warning("memory checkpoints: with %s Megatron changes the state before the optimizer's update; "
                            "the snapshots' copy stalls training instead of overlapping it", ", ".join(early))
            return
        self.tier.guard(optimizer)


    def step(self, call: dict) -> None:
        """After the loop's decision at ``call["iteration"]`` (on every rank): the tier's turn."""
        self.tier.step(call["iteration"], lambda: self._capture(call))

    def flush(self) -> None:
        """Every rank, at the same point: before a disk save, and when the loop ends."""
        self.tier.flush()

    def _capture(self, call: dict) -> SaveRequest:
        """What Megatron's save of this iteration would hand to ``dist_checkpointing.save``.

        The arguments are those ``save_checkpoint_and_time`` passes (its process groups, the
        common state's preprocessing), after the parameter sync it makes first; its other
        duties (timers, emptying the CUDA cache, logging) are a disk save's, not a snapshot's.
        """
        margs = seam.function(seam.GET_ARGS)()
        model = call["model"]
        optimizer = call["optimizer"]
        if seam.function(seam.NEEDS_PARAM_SYNC)(margs):  # --overlap-param-gather: parameters are behind
            seam.param_sync(model, optimizer)

        def intercept(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            options = {k: kwargs[k] for k in ("content_metadata", "preprocess_common_before_consistancy_check")
                       if kwargs.get(k) is not None}
            raise Captured(sharded_state_dict, options)

        # Megatron's save names its directory after --save (rank 0 creates it): the snapshot's.
        with attributes(margs, save=self.tier.dir, async_save=False, dataloader_save=None), \
                seam.swapped(seam.DIST_SAVE, intercept), contextlib.redirect_stdout(io.StringIO()):
            try:
                seam.function(seam.SAVE_CHECKPOINT)(
                    call["iteration"], model, optimizer, call["opt_param_scheduler"],
                    call["num_floating_point_operations_so_far"], self._context,
                    train_data_iterator=call.get("train_data_iterator"),
                    preprocess_common_state_dict_fn=seam.function(seam.PREPROCESS_COMMON),
                    **seam.save_keywords(model))  # the process groups, from megatron-core 0.19 on
            except Captured as captured:
                return captured.request
        raise seam.MegatronSeamError(f"{seam.SAVE_CHECKPOINT} returned without calling {seam.DIST_SAVE}; "
                                     "eft's Megatron seam (elasticft/megatron_seam.py) needs updating")

    # -- at the start -------------------------------------------------------------------------

    def restore(self, load, args: tuple, kwargs: dict):
        """Megatron's resume (``load_checkpoint(..., load_arg="load")``, every rank): from
        memory when the tier has an iteration at least as new as what Megatron would load."""
        margs = seam.function(seam.GET_ARGS)()
        # A fallback loads again into the same scheduler (seam.rewind_scheduler): before every load.
        scheduler = seam.bound("load_checkpoint", args, kwargs).get("opt_param_scheduler")
        disk = _MegatronDisk(load, args, kwargs, margs, scheduler)

        def pointed_at(parent: str, iteration: int):
            return attributes(margs, load=parent, ckpt_step=iteration, non_persistent_ckpt_type=None,
                              pretrained_checkpoint=None, finetune=False, no_load_optim=False, no_load_rng=False)

        restored = restore_through(self.tier, lambda: load(*args, **kwargs), pointed_at, scheduler, disk)
        return restored.result if restored.result is not None else disk.result


def restore_through(tier: MemoryCheckpoints, load, pointed_at, scheduler, disk):
    """``tier.restore`` with a loop's own load (``load()``, Megatron-LM's or Bridge's) for its memory
    candidates, each inside ``pointed_at(parent, iteration)`` (the load's arguments aimed at the
    prepared iteration), ``scheduler`` rewound before it; ``disk``: the loop's own resume."""

    def load_memory(path: str, iteration: int):
        with pointed_at(str(Path(path).parent), iteration):
            seam.rewind_scheduler(scheduler)
            result = load()
        if result[0] != iteration:
            raise RuntimeError(f"{path} holds iteration {result[0]}, not {iteration}")
        return result

    restored = tier.restore(load_memory, disk)
    if restored.source == "memory" and _rank() == 0:
        log.warning("eft: resumed at iteration %d from the memory checkpoint at %s", restored.iteration, restored.path)
    return restored


class _MegatronDisk:
    """What Megatron would resume from on its own, in the shape ``MemoryCheckpoints.restore``
    asks of a disk tier."""

    def __init__(self, load, args: tuple, kwargs: dict, margs, scheduler):
        self._load, self._args, self._kwargs, self._margs = load, args, kwargs, margs
        self._scheduler = scheduler
        self.result = None  # Megatron's own load's return value, once it ran

    def complete_iterations(self) -> list[int]:
        """The newest iteration Megatron's own load would pick (persistent or non-persistent).
        None with --finetune: Megatron would start that one over at iteration 0."""
        margs = self._margs
        if getattr(margs, "finetune", False):
            return []
        roots = [margs.load] if margs.load else []
        if getattr(margs, "non_persistent_ckpt_type", None) == "global":
            roots.append(margs.non_persistent_global_ckpt_dir or os.path.join(margs.load or "", "non_persistent"))
        found = [tracked(Path(root)) for root in roots if root]
        found = [i for i in found if i is not None]
        if getattr(margs, "ckpt_step", None):
            found.append(margs.ckpt_step)
        return [max(found)] if found else []

    def load_latest(self, _load_fn, agree=None):  # Megatron's load agrees itself (or a rank fails)
        seam.rewind_scheduler(self._scheduler)  # after a memory iteration that did not load
        self.result = self._load(*self._args, **self._kwargs)
        iteration = self.result[0] if self.result else 0
        return (iteration or None), self.result

    def dir_of(self, iteration: int) -> str:
        return str(seam.function(seam.CHECKPOINT_NAME)(self._margs.load, iteration, return_base_dir=True))


# Megatron configurations that change a tensor of the saved state in place between one
# iteration's update and the next one's: the copy of a snapshot must not run meanwhile.
_CHANGED_BEFORE_THE_UPDATE = {
    # the param buffer shares the grad buffer's memory: zeroing the grads and the next backward write it
    "--reuse-grad-buf-for-mxfp8-param-ag": lambda a: bool(getattr(a, "reuse_grad_buf_for_mxfp8_param_ag", False)),
    # the routers' expert_bias is updated in finalize_model_grads, before optimizer.step()
    "--moe-router-enable-expert-bias": lambda a: bool(getattr(a, "moe_router_enable_expert_bias", False)),
    # quantile balancing updates its qb_beta in the forward
    "--moe-router-load-balancing-type quantile_balancing":
        lambda a: "quantile_balancing" in (getattr(a, "moe_router_load_balancing_type", None) or ()),
}


def tracked(root: Path) -> int | None:
    """The iteration Megatron's tracker in ``root`` names (None: none, or a release checkpoint)."""
    try:
        return int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def attributes(obj, **values):
    """``obj``'s attributes set to ``values`` inside the block, put back after."""
    missing = object()
    saved = {name: getattr(obj, name, missing) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _wanted() -> bool:
    from elasticft.config import MemoryConfig, from_env

    return from_env(MemoryConfig).mem_ckpt_interval > 0
