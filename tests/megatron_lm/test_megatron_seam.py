"""What eft relies on in megatron.training (elasticft/megatron_seam.py), against the installed one.

An upgrade of megatron-core that renames a function eft wraps, drops a parameter eft
reads, or stops calling a wrapped function through its module's globals (so that the
wrapper would silently never run) fails here. CI runs this file on every tested minor
(0.17, 0.18, 0.19: the ``every_minor`` cases, ``-m every_minor``); where the minors differ,
a test checks the branch the seam takes for the installed one.
"""

import ast
import importlib
import importlib.util
import inspect
import textwrap

import pytest

from elasticft import megatron_seam as seam
from elasticft.versions import Support

pytestmark = pytest.mark.every_minor


def calls(caller: str, callee: str) -> list[ast.Call]:
    """The calls of ``callee`` (by its global name) in the source of megatron.training's ``caller``."""
    source = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(seam.TRAINING), caller)))
    return [node for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == callee]


def test_the_installed_megatron_core_is_a_tested_minor():
    assert seam.version_status(seam.installed_version())[0] is Support.TESTED
    assert seam.version_problem(seam.installed_version()) is None


def test_every_site_eft_uses_is_there_with_the_parameters_eft_reads():
    assert seam.problems() == []


@pytest.mark.parametrize("caller, callee", [
    ("pretrain", "train"),
    ("train", "train_step"),
    ("train", "checkpoint_and_decide_exit"),
    ("checkpoint_and_decide_exit", "save_checkpoint_and_time"),
    ("pretrain", "save_checkpoint_and_time"),  # the final save after train(): eft votes before it
    ("setup_model_and_optimizer", "load_checkpoint"),
    ("forward_backward_no_pipelining", "forward_step"),
    ("forward_backward_no_pipelining", "backward_step"),
    ("forward_backward_pipelining_without_interleaving", "forward_step"),
    ("forward_backward_pipelining_without_interleaving", "backward_step"),
])
def test_the_loop_calls_each_wrapped_function_through_its_module(caller, callee):
    """A replaced module attribute reaches the loop only if the caller looks the name up
    in its module's globals at call time (not a local alias bound at import)."""
    module = importlib.import_module(seam.SITES[callee].module)
    code = getattr(module, caller).__code__
    if (caller, callee) == ("pretrain", "save_checkpoint_and_time") and callee not in code.co_names:
        from importlib.metadata import version

        if version("megatron-core").startswith("0.17."):  # docs/megatron-lm.md, "Limits"
            pytest.skip("Megatron-LM 0.17's pretrain makes its final save through save_checkpoint: eft's vote "
                        "before that save does not run there")
    assert callee in code.co_names, f"{caller} no longer calls {callee} by its global name"


def test_the_dataset_helper_compile_is_imported_at_call_time():
    """initialize's compile step imports compile_helpers when it runs, so the module's
    attribute (eft's wrapper) is what it gets, not a name bound when initialize was imported."""
    initialize = importlib.import_module("megatron.training.initialize")
    assert "compile_helpers" not in vars(initialize)
    source = importlib.util.find_spec("megatron.training.initialize").loader.get_source("megatron.training.initialize")
    assert "from megatron.core.datasets.utils import compile_helpers" in source


def test_a_version_older_than_the_range_is_refused_and_named_with_the_range():
    status, why = seam.version_status("0.16.1")
    assert status == "unsupported" and why == seam.version_problem("0.16.1")
    assert why == ("megatron-core 0.16.1 is outside the range eft's Megatron-LM mode was tested with "
                   "(0.17.x, 0.18.x, 0.19.x)")
    assert "not installed" in seam.version_problem(None)


def test_a_newer_minor_runs_untested_where_its_megatron_has_every_site_as_eft_uses_it_in_0_19():
    """A minor newer than 0.19 is held to 0.19's sites: this Megatron as that minor runs untested
    where it has them all (0.19), and is refused, naming what 0.19 brought, where not (0.17, 0.18)."""
    status, why = seam.version_status("0.20.0")
    if seam.installed_minor() >= (0, 19):
        assert (status, seam.version_problem("0.20.0")) == ("untested", None)
        assert why.endswith("(0.17.x, 0.18.x, 0.19.x); every site eft relies on is there")
    else:
        assert status == "unsupported" and why == seam.version_problem("0.20.0")
        assert seam.problems((0, 19)) == [
            f"{seam.SAVE_CHECKPOINT}: no parameter dp_group, expt_dp_group, rng_state_key_prefix",
            f"{seam.PARAM_SYNC}: no parameter optimizer"]
        assert why.endswith("lacks what eft relies on: " + "; ".join(seam.problems((0, 19))))


