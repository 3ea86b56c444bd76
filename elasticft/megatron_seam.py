"""The one module that touches megatron-core's and ``megatron.training``'s internals.

eft enters an unmodified Megatron-LM script through the call sites of Megatron's own
training loop (``elasticft.megatron_lm``): it replaces a few module-level functions of
``megatron.training`` with wrappers that call the original. Those functions are
Megatron's internals, not an API it promises to keep, so every one of them is listed
here, with the parameters eft's wrappers read, and nowhere else:

* ``SITES``: each call site (module, function, the parameters eft passes on or reads);
* ``problems()``: what the installed Megatron lacks of them, in words;
* ``replace(site, make)``: the one place a Megatron function is swapped for a wrapper.

``tests/megatron_lm/test_megatron_seam.py`` checks every site against the installed
megatron-core, so an upgrade that renames or reshapes one fails there (CI runs it on each
of ``TESTED_MINORS``). Where the minors differ, a site names the minor that brought what eft
relies on (``Site.since``) and eft binds to what the installed one has (``installed_minor``):
the keywords of a memory snapshot's save (``save_keywords``) and the parameter sync before
it (``param_sync``). ``version_status`` is what the launcher makes of a version: a tested
minor runs, a newer one with every site there runs untested, an older one is refused.

Importing this module imports nothing of Megatron's: the launcher reads the version from
the package metadata (or the source tree's ``package_info.py``) without importing torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Callable

import elasticft.versions as versions
from elasticft.seam_sites import Minor, Site, Swaps, function, missing
from elasticft.versions import Support

# megatron-core minor releases whose megatron.training eft's Megatron-LM mode was tested with
# (the wheel ships megatron.training from 0.17 on); oldest first: versions.MEGATRON_CORE's range.
TESTED_MINORS = tuple((versions.MEGATRON_CORE.oldest[0], minor) for minor in
                      range(versions.MEGATRON_CORE.oldest[1], versions.MEGATRON_CORE.newest[1] + 1))

TRAINING = "megatron.training.training"
DATASET_UTILS = "megatron.core.datasets.utils"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"


SITES = {
    # pretrain() calls it once, after the model, optimizer, checkpoint and data are ready.
    "train": Site(TRAINING, "train", ("forward_step_func", "model", "optimizer", "opt_param_scheduler")),
    # One iteration; returns (loss_dict, skipped, should_checkpoint, should_exit, exit_code, grad_norm, ...).
    "train_step": Site(TRAINING, "train_step",
                       ("forward_step_func", "data_iterator", "model", "optimizer", "iteration")),
    # The loop's per-iteration decision point: save (periodic, signal) and whether to exit.
    "checkpoint_and_decide_exit": Site(TRAINING, "checkpoint_and_decide_exit", (
        "model", "optimizer", "opt_param_scheduler", "iteration", "num_floating_point_operations_so_far",
        "checkpointing_context", "train_data_iterator")),
    # Every save of the loop goes through it (periodic, signal, exit, end of training).
    "save_checkpoint_and_time": Site(TRAINING, "save_checkpoint_and_time", (
        "iteration", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
        "checkpointing_context")),
    # setup_model_and_optimizer's resume (load_arg "load"): where eft restores the memory tier.
    "load_checkpoint": Site(TRAINING, "load_checkpoint", (
        "ddp_model", "optimizer", "opt_param_scheduler", "load_arg", "checkpointing_context")),
    # One micro batch's forward and backward in every pipeline schedule: a rank's own work (stragglers).
    "forward_step": Site(SCHEDULES, "forward_step", ("forward_step_func", "data_iterator", "model")),
    "backward_step": Site(SCHEDULES, "backward_step", ("input_tensor", "output_tensor", "output_tensor_grad")),
    # --enable-ft-package: connects each rank to NVRx's rank monitor, which only ft_launcher starts.
    "ft_setup": Site("megatron.training.ft_integration", "setup"),
    # Rank 0 runs `make` for the dataset helper even when the wheel ships it compiled.
    "compile_helpers": Site(DATASET_UTILS, "compile_helpers"),
}


class MegatronSeamError(versions.SeamError):
    """The installed Megatron no longer has a name or parameter eft relies on."""


_swaps = Swaps(SITES, MegatronSeamError, "elasticft/megatron_seam.py")

# The update: train_step calls ``step()`` on the optimizer it is given, the one train() was
# given. The memory tier wraps that instance's ``step`` (megatron_lm/memory.py): the update
# waits for a snapshot's copy, which runs beside the step's forward and backward.
UPDATE = ("train_step", "optimizer", "step")  # caller, its parameter, the method it calls on it

CHECKPOINTING = "megatron.training.checkpointing"
# Called, not wrapped: the checkpoint name, the arguments, and what a memory snapshot runs.
CHECKPOINT_NAME = Site(CHECKPOINTING, "get_checkpoint_name", ("checkpoints_path", "iteration"))
GET_ARGS = Site("megatron.training.global_vars", "get_args")
# A memory snapshot is Megatron's own save, stopped where it hands the state to DIST_SAVE
# (looked up on the package at call time: eft swaps it for the duration of the call).
# From 0.19 on save_checkpoint_and_time passes save_checkpoint the process groups of the model's
# pg_collection (keyword: the collection's attribute) and its RNG key prefix; before, it passes
# none of them and save_checkpoint takes parallel_state's (0.18's has tp_, pp_ and dp_cp_group
# already, unused by the loop). A snapshot passes what the installed loop passes (save_keywords).
SAVE_GROUPS = {"tp_group": "tp", "pp_group": "pp", "dp_cp_group": "dp_cp_gtp_remat", "dp_group": "dp",
               "expt_dp_group": "expt_dp"}
SAVE_RNG_PREFIX = "rng_state_key_prefix"
SAVE_GROUPS_SINCE: Minor = (0, 19)
SAVE_CHECKPOINT = Site(CHECKPOINTING, "save_checkpoint", (
    "iteration", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
    "checkpointing_context", "train_data_iterator", "preprocess_common_state_dict_fn"),
    since=((SAVE_GROUPS_SINCE, (*SAVE_GROUPS, SAVE_RNG_PREFIX)),))
DIST_SAVE = Site("megatron.core.dist_checkpointing", "save", (
    "sharded_state_dict", "checkpoint_dir", "content_metadata", "preprocess_common_before_consistancy_check"))
# save_checkpoint_and_time's preparations, which a snapshot repeats: the groups of the
# model's process-group collection, the common state's preprocessing, the parameter sync
# that --overlap-param-gather defers to the next forward.
UNWRAP_MODEL = Site(TRAINING, "unwrap_model")
PREPROCESS_COMMON = Site(TRAINING, "preprocess_common_state_dict", ("common_state_dict",))
NEEDS_PARAM_SYNC = Site(TRAINING, "should_disable_forward_pre_hook", ("args",))
# From 0.19 on it takes the optimizer (which prepares its parameters for the sync first), and
# save_checkpoint_and_time passes it; before, the model chunks alone (param_sync).
PARAM_SYNC_OPTIMIZER_SINCE: Minor = (0, 19)
PARAM_SYNC = Site(TRAINING, "force_param_sync", ("model_chunks",),
                  since=((PARAM_SYNC_OPTIMIZER_SINCE, ("optimizer",)),))
# The rerun state machine (on by default): a resume puts it back to "no re-run pending" when
# eft's numbers check has taken over its verdict (rerun_idle_after_resume).
GET_RERUN_STATE_MACHINE = Site("megatron.core.rerun_state_machine", "get_rerun_state_machine")
CALLED = (CHECKPOINT_NAME, GET_ARGS, SAVE_CHECKPOINT, DIST_SAVE, UNWRAP_MODEL, PREPROCESS_COMMON, NEEDS_PARAM_SYNC,
          PARAM_SYNC, GET_RERUN_STATE_MACHINE)
# The machine's fields a resume resets: its state (RerunState) and the requests of the last run.
RERUN_IDLE_STATE = "NOT_RUNNING_YET"
RERUN_REQUESTS = ("rerun_requested", "checkpoint_requested", "restart_again_requested", "continue_requested")
# Megatron's parsed arguments (GET_ARGS) where its loop saves or stops on its own: the ranks vote
# there (worker/cadence.py). Read from what Megatron parsed and computed, never from sys.argv:
# --train-samples gives train_iters (setup's scheduler computes it, before the resume's load),
# and a --yaml-cfg or pretrain()'s args_defaults may set any of them.
LOOP_ENDS = ("save_interval", "exit_interval", "train_iters", "non_persistent_save_interval")


def loop_ends(margs) -> dict[str, int]:
    """``LOOP_ENDS`` from Megatron's parsed arguments ``margs``, as the Hook's keywords (the same
    names); 0 for unset (the Hook then looks for no flag in sys.argv; a YAML config's namespace
    holds only what the file sets)."""
    return {name: getattr(margs, name, None) or 0 for name in LOOP_ENDS}


def rerun_idle_after_resume(resumed: bool) -> str | None:
    """Put Megatron's rerun state machine back to "no re-run pending" after a resume; the
    state it was loaded in (None: idle already).

    A checkpoint Megatron's machine saves before its exit 16 carries a pending re-run
    ("resume on another GPU to disambiguate"); loaded again, the machine exits again at its
    first step, at every resume on the same GPU. eft's numbers check judges those re-runs
    itself (transient, bad data, bad node), so the resume it makes starts from a plain state;
    the machine's saved data-iterator position stays, so the re-run sees the same batch.
    After a resume (``resumed``: an iteration was loaded) the machine also checks the first
    step, which it skips only because a fresh job has nothing to save yet: the re-run of a
    bad step is then caught by the same check as the first run, and eft can compare the two.
    """
    module = importlib.import_module(GET_RERUN_STATE_MACHINE.module)
    machine = function(GET_RERUN_STATE_MACHINE)()
    if resumed:
        machine.first_iteration_complete = True
    idle = getattr(module.RerunState, RERUN_IDLE_STATE)
    if machine.state == idle:
        return None
    was = machine.state.name
    machine.state = idle
    for request in RERUN_REQUESTS:
        setattr(machine, request, False)
    return was




def installed_version() -> str | None:
    """megatron-core's version without importing it (``versions.installed``: the distribution's
    metadata, else the source tree's ``megatron/core/package_info.py``, a Megatron-LM checkout)."""
    return versions.installed(versions.MEGATRON_CORE)


