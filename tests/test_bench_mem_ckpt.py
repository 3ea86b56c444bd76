"""bench/mem_ckpt.py runs end to end (its behaviour, not its timings)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["disk save, synchronous torch_dist (baseline)", "memory snapshot: training stall (copy + plan)",
        "the copy alone (HostCopier.copy)", "memory snapshot, copy overlapped: stall (plan + the update's wait)",
        "the overlapped copy, start to end", "stand-in forward + backward alone (baseline)",
        "stand-in forward + backward beside the copy and the write", "the same after a blocking copy, beside the write",
        "memory snapshot: complete (+ write + finalize)", "disk load, ",
        "a plain read of its files", "memory load (local tmpfs)", "host memory: tmpfs bytes per snapshot",
        "host memory: peak RSS growth, snapshot", "host memory: peak RSS growth, disk save"]
REPLICA_ROWS = ["replicate: crc32 of the part", "replicate: push to a peer over HTTP",
                "restore from replica: fetch over HTTP", "restore from replica: fetch + load",
                "restore from replica: byte ranges during the load"]


@pytest.mark.slow
def test_quick_run_prints_the_table_and_goals(tmp_path):
    before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/mem_ckpt.py", "--quick", "--repeat", "1", "--disk-dir", str(tmp_path),
           "--step-seconds", "0.2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "50 MB per node:" in out
    for row in ROWS + (REPLICA_ROWS if "replication not measured" not in out else []):
        assert row in out, f"row {row!r} missing:\n{out}"
    assert "goal 50 MB: stall ≤ 10 % of a disk save: " in out and "overlapped / blocking " in out
    assert "goal 50 MB: restore from memory ≥ 3× faster than from disk: " in out
    assert "tmpfs bytes per snapshot" in out and "1.00" in out.split("tmpfs bytes per snapshot")[1].splitlines()[0]
    # Everything it wrote is gone.
    assert not [p for p in set(os.listdir("/dev/shm")) - before if p.startswith("eft-bench-")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("eft-bench-")]
