"""Watchdogs: pure decisions, a real checkpoint directory, and a save-and-exit through etcd."""

import json

import pytest

from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.agent.events import EventLog
from elasticft.agent.watchdogs import (
    CheckpointUsage,
    Latch,
    Trip,
    Watchdogs,
    check_disk,
    check_gpu_memory,
    check_memory,
    check_silence,
    checkpoint_usage,
    disk_free,
    newest_checkpoint,
    worker_activity,
)
from elasticft.config import ConfigError, WatchdogConfig
from elasticft.health.sample import GpuSample
from elasticft.worker.progress import ProgressWriter

GB = 10**9
CKPT = CheckpointUsage("iter_0000100", 10 * GB, 1000)


@pytest.mark.parametrize(
    "free_bytes, free_inodes, usage, keep, expected",
    [
        (100 * GB, 10**6, CKPT, 2, []),
        (20 * GB, 2000, CKPT, 2, []),  # exactly enough is enough
        (20 * GB - 1, 10**6, CKPT, 2, ["disk_space"]),
        (15 * GB, 10**6, CKPT, 1, []),
        (100 * GB, 1999, CKPT, 2, ["disk_inodes"]),
        (1 * GB, 10, CKPT, 2, ["disk_space", "disk_inodes"]),
        (1 * GB, None, CKPT, 2, ["disk_space"]),  # a filesystem without inode counts
        (0, 0, None, 2, []),  # no checkpoint yet: nothing learned, no trip
        (30 * GB - 1, 10**6, CKPT, 3, ["disk_space"]),
        (0, 0, CheckpointUsage("iter_0000001", 0, 1), 2, ["disk_inodes"]),
    ],
)
def test_check_disk(free_bytes, free_inodes, usage, keep, expected):
    trips = check_disk("/ckpt", free_bytes, free_inodes, usage, keep)
    assert [t.check for t in trips] == expected
    assert all(t.target == "/ckpt" and not t.save_and_exit and t.reading < t.limit for t in trips)


def test_check_disk_reports_reading_and_limit():
    trip, = check_disk("/ckpt", 5 * GB, None, CKPT, 2)
    assert (trip.reading, trip.limit) == (5 * GB, 20 * GB)
    assert "iter_0000100" in trip.message


@pytest.mark.parametrize(
    "percent, threshold, trips",
    [(50.0, 95.0, False), (94.9, 95.0, False), (95.0, 95.0, True), (99.5, 95.0, True),
     (100.0, 0.0, False), (80.0, 80.0, True)],
)
def test_check_memory(percent, threshold, trips):
    trip = check_memory(percent, threshold)
    assert (trip is not None) == trips
    if trip:
        assert trip.save_and_exit and (trip.check, trip.target, trip.reading, trip.limit) == ("cpu_memory", "host", percent, threshold)


def test_latch_reports_once_until_cleared():
    latch = Latch()
    a = Trip("disk_space", "/a", 1, 2)
    b = Trip("disk_space", "/b", 1, 2)
    checked = {("disk_space", "/a"), ("disk_space", "/b")}
    assert latch.update([a], checked) == [a]
    assert latch.update([a, b], checked) == [b]
    assert latch.update([a, b], checked) == []
    assert latch.update([b], {("disk_space", "/b")}) == []  # /a not checked this round: still active
    assert latch.update([a], checked) == []
    assert latch.update([], checked) == []  # both cleared
    assert latch.update([a, b], checked) == [a, b]


@pytest.mark.parametrize("kwargs", [{"watch_keep": 0}, {"mem_threshold": 101}, {"mem_threshold": -1}, {"watch_interval": 0.1},
                                    {"gpu_mem_headroom": 100}, {"gpu_mem_headroom": -1}, {"silence_limit": -5}])
def test_config_rejects(kwargs):
    with pytest.raises(ConfigError, match="--eft-"):
        WatchdogConfig(**kwargs)


H100_MIB = 81559.0


def gpu(index, used, total=H100_MIB, node="n0"):
    return GpuSample(timestamp=0.0, node=node, gpu=index, memory_used_mib=used, memory_total_mib=total)


