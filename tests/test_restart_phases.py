"""A restart taken apart (issue 34): what the agent and the workers mark, and eft report's phases.

The arithmetic is checked on hand-made logs (every phase, a phase nobody marked, ends out of
order, a restart that never reached a step); what writes the marks is checked with the real
heartbeat writer and the agent's recorder on a real etcd (torch's init_process_group, observed
through the seam: tests/test_torch_seam.py).
The end-to-end run (a worker crash and a lost node, every phase, sums to the downtime) is
tests/test_mem_ckpt_e2e.py's.
"""

from __future__ import annotations

import json

import pytest

from elasticft.agent.segments import StopRecorder
from elasticft.contract.events import EventKind
from elasticft.contract.phases import ORDER, LoadTier, RestartPhase
from elasticft.goodput.breakdown import breakdown
from elasticft.goodput.phases import split
from elasticft.worker import phases as worker_phases
from elasticft.worker.progress import ProgressWriter
from tests.test_goodput_report import eft_report, two_generations, write_jsonl

P = RestartPhase


def test_the_phases_add_up_to_the_downtime_whatever_order_the_ends_come_in():
    ends = {P.DETECTION: 12.0, P.STOP: 12.5, P.RENDEZVOUS: 14.0, P.REPLAN: 14.01, P.SPAWN: 14.2, P.IMPORTS: 17.0,
            P.PROCESS_GROUP: 17.5, P.LOAD: 18.5}
    spans = split(10.0, 19.0, ends)
    assert [s.phase for s in spans] == list(ORDER) and not any(s.merged for s in spans)
    assert [s.seconds for s in spans] == pytest.approx([2.0, 0.5, 1.5, 0.01, 0.19, 2.8, 0.5, 1.0, 0.5])
    # Clocks of different nodes: an end before the previous one is a phase of 0 s, one after the
    # first step is cut there; the sum stays the downtime.
    skewed = split(10.0, 19.0, {**ends, P.REPLAN: 13.0, P.LOAD: 25.0})
    assert {s.phase: s.seconds for s in skewed}[P.REPLAN] == 0.0
    assert {s.phase: s.seconds for s in skewed}[P.FIRST_STEP] == 0.0
    assert sum(s.seconds for s in skewed) == pytest.approx(9.0, abs=1e-12)


def test_a_phase_nobody_marked_is_merged_into_the_next_and_says_so():
    spans = split(10.0, 19.0, {P.DETECTION: 12.0, P.STOP: 12.5, P.SPAWN: 14.2})  # a script without eft's hook
    assert [(s.name, s.merged) for s in spans] == [
        ("detection", ()), ("stop", ()), ("spawn", (P.RENDEZVOUS, P.REPLAN)),
        ("first_step", (P.IMPORTS, P.PROCESS_GROUP, P.LOAD))]
    assert spans[-1].seconds == pytest.approx(4.8)
    never = split(10.0, 30.0, {P.DETECTION: 12.0, P.STOP: 12.5}, reached=False)  # the job ended instead
    assert [s.name for s in never] == ["detection", "stop", "unfinished"] and never[-1].seconds == 17.5


def with_phases(events: list[dict]) -> list[dict]:
    """two_generations() as today's eft records it: the generations' phase ends, and the second
    generation resumed from memory (n1 died; n0 holds its replica)."""
    first, second = [e for e in events if e["kind"] == EventKind.WORKERS_STOPPED]
    first["phases"] = {"rendezvous": 0.5, "replan": 0.6, "spawn": 1.9, "imports": 3.5, "process_group": 3.8,
                       "load": 4.5}
    second.update(phases={"rendezvous": 20.5, "replan": 20.6, "spawn": 21.0, "imports": 23.0, "process_group": 23.5,
                          "load": 25.0}, loaded_from="memory", loaded_bytes=1_500_000)
    return events


