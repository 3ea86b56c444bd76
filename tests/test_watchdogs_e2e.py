"""Watchdogs in real eft-run jobs (toy_train.py workers, the session's etcd): memory,
a small checkpoint disk, a GPU out of memory headroom, silent workers."""

import json
from pathlib import Path

import pytest

from bench.launch import read_jsonl, wait_for, worker_events
from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.agent.events import EventLog
from elasticft.contract.exit_codes import ExitCode


@pytest.mark.slow
def test_eft_run_memory_watchdog_saves_exits_and_notifies(tmp_path, eft_job):
    """End to end: a memory limit the host is always above makes the job save, stop with the
    requeue status (fresh processes may well fit) and say so."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    sinks = json.dumps([f"file:{tmp_path / 'notify.jsonl'}", f"command:cat >> {tmp_path / 'stdin.jsonl'}"])
    job = eft_job("toy_train.py", out, "--ckpt", ckpt, "--iters", "100000", "--save-interval", "0", nproc=2,
                  eft_flags=["--eft-mem-threshold", "0.01", "--eft-watch-interval", "0.5", "--eft-watch-dirs", ckpt,
                             "--eft-notify", sinks])
    assert job.wait(90) == ExitCode.REQUEUE, job.output()
    notified = read_jsonl(tmp_path / "notify.jsonl")
    kinds = [e["kind"] for e in notified]
    assert kinds[0] == "watchdog" and notified[0]["check"] == "cpu_memory"
    saved, = [e for e in notified if e["kind"] == "ckpt_saved"]
    assert saved["exit"] and (ckpt / f"iter_{saved['iteration']:07d}").is_dir()
    # Both ranks saved because of the watchdog, at that iteration, and stopped there.
    saves, exits = worker_events(out, "save"), worker_events(out, "exit")
    assert [(s["reason"], s["iteration"]) for s in saves] == [("watchdog", saved["iteration"])] * 2
    assert sorted(e["rank"] for e in exits) == [0, 1] and {e["iteration"] for e in exits} == {saved["iteration"]}
    assert "job_finished" in kinds
    assert read_jsonl(tmp_path / "stdin.jsonl") == notified


# -- end to end: eft-run, toy_train, real etcd -----------------------------------------

CKPT_BYTES = 2**20  # each rank's share: 2 ranks make a checkpoint of about 2 MiB
SMALL_DISK = 7 * 2**20  # room for three such checkpoints and a half


@pytest.fixture
def start_toy(eft_job, tmp_path):
    """``start_toy(*eft_flags, toy_flags=..., launcher=...)``: toy_train.py on 2 ranks, watched
    every 0.5 s, notifications in tmp_path/notify.jsonl, worker events in tmp_path/out."""
    (tmp_path / "out").mkdir()

    def start(*eft_flags, toy_flags=(), launcher=None):
        return eft_job("toy_train.py", tmp_path / "out", "--iters", "100000", *toy_flags, nproc=2, launcher=launcher,
                       eft_flags=["--eft-watch-interval", "0.5", "--eft-mem-threshold", "0",
                                  "--eft-notify", f"file:{tmp_path / 'notify.jsonl'}", *eft_flags])

    return start


def _notified(tmp_path, check):
    return [e for e in read_jsonl(tmp_path / "notify.jsonl") if e["kind"] == "watchdog" and e["check"] == check]


def _wait_started(out, job):
    """Until both ranks of a toy_train run have started (failing at once if the job ends)."""
    wait_for(lambda: len(worker_events(out, "resume")) == 2 or job.proc.poll() is not None, 120, "both ranks to start")
    assert job.proc.poll() is None, job.output()


def _free_bytes(statvfs, path):
    st = statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture(params=["tmpfs", "faked statvfs"])
def small_disk(request, tmp_path):
    """(checkpoint dir on a 7 MiB disk, the launcher to run (None: eft-run), the statvfs that sees that disk).

    A real tmpfs where this machine lets us mount one; otherwise (and always, as the
    second variant) eft-run under tests/small_disk.py, which fakes ``os.statvfs`` in
    the agent's process.
    """
    import os
    import shutil
    import subprocess
    import sys

    from tests.small_disk import small_disk as fake_statvfs

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if request.param == "faked statvfs":
        wrapper = Path(__file__).with_name("small_disk.py")
        yield ckpt, [sys.executable, str(wrapper), str(SMALL_DISK), str(ckpt)], fake_statvfs(SMALL_DISK, str(ckpt))
        return
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "eft-test", str(ckpt)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield ckpt, None, os.statvfs
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], capture_output=True, check=False)


@pytest.mark.slow
def test_eft_run_disk_watchdog_trips_while_one_more_checkpoint_still_fits(small_disk, tmp_path, start_toy, etcd,
                                                                          run_keys):
    """Checkpoints that pile up on a small disk: the watchdog trips while the next save
    still fits, so the job can still save and stop cleanly; the save after would fail."""
    import errno

    out = tmp_path / "out"
    ckpt, launcher, statvfs = small_disk
    job = start_toy("--eft-watch-dirs", ckpt, "--eft-watch-keep", "2", launcher=launcher,
                    toy_flags=["--ckpt", ckpt, "--keep", "100", "--ckpt-bytes", CKPT_BYTES])
    _wait_started(out, job)
    protocol = CheckpointProtocol(etcd, run_keys, "test")

    def save(n, exit=False):
        request, _ = protocol.request("manual", "test", exit=exit)
        wait_for(lambda: len(worker_events(out, "save")) == 2 * n or job.proc.poll() is not None,
                 60, f"save {n} on both ranks")
        assert job.proc.poll() is None or exit, job.output()
        wait_for(lambda: not protocol.is_open(request), 30, f"save {n} to be acknowledged")

    save(1)  # about 5 MiB free: room for two more
    save(2)  # about 3 MiB free: room for one more, not two
    trip, = wait_for(lambda: _notified(tmp_path, "disk_space"), 30, "the disk watchdog's notification")
    # The second save began when its first rank decided it; a rank's half written before the
    # other rank decides can already trip the watchdog (both ranks fill the one disk).
    second_began = min(e["decided"] for e in worker_events(out, "save")[2:4])
    assert trip["target"] == str(ckpt) and trip["time"] > second_began  # not after the first save
    one_checkpoint = trip["limit"] / 2  # learned from the newest checkpoint
    assert one_checkpoint >= 2 * CKPT_BYTES
    assert one_checkpoint <= trip["reading"] < 2 * one_checkpoint, trip  # tripped while one more still fits
    assert not worker_events(out, "exit") and job.proc.poll() is None  # no save failed: training goes on

    # The operator's answer to the notification: save and stop. It fits.
    save(3, exit=True)
    assert job.wait(60) == 0, job.output()
    assert len(worker_events(out, "exit")) == 2
    assert sorted(p.name for p in ckpt.glob("iter_*/.complete")) == [".complete"] * 3
    # And the save after that would not have fitted.
    assert _free_bytes(statvfs, ckpt) < one_checkpoint
    if statvfs is __import__("os").statvfs:  # the real small disk: show it
        with pytest.raises(OSError) as full:
            (ckpt / "next-checkpoint").write_bytes(bytes(int(one_checkpoint)))
        assert full.value.errno == errno.ENOSPC
    assert len(_notified(tmp_path, "disk_space")) == 1


def _full_gpu_trace(path, gpus=2, full_gpu=1, rounds=5):
    """An eft CSV trace (docs/health.md): a healthy node, except that one GPU's memory is
    nearly all used (81500 of 81559 MiB: 0.07 % free)."""
    lines = ["timestamp,node,gpu,temperature_c,memory_used_mib,memory_total_mib,power_w,power_limit_w,utilization_pct"]
    for r in range(rounds):
        for g in range(gpus):
            used = 81500 if g == full_gpu else 70000
            lines.append(f"{1714564800 + r},node-a,{g},60,{used},81559,550,700,98")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_eft_run_gpu_memory_watchdog_saves_and_training_goes_on(tmp_path, start_toy, etcd, run_keys):
    """Replayed telemetry of a GPU out of memory headroom: a save (reason watchdog, no exit)."""
    out = tmp_path / "out"
    trace = _full_gpu_trace(tmp_path / "full_gpu.csv")
    stop = tmp_path / "stop"
    job = start_toy("--eft-health-source", f"replay:{trace}", "--eft-health-interval", "0.5",
                    "--eft-gpu-mem-headroom", "2", "--eft-kill-switch", stop, toy_flags=["--ckpt", tmp_path / "ckpt"])
    _wait_started(out, job)
    saves = wait_for(lambda: len(worker_events(out, "save")) == 2 and worker_events(out, "save"), 60,
                     "the watchdog's save on both ranks")
    assert {s["reason"] for s in saves} == {"watchdog"} and len({s["iteration"] for s in saves}) == 1
    request = CheckpointProtocol(etcd, run_keys, "test").current()
    assert (request.reason, request.exit) == ("watchdog", False)
    assert request.requester.endswith("/gpu_memory/gpu1") and request.id == saves[0]["request_id"]
    logged = [e for e in EventLog(etcd, run_keys, "test").read() if e["kind"] == "watchdog"]
    assert [(e["check"], e["target"], e["save"], e["save_and_exit"]) for e in logged] == [
        ("gpu_memory", "gpu1", True, False)]  # GPU 0 has room; GPU 1 trips once while it stays full
    assert logged[0]["reading"] < 2 and _notified(tmp_path, "gpu_memory")

    stop.touch()  # training went on after the save: it stops now, later, with a save of its own
    assert job.wait(60) == 0, job.output()
    exits = worker_events(out, "exit")
    assert len(exits) == 2 and exits[0]["iteration"] > saves[0]["iteration"]


@pytest.mark.slow
def test_eft_run_silence_watchdog_reports_hung_workers(tmp_path, start_toy, etcd, run_keys):
    """A rank that hangs holds every rank in the next collective: no heartbeat, no log line."""
    out = tmp_path / "out"
    job = start_toy("--eft-silence-limit", "3", "--eft-inject", "rank_hung:1@20", "--redirects", "3",
                    "--log-dir", tmp_path / "logs", toy_flags=["--ckpt", tmp_path / "ckpt"])
    _wait_started(out, job)
    trip, = wait_for(lambda: _notified(tmp_path, "silence"), 60, "the silence watchdog")
    assert trip["target"] == "workers" and trip["limit"] == 3 and trip["reading"] > 3
    # Not at start-up: only after 20 iterations (at least 1 s) and then 3 s of silence.
    assert trip["time"] >= max(e["time"] for e in worker_events(out, "resume")) + 20 * 0.05 + 3
    assert not trip["save"] and not trip["save_and_exit"]
    assert CheckpointProtocol(etcd, run_keys, "test").current() is None  # a silent job is not asked to save
    assert job.proc.poll() is None  # the watchdog reports; it does not kill
    # The worker logs were redirected to files, which the watchdog watched as well.
    assert len(list((tmp_path / "logs").rglob("stderr.log"))) == 2
