"""eft's part at a Megatron-style loop's decision point (elasticft/worker/loop_duties.py), which
Megatron-LM's and Megatron-Bridge's loops share: when every rank must vote now, and what a vote's
answer does to the loop. The hook is a recorder of what the loop asked of it (the vote itself is
tests/test_vote_cadence.py's and the hook tests')."""

import math

import pytest

from elasticft.worker.loop_duties import LoopDuties
from elasticft.worker.vote import Action


class Recorder:
    def __init__(self, answer: Action):
        self.answer = answer
        self.steps = []

    def step(self, iteration, loss=None, grad_norm=None, vote=False):
        self.steps.append((iteration, vote))
        return self.answer

    def worked(self, seconds):
        pass


class Loop(LoopDuties):
    def __init__(self, answer: Action):
        super().__init__()
        self.hook = Recorder(answer)
        self.injector = type("NoFaults", (), {"after_iteration": lambda *a, **k: None})()
        self.saves = []

    def _save_now(self, call, iteration):
        self.saves.append(iteration)


@pytest.mark.parametrize("grad_norm, forced", [(float("nan"), True), (math.inf, True), (1.5, False), (None, False)])
def test_a_grad_norm_that_is_not_finite_makes_every_rank_vote_at_that_iteration(grad_norm, forced):
    """The grad norm is the job's (the same on every rank): all vote at once, and the next step
    does not run on what a spoilt update did to the weights; otherwise the cadence decides."""
    loop = Loop(Action())
    loop._grad_norm = grad_norm
    assert loop._decision(5, {}, lambda: False) is False
    assert loop.hook.steps == [(5, forced)]


def test_a_rollback_stops_the_loop_without_its_own_decision_or_a_save():
    loop = Loop(Action(save=False, exit=True, reason="numerics", rollback=True))
    ran = []
    assert loop._decision(7, {}, lambda: ran.append(1)) is True
    assert ran == [] and loop.saves == []


def test_a_save_and_exit_saves_through_the_loop_then_stops_it():
    loop = Loop(Action(save=True, exit=True, reason="signal"))
    assert loop._decision(9, {"state": "s"}, lambda: False) is True
    assert loop.saves == [9]