def test_a_snapshot_passes_save_checkpoint_the_keywords_the_installed_loop_passes():
    """A memory snapshot is the save save_checkpoint_and_time makes: the same keywords (its
    process groups from 0.19 on, none before), each group the same attribute of the model's
    pg_collection."""
    (call,) = calls(seam.SITES["save_checkpoint_and_time"].name, seam.SAVE_CHECKPOINT.name)
    groups = set(seam.SAVE_GROUPS) | {seam.SAVE_RNG_PREFIX}
    expected = groups if seam.installed_minor() >= seam.SAVE_GROUPS_SINCE else set()
    passed = {k.arg for k in call.keywords} - {"non_persistent_ckpt", "train_data_iterator",
                                               "preprocess_common_state_dict_fn"}
    assert passed == expected
    constants = set(getattr(importlib.import_module(seam.TRAINING), "save_checkpoint_and_time").__code__.co_consts)
    assert (set(seam.SAVE_GROUPS.values()) | {"pg_collection", seam.SAVE_RNG_PREFIX} <= constants) == bool(expected)


def test_the_parameter_sync_before_a_snapshot_is_called_as_the_installed_loop_calls_it():
    """save_checkpoint_and_time's sync under --overlap-param-gather: with the optimizer from 0.19 on."""
    (call,) = calls(seam.SITES["save_checkpoint_and_time"].name, seam.PARAM_SYNC.name)
    with_optimizer = seam.installed_minor() >= seam.PARAM_SYNC_OPTIMIZER_SINCE
    assert [k.arg for k in call.keywords] == (["optimizer"] if with_optimizer else [])
    assert len(call.args) == 1


def test_pretrain_calls_the_fault_tolerance_setup_through_its_module():
    """eft takes NVRx's place by replacing ft_integration.setup: pretrain must look it up on the module."""
    pretrain = importlib.import_module(seam.TRAINING).pretrain.__code__
    assert {"ft_integration", "setup"} <= set(pretrain.co_names)


def test_a_save_hands_its_state_to_dist_checkpointing_save_looked_up_on_the_package():
    """A memory snapshot is Megatron's save_checkpoint with the package's ``save`` swapped for
    the call: Megatron must reach it as ``dist_checkpointing.save`` at call time."""
    checkpointing = importlib.import_module(seam.CHECKPOINTING)
    assert {"dist_checkpointing", "save"} <= set(checkpointing.save_checkpoint.__code__.co_names)
    assert checkpointing.dist_checkpointing is importlib.import_module(seam.DIST_SAVE.module)


def test_the_rerun_state_machine_has_the_idle_state_and_requests_a_resume_resets():
    """A pending re-run loaded from Megatron's exit-16 checkpoint is reset to idle, requests cleared."""
    module = importlib.import_module(seam.GET_RERUN_STATE_MACHINE.module)
    machine = seam.function(seam.GET_RERUN_STATE_MACHINE)()
    assert seam.rerun_idle_after_resume(resumed=False) is None  # a fresh machine is idle
    assert machine.first_iteration_complete is False  # a fresh job: its first step is not checked
    machine.state = module.RerunState.WILL_RERUN_FROM_CHECKPOINT
    for request in seam.RERUN_REQUESTS:
        setattr(machine, request, True)
    assert seam.rerun_idle_after_resume(resumed=True) == "WILL_RERUN_FROM_CHECKPOINT"
    assert machine.state == getattr(module.RerunState, seam.RERUN_IDLE_STATE)
    assert not any(getattr(machine, request) for request in seam.RERUN_REQUESTS)
    assert machine.first_iteration_complete is True  # after a resume the first step is checked too


def test_train_step_updates_through_the_step_method_of_the_optimizer_train_gives_it():
    """The memory tier's copy overlaps a step's forward and backward because eft wraps ``step``
    on the optimizer instance train() receives: train_step must call it, on its parameter."""
    caller, parameter, method = seam.UPDATE
    training = importlib.import_module(seam.TRAINING)
    code = getattr(training, caller).__code__
    assert parameter in seam.SITES[caller].params and parameter in code.co_varnames
    assert method in code.co_names, f"{caller} no longer calls {parameter}.{method}()"
    assert "optimizer" in seam.SITES["train"].params and "optimizer" in training.train.__code__.co_varnames


def test_eft_run_says_in_one_line_that_a_newer_minor_runs_untested(tmp_path, monkeypatch, caplog):
    """The launch of a Megatron-LM script on a megatron-core newer than the range: it goes on,
    and the log says once that it is untested (this Megatron, as 0.20, has all of 0.19's sites)."""
    if seam.installed_minor() < (0, 19):
        pytest.skip("a newer minor is held to 0.19's sites, which this megatron-core lacks")
    from elasticft.megatron_lm.mode import worker_environment

    monkeypatch.setattr(seam, "installed_version", lambda: "0.20.0")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("from megatron.training import pretrain\n")
    with caplog.at_level("WARNING", logger="elasticft.megatron_lm.mode"):
        assert worker_environment("auto", str(script), [])
    assert [r.getMessage() for r in caplog.records] == [
        "--eft-megatron-lm: megatron-core 0.20.0 is newer than eft's Megatron-LM mode was tested with "
        "(0.17.x, 0.18.x, 0.19.x); every site eft relies on is there: running it untested"]