def minor_of(version: str | None) -> Minor | None:
    """``"0.19.2"`` -> ``(0, 19)`` (by the release part: ``0.19.0rc1`` too); None for no version
    or one that does not start with two numbers."""
    parts = versions.release(version) if version else None
    return parts[:2] if parts and len(parts) >= 2 else None


@functools.cache
def installed_minor() -> Minor:
    """The installed megatron-core's minor, which decides the per-minor branches (``Site.since``);
    the newest tested one where the version cannot be read."""
    return minor_of(installed_version()) or TESTED_MINORS[-1]


def version_status(version: str | None) -> tuple[Support, str]:
    """What eft makes of the installed megatron-core, ``version``, in the words of every version
    verdict (``versions.Support``): tested for a tested minor; untested for a newer minor whose
    Megatron has every site eft relies on (looking imports Megatron: ``problems``); unsupported
    for anything else."""
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_MINORS)
    minor = minor_of(version)
    if version is None:
        return Support.UNSUPPORTED, f"megatron-core is not installed (eft's Megatron-LM mode was tested with {tested})"
    if minor in TESTED_MINORS:
        return Support.TESTED, f"megatron-core {version} is one eft's Megatron-LM mode was tested with ({tested})"
    if minor is None or minor < TESTED_MINORS[-1]:
        return Support.UNSUPPORTED, (f"megatron-core {version} is outside the range eft's Megatron-LM mode was tested "
                               f"with ({tested})")
    missing = problems(minor)
    if missing:
        return Support.UNSUPPORTED, (f"megatron-core {version} is newer than eft's Megatron-LM mode was tested with "
                               f"({tested}) and lacks what eft relies on: {'; '.join(missing)}")
    return Support.UNTESTED, (f"megatron-core {version} is newer than eft's Megatron-LM mode was tested with ({tested}); "
                        f"every site eft relies on is there")


