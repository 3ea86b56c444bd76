"""Watchdogs: pure decisions, a real checkpoint directory, and a save-and-exit through etcd."""

import json

import pytest

from elasticft.checkpoint import CheckpointProtocol
from elasticft.config import ConfigError, WatchdogConfig
from elasticft.events import EventLog
from elasticft.store import RunKeys
from elasticft.watchdogs import (
    CheckpointUsage,
    Latch,
    Trip,
    Watchdogs,
    check_disk,
    check_memory,
    checkpoint_usage,
    disk_free,
    newest_checkpoint,
)

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


@pytest.mark.parametrize("kwargs", [{"watch_keep": 0}, {"mem_threshold": 101}, {"mem_threshold": -1}, {"watch_interval": 0.1}])
def test_config_rejects(kwargs):
    with pytest.raises(ConfigError, match="--eft-"):
        WatchdogConfig(**kwargs)


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
    # 10 + 20 bytes + the marker; inodes: the dir, shards/, 2 files, the marker.
    assert (usage.bytes, usage.inodes) == (30, 5)
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


def test_memory_trip_requests_one_save_and_exit(etcd):
    keys = RunKeys("watchdog-mem")
    protocol = CheckpointProtocol(etcd, keys, "n0")
    events = EventLog(etcd, keys, "n0")
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
    log = EventLog(etcd, keys, "x").read()
    assert [e["kind"] for e in log] == ["watchdog", "ckpt_request", "watchdog"]
    watchdog = [e for e in log if e["kind"] == "watchdog"][0]
    assert (watchdog["check"], watchdog["reading"], watchdog["limit"]) == ("cpu_memory", 96.0, 95)


def test_thread_starts_and_stops(tmp_path):
    checked = []
    dogs = Watchdogs(WatchdogConfig(mem_threshold=95, watch_interval=3600), lambda *a, **k: None, lambda t: None,
                     read_memory=lambda: checked.append(1) or 10.0)
    dogs.start()
    dogs.stop()  # the stop event wakes the wait: returns at once
    assert not dogs._thread.is_alive()


@pytest.mark.slow
def test_eft_run_memory_watchdog_saves_exits_and_notifies(tmp_path):
    """End to end: a memory limit the host is always above makes the job save, exit 0 and say so."""
    from tests.launch import WORKERS, Launched, eft_run

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    sinks = json.dumps([f"file:{tmp_path / 'notify.jsonl'}", f"command:cat >> {tmp_path / 'stdin.jsonl'}"])
    job = Launched([*eft_run(), "--standalone", "--nproc-per-node", "2", "--eft-mem-threshold", "0.01",
                    "--eft-watch-interval", "0.5", "--eft-watch-dirs", str(ckpt), "--eft-notify", sinks,
                    str(WORKERS / "toy_train.py"), str(out), "--ckpt", str(ckpt), "--iters", "100000",
                    "--save-interval", "0"], tmp_path / "eft-run.log")
    try:
        assert job.wait(90) == 0, job.output()
    finally:
        job.stop()
    notified = [json.loads(line) for line in (tmp_path / "notify.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in notified]
    assert kinds[0] == "watchdog" and notified[0]["check"] == "cpu_memory"
    saved, = [e for e in notified if e["kind"] == "ckpt_saved"]
    assert saved["exit"] and (ckpt / f"iter_{saved['iteration']:07d}").is_dir()
    assert "job_finished" in kinds
    assert [json.loads(line) for line in (tmp_path / "stdin.jsonl").read_text().splitlines()] == notified
