"""A memory snapshot whose copy runs beside the next iteration (``--eft-mem-ckpt-overlap``).

The GPT example's Trainer (megatron-core's GPTModel, schedules and Adam; TP2 on two forked
gloo ranks, each its own "node") takes one memory snapshot, at iteration K. The test holds
that copy at the lowest layer (``host_copy.copy_tensor``): an overlapped copy does not
finish before iteration K+1's forward and backward have run, and every copy lingers HOLD
seconds more. The snapshot must still hold iteration K bit for bit, although K+1 changes
every parameter; the stall is what the training thread waited, nothing else; and where
the loop cannot allow it (the knob off, no ``before_update``) the copy is on the training path.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticft.contract.run_dir import OutboxKind
from tests import forked
from tests.gloo_job import take_outbox

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt3"
RANKS, K, ITERS = 2, 3, 5
HOLD = 0.5  # seconds every snapshot's copy lingers (a slow copy)
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--vocab-size", "512", "--global-batch-size", "8", "--micro-batch-size", "4", "--train-iters", str(ITERS),
         "--lr", "1e-3", "--tensor-model-parallel-size", "2", "--weight-decay", "0.1"]


def tensors(value, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (loaded or sharded) state dict by its place in it, copied."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in tensors(v, f"{path}/{key}").items()}
    if isinstance(value, list):
        return {k: t for i, v in enumerate(value) for k, t in tensors(v, f"{path}/{i}").items()}
    if isinstance(value, ShardedTensor):
        return {path: value.data.detach().clone()}
    if isinstance(value, torch.Tensor):
        return {path: value.detach().clone()}
    return {}


def rank_main(rank: int, root: str, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS),
                      LOCAL_RANK="0", EFT_RUN_DIR=f"{root}/run{rank}", EFT_MEM_CKPT_WRITE_DIR=f"{root}/mem{rank}",
                      EFT_MEM_CKPT_INTERVAL=str(K), EFT_EXIT_SIGNALS="",
                      EFT_MEM_CKPT_OVERLAP="false" if mode == "knob_off" else "true")
    sys.path.insert(0, str(EXAMPLE))
    import train  # the GPT example (enables its CPU mode)

    from elasticft.worker import Hook, MemoryCheckpoints, host_copy

    trainer = train.Trainer(train.parse_args(MODEL))
    from megatron.core import dist_checkpointing

    hook = Hook()
    memory = MemoryCheckpoints(hook)
    times: dict = {"copied": [], "fb_end": {}, "update": {}}
    ran_forward = threading.Event()  # iteration K+1's forward and backward are done
    real_copy, lingered = host_copy.copy_tensor, threading.Lock()

    def held_copy(buffer, tensor, non_blocking):  # the lowest layer, slowed
        times.setdefault("shapes", []).append([threading.current_thread().name, list(tensor.shape)])
        if threading.current_thread().name == host_copy.COPY_THREAD:
            times.setdefault("copy_thread", True)
            ran_forward.wait(timeout=60)
            if mode == "copy_fails" and rank == 1:
                raise MemoryError("injected: the copy fails on rank 1")
        if tensor.numel() > 1 and lingered.acquire(blocking=False):  # once: the snapshot's first weight
            time.sleep(HOLD)
        real_copy(buffer, tensor, non_blocking)
        times["copied"].append(time.perf_counter())

    host_copy.copy_tensor = held_copy
    forward_backward, step = trainer.forward_backward, trainer.optimizer.step

    def timed_forward_backward(*args, **kwargs):
        result = forward_backward(*args, **kwargs)
        times["fb_end"][trainer.iteration + 1] = time.perf_counter()
        if trainer.iteration + 1 == K + 1:
            ran_forward.set()
        return result

    def timed_step(*args, **kwargs):  # the update itself, inside the guard
        times["update"][trainer.iteration + 1] = time.perf_counter()
        return step(*args, **kwargs)

    trainer.forward_backward = timed_forward_backward
    trainer.optimizer.step = timed_step
    if mode != "no_guard":
        memory.guard(trainer.optimizer)
    guarded = trainer.optimizer.step

    def called_step(*args, **kwargs):  # where the loop calls its update
        times["called"] = times.get("called", {}) | {trainer.iteration + 1: time.perf_counter()}
        return guarded(*args, **kwargs)

    trainer.optimizer.step = called_step
    for iteration in range(1, ITERS + 1):
        trainer.train_step(iteration - 1)
        hook.step(iteration)
        state = tensors(trainer.checkpoint_state(iteration))
        if iteration == K:
            expected = state
            began = time.perf_counter()
        memory.step(iteration, lambda i=iteration: trainer.checkpoint_state(i))
        if iteration == K:
            times["step"] = time.perf_counter() - began
            copying = memory._pending.copying
        if iteration == K + 1:
            after = state
    memory.flush()
    if mode == "copy_fails":  # training went on; nothing of the snapshot may be claimed
        Path(f"{root}/result{rank}.json").write_text(json.dumps({"last_complete": memory.last_complete,
                                                                "iterations": sorted(times["fb_end"])}))
        return
    restore = Path(root) / "restore"
    if rank == 0:  # what the agents' restore assembles: both nodes' files of iteration K
        restore.mkdir()
        for r in range(RANKS):
            for f in (Path(root) / f"mem{r}" / f"iter_{K:07d}").iterdir():
                shutil.copy(f, restore / f.name)
    dist.barrier()
    loaded = tensors(dist_checkpointing.load(trainer._state(is_loading=True), str(restore)))
    params = [k for k in expected if k.startswith("/model/")]
    result = {
        "same_keys": sorted(loaded) == sorted(expected),
        "bit_for_bit": [k for k in expected if not torch.equal(loaded.get(k, torch.empty(0)), expected[k])],
        "unchanged_by_k1": [k for k in params if torch.equal(after[k], expected[k])],
        "params": len(params),
        "copy_thread": times.get("copy_thread", False),
        "shapes": times["shapes"],
        "copy_seconds": copying.seconds,
        "copy_end": max(times["copied"]),
        "fb_end": times["fb_end"][K + 1],
        "update_began": times["update"][K + 1],
        "waited": times["update"][K + 1] - times["called"][K + 1] if mode != "no_guard" else 0.0,
        "step": times["step"],
        "stall": memory.last_stall,
        "hook_stall": hook.progress.stalls.get("memory"),
    }
    Path(f"{root}/result{rank}.json").write_text(json.dumps(result))
    hook.close()
    dist.destroy_process_group()


def run(root: Path, mode: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forked.start_processes(rank_main, args=(str(root), port, mode), nprocs=RANKS)
    return [json.loads((root / f"result{r}.json").read_text()) for r in range(RANKS)]


def snapshots(root: Path, rank: int) -> list[dict]:
    return [m for m in take_outbox(root / f"run{rank}") if m["type"] == OutboxKind.MEM_SAVED]


@pytest.mark.slow
def test_the_copy_runs_beside_the_next_iteration_and_holds_iteration_k_bit_for_bit(tmp_path):
    results = run(tmp_path, "overlap")
    for rank, r in enumerate(results):
        assert r["same_keys"] and r["bit_for_bit"] == [], r
        assert r["params"] > 0 and r["unchanged_by_k1"] == []  # K+1 changed every parameter
        # The copy ran on its own thread and ended after K+1's forward and backward; the update began after it.
        assert r["copy_thread"] and r["fb_end"] < r["copy_end"] <= r["update_began"], r
        # The stall is what the loop waited: in step(K) (state_fn and the plan) and before the update.
        assert r["hook_stall"] == pytest.approx(r["stall"], abs=1e-9), r
        assert r["step"] + r["waited"] - 0.1 < r["stall"] <= r["step"] + r["waited"] + 1e-3, r
        assert r["waited"] > 0 and r["stall"] < r["copy_seconds"], r  # not the copy's own time
        (saved,) = snapshots(tmp_path, rank)
        assert saved["iteration"] == K and saved["overlapped"] is True
        assert saved["stall"] == pytest.approx(r["stall"]) and saved["copy"] > saved["stall"] > saved["waited"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["knob_off", "no_guard"])
def test_where_the_loop_does_not_allow_it_the_copy_is_on_the_training_path(tmp_path, mode):
    """``--no-eft-mem-ckpt-overlap``, or a loop that never calls ``before_update``: today's copy."""
    results = run(tmp_path, mode)
    for rank, r in enumerate(results):
        assert r["same_keys"] and r["bit_for_bit"] == [], r
        assert not r["copy_thread"] and r["copy_end"] < r["fb_end"], r  # done before K+1's forward
        assert HOLD <= r["stall"] <= r["step"] + 1e-3 and r["hook_stall"] == pytest.approx(r["stall"], abs=1e-9), r
        (saved,) = snapshots(tmp_path, rank)
        assert saved["iteration"] == K and saved["overlapped"] is False


@pytest.mark.slow
def test_a_copy_that_fails_beside_the_next_iteration_drops_the_snapshot_on_every_rank(tmp_path):
    """A fault while the copy runs (here: it raises on rank 1) loses the snapshot, not training,
    and no rank claims it: it is never finalized, so its agent never hears of it."""
    results = run(tmp_path, "copy_fails")
    assert [r["last_complete"] for r in results] == [None, None]
    assert [r["iterations"] for r in results] == [list(range(1, ITERS + 1))] * RANKS
    assert snapshots(tmp_path, 0) == snapshots(tmp_path, 1) == []
