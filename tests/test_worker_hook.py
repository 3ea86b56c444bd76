"""elasticft.worker.Hook in real 4-rank gloo jobs; the test plays the node agent.

Unless a test says otherwise every rank has a run directory of its own, as if each rank
were a node, so a request written to one rank's directory is seen by that rank alone.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from bench.launch import wait_for
from elasticft.worker import Hook
from elasticft.worker.gap import gap_filter
from elasticft.worker.relay import RequestFile
from tests.gloo_job import (
    finish,
    job,
    run,
    start,
    take_outbox,
    wait_progress,
    write_request,
)


def saved_iterations(results):
    return [[s["iteration"] for s in r["saves"]] for r in results]


def test_a_request_seen_by_one_rank_makes_every_rank_save_the_same_iteration(tmp_path):
    spec = job(tmp_path, last=12)
    spec.events[(5, 2)] = [("request", spec.run_dir(2), {"id": "req-1"})]
    # Rank 0's agent relays the same request late, rank 1's twice: no second save.
    spec.events[(8, 0)] = [("request", spec.run_dir(0), {"id": "req-1"})]
    spec.events[(9, 1)] = [("request", spec.run_dir(1), {"id": "req-1"})]
    spec.events[(10, 1)] = [("request", spec.run_dir(1), {"id": "req-1"})]

    results = run(spec)

    assert saved_iterations(results) == [[5]] * 4
    assert [r["exit"] for r in results] == [None] * 4
    assert [r["saves"][0]["request_id"] for r in results] == [None, None, "req-1", None]
    assert {r["saves"][0]["reason"] for r in results} == {"manual"}
    # Only rank 0 writes to its agent; it did not see the request, so the agent fills the id.
    ack, = take_outbox(spec.run_dir(0))
    assert ack == {"type": "ack", "request_id": None, "iteration": 5,
                   "path": str(tmp_path / "ckpt" / "iter_0000005"), "seconds": ack["seconds"], "exit": False}
    assert ack["seconds"] >= 0
    assert [take_outbox(spec.run_dir(r)) for r in (1, 2, 3)] == [[], [], []]
    assert sorted(os.listdir(ack["path"])) == [".complete", "rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]


def test_a_request_is_acted_on_once_and_a_stop_request_ends_the_job(tmp_path):
    spec = job(tmp_path, ranks=4, shared_run_dir=True, until_exit=True)
    run_dir = spec.run_dir(0)
    context = start(spec)
    try:
        wait_progress(spec, 2)
        write_request(run_dir, "save-1", reason="manual")
        ack = wait_for(lambda: take_outbox(run_dir), 20, "the ack of save-1")
        assert [(m["type"], m["request_id"], m["exit"]) for m in ack] == [("ack", "save-1", False)]
        # The agent rewrites the same request (say it restarted): the workers do not save again.
        write_request(run_dir, "save-1", reason="manual")
        wait_progress(spec, ack[0]["iteration"] + 5)
        assert take_outbox(run_dir) == []
        write_request(run_dir, "stop-1", reason="manual", exit=True)
        finish(context)
    finally:
        for process in context.processes:
            process.kill()
    results = [spec.result(r) for r in range(4)]
    first, last = ack[0]["iteration"], results[0]["exit"]
    assert saved_iterations(results) == [[first, last]] * 4
    assert [r["exit"] for r in results] == [last] * 4
    assert [s["request_id"] for s in results[0]["saves"]] == ["save-1", "stop-1"]
    stop_ack, = take_outbox(run_dir)
    assert (stop_ack["request_id"], stop_ack["iteration"], stop_ack["exit"]) == ("stop-1", last, True)


def test_gap_rule_drops_a_risk_request_just_after_a_save_and_reports_it_once(tmp_path):
    # Resumed from iteration 90, saves every 100: a risk request needs 25 iterations since.
    spec = job(tmp_path, first=91, last=160, hook_args={"save_interval": 100, "last_saved_iteration": 90})
    everyone = range(spec.ranks)
    spec.events[(100, 2)] = [("request", spec.run_dir(2), {"id": "risk-1", "reason": "risk", "risk": 0.97})]
    # Rank 0 hears of risk-1 only when the gap has passed, twice: the job already dropped it.
    spec.events[(118, 0)] = [("request", spec.run_dir(0), {"id": "risk-1", "reason": "risk", "risk": 0.97})]
    spec.events[(119, 0)] = [("request", spec.run_dir(0), {"id": "risk-1", "reason": "risk", "risk": 0.97})]
    for r in everyone:
        spec.events[(120, r)] = [("request", spec.run_dir(r), {"id": "manual-1", "reason": "manual"})]
        spec.events[(130, r)] = [("request", spec.run_dir(r), {"id": "risk-2", "reason": "risk", "risk": 0.99})]
        spec.events[(150, r)] = [("request", spec.run_dir(r), {"id": "risk-3", "reason": "risk", "risk": 0.99})]

    results = run(spec)

    assert saved_iterations(results) == [[120, 150]] * 4
    assert [s["reason"] for s in results[0]["saves"]] == ["manual", "risk"]
    messages = take_outbox(spec.run_dir(0))
    assert [(m["type"], m["request_id"], m["iteration"]) for m in messages] == [
        ("filtered", "risk-1", 100), ("ack", "manual-1", 120), ("filtered", "risk-2", 130), ("ack", "risk-3", 150)]
    assert [m.get("last_saved_iteration") for m in messages if m["type"] == "filtered"] == [90, 120]
    assert "10 iteration(s) since the save at iteration 90" in messages[0]["why"]
    assert "0.25 x save interval 100 = 25" in messages[0]["why"]


def test_gap_rule_boundaries():
    assert gap_filter("risk", 125, 100, 100, 0.25) is None  # exactly the gap
    assert gap_filter("risk", 124, 100, 100, 0.25) is not None
    assert gap_filter("risk", 101, 100, 100, 0.25, exit=True) is None  # a stop always runs
    for reason in ("manual", "signal", "watchdog"):
        assert gap_filter(reason, 101, 100, 100, 0.25) is None
    assert gap_filter("risk", 101, None, 100, 0.25) is None  # nothing saved yet
    assert gap_filter("risk", 101, 100, None, 0.25) is None  # no --save-interval known
    assert gap_filter("risk", 101, 100, 100, 0.0) is None


def test_save_switch_saves_once_continues_and_is_removed(tmp_path):
    switch = tmp_path / "save-now"
    spec = job(tmp_path, last=10)
    for r in range(spec.ranks):
        spec.env[r]["EFT_SAVE_SWITCH"] = str(switch)
    spec.events[(3, 0)] = [("touch", switch)]

    results = run(spec)

    assert saved_iterations(results) == [[3]] * 4
    assert {r["saves"][0]["reason"] for r in results} == {"save_switch"}
    assert [r["exit"] for r in results] == [None] * 4
    assert not switch.exists()
    ack, = take_outbox(spec.run_dir(0))
    assert (ack["iteration"], ack["exit"], ack["request_id"]) == (3, False, None)


def test_kill_switch_saves_and_exits_on_every_rank_and_stays(tmp_path):
    switch = tmp_path / "kill-now"
    spec = job(tmp_path, last=20)
    for r in range(spec.ranks):
        spec.env[r]["EFT_KILL_SWITCH"] = str(switch)
    spec.events[(4, 0)] = [("touch", switch)]

    results = run(spec)

    assert saved_iterations(results) == [[4]] * 4
    assert [r["exit"] for r in results] == [4] * 4
    assert {r["saves"][0]["reason"] for r in results} == {"kill_switch"}
    assert switch.exists()  # it keeps the agent from starting workers again
    ack, = take_outbox(spec.run_dir(0))
    assert (ack["iteration"], ack["exit"]) == (4, True)


def test_kill_switch_present_at_start_exits_at_once(tmp_path):
    switch = tmp_path / "kill-now"
    switch.touch()
    spec = job(tmp_path, last=20)
    for r in range(spec.ranks):
        spec.env[r]["EFT_KILL_SWITCH"] = str(switch)

    results = run(spec)

    assert [r["system_exit"] for r in results] == [0] * 4
    assert saved_iterations(results) == [[]] * 4
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("votes_far_apart", [False, True], ids=["every-iteration", "at-saves-only"])
def test_sigterm_to_one_rank_makes_every_rank_save_and_exit_together(tmp_path, votes_far_apart):
    spec = job(tmp_path, until_exit=True)
    if votes_far_apart:  # a tiny --eft-vote-budget: the ranks vote at the loop's saves (every 20) only
        spec = job(tmp_path, until_exit=True, hook_args={"save_interval": 20}, step_seconds=0.01)
        for env in spec.env.values():
            env["EFT_VOTE_BUDGET"] = "1e-9"
    context = start(spec)
    try:
        wait_progress(spec, 3)
        os.kill(context.processes[2].pid, signal.SIGTERM)
        finish(context)
    finally:
        for process in context.processes:
            process.kill()
    assert [p.exitcode for p in context.processes] == [0] * 4  # saved and left; not killed
    results = [spec.result(r) for r in range(4)]
    last = results[0]["exit"]
    assert last is not None and last > 3
    assert saved_iterations(results) == [[last]] * 4
    assert [r["exit"] for r in results] == [last] * 4
    assert {r["saves"][0]["reason"] for r in results} == {"signal"}
    ack, = take_outbox(spec.run_dir(0))
    assert (ack["iteration"], ack["exit"]) == (last, True)


def test_exit_duration_saves_and_exits_once_the_time_is_up(tmp_path):
    start_time = time.time()
    minutes = 0.04  # 2.4 s after the "job" started
    spec = job(tmp_path, until_exit=True)
    for r in range(spec.ranks):
        spec.env[r].update(EFT_START_TIME=str(start_time), EFT_EXIT_DURATION_MINS=str(minutes))

    results = run(spec)

    last = results[0]["exit"]
    assert last is not None and last > 0
    assert [r["exit"] for r in results] == [last] * 4
    assert saved_iterations(results) == [[last]] * 4
    assert {r["saves"][0]["reason"] for r in results} == {"exit_duration"}
    assert min(r["saves"][0]["time"] for r in results) >= start_time + minutes * 60


def test_without_run_dir_the_hook_is_inert(tmp_path, monkeypatch):
    """Plain torchrun: no action, no files, and SIGTERM keeps its meaning."""
    for name in [n for n in os.environ if n.startswith("EFT_")]:
        monkeypatch.delenv(name)
    switch = tmp_path / "kill-now"
    switch.touch()
    monkeypatch.setenv("EFT_KILL_SWITCH", str(switch))
    monkeypatch.setenv("EFT_EXIT_DURATION_MINS", "0.0001")
    monkeypatch.setenv("EFT_START_TIME", "0")
    before = signal.getsignal(signal.SIGTERM)

    hook = Hook(save_interval=10)  # no process group needed, no SystemExit

    assert signal.getsignal(signal.SIGTERM) is before
    actions = [hook.step(i) for i in range(5)]
    assert all(not a.save and not a.exit for a in actions)
    hook.saved(4, tmp_path / "ckpt", 1.0)
    assert hook.last_saved_iteration is None
    assert sorted(os.listdir(tmp_path)) == ["kill-now"]


def test_save_interval_is_read_from_megatron_arguments(monkeypatch):
    monkeypatch.delenv("EFT_RUN_DIR", raising=False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--save-interval", "500", "--save-interval=1000"])
    assert Hook().save_interval == 1000
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--save", "/ckpt"])
    assert Hook().save_interval is None
    assert Hook(save_interval=7).save_interval == 7


def test_request_file_sees_a_new_request_of_the_same_size_at_once(tmp_path, caplog):
    watched = RequestFile(tmp_path)
    assert watched.poll() is None
    write_request(tmp_path, "req-a")
    assert watched.poll().id == "req-a"
    assert watched.poll() is None  # unchanged: one stat, no read
    write_request(tmp_path, "req-b")  # same size, most likely the same mtime tick
    assert watched.poll().id == "req-b"
    (tmp_path / "request.json").write_text('{"id": ')
    assert watched.poll() is None
    assert "ignoring" in caplog.text and "request.json" in caplog.text
    (tmp_path / "request.json").write_text(json.dumps({"id": "req-c", "reason": "watchdog", "exit": True}))
    request = watched.poll()
    assert (request.id, request.reason, request.exit, request.risk) == ("req-c", "watchdog", True, None)


@pytest.mark.parametrize("value", ["SIGNOPE", "TERM,BOGUS"])
def test_bad_exit_signals_name_the_variable(tmp_path, monkeypatch, value):
    from elasticft.config import ConfigError
    monkeypatch.setenv("EFT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("EFT_EXIT_SIGNALS", value)
    with pytest.raises(ConfigError, match="exit-signals"):
        Hook()
