"""The worker's memory tier (elasticft/worker/memory.py) in a real gloo group, without an agent.

Two forked ranks, each its own "node" (run directory and write directory), a megatron-core
sharded state whose tensor training changes in place every iteration. What the agent
would see is the outbox; what a restore would load is a directory with both ranks' files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elasticft.contract.memory import (
    ITEMS_SUFFIX,
    LAG_MARKER,
    PAUSE_MARKER,
    RESTORE_FILE,
    RestoreCandidate,
    RestorePlan,
    is_shard_file,
)
from elasticft.contract.run_dir import OutboxKind, write_atomically
from tests import forked
from tests.gloo_job import take_outbox

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt3"
RANKS, ROWS, COLUMNS = 2, 4, 4096
STEP_SECONDS = 0.05


def state(value: torch.Tensor, rank: int, iteration: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", value, (0, rank, RANKS)), "iteration": iteration}


def rank_main(rank: int, root: str, iterations: int, interval: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK="0",
                      EFT_RUN_DIR=f"{root}/run{rank}", EFT_MEM_CKPT_WRITE_DIR=f"{root}/mem{rank}",
                      EFT_MEM_CKPT_INTERVAL=str(interval), EFT_EXIT_SIGNALS="")
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=RANKS)
    sys.path.insert(0, str(EXAMPLE))
    import cpu_mode  # megatron-core's finalization asks torch.cuda for a device

    cpu_mode.enable()
    from megatron.core import dist_checkpointing

    from elasticft.worker import CheckpointDir, Hook, MemoryCheckpoints

    hook = Hook()
    memory = MemoryCheckpoints(hook)
    value = torch.zeros(ROWS, COLUMNS)

    def load_fn(path, iteration):
        loaded = dist_checkpointing.load(state(torch.empty(ROWS, COLUMNS), rank, iteration), path)
        return float(loaded["w"][0, 0])

    restored = memory.restore(load_fn, CheckpointDir(f"{root}/disk"))
    results = {"restored": [restored.iteration, restored.source, restored.result]}
    for iteration in range(1, iterations + 1):
        time.sleep(STEP_SECONDS)  # the forward and backward of a training step
        value.fill_(iteration * 10 + rank)  # in place, as an optimizer step
        hook.step(iteration)
        memory.step(iteration, lambda i=iteration: state(value, rank, i))
    memory.flush()
    results["last_complete"] = memory.last_complete
    Path(f"{root}/result{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def fresh_store(root: Path) -> None:
    """gloo's FileStore file outlives a group whose ranks exit before all of them have read it;
    a new group on the old file reads the old ranks' addresses and times out connecting."""
    (root / "store").unlink(missing_ok=True)


def run(root: Path, iterations: int = 6, interval: int = 2) -> list[dict]:
    fresh_store(root)
    forked.start_processes(rank_main, args=(str(root), iterations, interval), nprocs=RANKS)
    return [json.loads((root / f"result{r}.json").read_text()) for r in range(RANKS)]


def assemble(root: Path, iteration: int, dest: Path) -> Path:
    """What the agents' restore does: one directory with every node's files of ``iteration``."""
    dest.mkdir(parents=True)
    for rank in range(RANKS):
        for f in (root / f"mem{rank}" / f"iter_{iteration:07d}").iterdir():
            shutil.copy(f, dest / f.name)
    return dest