@pytest.mark.parametrize(
    "used, total, headroom, trips",
    [
        (78025, H100_MIB, 2.0, False),  # Megatron's usual 95-97 % used: 4.3 % free
        (H100_MIB * 0.98, H100_MIB, 2.0, False),  # exactly the headroom left is enough
        (H100_MIB * 0.981, H100_MIB, 2.0, True),
        (81500, H100_MIB, 2.0, True),
        (81500, H100_MIB, 0.0, False),  # 0: off
        (70000, H100_MIB, 15.0, True),
        (None, H100_MIB, 2.0, False),  # missing readings are not zero
        (81500, None, 2.0, False),
        (0, 0, 2.0, False),  # a total of 0 is a broken reading, not a full GPU
    ],
)
def test_check_gpu_memory(used, total, headroom, trips):
    found = check_gpu_memory([gpu(3, used, total)], headroom)
    assert bool(found) == trips
    if trips:
        trip, = found
        assert (trip.check, trip.target, trip.limit) == ("gpu_memory", "gpu3", headroom)
        assert trip.save and not trip.save_and_exit  # save and go on: memory may well free up
        assert trip.reading == pytest.approx(100 * (total - used) / total, abs=1e-3)
        assert "GPU 3" in trip.message and f"{total - used:.0f} MiB" in trip.message


def test_check_gpu_memory_one_trip_per_full_gpu():
    samples = [gpu(0, 70000), gpu(1, 81400), gpu(2, 81000), gpu(3, 81558)]
    assert [t.target for t in check_gpu_memory(samples, 2.0)] == ["gpu1", "gpu2", "gpu3"]


@pytest.mark.parametrize(
    "last, now, limit, silent",
    [
        (100.0, 150.0, 60.0, False),
        (100.0, 160.0, 60.0, False),  # exactly the limit is not yet silence
        (100.0, 160.5, 60.0, True),
        (100.0, 1000.0, 0.0, False),  # 0: off
        (None, 1000.0, 60.0, False),  # no worker heartbeat yet: nothing to judge
        (200.0, 100.0, 60.0, False),  # a worker clock ahead of ours is not silence
    ],
)
def test_check_silence(last, now, limit, silent):
    trip = check_silence(last, now, limit)
    assert (trip is not None) == silent
    if trip:
        assert (trip.check, trip.target, trip.reading, trip.limit) == ("silence", "workers", now - last, limit)
        assert not trip.save and not trip.save_and_exit  # a silent job cannot save


def test_trip_names_its_requester():
    assert Trip("cpu_memory", "host", 99, 95).requester("n0") == "n0/cpu_memory"
    assert Trip("gpu_memory", "gpu3", 1, 2).requester("n0") == "n0/gpu_memory/gpu3"


def test_enabled_counts_a_check_only_with_its_readings():
    off = WatchdogConfig(mem_threshold=0, gpu_mem_headroom=2, silence_limit=60)
    assert not Watchdogs(off, None, None).enabled  # no sampler, no workers to watch
    assert Watchdogs(off, None, None, read_gpus=list).enabled
    assert Watchdogs(off, None, None, read_activity=lambda: None).enabled
    assert not Watchdogs(WatchdogConfig(mem_threshold=0, gpu_mem_headroom=0), None, None,
                         read_gpus=list, read_activity=lambda: None).enabled


def test_gpu_memory_trip_requests_a_save_once_per_crossing(etcd, run_keys):
    protocol = CheckpointProtocol(etcd, run_keys, "n0")
    events = EventLog(etcd, run_keys, "n0")
    made = []

    def request(trip):
        made.append(protocol.request("watchdog", trip.requester("n0"), exit=trip.save_and_exit))

    rounds = iter([
        [gpu(0, 70000), gpu(1, 70000)],
        [gpu(0, 70000), gpu(1, 81500)],  # GPU 1 nearly full: a save
        [gpu(0, 70000), gpu(1, 81500)],  # still: nothing new
        [gpu(0, 70000)],  # GPU 1 not read this round: still latched
        [gpu(0, 70000), gpu(1, 81500)],
        [gpu(0, 81500), gpu(1, 70000)],  # GPU 1 cleared, GPU 0 full
        [gpu(0, 81500), gpu(1, 81500)],  # GPU 1 full again: another save
    ])
    dogs = Watchdogs(WatchdogConfig(mem_threshold=0, gpu_mem_headroom=2.0), events.record, request,
                     read_gpus=lambda: next(rounds))
    assert dogs.enabled
    assert [[t.target for t in dogs.check_once()] for _ in range(7)] == [[], ["gpu1"], [], [], [], ["gpu0"], ["gpu1"]]
    assert len(made) == 3
    request, created = made[0]
    assert created and (request.reason, request.exit, request.requester) == ("watchdog", False, "n0/gpu_memory/gpu1")
    logged = [e for e in EventLog(etcd, run_keys, "x").read() if e["kind"] == "watchdog"]
    assert [(e["check"], e["target"], e["save"], e["save_and_exit"]) for e in logged] == [
        ("gpu_memory", "gpu1", True, False), ("gpu_memory", "gpu0", True, False), ("gpu_memory", "gpu1", True, False)]


