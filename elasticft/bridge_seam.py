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
* ``problems()``: what the installed Bridge lacks of them, in words, one line each: the sites, the
  ConfigContainer's fields, GlobalState's paths, the names ``train`` unpacks ``train_step``'s
  result into, and ``save_checkpoint``'s call of ``dist_checkpointing.save`` (the mode's launch
  check, ``megatron_bridge/mode.py``);
* ``replace(site, make)``: the one place a Bridge function is swapped for a wrapper.

``tests/megatron_bridge/test_bridge_seam.py`` checks every site against the installed Bridge, so
an upgrade that renames or reshapes one fails there. Importing this module imports nothing of
Bridge's.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import textwrap
from typing import Callable

import elasticft.versions as versions
from elasticft.seam_sites import Site, Swaps, function, missing

TRAIN = "megatron.bridge.training.train"
PRETRAIN = "megatron.bridge.training.pretrain"
CHECKPOINTING = "megatron.bridge.training.checkpointing"
SETUP = "megatron.bridge.training.setup"
STATE = "megatron.bridge.training.state"


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
# dist_checkpointing.save: eft swaps the package's function for the call (megatron_seam.swapped),
# so save_checkpoint must look it up on the package at call time, and pass it by keyword the
# options a snapshot keeps for the load (``problems``: ``_hand_off``). The same site as
# megatron_seam.DIST_SAVE, named here too: this seam stands on nothing of eft's above the ground.
SAVE_CHECKPOINT = Site(CHECKPOINTING, "save_checkpoint", (
    "state", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
    "checkpointing_context", "train_data_iterator"))
SNAPSHOT_OPTIONS = ("content_metadata", "preprocess_common_before_consistancy_check")
DIST_SAVE = Site("megatron.core.dist_checkpointing", "save",
                 ("sharded_state_dict", "checkpoint_dir", *SNAPSHOT_OPTIONS))
# Beside the tensors Bridge's load reads two files rank 0 writes after them (names in contract.memory).
TRAIN_STATE_FILE = Site("megatron.bridge.training.utils.checkpoint_utils", "get_checkpoint_train_state_filename",
                        ("checkpoints_path",))
RUN_CONFIG_FILE = Site("megatron.bridge.training.utils.checkpoint_utils", "get_checkpoint_run_config_filename",
                       ("checkpoints_path",))
# The parameter sync save_checkpoint_and_time makes first (overlapped parameter gather), repeated by a snapshot.
NEEDS_PARAM_SYNC = Site(TRAIN, "should_disable_forward_pre_hook", (
    "use_megatron_fsdp", "use_distributed_optimizer", "overlap_param_gather"))
PARAM_SYNC = Site(TRAIN, "force_param_sync", ("model", "optimizer"))
CALLED = (CHECKPOINT_NAME, SAVE_CHECKPOINT, DIST_SAVE, TRAIN_STATE_FILE, RUN_CONFIG_FILE, NEEDS_PARAM_SYNC, PARAM_SYNC)

# The items of train_step's result eft reads (worker/loop_duties.py, LoopDuties._step), by the
# names Bridge's train() unpacks them into, at their positions. Checked in train()'s source, not in
# train_step's signature: 0.6.2's return annotation says 7 items where it returns 8 (nothing runs
# an annotation, so it drifts), and its docstring is prose; the unpacking is code Bridge runs every
# iteration, which must agree with what train_step returns for Bridge itself to work, and eft's
# wrapper sits exactly between the two.
TRAIN_STEP_READS = {"loss_dict": 0, "should_exit": 3, "exit_code": 4, "grad_norm": 5}

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
# TrainState: its state_dict() is what train_state.pt holds), and the config (a ConfigContainer,
# whose to_yaml() writes run_config.yaml).
STEP = "train_state.step"
TRAIN_STATE = "train_state"
TRAIN_STATE_DICT = "train_state.state_dict"
CONFIG = "cfg"
STATE_PATHS = (CONFIG, TRAIN_STATE, STEP, TRAIN_STATE_DICT)
TO_YAML = "to_yaml"


class BridgeSeamError(versions.SeamError):
    """The installed Megatron-Bridge no longer has a name or parameter eft relies on."""


_swaps = Swaps(SITES, BridgeSeamError, "elasticft/bridge_seam.py")


def installed_version() -> str | None:
    """Megatron-Bridge's version without importing it (None: not installed)."""
    return versions.installed(versions.MEGATRON_BRIDGE)


def problems() -> list[str]:
    """What the installed Bridge lacks of what eft uses at run time, one line each (empty: all there):
    the sites (a module that imported a site's function by name and now holds another is one:
    ``seam_sites.missing``), the ConfigContainer's fields, GlobalState's paths, the names train()
    unpacks train_step's result into, and save_checkpoint's hand-off to dist_checkpointing.save.
    The mode's launch check: a name that moved is refused here, not found at the first step or
    snapshot in mid-training (and again after every restart)."""
    return [*missing((*SITES.values(), *CALLED)), *_config(), *_state(), *_step_result(), *_hand_off()]