def version_problem(version: str | None) -> str | None:
    """Why eft cannot enter this megatron-core's training loop, or None when it can
    (a tested minor, or a newer one with every site there: ``version_status``)."""
    status, why = version_status(version)
    return why if status is Support.UNSUPPORTED else None


def problems(minor: Minor | None = None) -> list[str]:
    """What the installed Megatron lacks of the sites eft uses as it uses them in ``minor``
    (default: the installed minor) (empty: all there)."""
    return missing((*SITES.values(), *CALLED), minor or installed_minor())


def save_keywords(model) -> dict:
    """The keywords ``save_checkpoint_and_time`` of the installed minor passes ``save_checkpoint``
    besides the state, ``train_data_iterator`` and ``preprocess_common_state_dict_fn``: from
    0.19 on the process groups of the model's pg_collection and its RNG key prefix
    (``SAVE_GROUPS``), before that none."""
    if installed_minor() < SAVE_GROUPS_SINCE:
        return {}
    first = function(UNWRAP_MODEL)(model)[0]
    groups = getattr(first, "pg_collection", None)
    keywords = {keyword: getattr(groups, name, None) if groups is not None else None
                for keyword, name in SAVE_GROUPS.items()}
    keywords[SAVE_RNG_PREFIX] = getattr(first, SAVE_RNG_PREFIX, "")
    return keywords


