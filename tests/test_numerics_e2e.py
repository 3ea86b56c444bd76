"""Bad numbers end to end: the megatron-core GPT example under eft-run, faults in its loss.

``--eft-inject nan`` (once), ``poison`` (every time) and ``corrupt`` (garbage, other garbage
each time) act inside the training step of one rank. What a user sees: the job re-runs the
bad iteration from the last good state, tells a transient fault from bad data from a bad
node, and trains to the end with the losses an undisturbed run has.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.launch import eft_run, read_jsonl, torchrun
from elasticft.contract.exit_codes import ExitCode
from tests.test_demo import demo  # noqa: F401 - the fixture
from tests.test_gpt3 import events, finish, losses, start

# Longer than the longest wait below (tests/test_waits.py): a late job fails with its own message.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]

ITERS = 12
DP2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--save-interval", "4",
       "--train-iters", str(ITERS)]


def run_eft(tmp: Path, name: str, inject: str, *flags: str) -> tuple[list[dict], list[dict]]:
    """eft-run on 2 local ranks (DP2) with memory snapshots every 2 iterations: (log, events)."""
    ckpt = tmp / f"{name}-ckpt"
    event_file = tmp / f"{name}-events.jsonl"
    job = start([*eft_run(), "--eft-inject", inject, "--eft-mem-ckpt-interval", "2",
                 "--eft-events-file", str(event_file), *flags], tmp, name, 2,
                [*DP2, "--save", str(ckpt), "--load", str(ckpt)])
    finish(job, 300)
    return read_jsonl(tmp / f"{name}.jsonl"), read_jsonl(event_file)


def of_kind(log: list[dict], kind: str) -> list[dict]:
    return [e for e in log if e["kind"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The losses of an undisturbed run (torchrun, the same layout)."""
    tmp = tmp_path_factory.mktemp("reference")
    finish(start(torchrun(), tmp, "ref", 2, [*DP2, "--save", str(tmp / "ckpt")]), 300)
    return losses(read_jsonl(tmp / "ref.jsonl"))


def test_a_nan_once_is_rerun_and_the_run_ends_with_the_undisturbed_losses(tmp_path, reference):
    log, run_events = run_eft(tmp_path, "nan", "nan:1@6")
    rollback, = of_kind(run_events, "rollback")
    assert (rollback["iteration"], rollback["fault"], rollback["cause"], rollback["ranks"]) == (6, "nan", "unknown", [1])
    assert [e["reason"] for e in of_kind(run_events, "restart")] == ["rollback"]
    transient, = of_kind(run_events, "transient_fault")
    assert transient["iteration"] == 6 and transient["ranks"] == [1]
    restored = of_kind(run_events, "ckpt_restored")[-1]
    assert restored["iteration"] < 6  # from the last good state, never the bad one
    got = losses(log)  # the last record of each iteration: the re-run's
    assert sorted(got) == list(range(1, ITERS + 1))
    for iteration in range(1, ITERS + 1):
        assert got[iteration] == pytest.approx(reference[iteration], abs=1e-6), iteration
    assert [r["iteration"] for r in events(log, "rollback")] == [6]


def test_a_poisoned_batch_is_skipped_once_and_the_job_finishes(tmp_path):
    log, run_events = run_eft(tmp_path, "poison", "poison:0@7")
    assert [e["cause"] for e in of_kind(run_events, "rollback")] == ["unknown", "data"]
    skipped, = of_kind(run_events, "data_skipped")
    assert skipped["iteration"] == 7
    steps = [r for r in events(log, "iteration") if r["iteration"] == 7]
    assert steps[-1]["skipped"] and steps[-1]["loss"] is None  # the last time, its step did not run
    assert events(log, "end")[0]["iteration"] == ITERS
    assert of_kind(run_events, "job_finished")


def test_a_node_that_computes_garbage_is_suspect_and_leaves(demo, tmp_path):  # noqa: F811 - the fixture
    """Two nodes (TP2 x PP2): rank 3, on node 1, multiplies its loss by another random factor
    every time from iteration 8 on. Twice implicated, node 1 is suspect and, with exclude,
    leaves; node 0 re-runs the iteration alone, clean, and finishes."""
    args = argparse.Namespace(out=str(tmp_path), train_iters=14, save_interval=50, degrade_at=0, lose_at=0,
                              no_health=True, comeback_at=0, timeout=400, nodes=2, mem_ckpt_interval=1,
                              no_memory=False, faults=["corrupt:3@8"], micro_batch_size=8, procs=2, during=None,
                              agent_flags=["--eft-suspect-action", "exclude", "--eft-spike-min-history", "4"])
    result = demo.run(args)
    assert result["exit_code"] == 0, (tmp_path / "node0.log").read_text()[-3000:]
    run_events = result["events"]
    causes = [(e["iteration"], e["cause"]) for e in of_kind(run_events, "rollback")]
    assert causes[:3] == [(8, "unknown"), (8, "hardware"), (8, "hardware")]
    suspect, = of_kind(run_events, "node_suspect")
    assert suspect["node"] == "node1" and suspect["faults"] == 2
    excluded, = of_kind(run_events, "node_excluded")
    assert excluded["source"] == "node1" and excluded["reason"] == "suspect"
    steps = [r for r in result["log"] if r.get("event") == "iteration"]
    assert steps[-1]["iteration"] == 14 and steps[-1]["world_size"] == 2
    assert all(json.dumps(r["loss"]) != "NaN" and r["loss"] < 10 for r in steps if r["iteration"] > 8
               and r["world_size"] == 2)


def test_a_node_that_stays_and_computes_garbage_ends_the_job_as_no_progress(tmp_path):
    """With --eft-suspect-action report the bad GPU stays; every re-run of the iteration is
    bad again, and the job ends with the no-progress exit code instead of looping."""
    event_file = tmp_path / "events.jsonl"
    ckpt = tmp_path / "ckpt"
    job = start([*eft_run(), "--eft-inject", "corrupt:1@6", "--eft-spike-min-history", "4", "--max-restarts", "50",
                 "--eft-max-no-progress-restarts", "2", "--eft-mem-ckpt-interval", "2",
                 "--eft-events-file", str(event_file)], tmp_path, "stays", 2,
                [*DP2, "--save", str(ckpt), "--load", str(ckpt)])
    try:
        assert job.wait(400) == ExitCode.NO_PROGRESS, job.output()[-3000:]
    finally:
        job.stop()
    run_events = read_jsonl(event_file)
    assert [e["cause"] for e in of_kind(run_events, "rollback")] == ["unknown", "hardware", "hardware"]
    assert of_kind(run_events, "node_suspect")[0]["action"] == "report"
    assert of_kind(run_events, "no_progress") and not of_kind(run_events, "job_finished")
    assert "no progress" in (tmp_path / "stays.log").read_text().strip().splitlines()[-1]


@pytest.mark.parametrize("seed", [1234, 1])
def test_the_normal_loss_curve_never_rolls_back(tmp_path, seed):
    """The example's own curve, 60 iterations with the default spike rule (docs/numerics.md)."""
    ckpt = tmp_path / "ckpt"
    event_file = tmp_path / "events.jsonl"
    finish(start([*eft_run(), "--eft-events-file", str(event_file)], tmp_path, "calm", 2,
                 ["--train-iters", "60", "--seed", str(seed), "--save", str(ckpt)]), 300)
    log = read_jsonl(tmp_path / "calm.jsonl")
    assert events(log, "end")[0]["iteration"] == 60
    assert of_kind(read_jsonl(event_file), "rollback") == []
    assert events(log, "rollback") == []