def test_a_second_load_into_the_same_scheduler_leaves_the_checkpoints_steps_after_a_rewind():
    """Megatron's scheduler adds a checkpoint's steps to its own when it loads; the memory tier's
    fallback loads twice in one process, rewinding first (seam.rewind_scheduler): the learning
    rate must then be the older checkpoint's, not that of the two counts added."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def scheduler() -> OptimizerParamScheduler:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=100,
                                       lr_decay_steps=1000, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=1000, wd_incr_style="constant")

    saved = {}
    for steps in (8, 16):
        trained = scheduler()
        trained.step(increment=steps)
        saved[steps] = (trained.state_dict(), trained.optimizer.param_groups[0]["lr"])
    resumed = scheduler()
    for steps in (16, 8):  # the newer iteration loads on this rank, then every rank falls back
        seam.rewind_scheduler(resumed)
        resumed.load_state_dict(saved[steps][0])
    assert getattr(resumed, seam.SCHEDULER_STEPS) == 8
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(saved[8][1])


def test_megatrons_arguments_hold_every_iteration_its_loop_saves_or_stops_at():
    """The vote's cadence reads where the loop saves and stops from Megatron's parsed arguments
    (``LOOP_ENDS``): the parser must still define each, and the loop still test each."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    defined = {action.dest for action in add_megatron_arguments(argparse.ArgumentParser())._actions}
    assert set(seam.LOOP_ENDS) <= defined
    training = importlib.import_module(seam.TRAINING)
    decides = set(training.checkpoint_and_decide_exit.__code__.co_names)
    assert {"save_interval", "non_persistent_save_interval", "exit_interval"} <= decides
    assert "train_iters" in training.train.__code__.co_names


def test_eft_doctor_gives_a_newer_minor_the_modes_own_verdict(monkeypatch):
    """A megatron-core newer than the tested minors: `eft doctor` and `eft-run --version` say what
    the Megatron-LM mode will do with it — untested where every site is there (0.19's), unsupported
    where not (0.17, 0.18 as 0.20) — not "untested" by its range alone."""
    from launcher.version_report import version_lines

    real = seam.installed_minor()  # the installed Megatron's (cached: the patch below must not reach it)
    monkeypatch.setattr(seam.versions, "installed", lambda component: "0.20.0" if component is
                        seam.versions.MEGATRON_CORE else None)
    (line,) = [line for line in version_lines() if line.startswith("megatron-core")]
    expected, _ = seam.version_status("0.20.0")
    assert f"0.20.0  {expected} for the Megatron-LM mode: " in line
    assert (expected is Support.UNTESTED) == (real >= (0, 19))


def _save_that_swallows_every_exception(iteration, model, optimizer, opt_param_scheduler,
                                        num_floating_point_operations_so_far, checkpointing_context=None, **kwargs):
    """Megatron's save_checkpoint as a release (or a site's wrapper) may write it: the hand-off to
    dist_checkpointing.save inside a broad ``except Exception`` that logs and goes on."""
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.save({"weights": "sharded"}, f"{seam.function(seam.GET_ARGS)().save}/iter_{iteration}",
                                content_metadata={"layout": "tp1"},
                                preprocess_common_before_consistancy_check=kwargs["preprocess_common_state_dict_fn"])
    except Exception as exc:  # noqa: BLE001 - the point of the test
        print(f"save failed: {exc}; training goes on")


def test_a_snapshot_takes_its_state_through_a_save_path_that_catches_every_exception(monkeypatch, tmp_path):
    """eft's capture stops Megatron's save where it hands the state to dist_checkpointing.save; a
    broad ``except Exception`` between the two must not swallow it, where it used to end every
    snapshot in mid-training with "returned without calling"."""
    from types import SimpleNamespace

    from elasticft.megatron_lm.memory import MegatronMemory

    margs = SimpleNamespace(save=str(tmp_path / "ckpt"), async_save=False, dataloader_save=None)
    monkeypatch.setattr(importlib.import_module(seam.GET_ARGS.module), "_GLOBAL_ARGS", margs)
    monkeypatch.setattr(importlib.import_module(seam.NEEDS_PARAM_SYNC.module), seam.NEEDS_PARAM_SYNC.name,
                        lambda args: False)  # no --overlap-param-gather: not what is under test
    monkeypatch.setattr(importlib.import_module(seam.SAVE_CHECKPOINT.module), seam.SAVE_CHECKPOINT.name,
                        _save_that_swallows_every_exception)
    memory = MegatronMemory.__new__(MegatronMemory)  # the tier itself is not under test: its directory only
    memory.tier, memory._context = SimpleNamespace(dir=str(tmp_path / "mem")), {}
    request = memory._capture({"iteration": 1, "model": [SimpleNamespace()], "optimizer": None,
                               "opt_param_scheduler": None, "num_floating_point_operations_so_far": 0})
    assert request.state == {"weights": "sharded"}
    assert request.options == {"content_metadata": {"layout": "tp1"},
                               "preprocess_common_before_consistancy_check": seam.function(seam.PREPROCESS_COMMON)}
    assert margs.save == str(tmp_path / "ckpt")  # the job's own, put back
