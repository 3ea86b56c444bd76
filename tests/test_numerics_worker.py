"""The numbers check in real 2-rank gloo jobs (elasticft.worker.Hook); the test plays the agents.

Each rank stands for a node ("node0", "node1": its own run directory, local rank 0) and
reports a scripted loss. A generation runs from a start iteration until the workers stop
for a rollback (or the end); the next generation starts where a restore from the last good
state would, as the agent's restart does. What the workers kept in their run directories
between generations is all that carries over, as across a real restart.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticft.contract.numerics import NUMERICS_FILE, ROLLBACK_FILE, Cause, NumericFault, NumericKind, NumericsState
from elasticft.worker.loss_rules import from_bits, judge, rerun_cause, same_numbers, spike_level, to_bits
from tests import forked
from tests.gloo_job import finish, take_outbox

RANKS = 2


def normal_loss(iteration: int, rank: int, seed: int = 0) -> float:
    """A falling, noisy curve like a language model's (each rank its own slice of the batch)."""
    noise = random.Random(f"{seed}:{iteration}:{rank}").gauss(0.0, 0.03)
    return 1.5 + 3.0 * math.exp(-iteration / 40) + noise


@dataclass
class Generation:
    root: Path
    number: int
    first: int
    last: int
    # (rank, iteration) -> "nan", or a factor the loss is multiplied by, in this generation
    bad: dict[tuple[int, int], object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    save_interval: int | None = None  # the loop's own (the hook votes at each)

    def run_dir(self, rank: int) -> Path:
        return self.root / f"node{rank}"

    def result(self, rank: int) -> dict:
        return json.loads((self.root / f"gen{self.number}-rank{rank}.json").read_text())


def _rank_main(rank: int, gen: Generation) -> None:
    for name in [n for n in os.environ if n.startswith("EFT_")]:
        del os.environ[name]
    os.environ.update({"EFT_RUN_DIR": str(gen.run_dir(rank)), "EFT_NODE_ID": f"node{rank}", "LOCAL_RANK": "0",
                       **gen.env})
    dist.init_process_group("gloo", init_method=f"file://{gen.root}/init-{gen.number}", rank=rank,
                            world_size=RANKS)
    from elasticft.worker import Hook

    hook = Hook(save_interval=gen.save_interval)
    result = {"rollback": None, "skipped": [], "stepped": [], "ballot": None}
    hook.add_ballot(_Recorder(result))
    iteration = gen.first
    while iteration < gen.last:
        if hook.skips(iteration + 1):
            loss = None
            result["skipped"].append(iteration + 1)
        else:
            loss = normal_loss(iteration + 1, rank)
            bad = gen.bad.get((rank, iteration + 1))
            loss = float("nan") if bad == "nan" else loss * bad if bad is not None else loss
            result["stepped"].append(iteration + 1)
        iteration += 1
        action = hook.step(iteration, loss=loss, grad_norm=None if loss is None else 1.0)
        if action.rollback:
            assert action.exit and not action.save
            result["rollback"] = iteration
            break
    (gen.root / f"gen{gen.number}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


class _Recorder:
    """A ballot (the memory tier's, an async save's) that votes the iteration: what it was told last."""

    width = 1

    def __init__(self, result: dict):
        self.result = result

    def needs_vote(self, iteration: int) -> bool:
        return False

    def mine(self, iteration: int) -> list[int]:
        return [iteration]

    def settle(self, agreed: list[int]) -> None:
        self.result["ballot"] = agreed


class Job:
    """Generations of workers over the same run directories."""

    def __init__(self, root: Path, save_interval: int | None = None, **env):
        self.root = root
        self.save_interval = save_interval
        # A vote every iteration unless a test says otherwise: the tests name the iteration of each verdict.
        self.env = {f"EFT_{k.upper()}": str(v) for k, v in {"vote_budget": 0, **env}.items()}
        self.generations = 0
        self.events: list[dict] = []
        for rank in range(RANKS):
            (root / f"node{rank}").mkdir(parents=True, exist_ok=True)

    def run(self, first: int, last: int, bad: dict | None = None) -> dict:
        """One generation; rank 0's result, with ``events`` (its outbox's verdicts)."""
        self.generations += 1
        gen = Generation(self.root, self.generations, first, last, bad or {}, self.env, self.save_interval)
        finish(forked.start_processes(_rank_main, args=(gen,), nprocs=RANKS, join=False), 60)
        results = [gen.result(r) for r in range(RANKS)]
        assert results[0] == results[1], "the ranks disagree"
        events = [m for m in take_outbox(gen.run_dir(0)) if m["type"] == "numerics"]
        assert take_outbox(gen.run_dir(1)) == []  # rank 0 reports for the job
        self.events += events
        return {**results[0], "events": events, "marker": self.take_marker()}

    def take_marker(self) -> dict | None:
        markers = []
        for rank in range(RANKS):
            path = self.root / f"node{rank}" / ROLLBACK_FILE
            markers.append(json.loads(path.read_text()) if path.exists() else None)
            path.unlink(missing_ok=True)
        assert markers[0] == markers[1], "every node's agent must learn of the rollback"
        return markers[0]

    def state(self) -> NumericsState:
        return NumericsState.from_json((self.root / "node0" / NUMERICS_FILE).read_text())


def kinds(result: dict) -> list[str]:
    return [e["event"] for e in result["events"]]


# -- the rules, pure --------------------------------------------------------------------------

def test_the_vote_encoding_orders_values_and_puts_nan_above_everything():
    values = [0.0, 1e-30, 0.5, 2.0, 3.5, 1e30, math.inf]
    assert sorted(values, key=to_bits) == values
    assert [from_bits(to_bits(v)) for v in values] == values
    assert math.isnan(from_bits(max(to_bits(v) for v in [*values, math.nan])))
    assert from_bits(to_bits(None)) is None
    assert from_bits(max(to_bits(-7.0), to_bits(3.0))) == 7.0  # magnitudes: a negative loss is not hidden


def test_a_spike_is_judged_against_the_median_and_mad_with_a_floor():
    window = [2.0 + 0.01 * (i % 5) for i in range(30)]
    level = spike_level(window, mads=6.0, min_rise=0.5, min_history=20)
    assert level == pytest.approx(2.02 * 1.5)  # the floor: quiet curve, MAD small
    assert judge(2.5, 1.0, level) is None
    assert judge(3.2, 1.0, level) is NumericKind.SPIKE
    assert judge(math.nan, 1.0, level) is NumericKind.NAN
    assert judge(2.0, math.inf, level) is NumericKind.NAN
    assert spike_level(window[:10], 6.0, 0.5, 20) is None  # too little history: only NaN is judged
    noisy = [2.0 + (1.0 if i % 2 else -1.0) for i in range(30)]  # MAD 1: 6 sigma is far above the floor
    assert spike_level(noisy, 6.0, 0.5, 20) == pytest.approx(2.0 + 6 * 1.4826)


def test_a_rerun_tells_transient_from_data_from_hardware():
    first = NumericFault(10, NumericKind.NAN, math.nan, math.nan)
    assert rerun_cause(first, None, 2.0, 1.0, 1e-6) is None
    assert rerun_cause(first, NumericKind.NAN, math.nan, math.nan, 1e-6) is Cause.DATA
    spike = NumericFault(10, NumericKind.SPIKE, 40.0, 9.0)
    assert rerun_cause(spike, NumericKind.SPIKE, 40.0 * (1 + 1e-9), 9.0, 1e-6) is Cause.DATA
    assert rerun_cause(spike, NumericKind.SPIKE, 55.0, 9.0, 1e-6) is Cause.HARDWARE
    assert same_numbers(math.inf, math.inf, 0) and not same_numbers(math.inf, math.nan, 0)


# -- the workers --------------------------------------------------------------------------------

def test_a_nan_on_one_rank_rolls_back_and_a_clean_rerun_is_a_transient_fault(tmp_path):
    job = Job(tmp_path)
    first = job.run(0, 12, bad={(1, 6): "nan"})
    assert first["rollback"] == 6 and first["stepped"] == list(range(1, 7))
    # the other parts of the rollback's vote learnt what it agreed (an async save's, a snapshot's)
    assert first["ballot"] == [6]
    assert kinds(first) == ["rollback"]
    rollback = first["events"][0]
    assert (rollback["cause"], rollback["fault"], rollback["ranks"], rollback["nodes"]) == \
        ("unknown", "nan", [1], ["node1"])
    assert first["marker"]["iteration"] == 6
    again = job.run(4, 12)  # restored from iteration 4
    assert again["rollback"] is None and again["stepped"] == list(range(5, 13))
    transient, = again["events"]
    assert (transient["event"], transient["iteration"], transient["ranks"], transient["nodes"]) == \
        ("transient_fault", 6, [1], ["node1"])
    assert transient["rerun_loss"] == pytest.approx(max(normal_loss(6, r) for r in range(RANKS)))
    state = job.state()
    assert state.pending is None and state.implicated == {"node1": 1} and state.suspects == []


def test_between_votes_a_nan_is_held_to_the_next_one_and_its_own_iteration_is_rolled_back_and_rerun(tmp_path):
    # Votes far apart (a tiny --eft-vote-budget), and at each of the loop's saves (every 10): the
    # NaN of iteration 13 reaches every rank at 20, before the save; the re-run judges 13 itself.
    job = Job(tmp_path, save_interval=10, vote_budget=1e-9)
    first = job.run(0, 30, bad={(1, 13): "nan"})
    assert first["rollback"] == 20 and first["marker"]["iteration"] == 13
    rollback, = first["events"]
    assert (rollback["iteration"], rollback["fault"], rollback["ranks"]) == (13, "nan", [1])
    again = job.run(10, 30)  # restored from the save before it
    assert again["rollback"] is None and again["stepped"] == list(range(11, 31))
    transient, = again["events"]
    assert (transient["event"], transient["iteration"], transient["ranks"]) == ("transient_fault", 13, [1])


def test_a_poisoned_batch_is_skipped_after_the_same_numbers_twice(tmp_path):
    job = Job(tmp_path)
    poison = {(0, 7): "nan"}
    assert job.run(0, 12, bad=poison)["rollback"] == 7
    second = job.run(5, 12, bad=poison)
    assert second["rollback"] == 7 and kinds(second) == ["data_skipped", "rollback"]
    assert second["events"][1]["cause"] == "data"
    third = job.run(5, 12, bad=poison)
    assert third["rollback"] is None and third["skipped"] == [7]
    assert 7 not in third["stepped"] and third["stepped"][-1] == 12
    state = job.state()
    assert state.skipped == [7] and state.implicated == {}  # bad data implicates no node


def test_a_rank_that_computes_garbage_every_time_makes_its_node_suspect(tmp_path):
    job = Job(tmp_path, spike_min_history=5)
    garbage = lambda factor: {(1, i): factor for i in range(10, 20)}  # noqa: E731 - a script
    assert job.run(0, 20, bad=garbage(300.0))["rollback"] == 10
    second = job.run(9, 20, bad=garbage(450.0))  # other garbage: not the data
    assert second["rollback"] == 10 and kinds(second) == ["rollback"]
    assert second["events"][0]["cause"] == "hardware" and second["events"][0]["nodes"] == ["node1"]
    third = job.run(9, 20, bad=garbage(700.0))
    assert third["rollback"] == 10 and kinds(third) == ["node_suspect", "rollback"]
    assert third["events"][0]["node"] == "node1" and third["events"][0]["faults"] == 2
    assert job.state().suspects == ["node1"]
    # Without the suspect node (excluded), the re-run is clean.
    last = job.run(9, 20)
    assert last["rollback"] is None and kinds(last) == ["transient_fault"]


def test_a_normal_curve_never_rolls_back_and_a_spike_does(tmp_path):
    job = Job(tmp_path)
    calm = job.run(0, 120)
    assert calm["rollback"] is None and calm["events"] == []
    spiky = Job(tmp_path / "spiky")
    result = spiky.run(0, 120, bad={(0, 60): 1.8})
    assert result["rollback"] == 60 and result["events"][0]["fault"] == "spike"
    assert result["events"][0]["ranks"] == [0]
    below = Job(tmp_path / "below")
    assert below.run(0, 120, bad={(0, 60): 1.2})["rollback"] is None  # under the 1.3x floor


def test_the_spike_window_survives_a_crash_restart(tmp_path):
    job = Job(tmp_path)
    assert job.run(0, 64)["rollback"] is None  # "crashes" after 64; the state was kept at 60
    result = job.run(61, 70, bad={(1, 63): 2.0})  # restored from 61: one new loss, under the 10 needed
    assert result["rollback"] == 63 and result["events"][0]["fault"] == "spike"