def test_snapshots_hold_the_iteration_they_were_taken_at_and_the_agent_hears_of_each(tmp_path):
    results = run(tmp_path, iterations=12)
    newest = results[0]["last_complete"]
    assert newest and results[1]["last_complete"] == newest
    for rank in range(RANKS):
        saved = [m["iteration"] for m in take_outbox(tmp_path / f"run{rank}") if m["type"] == OutboxKind.MEM_SAVED]
        # One at a time (a due snapshot waits while one is in flight), each on an even iteration,
        # the newest flushed at the end; every rank's agent hears of the same ones.
        assert saved == sorted(set(saved)) and set(saved) <= set(range(2, 13, 2)) and saved[-1] == newest
        assert len(saved) >= 2
    # Beside each shard file, where each of its storage items lies: a restarting rank then fetches
    # only its items' chunks from the node holding the file (whatever writer megatron-core has).
    for rank in range(RANKS):
        files = {f.name for f in (tmp_path / f"mem{rank}" / f"iter_{newest:07d}").iterdir()}
        shards = {name for name in files if is_shard_file(name)}
        assert shards and {name + ITEMS_SUFFIX for name in shards} <= files, files
    # The newest one's files, from both "nodes", hold that iteration although training went on.
    path = assemble(tmp_path, newest, tmp_path / "restore")
    code = f"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(EXAMPLE)!r}); import cpu_mode; cpu_mode.enable()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", init_method="file://{tmp_path}/store2", rank=0, world_size=1)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
out = dist_checkpointing.load({{"w": ShardedTensor.from_rank_offsets("w", torch.empty(2 * {ROWS}, {COLUMNS}), (0, 0, 1))}}, {str(path)!r})
print(out["w"][0, 0].item(), out["w"][{ROWS}, 0].item(), out["iteration"])
"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [f"{newest * 10}.0", f"{newest * 10 + 1}.0", str(newest)]  # one rank reads both


def test_a_write_that_fails_on_one_rank_is_dropped_on_every_rank(tmp_path):
    import subprocess

    full = tmp_path / "mem1"  # node 1's host memory is nearly full: its writes fail (ENOSPC)
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], check=True)
    try:
        results = run(tmp_path)
    finally:
        subprocess.run(["umount", str(full)], check=True)
    assert [r["last_complete"] for r in results] == [None, None]  # training went on, nothing claimed
    for rank in range(RANKS):
        assert not [m for m in take_outbox(tmp_path / f"run{rank}") if m["type"] == OutboxKind.MEM_SAVED]


def test_a_paused_node_stops_every_rank_from_snapshotting(tmp_path):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / PAUSE_MARKER).touch()  # node 1's agent is over its budget
    results = run(tmp_path)
    assert [r["last_complete"] for r in results] == [None, None]
    assert not (tmp_path / "mem0").exists() or not any((tmp_path / "mem0").iterdir())


def test_a_node_still_replicating_holds_every_ranks_next_snapshot(tmp_path):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / LAG_MARKER).touch()  # node 1's agent is still pushing its newest part
    results = run(tmp_path)
    assert [r["last_complete"] for r in results] == [None, None]


def test_restore_takes_memory_only_where_every_node_has_it_ready(tmp_path):
    run(tmp_path, iterations=12)
    on_both = set.intersection(*({d.name for d in (tmp_path / f"mem{r}").iterdir()} for r in range(RANKS)))
    newest, older = sorted(int(name.removeprefix("iter_")) for name in on_both)[-1:-3:-1]
    for rank in range(RANKS):  # both "agents" assembled the newest; only node 0 has the older one ready
        take_outbox(tmp_path / f"run{rank}")
        new = assemble(tmp_path, newest, tmp_path / f"restore{rank}" / "new")
        old = assemble(tmp_path, older, tmp_path / f"restore{rank}" / "old")
        plan = RestorePlan([RestoreCandidate(newest, str(new), ready=True),
                            RestoreCandidate(older, str(old), ready=rank == 0)], 2)
        write_atomically(tmp_path / f"run{rank}" / RESTORE_FILE, plan.to_json())
    again = tmp_path / "again"
    shutil.copytree(tmp_path, again, ignore=shutil.ignore_patterns("store*", "result*", "mem0", "mem1"))
    results = run(again, iterations=0)
    assert [r["restored"] for r in results] == [[newest, "memory", newest * 10.0], [newest, "memory", newest * 10 + 1.0]]
    told = [m for m in take_outbox(again / "run0") if m["type"] == OutboxKind.RESTORED]
    assert told and told[0]["iteration"] == newest and told[0]["source"] == "memory"
    # Only the older one, and only on node 0: nothing is ready everywhere -> from scratch (no disk).
    for rank in range(RANKS):
        plan = RestorePlan([RestoreCandidate(newest, "", ready=False, why="checksum"),
                            RestoreCandidate(older, str(again / f"restore{rank}" / "old"), ready=rank == 0)], 3)
        write_atomically(again / f"run{rank}" / RESTORE_FILE, plan.to_json())
    results = run(again, iterations=0)
    assert [r["restored"][:2] for r in results] == [[None, "none"], [None, "none"]]


