"""What eft relies on in Megatron-Bridge (elasticft/bridge_seam.py), against the installed one.

An upgrade of Bridge that renames a loop function eft wraps, drops a parameter eft reads, moves
a ConfigContainer field eft sets, or stops calling a wrapped function through its module's
globals (so that the wrapper would silently never run) fails here.
"""

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticft import bridge_seam as seam
from elasticft import versions
from elasticft.contract.checkpoints import TRACKER

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import cpu_emulation  # noqa: E402 - before megatron: Bridge's import reaches transformer_engine

cpu_emulation.enable()


def test_the_installed_bridge_is_a_tested_release():
    verdict = versions.judge(versions.MEGATRON_BRIDGE, seam.installed_version())
    assert verdict.support is versions.Support.TESTED, verdict.line


def test_every_site_and_field_eft_uses_is_there():
    assert seam.problems() == []


@pytest.mark.parametrize("caller_module, caller, callee", [
    (seam.PRETRAIN, "_pretrain", "train"),
    (seam.TRAIN, "train", "checkpoint_and_decide_exit"),
    (seam.TRAIN, "checkpoint_and_decide_exit", "save_checkpoint_and_time"),
    (seam.TRAIN, "train", "save_checkpoint_and_time"),
    ("megatron.bridge.training.setup", "setup", "_should_load_checkpoint"),
    (seam.CHECKPOINTING, "DefaultCheckpointManager.load", "load_checkpoint"),
    (seam.CHECKPOINTING, "save_checkpoint", "dist_checkpointing"),  # then .save, on the package at call time
])
def test_the_loop_calls_each_wrapped_function_by_its_global_name(caller_module, caller, callee):
    holder = importlib.import_module(caller_module)
    for name in caller.split("."):
        holder = getattr(holder, name)
    code = holder.__code__
    assert callee in code.co_names, f"{caller} no longer calls {callee} by its global name"


def test_train_calls_train_step_through_a_local_bound_from_the_module_global_at_each_train():
    """Bridge's train() takes ``wrapped_train_step = train_step`` (then NVRx's straggler wrapper,
    if on) when it starts: the module global at that moment, which is eft's wrapper."""
    code = importlib.import_module(seam.TRAIN).train.__code__
    assert "train_step" in code.co_names and "wrapped_train_step" in code.co_varnames


def test_a_replaced_function_reaches_the_modules_that_imported_it_by_name():
    train_module, pretrain_module = (importlib.import_module(m) for m in (seam.TRAIN, seam.PRETRAIN))
    assert pretrain_module.train is train_module.train  # what replace() relies on to find the copies
    original = train_module.train
    try:
        seam.replace("train", lambda f: lambda *a, **k: f(*a, **k))
        assert pretrain_module.train is train_module.train is not original
        assert pretrain_module.train.__wrapped__ is original
    finally:
        train_module.train = pretrain_module.train = original


def test_a_module_whose_imported_name_moved_is_named_at_launch_and_never_wrapped_half_way():
    """pretrain.py imports ``train`` by name: if it holds another function (Bridge moved it, or
    something else wrapped it), the launch check says so in one line and replace() refuses,
    where it used to wrap train.py's alone and leave eft outside the loop without a word."""
    pretrain_module = importlib.import_module(seam.PRETRAIN)
    original = pretrain_module.train
    pretrain_module.train = lambda *a, **k: original(*a, **k)
    try:
        assert [p for p in seam.problems() if "pretrain.train" in p] == [
            f"{seam.PRETRAIN}.train is no longer {seam.SITES['train']}: its callers would go round eft"]
        with pytest.raises(seam.BridgeSeamError, match="pretrain.train is no longer"):
            seam.replace("train", lambda f: f)
        assert importlib.import_module(seam.TRAIN).train is original  # nothing wrapped
    finally:
        pretrain_module.train = original


def test_the_transformer_engine_stand_in_is_gone_after_bridge_imported():
    """The CPU emulation answers one import of TE (Bridge's LoRA layers) and no other."""
    import megatron.bridge.training.pretrain  # noqa: F401
    from megatron.core.extensions import transformer_engine as te_extension

    assert "transformer_engine" not in sys.modules
    assert importlib.util.find_spec("transformer_engine") is None
    assert not getattr(te_extension, "HAVE_TE", False)


def test_bridges_checkpoint_holds_the_files_a_memory_snapshot_carries_beside_the_tensors(plain):
    """Bridge's load reads train_state.pt and run_config.yaml from the iteration's directory: a
    snapshot writes them under the names the tier carries whole (contract.memory.GLOBAL_FILES),
    and a checkpoint of Bridge's own has them there."""
    from elasticft.contract.memory import BRIDGE_RUN_CONFIG, BRIDGE_TRAIN_STATE, GLOBAL_FILES, is_shard_file

    _, ckpt = plain
    iteration_dir = seam.function(seam.CHECKPOINT_NAME)(str(ckpt), 3)
    for site, name in ((seam.TRAIN_STATE_FILE, BRIDGE_TRAIN_STATE), (seam.RUN_CONFIG_FILE, BRIDGE_RUN_CONFIG)):
        path = seam.function(site)(iteration_dir)
        assert path == f"{iteration_dir}/{name}" and name in GLOBAL_FILES and not is_shard_file(name)
        assert Path(path).is_file()


