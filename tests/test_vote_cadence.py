"""Where a vote costs more than --eft-vote-budget allows, the ranks vote every few iterations,
not every one, and keep every guarantee of a vote every iteration (a signal's case is in
tests/test_worker_hook.py): real gloo jobs of forked ranks, the test playing
the agent (tests/gloo_job.py); the numbers check's case in tests/test_numerics_worker.py."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticft.worker.cadence import CAP, VoteCadence
from elasticft.worker.tree_max import group_max
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
    mp.start_processes(_tree_rank, args=(ranks, str(tmp_path)), nprocs=ranks, join=True, start_method="fork")
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