def test_eft_report_splits_each_restart_and_the_start_into_phases(tmp_path):
    report = breakdown(with_phases(two_generations()))
    (failure,) = report.failures
    # Failure at 15 (last heartbeat), node_lost at 18, n0 stopped at 20, its next first step at 26.
    assert [s.phase for s in failure.phases] == list(ORDER)
    assert [s.seconds for s in failure.phases] == pytest.approx([3.0, 2.0, 0.5, 0.1, 0.4, 2.0, 0.5, 1.5, 1.0])
    assert sum(s.seconds for s in failure.phases) == pytest.approx(failure.downtime_seconds, abs=1e-9)
    assert (failure.loaded_from, failure.loaded_bytes) == ("memory", 1_500_000)
    assert [s.name for s in report.start_phases] == [str(p) for p in ORDER[2:]]
    assert sum(s.seconds for s in report.start_phases) == report.generations[0].first_step - report.start
    # eft simulate's costs: detection; stop to spawn; imports to first step, a memory load.
    costs = report.costs
    assert (costs.detection_seconds, costs.restart_seconds) == pytest.approx((3.0, 3.0))
    assert costs.memory_load_seconds == pytest.approx(5.0) and costs.load_seconds == pytest.approx(5.0)

    log = write_jsonl(tmp_path / "events.jsonl", with_phases(two_generations()))
    done = eft_report("--events", str(log), "--plot", str(tmp_path / "run.html"))
    assert done.returncode == 0, done.stderr
    table = done.stdout[done.stdout.index("restart phases"):].splitlines()
    assert table[1].split() == ["restart", *map(str, ORDER), "total", "loaded"]
    assert table[2].split() == ["#1", "at", "15.0s", "3.00", "2.00", "0.50", "0.10", "0.40", "2.00", "0.50", "1.50",
                                "1.00", "11.00", "memory", "1.5", "MB"]
    assert table[3].split()[:3] == ["job", "start", "0.50"]
    assert "restart #1 (node lost: n1): load 1.50 s" in (tmp_path / "run.html").read_text()
    as_json = json.loads(eft_report("--events", str(log), "--json").stdout)
    assert [p["phase"] for p in as_json["failures"][0]["phases"]] == [str(p) for p in ORDER]
    assert as_json["restart_phases"]["summed"]["load"] == pytest.approx(1.5)
    assert as_json["costs"]["memory_load_seconds"] == pytest.approx(5.0)  # what eft simulate --costs reads


def test_a_log_without_phase_ends_still_adds_up_and_labels_what_is_missing(tmp_path):
    done = eft_report("--events", str(write_jsonl(tmp_path / "old.jsonl", two_generations())))
    row = next(line for line in done.stdout.splitlines() if line.strip().startswith("#1"))
    # Spawn falls back on the workers' process start (22); the rest of the start is first_step's.
    assert row.split()[3:13] == ["3.00", "2.00", "-", "-", "2.00+", "-", "-", "-", "4.00+", "11.00"]
    assert "+: holds the phases marked - before it" in done.stdout


def test_the_heartbeat_carries_the_workers_phases_and_the_agent_records_them(tmp_path, monkeypatch, agent_context):
    monkeypatch.setenv("EFT_RUN_DIR", str(tmp_path))
    monkeypatch.setattr(worker_phases, "_stamps", {})
    monkeypatch.setattr(worker_phases, "_load", {})
    ctx = agent_context("n0", tmp_path)
    recorder = StopRecorder(ctx.record, tmp_path)
    recorder.stamp(P.RENDEZVOUS)
    recorder.stamp(P.REPLAN)
    recorder.started()
    recorder.stamp(P.SPAWN)
    checkpoint = tmp_path / "iter_0000010"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"x" * 1000)
    (checkpoint / ".metadata").write_bytes(b"y" * 24)
    worker_phases.stamp(P.IMPORTS)
    worker_phases.stamp(P.PROCESS_GROUP)
    writer = ProgressWriter(tmp_path, rank=0, local_rank=0)
    worker_phases.loaded(LoadTier.DISK, checkpoint)
    writer.step(11)  # the first step is written at once: the start's phases are complete
    recorder.stopped("restart")
    (event,) = [e for e in ctx.events.read() if e["kind"] == EventKind.WORKERS_STOPPED]
    assert set(event["phases"]) == {"rendezvous", "replan", "spawn", "imports", "process_group", "load"}
    assert event["phases"]["spawn"] <= event["phases"]["imports"] <= event["phases"]["load"] <= event["first_step"]
    assert (event["loaded_from"], event["loaded_bytes"]) == ("disk", 1024)
    recorder.stamp(P.RENDEZVOUS)  # the next generation carries only its own marks
    recorder.started()
    recorder.stopped("restart")
    last = [e for e in ctx.events.read() if e["kind"] == EventKind.WORKERS_STOPPED][-1]
    assert "rendezvous" in last["phases"] and "replan" not in last["phases"]


def test_a_generation_got_as_far_as_its_furthest_heartbeat(tmp_path, agent_context):
    # A killed rank's heartbeat can lag its last iterations (written at most every
    # STEP_WRITE_INTERVAL) while its peer's has them: eft report's iterations lost then counted
    # one less than the restore's re-done (CI25). Both count from the furthest heartbeat.
    ctx = agent_context("n0", tmp_path)
    recorder = StopRecorder(ctx.record, tmp_path)
    recorder.started()
    ProgressWriter(tmp_path, rank=0, local_rank=0).step(19)
    ProgressWriter(tmp_path, rank=1, local_rank=1).step(20)
    recorder.stopped("restart")
    (event,) = [e for e in ctx.events.read() if e["kind"] == EventKind.WORKERS_STOPPED]
    assert (event["rank"], event["iteration"]) == (0, 20)