def test_no_save_is_asked_after_the_save_and_exit():
    asked = []
    dogs = Watchdogs(WatchdogConfig(mem_threshold=95, gpu_mem_headroom=2.0), lambda *a, **k: None, asked.append,
                     read_memory=lambda: 99.0, read_gpus=lambda: [gpu(0, 81500)])
    trips = dogs.check_once()
    assert {t.check for t in trips} == {"cpu_memory", "gpu_memory"}  # both recorded
    assert [t.check for t in asked] == ["cpu_memory"]  # the job stops after its save anyway


def test_silence_trips_once_and_clears_with_a_heartbeat():
    now = [1000.0]
    last = [None]
    events = []
    dogs = Watchdogs(WatchdogConfig(mem_threshold=0, silence_limit=60), lambda kind, **f: events.append(f),
                     lambda trip: pytest.fail("a silent job is not asked to save"),
                     read_activity=lambda: last[0], clock=lambda: now[0])
    assert dogs.check_once() == []  # workers starting: no heartbeat yet
    last[0] = 990.0
    assert dogs.check_once() == []
    now[0] = 1051.0
    trip, = dogs.check_once()
    assert (trip.check, trip.reading, trip.limit) == ("silence", 61.0, 60)
    now[0] = 2000.0
    assert dogs.check_once() == []  # reported once
    last[0] = None  # the workers were restarted and have not written yet: no judgement
    assert dogs.check_once() == []
    last[0] = 1990.0
    assert dogs.check_once() == []  # heard from again: cleared
    now[0] = 2100.0
    assert len(dogs.check_once()) == 1 and len(events) == 2


class _Context:
    """The part of torch's PContext that worker_activity reads."""

    def __init__(self, pids, stdouts=None, stderrs=None):
        self._pids, self.stdouts, self.stderrs = pids, stdouts or {}, stderrs or {}

    def pids(self):
        return self._pids


def test_worker_activity_reads_running_workers_heartbeats_and_logs(tmp_path):
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    assert worker_activity(run_dir, None) is None  # no workers
    assert worker_activity(run_dir, _Context({0: os.getpid()})) is None  # no heartbeat yet
    clock = [1000.0]
    ProgressWriter(run_dir, rank=0, local_rank=0, clock=lambda: clock[0])  # writes its first heartbeat
    heartbeat = run_dir / "progress" / "0.json"
    os.utime(heartbeat, (900.0, 900.0))
    assert worker_activity(run_dir, _Context({0: os.getpid()})) == 1000.0
    os.utime(heartbeat, (1005.0, 1005.0))  # the file's mtime when it is newer than the record
    assert worker_activity(run_dir, _Context({0: os.getpid()})) == 1005.0
    # A heartbeat left by a worker of an earlier generation does not count.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    assert worker_activity(run_dir, _Context({0: int(done.stdout)})) is None
    # Redirected logs (--redirects/--tee): a line written later is a sign of life.
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    stdout.write_text("step 10\n")
    stderr.write_text("")
    os.utime(stdout, (1010.0, 1010.0))
    os.utime(stderr, (1020.0, 1020.0))
    context = _Context({0: os.getpid()}, {0: str(stdout)}, {0: str(stderr)})
    assert worker_activity(run_dir, context) == 1020.0
    assert worker_activity(run_dir, _Context({0: os.getpid()}, {0: ""}, {0: os.devnull})) == 1005.0


def test_worker_activity_counts_a_worker_started_through_a_wrapper(tmp_path):
    """``--no-python`` and shell wrappers: the heartbeat's pid is a child of torch's worker."""
    import subprocess
    import sys

    script = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(p.pid, flush=True); p.wait()")
    wrapper = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        python_pid = int(wrapper.stdout.readline())
        writer = ProgressWriter(tmp_path, rank=0, local_rank=0)
        record = json.loads(writer.path.read_text())
        writer.path.write_text(json.dumps({**record, "pid": python_pid}))
        assert worker_activity(tmp_path, _Context({0: wrapper.pid})) == pytest.approx(record["time"], abs=60)
        with subprocess.Popen(["sleep", "60"]) as stranger:
            assert worker_activity(tmp_path, _Context({0: stranger.pid})) is None  # not a worker of this context
            stranger.kill()
    finally:
        subprocess.run(["kill", str(python_pid)], check=False)
        wrapper.wait(10)


def _fake_checkpoint(root, iteration, sizes, complete=False):
    """An iter_* directory whose files have the given apparent sizes (sparse: no disk used)."""
    path = root / f"iter_{iteration:07d}"
    (path / "shards").mkdir(parents=True)
    for i, size in enumerate(sizes):
        with open(path / "shards" / f"{i}.distcp", "wb") as f:
            f.truncate(size)
    if complete:
        (path / ".complete").touch()
    return path


