"""What eft relies on in Megatron-Bridge (elasticft/bridge_seam.py), against the installed one.

An upgrade of Bridge that renames a loop function eft wraps, drops a parameter eft reads, moves
a ConfigContainer field eft sets, or stops calling a wrapped function through its module's
globals (so that the wrapper would silently never run) fails here.
"""

import importlib
import sys

import pytest

from elasticft import bridge_seam as seam
from elasticft import versions

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
])
def test_the_loop_calls_each_wrapped_function_by_its_global_name(caller_module, caller, callee):
    code = getattr(importlib.import_module(caller_module), caller).__code__
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


def test_the_transformer_engine_stand_in_is_gone_after_bridge_imported():
    """The CPU emulation answers one import of TE (Bridge's LoRA layers) and no other."""
    import megatron.bridge.training.pretrain  # noqa: F401
    from megatron.core.extensions import transformer_engine as te_extension

    assert "transformer_engine" not in sys.modules
    assert importlib.util.find_spec("transformer_engine") is None
    assert not getattr(te_extension, "HAVE_TE", False)
