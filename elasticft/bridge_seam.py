"""The one module that touches Megatron-Bridge's internals.

Megatron-Bridge (``megatron.bridge``, NVIDIA's recipe-based trainer) runs a training loop of its
own, ``megatron.bridge.training.train``, whose call sites match those eft wraps in
Megatron-LM's: ``train``, ``train_step`` (the same 8-tuple), ``checkpoint_and_decide_exit`` and
``save_checkpoint_and_time``. eft enters an unmodified Bridge script there
(``elasticft.megatron_bridge``). Those functions are Bridge's internals, not an API it promises
to keep, so every one of them is listed here, with the parameters eft's wrappers read, and
nowhere else:

* ``SITES``: each call site (module, function, parameters), and the modules that import it by
  name (``pretrain.py`` has its own ``train``: replacing ``train.py``'s attribute alone is not
  enough);
* ``problems()``: what the installed Bridge lacks of them, in words;
* ``replace(site, make)``: the one place a Bridge function is swapped for a wrapper.

``tests/megatron_bridge/test_bridge_seam.py`` checks every site against the installed Bridge, so
an upgrade that renames or reshapes one fails there. Importing this module imports nothing of
Bridge's.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Callable

import elasticft.versions as versions
from elasticft.seam_sites import Site, Swaps, function, missing

TRAIN = "megatron.bridge.training.train"
PRETRAIN = "megatron.bridge.training.pretrain"
CHECKPOINTING = "megatron.bridge.training.checkpointing"
SETUP = "megatron.bridge.training.setup"


SITES = {
    # The entry a recipe script calls: its ConfigContainer is where a re-plan's TP and PP go.
    "pretrain": Site(PRETRAIN, "pretrain", ("config", "forward_step_func")),
    # _pretrain calls it once, after setup (model, optimizer, checkpoint, data).
    "train": Site(TRAIN, "train", ("forward_step_func", "model", "optimizer", "scheduler", "global_state",
                                   "checkpoint_manager"), imported_by=(PRETRAIN,)),
    # One iteration; returns (loss_dict, skipped, should_checkpoint, should_exit, exit_code, grad_norm, ...).
    "train_step": Site(TRAIN, "train_step", ("forward_step_func", "data_iterator", "model", "optimizer",
                                             "global_state")),
    # The loop's per-iteration decision point: save (periodic, signal) and whether to exit.
    "checkpoint_and_decide_exit": Site(TRAIN, "checkpoint_and_decide_exit", (
        "state", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
        "checkpoint_manager", "train_data_iterator")),
    # Every save of the loop goes through it (periodic, signal, exit, end of training).
    "save_checkpoint_and_time": Site(TRAIN, "save_checkpoint_and_time", (
        "state", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
        "checkpoint_manager", "non_persistent_ckpt", "train_data_iterator")),
    # setup's decision to load at all (a checkpoint in checkpoint.load): the memory tier may hold a newer one.
    "should_load": Site(SETUP, "_should_load_checkpoint", ("cfg", "checkpoint_manager")),
    # The resume: the default checkpoint manager's load calls it by its global name.
    "load_checkpoint": Site(CHECKPOINTING, "load_checkpoint", ("state", "model", "optimizer",
                                                               "opt_param_scheduler")),
    # Rank 0 runs `make` for megatron-core's dataset helper even when the wheel ships it compiled;
    # Bridge's initialize imported the function by name.
    "compile_helpers": Site("megatron.core.datasets.utils", "compile_helpers",
                            imported_by=("megatron.bridge.training.initialize",)),
}
# Called, not wrapped: an iteration's checkpoint directory.
CHECKPOINT_NAME = Site("megatron.bridge.training.utils.checkpoint_utils", "get_checkpoint_name",
                       ("checkpoints_path", "iteration"))
# A memory snapshot is Bridge's own save, stopped where it hands the state to megatron-core's
# dist_checkpointing.save (megatron_seam.DIST_SAVE, looked up on the package at call time).
SAVE_CHECKPOINT = Site(CHECKPOINTING, "save_checkpoint", (
    "state", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
    "checkpointing_context", "train_data_iterator"))
# Beside the tensors Bridge's load reads two files rank 0 writes after them (names in contract.memory).
TRAIN_STATE_FILE = Site("megatron.bridge.training.utils.checkpoint_utils", "get_checkpoint_train_state_filename",
                        ("checkpoints_path",))
RUN_CONFIG_FILE = Site("megatron.bridge.training.utils.checkpoint_utils", "get_checkpoint_run_config_filename",
                       ("checkpoints_path",))
# The parameter sync save_checkpoint_and_time makes first (overlapped parameter gather), repeated by a snapshot.
NEEDS_PARAM_SYNC = Site(TRAIN, "should_disable_forward_pre_hook", (
    "use_megatron_fsdp", "use_distributed_optimizer", "overlap_param_gather"))
PARAM_SYNC = Site(TRAIN, "force_param_sync", ("model", "optimizer"))
CALLED = (CHECKPOINT_NAME, SAVE_CHECKPOINT, TRAIN_STATE_FILE, RUN_CONFIG_FILE, NEEDS_PARAM_SYNC, PARAM_SYNC)

# The ConfigContainer's fields eft reads or sets (dotted: section.field).
TP = "model.tensor_model_parallel_size"
PP = "model.pipeline_model_parallel_size"
SAVE_DIR = "checkpoint.save"
LOAD_DIR = "checkpoint.load"
SAVE_INTERVAL = "checkpoint.save_interval"
TRAIN_ITERS = "train.train_iters"
EXIT_INTERVAL = "train.exit_interval"
NON_PERSISTENT_INTERVAL = "checkpoint.non_persistent_save_interval"  # its loop's non-persistent saves: a vote there
ASYNC_SAVE = "checkpoint.async_save"
DISTRIBUTED_OPTIMIZER = "optimizer.use_distributed_optimizer"
FULLY_RESHARDABLE = "checkpoint.dist_ckpt_optim_fully_reshardable"
CKPT_FORMAT = "checkpoint.ckpt_format"
# What a memory restore sets for its load, and reads to find what Bridge would load on its own.
CKPT_STEP = "checkpoint.ckpt_step"
FINETUNE = "checkpoint.finetune"
PRETRAINED = "checkpoint.pretrained_checkpoint"
LOAD_OPTIM = "checkpoint.load_optim"
LOAD_RNG = "checkpoint.load_rng"
NON_PERSISTENT_TYPE = "checkpoint.non_persistent_ckpt_type"
NON_PERSISTENT_DIR = "checkpoint.non_persistent_global_ckpt_dir"
SAVE_TOKENIZER = "checkpoint.save_tokenizer_assets"
OVERLAP_PARAM_GATHER = "ddp.overlap_param_gather"
MEGATRON_FSDP = "ddp.use_megatron_fsdp"
FT = "ft"  # FaultToleranceConfig: NVRx's rank monitor (ft_launcher only), None when off
FT_ENABLED = "enable_ft_package"
# InProcessRestartConfig: NVRx's in-process restart, which pretrain wraps _pretrain in when enabled
INPROCESS_RESTART = "inprocess_restart"
INPROCESS_ENABLED = "enabled"
CONFIG_FIELDS = (TP, PP, SAVE_DIR, LOAD_DIR, SAVE_INTERVAL, TRAIN_ITERS, EXIT_INTERVAL, NON_PERSISTENT_INTERVAL,
                 ASYNC_SAVE, DISTRIBUTED_OPTIMIZER, FULLY_RESHARDABLE, CKPT_FORMAT, CKPT_STEP, FINETUNE, PRETRAINED, LOAD_OPTIM,
                 LOAD_RNG, NON_PERSISTENT_TYPE, NON_PERSISTENT_DIR, SAVE_TOKENIZER, OVERLAP_PARAM_GATHER, MEGATRON_FSDP)
# GlobalState: the iteration the loop has finished (train_state.step), the loop's counters (a
# TrainState: its state_dict() is what train_state.pt holds), and the config.
STEP = "train_state.step"
TRAIN_STATE = "train_state"
CONFIG = "cfg"


class BridgeSeamError(versions.SeamError):
    """The installed Megatron-Bridge no longer has a name or parameter eft relies on."""


_swaps = Swaps(SITES, BridgeSeamError, "elasticft/bridge_seam.py")


def installed_version() -> str | None:
    """Megatron-Bridge's version without importing it (None: not installed)."""
    return versions.installed(versions.MEGATRON_BRIDGE)


