"""eft report: a run's wall time split from its event log, the CLI over etcd and files, bad input.

The hand-made log below is one a two-node job would write: node n1 dies after iteration 10,
the survivor resumes at iteration 7 on half the GPUs and finishes at 20. Its breakdown is
worked out by hand in the comments, so the accounting is checked number by number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticft.agent.events import EventLog
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.goodput.breakdown import CATEGORIES, ReportError, breakdown

ROOT = Path(__file__).resolve().parents[1]


def ev(kind: EventKind, time: float, source: str = "n0", **fields) -> dict:
    return {"kind": str(kind), "time": time, "source": source, **fields}


def two_generations() -> list[dict]:
    return [
        ev(EventKind.NODE_JOINED, 0.0, "n0", host="a", gpus=2),
        ev(EventKind.NODE_JOINED, 0.0, "n1", host="b", gpus=2),
        ev(EventKind.LAYOUT, 1.0, tp=1, pp=1, dp=4, used=4, world_size=4, spare=[]),
        ev(EventKind.CKPT_SAVED, 12.0, request_id=None, iteration=7, seconds=1.0, path="p7"),
        ev(EventKind.NODE_LOST, 18.0, nodes=["n1"], restarts=1),
        ev(EventKind.RESTART, 18.0, reason="membership", remaining_restarts=3, max_restarts=3),
        # Generation 0: started 2, setup 3 s (first step at 5), 9 steps of 1 s, a 1 s save: 15.
        ev(EventKind.WORKERS_STOPPED, 20.0, why="restart", rank=0, iteration=10, first_iteration=1, started=2.0,
           first_step=5.0, last_beat=15.0, steps=9, totals={"setup": 3.0, "step": 9.0, "checkpointing": 1.0},
           stalls={}),
        ev(EventKind.LAYOUT, 21.0, tp=1, pp=1, dp=2, used=2, world_size=2, spare=[]),
        ev(EventKind.CKPT_RESTORED, 26.0, iteration=7, path="p7", reached=10, redone=3),
        ev(EventKind.CKPT_SAVED, 37.0, request_id=None, iteration=20, seconds=0.0, path="p20"),
        # Generation 1: started 22, setup 4 s (iteration 8 inside it), 12 steps of 1 s: 38.
        ev(EventKind.WORKERS_STOPPED, 43.0, why="finished", rank=0, iteration=20, first_iteration=8, started=22.0,
           first_step=26.0, last_beat=38.0, steps=12, totals={"setup": 4.0, "step": 12.0}, stalls={}),
        ev(EventKind.JOB_FINISHED, 44.0),
    ]


def test_a_loss_a_spare_filled_is_named_a_swap():
    """n2 waited as a spare and took n1's place: the failure says so (eft report's restart line)."""
    events = two_generations()
    events[2:2] = [ev(EventKind.NODE_JOINED, 0.0, "n2", host="c", gpus=2), ev(EventKind.SPARE_WAITING, 1.0, "n2", round=1)]
    events.insert(next(i for i, e in enumerate(events) if e["kind"] == EventKind.RESTART) + 1,
                  ev(EventKind.SPARE_PROMOTED, 19.0, "n2", round=1))
    (failure,) = breakdown(events).failures
    assert failure.cause == "node lost: n1 (spare n2 took its place)"


def test_the_breakdown_adds_up_to_paid_time_category_by_category():
    report = breakdown(list(reversed(two_generations())))  # any order
    assert (report.wall, report.gpus) == (44.0, 4)
    expected = {
        "productive": 9 * 4 + (12 - 2) * 2,  # iterations 8-10 ran twice: 2 steps, and the one inside setup
        "rework": (2 + 1) * 2,
        "save_disk": 1 * 4,
        "rendezvous_load": 2 * 4 + 3 * 4 + (4 - 1) * 2,  # to the first start, then each setup
        "detection": (18 - 15) * 4,  # last heartbeat -> node_lost
        "restart": (20 - 18) * 4 + (22 - 20) * 4,  # stopping, then the new round
        "shutdown": (43 - 38) * 2 + (44 - 43) * 4,
        "reduced_capacity": (43 - 22) * 2,  # n1's GPUs, gone
    }
    assert report.seconds == pytest.approx({name: float(expected.get(name, 0)) for name in CATEGORIES})
    assert sum(report.seconds.values()) == pytest.approx(report.paid)
    assert report.goodput == pytest.approx(56 / 176)
    (failure,) = report.failures
    assert failure.cause == "node lost: n1" and failure.iterations_lost == 3 and report.iterations_redone == 3
    assert (failure.detection_seconds, failure.downtime_seconds) == (3.0, 26.0 - 15.0)
    costs = report.costs
    assert costs.iteration_seconds == 1.0 and costs.save_seconds == 0.5 and costs.save_interval_seconds == 13.0
    assert (costs.detection_seconds, costs.restart_seconds, costs.load_seconds) == (3.0, 4.0, 4.0)


def test_a_process_start_read_early_is_not_counted_twice():
    events = two_generations()
    events[-2]["started"] = 19.5  # psutil's create time can read before the previous stop (20)
    events[-2]["totals"]["setup"] = 6.5
    report = breakdown(events)
    assert sum(report.seconds.values()) == pytest.approx(report.paid)
    assert report.generations[1].started == 20.0


def test_logs_that_cannot_be_reported_say_why():
    with pytest.raises(ReportError, match="node_joined"):
        breakdown([ev(EventKind.LAYOUT, 1.0)])
    with pytest.raises(ReportError, match="workers_stopped"):
        breakdown([e for e in two_generations() if e["kind"] != EventKind.WORKERS_STOPPED])


def eft_report(*args: str, runs_dir: Path | None = None) -> subprocess.CompletedProcess:
    """``eft report``; ``runs_dir``: where it looks for a run of this host when none is named."""
    env = {**os.environ, "EFT_RUNS_DIR": str(runs_dir)} if runs_dir else None
    return subprocess.run([sys.executable, "-m", "launcher.cli", "report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=env)


def write_jsonl(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_report_from_a_file_prints_the_table_and_draws_the_timeline(tmp_path):
    log = write_jsonl(tmp_path / "events.jsonl", two_generations())
    done = eft_report("--events", str(log), "--plot", str(tmp_path / "run.html"))
    assert done.returncode == 0, done.stderr
    assert "goodput 31.8%" in done.stdout and "node lost: n1" in done.stdout
    assert "Young-Daly for an MTBF of 44 s (observed)" in done.stdout
    picture = (tmp_path / "run.html").read_text()
    assert "<svg" in picture and "n0: training, iterations 8-20" in picture and "n1: lost" in picture
    # n1 was killed outright: its last generation is drawn from what the survivors saw (it was in
    # the round and stepping until the failure), not as idle time.
    assert "n1: training, iterations 1-10" in picture and "n1: no workers of its own" in picture
    assert picture.count("n1: training") == 1 and "n1: restarting" not in picture
    as_json = json.loads(eft_report("--events", str(log), "--json").stdout)
    assert as_json["goodput"] == pytest.approx(56 / 176) and as_json["iterations_redone"] == 3
    assert as_json["costs"]["restart_seconds"] == 4.0  # what eft simulate --costs reads


def test_report_reads_a_live_run_from_etcd(etcd, etcd_server):
    keys = RunKeys("report-live")
    for index, event in enumerate(two_generations()):  # as EventLog.record names them, at the events' times
        etcd.put(keys.event(f"{int(event['time'] * 1e9):020d}-{index:06d}"), json.dumps(event))
    assert len(EventLog(etcd, keys, "reader").read()) == len(two_generations())
    done = eft_report("--endpoint", etcd_server.endpoint, "--run-id", "report-live", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["goodput"] == pytest.approx(56 / 176)
    unknown = eft_report("--endpoint", etcd_server.endpoint, "--run-id", "no-such-run")
    assert unknown.returncode == 2 and unknown.stderr.strip().count("\n") == 0
    assert "no events under /eft/no-such-run" in unknown.stderr


def test_a_run_without_failures_asks_for_an_mtbf(tmp_path):
    events = [e for e in two_generations()[:7] if e["kind"] not in (EventKind.NODE_LOST, EventKind.RESTART)]
    events[-1] = {**events[-1], "why": "finished"}
    log = write_jsonl(tmp_path / "calm.jsonl", [*events, ev(EventKind.JOB_FINISHED, 21.0)])
    done = eft_report("--events", str(log))
    assert done.returncode == 0 and "no failures" in done.stdout and "pass --mtbf-hours" in done.stdout
    done = eft_report("--events", str(log), "--mtbf-hours", "2")
    assert "Young-Daly for an MTBF of 7200 s (--mtbf-hours)" in done.stdout


@pytest.mark.parametrize("args, says", [
    (["--events", "missing.jsonl"], "--events missing.jsonl: cannot read it"),
    (["--events", "{bad}"], "line 2 is not JSON"),
    (["--events", "{empty}"], "no events in it"),
    (["--events", "{good}", "--mtbf-hours", "-1"], "--mtbf-hours must be > 0"),
    (["--events", "{good}", "--plot", "x.png"], "PNG needs matplotlib"),
    (["--events", "{nojoin}"], "not the event log of an eft-run job"),
    ([], "give --endpoint and --run-id (the launch line's --rdzv-endpoint and --rdzv-id); or give --events FILE"),
    (["--endpoint", "127.0.0.1:1", "--run-id", "r"], "unreachable"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    files = {"bad": "{\"kind\": \"x\", \"time\": 1}\nnot json\n", "empty": "\n",
             "good": "".join(json.dumps(e) + "\n" for e in two_generations()),
             "nojoin": json.dumps(ev(EventKind.LAYOUT, 1.0)) + "\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = eft_report(*[a.format(**{k: str(tmp_path / k) for k in files}) for a in args], runs_dir=tmp_path / "runs")
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr


def test_a_workers_start_is_read_on_the_wall_clock_it_was_spawned_at():
    # psutil's create_time drifts from the wall clock with the boot time (0.8 s on a test VM):
    # a restart quicker than that seemed to start before its predecessor's last heartbeat
    before = time.time()
    done = subprocess.run([sys.executable, "-c", "from elasticft.worker.progress import process_started_at\n"
                           "print(process_started_at())"], capture_output=True, text=True, check=True)
    after = time.time()
    assert before - 0.05 <= float(done.stdout) <= after