def test_newest_checkpoint_and_its_usage(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    assert newest_checkpoint(tmp_path / "missing") is None
    _fake_checkpoint(tmp_path, 100, [10, 20], complete=True)
    _fake_checkpoint(tmp_path, 200, [5])  # no marker while others have one: being written
    (tmp_path / "iter_bogus").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100")
    assert newest_checkpoint(tmp_path).name == "iter_0000100"
    usage = checkpoint_usage(newest_checkpoint(tmp_path))
    # inodes: the dir, shards/, 2 files, the marker.
    assert usage.inodes == 5
    # At least 10 + 20 bytes; and what the filesystem allocates for such small files.
    files = [p for p in newest_checkpoint(tmp_path).rglob("*") if p.is_file()]
    assert usage.bytes >= max(30, sum(p.stat().st_blocks * 512 for p in files))
    _fake_checkpoint(tmp_path / "plain", 7, [1])
    _fake_checkpoint(tmp_path / "plain", 12, [1])  # Megatron-LM writes no markers: the newest
    assert newest_checkpoint(tmp_path / "plain").name == "iter_0000012"


def test_disk_watchdog_on_a_real_directory(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    free_bytes, free_inodes = disk_free(root)
    events = []
    config = WatchdogConfig(watch_dirs=str(root), watch_keep=2, mem_threshold=0)
    dogs = Watchdogs(config, lambda kind, **f: events.append((kind, f)), lambda trip: pytest.fail("no exit"))
    assert dogs.check_once() == []  # no checkpoint yet
    # A checkpoint of about half the free space: one more fits, two do not.
    _fake_checkpoint(root, 100, [free_bytes // 4, free_bytes // 4 + 4096])
    trips = dogs.check_once()
    assert [t.check for t in trips] == ["disk_space"]
    kind, fields = events[-1]
    assert kind == "watchdog" and fields["check"] == "disk_space" and fields["target"] == str(root)
    assert fields["limit"] >= free_bytes and fields["reading"] <= free_bytes + 10**7
    assert dogs.check_once() == [] and len(events) == 1  # reported once
    # A smaller newest checkpoint: the size is learned again and the trip clears.
    _fake_checkpoint(root, 200, [1000])
    assert dogs.check_once() == [] and len(events) == 1
    assert not dogs._latch.active


def test_disk_watchdog_inodes_and_unreadable_dir(tmp_path):
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 1, [1] * 8)
    readings = {str(root): (10**15, 15)}
    events = []
    config = WatchdogConfig(watch_dirs=f"{root},{tmp_path / 'gone'}", watch_keep=2, mem_threshold=0)

    def read_disk(path):
        if path not in readings:
            raise FileNotFoundError(path)
        return readings[path]

    dogs = Watchdogs(config, lambda kind, **f: events.append(f), lambda trip: None, read_disk=read_disk)
    trip, = dogs.check_once()
    assert (trip.check, trip.reading, trip.limit) == ("disk_inodes", 15, 2 * 10)


def test_memory_trip_requests_one_save_and_exit(etcd, run_keys):
    protocol = CheckpointProtocol(etcd, run_keys, "n0")
    events = EventLog(etcd, run_keys, "n0")
    readings = iter([50.0, 96.0, 97.0, 90.0, 98.0])
    made = []

    def request_exit(trip):
        made.append(protocol.request("watchdog", f"n0/{trip.check}", exit=True))

    dogs = Watchdogs(WatchdogConfig(mem_threshold=95), events.record, request_exit, read_memory=lambda: next(readings))
    assert dogs.check_once() == []
    trip, = dogs.check_once()
    assert trip.save_and_exit
    request = protocol.current()
    assert (request.reason, request.exit, request.requester) == ("watchdog", True, "n0/cpu_memory")
    assert dogs.check_once() == []  # still high: no second event
    dogs.check_once()  # cleared
    assert len(dogs.check_once()) == 1  # high again: another event, but the exit was asked once
    assert len(made) == 1
    log = EventLog(etcd, run_keys, "x").read()
    assert [e["kind"] for e in log] == ["watchdog", "ckpt_request", "watchdog"]
    watchdog = [e for e in log if e["kind"] == "watchdog"][0]
    assert (watchdog["check"], watchdog["reading"], watchdog["limit"]) == ("cpu_memory", 96.0, 95)


def test_thread_starts_and_stops(tmp_path):
    checked = []
    dogs = Watchdogs(WatchdogConfig(mem_threshold=95, watch_interval=3600), lambda *a, **k: None, lambda t: None,
                     read_memory=lambda: checked.append(1) or 10.0)
    dogs.start()
    dogs.stop()  # the stop event wakes the wait: returns at once
    assert not dogs.running
