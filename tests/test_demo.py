"""The GPT demo end to end (examples/gpt3/demo.py): real megatron-core, agents, etcd, faults."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from bench.launch import read_jsonl
from elasticft.goodput.breakdown import breakdown
from tests.metrics_story import METRICS_FLAGS, TargetsWatch, assert_prometheus_saw_the_story
from tests.prometheus_server import PrometheusServer

# Longer than the longest wait below (tests/test_waits.py): a late job fails with its own message.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt3"
ITERS, SAVE_INTERVAL, DEGRADE_AT, LOSE_AT = 24, 10, 12, 14


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo():
    return load("demo")


@pytest.fixture(scope="module")
def reference(demo, tmp_path_factory):
    """Losses of an uninterrupted run at the demo's first layout (TP2 x PP1 x DP2)."""
    import subprocess

    out = tmp_path_factory.mktemp("reference")
    args = argparse.Namespace(train_iters=ITERS, save_interval=1000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           *demo.train_args(out, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {r["iteration"]: r["loss"] for r in read_jsonl(out / "train.jsonl") if r["event"] == "iteration"}


def scenario(demo, out: Path, **overrides):
    args = argparse.Namespace(out=str(out), train_iters=ITERS, save_interval=SAVE_INTERVAL, degrade_at=DEGRADE_AT,
                              lose_at=LOSE_AT, no_health=False, comeback_at=0, timeout=280,
                              nodes=2, no_memory=True, mem_ckpt_interval=0)  # the disk tier's story (see test_mem_ckpt_e2e)
    for key, value in overrides.items():
        setattr(args, key, value)
    result = demo.run(args)
    assert result["exit_code"] == 0, (out / "node0.log").read_text()[-3000:]
    return result, load("story").summary(result), load("story").tell(result, args)


def assert_same_losses(result: dict, reference: dict) -> None:
    steps = [r for r in result["log"] if r.get("event") == "iteration"]
    assert {r["iteration"] for r in steps} == set(range(1, ITERS + 1))
    for record in steps:
        assert record["loss"] == pytest.approx(reference[record["iteration"]], abs=1e-4), record


def test_dying_gpu_is_saved_before_its_node_is_lost(demo, reference, tmp_path):
    # A real Prometheus watches (tests/metrics_story.py says what it must see); memory snapshots every
    # 5 iterations: the newest at the loss (10) is older than the emergency save (12 or 13), so the
    # story resumes from disk as without them.
    with PrometheusServer(tmp_path / "prometheus") as prometheus, TargetsWatch(prometheus) as watch:
        result, facts, story = scenario(demo, tmp_path, during=watch.during, agent_flags=METRICS_FLAGS,
                                        no_memory=False, mem_ckpt_interval=5)
        assert_prometheus_saw_the_story(prometheus, watch, result, LOSE_AT)
    assert facts["detections"] and facts["detections"][0][0].startswith("node1/")
    assert facts["emergency_checkpoint"] in (DEGRADE_AT, DEGRADE_AT + 1)
    assert facts["lost_nodes"] == ["node1"]
    assert facts["iterations_redone"] <= 1
    (tp, pp, dp, _), (ntp, npp, ndp, resumed) = facts["layouts"][:2]
    assert (tp, pp, dp) == (2, 1, 2) and ntp * npp * ndp == 2
    assert resumed == facts["emergency_checkpoint"]
    assert facts["final_iteration"] == ITERS
    assert_same_losses(result, reference)  # resharded resume: exactly where it would have been
    assert "iterations re-done after the restart" in story and "final loss" in story


def test_without_the_health_trigger_the_iterations_since_the_periodic_save_are_redone(demo, reference, tmp_path):
    result, facts, _ = scenario(demo, tmp_path, no_health=True)
    assert facts["emergency_checkpoint"] is None and not facts["detections"]
    assert facts["iterations_redone"] == LOSE_AT - SAVE_INTERVAL  # 4, against <= 1 with the trigger
    assert_same_losses(result, reference)
    # eft report on the same run: the loss, the re-done iterations and the half-size layout.
    report = breakdown(read_jsonl(tmp_path / "events.jsonl"))
    (failure,) = report.failures
    assert failure.cause == "node lost: node1" and failure.iterations_lost == facts["iterations_redone"]
    assert report.seconds["rework"] > 0 and report.seconds["reduced_capacity"] > 0
    assert sum(report.seconds.values()) == pytest.approx(report.paid)


def test_a_node_that_comes_back_is_admitted_at_the_larger_layout(demo, reference, tmp_path):
    # Started again as soon as node 1 is gone and admitted at once (--eft-join-at save would hold
    # it for the next disk save: see tests/test_join_at.py): in the survivor's restart round if its
    # agent is up by then, else at the next round while the survivor trains alone (a third layout).
    # Cold workers: with warm ones the survivor trained its last 11 iterations in 5 s while the
    # comeback's agent took 8 s to start under CI's load (CI24), and the job ended without it.
    result, facts, _ = scenario(demo, tmp_path, comeback_at=LOSE_AT, agent_flags=["--eft-join-at", "now"],
                                cold_workers=True)
    layouts = facts["layouts"]
    assert len(layouts) >= 2 and layouts[-1][3] > 0  # a layout after the loss
    tp, pp, dp, resumed = layouts[-1]
    assert tp * pp * dp == 4  # back on both nodes
    saves = [r["iteration"] for r in result["log"] if r.get("event") == "save"]
    assert resumed == max(s for s in saves if s <= resumed)  # from the latest checkpoint
    assert facts["final_iteration"] == ITERS
    assert_same_losses(result, reference)


def test_readme_quick_start_runs_the_demo(tmp_path):
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("bash .ci/setup && "))
    command = line.split("&& ", 1)[1].split()
    assert command == [".venv/bin/python", "examples/gpt3/demo.py"]
    import subprocess

    # the interpreter under test: .venv's in the main lane (README), another lane's own elsewhere
    done = subprocess.run([sys.executable, *command[1:], "--out", str(tmp_path)], cwd=EXAMPLE.parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "emergency checkpoint" in done.stdout and "finished iteration 24/24" in done.stdout
    assert "goodput" in done.stdout and "node lost: node1" in done.stdout  # eft report on the run
    assert "<svg" in (tmp_path / "timeline.html").read_text()