def saves_main(rank: int, root: str, iterations: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK="0",
                      EFT_RUN_DIR=f"{root}/run{rank}", EFT_EXIT_SIGNALS="")
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=RANKS)
    sys.path.insert(0, str(EXAMPLE))
    import cpu_mode

    cpu_mode.enable()
    from elasticft.worker import CheckpointDir, Hook
    from elasticft.worker.async_save import AsyncSaves

    hook = Hook()
    saves = AsyncSaves(hook, CheckpointDir(f"{root}/disk"))
    value, done = torch.zeros(ROWS, COLUMNS), []
    for iteration in range(1, iterations + 1):
        time.sleep(STEP_SECONDS)
        value.fill_(iteration * 10 + rank)  # the optimizer, in place, while the save is being written
        hook.step(iteration)
        done.append(saves.step())
        if iteration % 3 == 0:
            saves.start(iteration, state(value, rank, iteration))
    done.append(saves.flush())
    Path(f"{root}/result{rank}.json").write_text(json.dumps({"done": [d for d in done if d is not None]}))
    dist.destroy_process_group()


def run_saves(root: Path, iterations: int = 9) -> list[dict]:
    fresh_store(root)
    forked.start_processes(saves_main, args=(str(root), iterations), nprocs=RANKS)
    return [json.loads((root / f"result{r}.json").read_text()) for r in range(RANKS)]


def test_periodic_disk_saves_complete_in_the_background_and_hold_their_iteration(tmp_path):
    from elasticft.worker import CheckpointDir

    results = run_saves(tmp_path)
    assert results[0]["done"] == results[1]["done"] == [3, 6, 9]  # every rank finished each at one iteration
    disk = CheckpointDir(tmp_path / "disk")
    assert disk.tracked_iteration() == 9 and disk.complete_iterations() == [9, 6]
    acks = [m for m in take_outbox(tmp_path / "run0") if m["type"] == OutboxKind.ACK]
    assert [m["iteration"] for m in acks] == [3, 6, 9]  # rank 0 told its agent of each
    path = assemble_single(disk.dir_of(6))
    assert path == [60.0, 61.0]  # what training held at iteration 6, not later


def test_a_disk_save_that_fails_is_never_marked_complete(tmp_path):
    import subprocess

    from elasticft.worker import CheckpointDir

    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "iter_0000006").mkdir()  # this save's directory fills up: ENOSPC
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(tmp_path / "disk" / "iter_0000006")],
                   check=True)
    try:
        results = run_saves(tmp_path)
    finally:
        subprocess.run(["umount", str(tmp_path / "disk" / "iter_0000006")], check=True)
    assert results[0]["done"] == results[1]["done"] == [3, 9]  # training went on past the failed one
    disk = CheckpointDir(tmp_path / "disk")
    assert disk.tracked_iteration() == 9 and 6 not in disk.complete_iterations()


def assemble_single(path: Path) -> list[float]:
    """Load a two-rank checkpoint in one process: each rank's first row."""
    import subprocess

    code = f"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(EXAMPLE)!r}); import cpu_mode; cpu_mode.enable()
dist.init_process_group("gloo", init_method="file://{path}.store", rank=0, world_size=1)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
out = dist_checkpointing.load({{"w": ShardedTensor.from_rank_offsets("w", torch.empty(2 * {ROWS}, {COLUMNS}), (0, 0, 1))}}, {str(path)!r})
print(out["w"][0, 0].item(), out["w"][{ROWS}, 0].item())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [float(x) for x in done.stdout.split()]
