"""The memory tier's flags: a mistake is one line and exit 2, before anything starts."""

import subprocess
import sys
from pathlib import Path


def test_bad_memory_tier_flags_cost_one_line(tmp_path):
    base = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "1",
            "--eft-mem-ckpt-interval", "1"]
    for flags, says in (
        (["--nnodes", "1:2", "--eft-mem-ckpt-replicas", "2"], "--eft-mem-ckpt-replicas 2: needs at least 3 nodes"),
        (["--eft-node-label", "rack"], "--eft-node-label: expected KEY=VALUE"),
        (["--eft-node-label", "zone=a", "--eft-mem-ckpt-domain", "rack"], "--eft-mem-ckpt-domain: this node has no label"),
        (["--eft-mem-ckpt-budget-gb", "-1"], "--eft-mem-ckpt-budget-gb: expected GB >= 0"),
        (["--eft-mem-ckpt-max-lag", "0"], "--eft-mem-ckpt-max-lag: expected >= 1"),
    ):
        done = subprocess.run([*base, *flags, "examples/minimal_train.py"], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 2, (flags, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and says in lines[0], (flags, done.stderr)