def param_sync(model, optimizer) -> None:
    """``force_param_sync`` as ``save_checkpoint_and_time`` of the installed minor calls it
    (--overlap-param-gather: the parameters are behind): from 0.19 on with the optimizer."""
    if installed_minor() >= PARAM_SYNC_OPTIMIZER_SINCE:
        function(PARAM_SYNC)(model, optimizer=optimizer)
    else:
        function(PARAM_SYNC)(model)


def replace(name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Swap the function of ``SITES[name]`` for ``make(original)``; the original.

    Megatron's loop calls these functions through their module's globals (and
    ``ft_integration.X`` through the module), so replacing the module attribute reaches
    every call site (``seam_sites.Swaps.replace``)."""
    return _swaps.replace(name, make)


@contextlib.contextmanager
def swapped(site: Site, replacement: Callable):
    """``site``'s function is ``replacement`` inside the block (on its module, for every caller)."""
    module = importlib.import_module(site.module)
    original = getattr(module, site.name)
    setattr(module, site.name, replacement)
    try:
        yield original
    finally:
        setattr(module, site.name, original)


def bound(name: str, args: tuple, kwargs: dict) -> dict:
    """A call of ``SITES[name]``'s original, its arguments by parameter name (Megatron
    passes some by position, some by keyword)."""
    return _swaps.bound(name, args, kwargs)


def rewind_scheduler(scheduler) -> None:
    """Before ``load_checkpoint`` loads into ``scheduler`` (its ``opt_param_scheduler``; None:
    nothing), which may have loaded before: back to a fresh one's step count. Megatron's
    OptimizerParamScheduler adds a checkpoint's steps to its own (``load_state_dict``:
    ``step(increment=num_steps)``), and eft loads twice in one process where the memory tier
    falls back to an older iteration after this rank's first load went through: the learning
    rate would be the sum's."""
    if scheduler is None:
        return
    if not isinstance(getattr(scheduler, SCHEDULER_STEPS, None), int):
        raise MegatronSeamError(f"{type(scheduler).__name__} has no {SCHEDULER_STEPS}; eft's Megatron seam "
                                "(elasticft/megatron_seam.py) needs updating")
    setattr(scheduler, SCHEDULER_STEPS, 0)


SCHEDULER_STEPS = "num_steps"  # OptimizerParamScheduler's count, which its load_state_dict adds to
