"""Where a vote costs more than --eft-vote-budget allows, the ranks vote every few iterations,
not every one, and keep every guarantee of a vote every iteration (a signal's case is in
tests/test_worker_hook.py): real gloo jobs of forked ranks, the test playing
the agent (tests/gloo_job.py); the numbers check's case in tests/test_numerics_worker.py."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticft.contract.numerics import ROLLBACK_FILE
from elasticft.worker.loop_duties import LoopDuties
from elasticft.worker import Hook
from elasticft.worker.cadence import CAP, VoteCadence
from elasticft.worker.inject import FaultInjector
from elasticft.worker.memory import MemoryCheckpoints
from elasticft.worker.tree_max import group_max
from tests import forked
from tests.gloo_job import finish, job, run, start, take_outbox

def cadenced(tmp_path, **kwargs):
    """Votes only where every rank must: the first two iterations, and the loop's saves (every 20)."""
    spec = job(tmp_path, hook_args={"save_interval": 20}, step_seconds=0.01, **kwargs)
    for env in spec.env.values():
        env["EFT_VOTE_BUDGET"] = "1e-9"  # a vote costs more than the budget allows: as rarely as can be
    return spec


def saved_iterations(results):
    return [[s["iteration"] for s in r["saves"]] for r in results]


def test_a_request_seen_by_one_rank_waits_for_the_next_vote_and_every_rank_saves_it_there_once(tmp_path):
    spec = cadenced(tmp_path, last=60)
    spec.events[(25, 2)] = [("request", spec.run_dir(2), {"id": "req-1"})]
    spec.events[(45, 0)] = [("request", spec.run_dir(0), {"id": "req-1"})]  # relayed late: no second save

    results = run(spec)

    assert saved_iterations(results) == [[40]] * 4  # held from 25 to the vote at 40, the same on every rank
    assert [s["request_id"] for r in results for s in r["saves"]] == [None, None, "req-1", None]
    ack, = take_outbox(spec.run_dir(0))
    assert (ack["type"], ack["iteration"]) == ("ack", 40)
    assert [r["votes"] for r in results] == [4] * 4  # at 0 and 1 (the first two steps), 20 and 40


def test_a_rank_killed_after_the_vote_decided_a_save_leaves_nothing_marked_complete(tmp_path):
    spec = cadenced(tmp_path, last=60, dies_saving=3)
    for rank in range(4):
        spec.events[(10, rank)] = [("request", spec.run_dir(rank), {"id": "req-1"})]  # saved at the vote at 20
    context = start(spec)
    with pytest.raises(mp.ProcessExitedException):  # the survivors' barrier fails: the dead rank never wrote its part
        finish(context, 60)
    assert context.processes[3].exitcode == -signal.SIGKILL
    checkpoints = tmp_path / "ckpt"
    assert not (checkpoints / "latest_checkpointed_iteration.txt").exists()
    assert not list(checkpoints.glob("*/.complete")) and take_outbox(spec.run_dir(0)) == []


@pytest.mark.parametrize("ranks", [3, 6])
def test_the_tree_exchange_is_the_max_over_every_rank(tmp_path, ranks):
    forked.start_processes(_tree_rank, args=(ranks, str(tmp_path)), nprocs=ranks, join=True)
    values = [_values(r) for r in range(ranks)]
    expected = [max(column) for column in zip(*values)]
    assert [(tmp_path / f"{r}.txt").read_text() for r in range(ranks)] == [repr(expected)] * ranks


def _values(rank: int) -> list[int]:
    rng = random.Random(rank)
    return [rng.randrange(0, 1 << 62) for _ in range(12)]


def _tree_rank(rank: int, ranks: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=ranks)
    result = group_max(_values(rank), None, torch.device("cpu"))
    Path(root, f"{rank}.txt").write_text(repr(result))
    dist.destroy_process_group()


def test_the_cadence_keeps_votes_within_the_budget_and_names_the_same_iterations_from_what_was_agreed():
    now = [0.0]
    cadence = VoteCadence(0.01, every=(50, None), last=95, clock=lambda: now[0])
    assert cadence.due(1) and cadence.every_k() == 1  # nothing agreed or measured yet: vote
    for _ in range(5):
        now[0] += 0.1
        cadence.tick()
    cadence.voted(0.0005)
    assert cadence.every_k() == 1  # a 0.5 ms vote is under 1 % of a 0.1 s step: every iteration
    cadence.voted(0.004)
    cadence.voted(0.004)
    assert cadence.proposal() == CAP - 4  # 4 ms: once in 4 steps keeps it at 1 %
    cadence.settle(5, CAP - 3)  # another rank measured less: the job votes again 3 iterations on
    assert [i for i in range(6, 9) if cadence.due(i)] == [8]
    cadence.settle(8, CAP - 100)
    # the loop's own save interval (50) and last iteration (95) vote too: bad numbers are never saved
    assert [i for i in range(9, 108) if cadence.due(i)] == [50, 95, 100] and cadence.due(108)
    assert all(VoteCadence(0.0).due(i) for i in range(5))  # 0: every iteration