def test_the_disk_tier_bridge_would_load_on_its_own_is_what_its_tracker_names(plain, tmp_path):
    """What a memory iteration must be at least as new as: checkpoint.load's tracker (Bridge's
    own checkpoint), a global non-persistent one if newer, nothing when setup would not load or
    a fine-tuning would start over."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from elasticft.megatron_bridge.memory import _BridgeDisk
    from pretrain_bridge import tiny_gpt

    _, ckpt = plain
    config = process_config_with_overrides(tiny_gpt(), cli_overrides=[f"checkpoint.load={ckpt}"])
    assert _BridgeDisk(None, (), {}, config, None, wanted=True).complete_iterations() == [8]
    assert _BridgeDisk(None, (), {}, config, None, wanted=False).complete_iterations() == []
    non_persistent = tmp_path / "np"
    non_persistent.mkdir()
    (non_persistent / TRACKER).write_text("11")
    config.checkpoint.non_persistent_ckpt_type, config.checkpoint.non_persistent_global_ckpt_dir = "global", str(
        non_persistent)
    assert _BridgeDisk(None, (), {}, config, None, wanted=True).complete_iterations() == [11]
    config.checkpoint.finetune = True
    assert _BridgeDisk(None, (), {}, config, None, wanted=True).complete_iterations() == []


def _save_that_swallows_every_exception(state, model, optimizer, opt_param_scheduler,
                                        num_floating_point_operations_so_far, checkpointing_context=None,
                                        train_data_iterator=None):
    """Bridge's save_checkpoint as a release (or a wrapper of the recipe's) may write it: the hand-off
    to megatron-core's dist_checkpointing.save inside a broad ``except Exception`` that logs and goes on."""
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.save({"weights": "sharded"}, checkpoint_name(state), content_metadata={"layout": "tp1"},
                                preprocess_common_before_consistancy_check=None)
    except Exception as exc:  # noqa: BLE001 - the point of the test
        print(f"save failed: {exc}; training goes on")


def checkpoint_name(state):
    return seam.function(seam.CHECKPOINT_NAME)(seam.get(state, f"{seam.CONFIG}.{seam.SAVE_DIR}"), 1)


@pytest.mark.seam
def test_a_snapshot_takes_its_state_through_a_save_path_that_catches_every_exception(monkeypatch, tmp_path):
    """eft's capture stops Bridge's save where it hands the state to dist_checkpointing.save; a
    broad ``except Exception`` between the two (Bridge's or Megatron's save path) must not swallow
    it, where it used to end every snapshot in mid-training with "returned without calling"."""
    from megatron.bridge.training.state import GlobalState

    from elasticft.megatron_bridge.memory import BridgeMemory
    from pretrain_bridge import tiny_gpt

    config = tiny_gpt(str(tmp_path / "ckpt"))
    config.train.exit_signal_handler = False  # no SIGTERM handler in the test process
    state = GlobalState()
    state.cfg = config
    state.train_state.step = 1
    memory = BridgeMemory.__new__(BridgeMemory)  # the tier itself is not under test: its directory only
    memory.tier, memory._context, memory._run_config = SimpleNamespace(dir=str(tmp_path / "mem")), {}, None
    monkeypatch.setattr(importlib.import_module(seam.CHECKPOINTING), seam.SAVE_CHECKPOINT.name,
                        _save_that_swallows_every_exception)
    request = memory._capture({"state": state, "model": [], "optimizer": None, "opt_param_scheduler": None,
                               "num_floating_point_operations_so_far": 0}, 1)
    assert request.state == {"weights": "sharded"} and request.options == {"content_metadata": {"layout": "tp1"}}
    snapshot = Path(seam.function(seam.CHECKPOINT_NAME)(str(tmp_path / "mem"), 1))
    assert (snapshot / "train_state.pt").is_file() and (snapshot / "run_config.yaml").is_file()
    assert config.checkpoint.save == str(tmp_path / "ckpt")  # the recipe's own, put back


# Bridge as a release that moved a name eft relies on at run time might look: each stand-in has the
# parameters of the site it replaces, so that the launch check finds that one change and no other.

def _train_whose_step_returns_the_grad_norm_last(forward_step_func, model, optimizer, scheduler, global_state,
                                                 checkpoint_manager, wrapped_train_step=None):
    (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, num_zeros_in_grad,
     grad_norm) = wrapped_train_step(forward_step_func, model, optimizer, scheduler, global_state)


def _train_that_keeps_the_steps_result_whole(forward_step_func, model, optimizer, scheduler, global_state,
                                             checkpoint_manager, wrapped_train_step=None):
    result = wrapped_train_step(forward_step_func, model, optimizer, scheduler, global_state)
    return result.loss_dict


