"""The memory checkpoint tier end to end: megatron-core GPT, eft-run agents, etcd, real kills.

No health warning in any of these: the failures come unannounced, and what is lost is
decided by the newest iteration the survivors hold in memory (or on disk).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from elasticft.contract.events import EventKind
from tests.test_demo import ITERS, assert_same_losses, demo, load, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

LOSE_AT = 14


def run_demo(demo, out: Path, **overrides) -> tuple[dict, dict]:  # noqa: F811 - the fixture
    args = argparse.Namespace(out=str(out), train_iters=ITERS, save_interval=50, degrade_at=0, lose_at=LOSE_AT,
                              no_health=True, comeback_at=0, timeout=280, nodes=2, mem_ckpt_interval=1,
                              no_memory=False, faults=[], agent_flags=[])
    for key, value in overrides.items():
        setattr(args, key, value)
    result = demo.run(args)
    assert result["exit_code"] == 0, (out / "node0.log").read_text()[-4000:]
    return result, load("story").summary(result)


def result_of(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def events(result: dict, kind: EventKind) -> list[dict]:
    return [e for e in result["events"] if e["kind"] == kind]


def test_a_lost_node_resumes_from_memory_and_without_the_tier_from_scratch(demo, reference, tmp_path, capsys):  # noqa: F811
    """kill -9 of a whole node: its share comes from its replica on the survivor."""
    code = demo.main(["--compare", "--no-health", "--out", str(tmp_path), "--save-interval", "50",
                      "--lose-at", str(LOSE_AT), "--train-iters", str(ITERS)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    with_memory = load("story").summary(result_of(tmp_path / "memory"))
    without = load("story").summary(result_of(tmp_path / "disk"))
    ((source, resumed, redone),) = with_memory["restarts"]
    assert source == "memory" and resumed in (LOSE_AT - 1, LOSE_AT) and redone <= 1
    (_, layout_after) = with_memory["layouts"][0], with_memory["layouts"][1]
    assert layout_after[0] * layout_after[1] * layout_after[2] == 2  # resharded onto the survivor
    ((source, resumed, redone),) = without["restarts"]
    assert (source, resumed, redone) == ("none", 0, LOSE_AT)  # no save before the 50th iteration
    # Both figures, side by side.
    row = next(line for line in printed.splitlines() if line.startswith("iterations re-done"))
    assert row.split()[-2:] == [str(with_memory["iterations_redone"]), str(LOSE_AT)]
    for name in ("memory", "disk"):
        assert_same_losses(result_of(tmp_path / name), reference)


def test_a_killed_worker_resumes_from_local_memory(demo, reference, tmp_path):  # noqa: F811
    result, facts = run_demo(demo, tmp_path, lose_at=0, faults=[f"rank_killed:1@{LOSE_AT}"])
    ((source, resumed, redone),) = facts["restarts"]
    assert source == "memory" and resumed in (LOSE_AT - 1, LOSE_AT) and redone <= 1
    (restored,) = events(result, EventKind.CKPT_RESTORED)[-1:]
    assert restored["source"] == "memory" and restored["iteration"] == resumed
    assert_same_losses(result, reference)


def test_a_hung_rank_resumes_from_local_memory(demo, reference, tmp_path):  # noqa: F811
    result, facts = run_demo(demo, tmp_path, lose_at=0, faults=[f"rank_hung:3@{LOSE_AT}"],
                             agent_flags=["--eft-timeouts", "step=8,setup=120"])
    assert events(result, EventKind.HANG)
    ((source, resumed, redone),) = facts["restarts"]
    assert source == "memory" and resumed in (LOSE_AT - 1, LOSE_AT) and redone <= 1
    assert_same_losses(result, reference)


def test_a_corrupt_replica_falls_back_to_the_previous_memory_iteration(demo, reference, tmp_path):  # noqa: F811
    result, facts = run_demo(demo, tmp_path, faults=[f"replica_corrupt:0@{LOSE_AT}"])
    (fallback, *_) = events(result, EventKind.MEM_CKPT_FALLBACK)
    assert "checksum" in fallback["why"]
    ((source, resumed, _),) = facts["restarts"]
    assert resumed < fallback["iteration"]  # never the corrupt one, never a mixture
    assert source == "memory" or (source == "none" and resumed == 0)
    assert_same_losses(result, reference)


def test_a_lost_node_and_its_replica_holder_fall_back_to_disk(demo, reference, tmp_path):  # noqa: F811
    """Three nodes, one replica each: losing node 1 and node 2 (which holds node 1's
    replica) leaves node 1's share nowhere; the restore takes the newest disk checkpoint."""
    result, facts = run_demo(demo, tmp_path, nodes=3, save_interval=10, faults=[f"node_lost:2@{LOSE_AT}"])
    assert sorted(load("story").summary(result)["lost_nodes"]) == ["node1", "node2"]
    assert events(result, EventKind.MEM_CKPT_FALLBACK)
    ((source, resumed, _),) = facts["restarts"]
    assert (source, resumed) == ("disk", 10)
    assert_same_losses(result, reference)
