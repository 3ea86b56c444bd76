"""A node's memory checkpoints left on tmpfs by an agent killed outright are reclaimed by the
next agent on the host; a live agent's, and this agent's own, are not."""

import os
import subprocess
import sys
import time

from elasticft.contract.memory import OWNER_FILE
from elasticft.memckpt.reclaim import EMPTY_RUN_GRACE, claim, owner_alive, reclaim_stale


def owned_by_a_killed_process(node_dir):
    """``node_dir`` claimed by a real process that was then SIGKILLed (a dead agent)."""
    node_dir.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, pathlib; from elasticft.memckpt.reclaim import claim; "
                              "claim(pathlib.Path(sys.argv[1])); print('claimed', flush=True); "
                              "import time; time.sleep(600)", str(node_dir)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "claimed"
    child.kill()
    child.wait()
    (node_dir / "own" / "g0" / "iter_0000007").mkdir(parents=True)
    (node_dir / "own" / "g0" / "iter_0000007" / "__0_0.distcp").write_bytes(b"x" * 4096)


def test_a_killed_agents_node_dir_goes_and_live_ones_stay(tmp_path):
    root = tmp_path / "eft"
    dead = root / "run-a" / "node1"
    owned_by_a_killed_process(dead)
    live = root / "run-b" / "node0"
    live.mkdir(parents=True)
    claim(live)  # this process: alive
    mine = root / "run-a" / "node0"
    mine.mkdir(parents=True)  # the starting agent's own (not yet claimed)
    unowned = root / "run-c" / "node9"
    unowned.mkdir(parents=True)
    assert (owner_alive(dead), owner_alive(live), owner_alive(unowned)) == (False, True, None)

    removed, freed = reclaim_stale(root, keep=mine)
    assert (removed, freed >= 4096) == (1, True)
    assert not dead.exists() and live.is_dir() and mine.is_dir() and unowned.is_dir()


def test_a_pid_reused_by_another_process_is_not_the_owner(tmp_path):
    node = tmp_path / "eft" / "run" / "node0"
    node.mkdir(parents=True)
    (node / OWNER_FILE).write_text(f'{{"pid": {os.getpid()}, "started": 1.0}}')  # our pid, another start time
    assert owner_alive(node) is False


def test_empty_run_dirs_go_once_old_enough(tmp_path):
    root = tmp_path / "eft"
    (root / "old-run").mkdir(parents=True)
    (root / "new-run").mkdir()
    old = time.time() - EMPTY_RUN_GRACE - 10
    os.utime(root / "old-run", (old, old))
    assert reclaim_stale(root)[0] == 1
    assert sorted(p.name for p in root.iterdir()) == ["new-run"]