def test_the_ranks_vote_at_the_loops_non_persistent_saves_its_exit_interval_and_its_last_iteration(tmp_path):
    """Megatron's --non-persistent-save-interval saves too: a request a rank sees waits only until
    the next of the loop's own saves or stops, non-persistent ones included, never past one."""
    spec = cadenced(tmp_path, last=34)
    spec.hook_args.update(non_persistent_save_interval=7, exit_interval=30, train_iters=33)
    for iteration, rank, request in ((3, 1, "req-np"), (29, 2, "req-exit"), (31, 3, "req-last")):
        spec.events[(iteration, rank)] = [("request", spec.run_dir(rank), {"id": request})]

    results = run(spec)

    assert saved_iterations(results) == [[7, 30, 33]] * 4
    # at 0 and 1 (the first two steps), the non-persistent saves (7, 14, 21, 28), 20, 30 and 33
    assert [r["votes"] for r in results] == [9] * 4


def test_a_bad_loss_held_at_the_loops_end_is_rolled_back_not_saved_by_the_loops_own_final_save(tmp_path):
    """Votes every few iterations (k > 1) and a loop that ends where the ranks did not vote (the
    last iteration unknown to eft, an exit of the loop's own): rank 1's NaN loss at iteration 11
    is held when the loop makes its own save of iteration 12. Through the save wrappers' duty
    (worker/loop_duties.py) every rank votes first: no save, the rollback marker, exit 0, both
    where the save comes after train() returned (Megatron-LM's pretrain) and where it is inside
    it (Megatron-Bridge's train, a signal's save); with good numbers the save is made."""
    outcomes = {}
    for case, bad, inside in (("after", 11, False), ("inside", 11, True), ("good", None, False)):
        root = tmp_path / case
        root.mkdir()
        forked.start_processes(_held_rank, args=(str(root), bad, inside), nprocs=2, join=True)
        outcomes[case] = [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(2)]
    for case in ("after", "inside"):
        assert [(o["saved"], o["exit"]) for o in outcomes[case]] == [(None, 0)] * 2, case
        assert all(o["rollback_marker"] for o in outcomes[case]), case
        assert [o["votes"] for o in outcomes[case]] == [3] * 2  # 1, 2, and the one before the save
    assert [(o["saved"], o["exit"], o["rollback_marker"]) for o in outcomes["good"]] == [(12, None, False)] * 2


class _Loop(LoopDuties):
    """A Megatron-style loop's duties (the vote at each decision, the vote before its own saves)."""

    def _save_now(self, call, iteration):
        raise AssertionError("no save was asked for")


def _held_rank(rank: int, root: str, bad: int | None, inside: bool) -> None:
    for name in [n for n in os.environ if n.startswith("EFT_")]:
        del os.environ[name]
    run_dir = Path(root, f"run{rank}")
    run_dir.mkdir()
    os.environ.update(EFT_RUN_DIR=str(run_dir), EFT_VOTE_BUDGET="1e-9")
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    outcome = {"saved": None, "exit": None}
    loop = _Loop()
    loop.hook = Hook(save_interval=100)  # the loop's last iteration unknown to eft (as --train-samples was)
    loop.memory = MemoryCheckpoints(loop.hook)
    loop.injector = FaultInjector.from_env()

    def own_save(iteration: int) -> None:  # the loop's save_checkpoint_and_time, through eft's wrapper
        if not loop._refuses_save():
            outcome["saved"] = iteration

    def train() -> int:
        for iteration in range(1, 13):
            time.sleep(0.002)
            loop._loss = math.nan if (rank, iteration) == (1, bad) else 2.0
            if loop._decision(iteration, {}, lambda: False):
                return iteration
        if inside:
            own_save(12)
        return 12

    try:
        last = loop._run(lambda: train(), (), {})
        if not inside:
            own_save(last)
    except SystemExit as stop:
        outcome["exit"] = stop.code
    outcome.update(votes=loop.hook.votes, rollback_marker=(run_dir / ROLLBACK_FILE).exists())
    Path(root, f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()