def _save_calling_save_imported_by_name(state, model, optimizer, opt_param_scheduler,
                                        num_floating_point_operations_so_far, checkpointing_context=None,
                                        train_data_iterator=None):
    from megatron.core.dist_checkpointing import save

    save({}, "dir", content_metadata=None, preprocess_common_before_consistancy_check=None)


def _save_without_content_metadata(state, model, optimizer, opt_param_scheduler,
                                   num_floating_point_operations_so_far, checkpointing_context=None,
                                   train_data_iterator=None):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save({}, "dir", preprocess_common_before_consistancy_check=None)


def _without(name):
    def apply(monkeypatch):
        monkeypatch.delattr(importlib.import_module(seam.STATE).GlobalState, name)
    return apply


def _container(change):
    def apply(monkeypatch):
        container = importlib.import_module("megatron.bridge.training.config").ConfigContainer
        monkeypatch.setattr(container, *change(container))
    return apply


def _train_is(stand_in):
    def apply(monkeypatch):
        for module in (seam.TRAIN, seam.PRETRAIN):  # pretrain.py's copy too: only the unpacking differs
            monkeypatch.setattr(importlib.import_module(module), "train", stand_in)
    return apply


def _save_is(stand_in):
    def apply(monkeypatch):
        monkeypatch.setattr(importlib.import_module(seam.CHECKPOINTING), seam.SAVE_CHECKPOINT.name, stand_in)
    return apply


READS = "eft reads loss_dict at 0, should_exit at 3, exit_code at 4, grad_norm at 5"


@pytest.mark.seam
@pytest.mark.parametrize("move, line", [
    (_without("train_state"), f"{seam.STATE}.GlobalState has no train_state "
                              "(eft reads train_state, train_state.step, train_state.state_dict)"),
    (_without("cfg"), f"{seam.STATE}.GlobalState has no cfg (eft reads cfg)"),
    (_container(lambda c: ("__dataclass_fields__",
                           {k: v for k, v in c.__dataclass_fields__.items() if k != "checkpoint"})),
     "ConfigContainer has no field checkpoint"),
    (_container(lambda c: ("to_yaml", None)), "ConfigContainer has no to_yaml() (a memory snapshot's run_config.yaml)"),
    (_train_is(_train_whose_step_returns_the_grad_norm_last),
     f"{seam.TRAIN}.train unpacks train_step's result as (loss_dict, skipped_iter, should_checkpoint, should_exit, "
     f"exit_code, num_zeros_in_grad, grad_norm); {READS}"),
    (_train_is(_train_that_keeps_the_steps_result_whole),
     f"{seam.TRAIN}.train no longer unpacks train_step's result into names; {READS}"),
    (_save_is(_save_calling_save_imported_by_name),
     f"{seam.SAVE_CHECKPOINT} no longer calls {seam.DIST_SAVE} on its package, where a memory snapshot takes the "
     "state (it swaps the package's function)"),
    (_save_is(_save_without_content_metadata),
     f"{seam.SAVE_CHECKPOINT} no longer passes {seam.DIST_SAVE} content_metadata, which a memory snapshot keeps "
     "for the load"),
], ids=["GlobalState.train_state", "GlobalState.cfg", "ConfigContainer.checkpoint", "ConfigContainer.to_yaml",
        "train_step's tuple reordered", "train_step's tuple whole",
        "dist save imported by name", "dist save without content_metadata"])
def test_a_name_eft_relies_on_in_mid_training_that_moved_is_refused_at_launch_in_one_line(
        move, line, monkeypatch, tmp_path):
    """GlobalState's paths, the ConfigContainer's sections, the names train() unpacks train_step's
    result into, and save_checkpoint's hand-off to dist_checkpointing.save: all used first at the
    first step or snapshot, and again after every restart. A newer Bridge that moved one is refused
    before any worker starts, in one line."""
    from elasticft.config import ConfigError
    from elasticft.megatron_bridge.mode import worker_environment

    move(monkeypatch)
    assert seam.problems() == [line]
    recipe = tmp_path / "recipe.py"
    recipe.write_text("from megatron.bridge.training.pretrain import pretrain\n")
    monkeypatch.setattr(seam, "installed_version", lambda: "0.7.0")  # newer than tested: the check decides
    with pytest.raises(ConfigError) as refused:
        worker_environment("auto", str(recipe))
    assert line in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.seam
def test_the_loop_reads_train_steps_result_where_the_launch_check_looks_for_it():
    from elasticft import megatron_seam
    from elasticft.worker import loop_duties

    assert seam.TRAIN_STEP_READS == {"loss_dict": loop_duties.LOSS_DICT, "should_exit": loop_duties.SHOULD_EXIT,
                                     "exit_code": loop_duties.EXIT_CODE, "grad_norm": loop_duties.GRAD_NORM}
    assert seam.DIST_SAVE == megatron_seam.DIST_SAVE  # the function a snapshot swaps (megatron_seam.swapped)
