"""Fault injection: the spec, and which worker acts (the demo tests run the faults for real)."""

import re

import pytest

from elasticft.config import ConfigError, FTConfig, RiskConfig
from elasticft.contract.faults import Fault, FaultSpecError, parse_faults
from elasticft.contract.run_dir import DEGRADE_MARKER
from elasticft.health import RiskModel
from elasticft.health.injected import InjectedGpuSource
from elasticft.worker.inject import FaultInjector


def test_parse_faults():
    assert parse_faults(" gpu_degrade:2@8, node_lost:1@10 ") == [Fault("gpu_degrade", 2, 8), Fault("node_lost", 1, 10)]
    assert parse_faults("") == []
    for bad in ("gpu_melt:1@2", "rank_killed:1", "node_lost:x@3", "nan:0@3*"):
        with pytest.raises(FaultSpecError, match=re.escape(repr(bad))):
            parse_faults(bad)
        # The knob names its flag: one line for the user, before anything starts.
        with pytest.raises(ConfigError, match=f"^--eft-inject: .*{re.escape(repr(bad))}$"):
            FTConfig(inject=f"rank_killed:0@1,{bad}")


def test_only_the_target_acts_once_and_degrades_its_gpu(tmp_path):
    faults = parse_faults("gpu_degrade:3@5")
    bystander = FaultInjector(faults, str(tmp_path), rank=2, local_rank=0, group_rank=1)
    target = FaultInjector(faults, str(tmp_path), rank=3, local_rank=1, group_rank=1)
    source = InjectedGpuSource("node1", 2, tmp_path)
    model = RiskModel(RiskConfig())
    assert not any(s.triggered for s in model.update(source.read()))
    for iteration in range(1, 8):
        bystander.after_iteration(iteration)
        target.after_iteration(iteration)
    assert (tmp_path / DEGRADE_MARKER).read_text() == "1" and source.degraded_gpu() == 1
    scores = model.update(source.read())
    assert [s.triggered for s in scores] == [False, True] and scores[1].score == 1.0
    (tmp_path / DEGRADE_MARKER).unlink()
    target.after_iteration(5)  # a re-done iteration after a restart does not fire again
    assert not (tmp_path / DEGRADE_MARKER).exists()


def test_nothing_fires_outside_eft_run():
    FaultInjector(parse_faults("rank_killed:0@1"), None, 0, 0, 0).after_iteration(1)  # still alive


def test_a_loop_that_reaches_into_its_steps_hangs_its_rank_mid_step_not_between_iterations(tmp_path, monkeypatch):
    """Megatron-LM's loop passes in_step=True after an iteration and calls in_step() from the
    next step's forward: the hang happens there, once (a re-done step does not hang again)."""
    hung = []
    monkeypatch.setattr(FaultInjector, "_rank_hung", staticmethod(lambda: hung.append("hung")))
    target = FaultInjector(parse_faults("rank_hung:1@3"), str(tmp_path), rank=1, local_rank=1, group_rank=0)
    target.after_iteration(3, in_step=True)
    assert hung == []  # not between iterations
    target.in_step(2)
    assert hung == []  # not in the step after another iteration
    target.in_step(3)
    target.in_step(3)
    assert hung == ["hung"]
