"""The memory tier's flags: a mistake is one line and exit 2, before anything starts.

eft-run's entry is called in this process, as its console script calls it (an eft-run per case
would pay torch's import each time; tests/test_new_user.py runs the command itself)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, says", [
    (["--nnodes", "1:2", "--eft-mem-ckpt-replicas", "2"], "--eft-mem-ckpt-replicas 2: needs at least 3 nodes"),
    (["--eft-node-label", "rack"], "--eft-node-label: expected KEY=VALUE"),
    (["--eft-node-label", "zone=a", "--eft-mem-ckpt-domain", "rack"], "--eft-mem-ckpt-domain: this node has no label"),
    (["--eft-mem-ckpt-budget-gb", "-1"], "--eft-mem-ckpt-budget-gb: expected GB >= 0"),
    (["--eft-mem-ckpt-max-lag", "0"], "--eft-mem-ckpt-max-lag: expected >= 1"),
])
def test_bad_memory_tier_flags_cost_one_line(flags, says, capfd):
    from launcher import eft_run as launch

    handlers = list(launch.log.handlers)
    try:
        with pytest.raises(SystemExit) as stopped:
            launch.main(["--standalone", "--nproc-per-node", "1", "--eft-mem-ckpt-interval", "1", *flags,
                         str(ROOT / "examples" / "minimal_train.py")])
    finally:
        launch.log.handlers[:] = handlers  # the launch set up its log as eft-run does
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert stopped.value.code == 2 and len(lines) == 1 and says in lines[0], (flags, lines)