def _config() -> list[str]:
    """The ConfigContainer's sections and fields eft reads or sets, and its ``to_yaml``."""
    found = []
    try:
        config = importlib.import_module("megatron.bridge.training.config")
        container = config.ConfigContainer.__dataclass_fields__
        for section in dict.fromkeys([d.split(".")[0] for d in CONFIG_FIELDS] + [FT, INPROCESS_RESTART]):
            if section not in container:
                found.append(f"ConfigContainer has no field {section}")
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
        if INPROCESS_ENABLED not in config.InProcessRestartConfig.__dataclass_fields__:
            found.append(f"InProcessRestartConfig has no field {INPROCESS_ENABLED}")
        if not callable(getattr(config.ConfigContainer, TO_YAML, None)):
            found.append(f"ConfigContainer has no {TO_YAML}() (a memory snapshot's run_config.yaml)")
    except (ImportError, AttributeError) as exc:
        found.append(f"megatron.bridge.training.config: {exc}")
    return found


def _state() -> list[str]:
    """``STATE_PATHS`` on a fresh GlobalState of Bridge's: one line per attribute gone, with the
    paths that went with it. The config is None until setup sets it: its fields are ``_config``'s."""
    try:
        state = importlib.import_module(STATE).GlobalState()
    except (ImportError, AttributeError, TypeError) as exc:
        return [f"{STATE}.GlobalState: {exc}"]
    gone: dict[str, list[str]] = {}
    for dotted in STATE_PATHS:
        obj, parts = state, dotted.split(".")
        for depth, part in enumerate(parts, 1):
            if obj is None:
                break
            try:
                obj = getattr(obj, part)
            except AttributeError:
                gone.setdefault(".".join(parts[:depth]), []).append(dotted)
                break
    return [f"{STATE}.GlobalState has no {path} (eft reads {', '.join(paths)})" for path, paths in gone.items()]


def _source(site: Site) -> tuple[Callable, ast.AST]:
    """The function at ``site`` (the original, under eft's wrapper) and its parsed source."""
    target = inspect.unwrap(function(site))
    return target, ast.parse(textwrap.dedent(inspect.getsource(target)))


def _step_result() -> list[str]:
    """Whether train() unpacks train_step's result into ``TRAIN_STEP_READS``'s names at their positions."""
    site, reads = SITES["train"], ", ".join(f"{name} at {at}" for name, at in TRAIN_STEP_READS.items())
    try:
        _, tree = _source(site)
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError) as exc:
        return [f"{site}: its source cannot be read to check train_step's result, of which eft reads {reads} ({exc})"]
    unpackings = [[getattr(item, "id", "?") for item in node.targets[0].elts] for node in ast.walk(tree)
                  if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                  and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                  and node.value.func.id.endswith("train_step")]
    if not unpackings:
        return [f"{site} no longer unpacks train_step's result into names; eft reads {reads}"]
    return [f"{site} unpacks train_step's result as ({', '.join(names)}); eft reads {reads}" for names in unpackings
            if any(at >= len(names) or names[at] != name for name, at in TRAIN_STEP_READS.items())]


def _hand_off() -> list[str]:
    """Whether save_checkpoint calls ``DIST_SAVE`` as an attribute of its package (a module global or
    a local import: what a snapshot swaps), passing it ``SNAPSHOT_OPTIONS`` by keyword. A call moved
    into a helper is reported too: a false alarm costs a line at launch and a look at this seam, a
    miss a failed snapshot at every restart."""
    try:
        save, tree = _source(SAVE_CHECKPOINT)
        package = importlib.import_module(DIST_SAVE.module)
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError) as exc:
        return [f"{SAVE_CHECKPOINT}: its source cannot be read to check its call of {DIST_SAVE} ({exc})"]
    parent, _, last = DIST_SAVE.module.rpartition(".")
    local = {alias.asname or alias.name for node in ast.walk(tree) for alias in getattr(node, "names", ())
             if (isinstance(node, ast.ImportFrom) and node.module == parent and alias.name == last)
             or (isinstance(node, ast.Import) and alias.name == DIST_SAVE.module and alias.asname)}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == DIST_SAVE.name and isinstance(node.func.value, ast.Name)
             and (node.func.value.id in local or save.__globals__.get(node.func.value.id) is package)]
    if not calls:
        return [f"{SAVE_CHECKPOINT} no longer calls {DIST_SAVE} on its package, where a memory snapshot takes the "
                f"state (it swaps the package's function)"]
    passed = {keyword.arg for call in calls for keyword in call.keywords}
    absent = [option for option in SNAPSHOT_OPTIONS if option not in passed]
    return [f"{SAVE_CHECKPOINT} no longer passes {DIST_SAVE} {', '.join(absent)}, which a memory snapshot keeps "
            f"for the load"] if absent else []


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