def problems() -> list[str]:
    """What the installed Bridge lacks of the sites and fields eft uses (empty: all there); a module
    that imported a site's function by name and now holds another is one (``seam_sites.missing``)."""
    found = missing((*SITES.values(), *CALLED))
    try:
        config = importlib.import_module("megatron.bridge.training.config")
        for dotted in CONFIG_FIELDS:
            section, field = dotted.split(".")
            holder = {"model": "GPTModelProvider"}.get(section)
            name = {"train": "TrainingConfig", "ddp": "DistributedDataParallelConfig"}.get(
                section, f"{section.capitalize()}Config")
            cls = (getattr(importlib.import_module("megatron.bridge.models.gpt_provider"), holder) if holder
                   else getattr(config, name))
            if field not in getattr(cls, "__dataclass_fields__", {}):
                found.append(f"{cls.__name__} has no field {field} ({dotted})")
        if FT_ENABLED not in config.FaultToleranceConfig.__dataclass_fields__:
            found.append(f"FaultToleranceConfig has no field {FT_ENABLED}")
        if INPROCESS_RESTART not in config.ConfigContainer.__dataclass_fields__:
            found.append(f"ConfigContainer has no field {INPROCESS_RESTART}")
        if INPROCESS_ENABLED not in config.InProcessRestartConfig.__dataclass_fields__:
            found.append(f"InProcessRestartConfig has no field {INPROCESS_ENABLED}")
    except (ImportError, AttributeError) as exc:
        found.append(f"megatron.bridge.training.config: {exc}")
    return found


def replace(name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Swap the function of ``SITES[name]`` for ``make(original)`` in its module and in every
    module that imported it by name; the original. A module that holds another function under
    that name is ``BridgeSeamError`` naming it, not a wrapper some callers go round."""
    return _swaps.replace(name, make)


def bound(name: str, args: tuple, kwargs: dict) -> dict:
    """A call of ``SITES[name]``'s original, its arguments by parameter name."""
    return _swaps.bound(name, args, kwargs)


def get(obj, dotted: str):
    """``obj``'s attribute at a dotted path (a ConfigContainer's ``model.tensor_model_parallel_size``)."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def put(obj, dotted: str, value) -> None:
    """Set ``obj``'s attribute at a dotted path."""
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


@contextlib.contextmanager
def overridden(config, values: dict[str, object]):
    """``config``'s dotted fields set to ``values`` inside the block, put back after."""
    saved = {dotted: get(config, dotted) for dotted in values}
    for dotted, value in values.items():
        put(config, dotted, value)
    try:
        yield
    finally:
        for dotted, value in saved.items():
            put(config, dotted, value)
