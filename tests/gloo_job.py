"""A small distributed training loop wired to elasticft.worker.Hook, and the agent's side
of the relay, for the worker tests and the bench.

Ranks are forked processes in a real gloo group (FileStore rendezvous, no eft agent).
Each rank gets its own run directory unless told otherwise, as if every rank were a
node: a request written into one rank's run directory is seen by that rank alone.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from bench.launch import wait_for
from elasticft.contract.run_dir import write_atomically
from elasticft.worker import CheckpointDir, Hook
from tests import forked

# -- the agent's side of the relay ---------------------------------------------------------


def write_request(run_dir: Path, id: str, reason: str = "manual", exit: bool = False,
                  risk: float | None = None) -> None:
    """What an agent does when a new request appears in etcd."""
    record = {"id": id, "reason": reason, "requester": "test-agent", "exit": exit,
              "risk": risk, "time": time.time()}
    write_atomically(Path(run_dir) / "request.json", json.dumps(record))


def take_outbox(run_dir: Path) -> list[dict]:
    """Read and delete the messages rank 0 left, oldest first, as the agent does."""
    outbox = Path(run_dir) / "outbox"
    if not outbox.is_dir():
        return []
    messages = []
    for path in sorted(outbox.glob("*.json"), key=lambda p: [int(x) for x in p.stem.split("-")]):
        messages.append(json.loads(path.read_text()))
        path.unlink()
    return messages


# -- the job -------------------------------------------------------------------------------


@dataclass
class Job:
    """What every rank runs. ``events`` maps (iteration, rank) to things that rank does
    just before ``hook.step(iteration)``: ("request", run_dir, kwargs) or ("touch", path)."""

    root: Path
    ranks: int = 4
    first: int = 0
    last: int = 20  # exclusive; with until_exit the loop ignores it and runs until told to exit
    until_exit: bool = False
    env: dict[int, dict[str, str]] = field(default_factory=dict)  # rank -> EFT_* for it
    hook_args: dict = field(default_factory=dict)
    events: dict[tuple[int, int], list[tuple]] = field(default_factory=dict)
    step_seconds: float = 0.0  # each iteration's "compute"
    dies_saving: int | None = None  # this rank is SIGKILLed once a vote decided a save, before it writes

    def run_dir(self, rank: int) -> Path:
        return Path(self.env[rank]["EFT_RUN_DIR"])

    def result(self, rank: int) -> dict:
        return json.loads((self.root / f"rank{rank}.json").read_text())

    def progress(self, rank: int) -> dict | None:
        path = self.root / f"progress{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None


def job(tmp_path: Path, ranks: int = 4, shared_run_dir: bool = False, **kwargs) -> Job:
    """A Job whose ranks each have a run directory (one shared one if ``shared_run_dir``)."""
    env = {}
    for rank in range(ranks):
        run_dir = tmp_path / ("run" if shared_run_dir else f"run{rank}")
        run_dir.mkdir(exist_ok=True)
        # A vote every iteration: these tests say at which iteration each rank sees what
        # (tests/test_vote_cadence.py holds the same guarantees with votes iterations apart).
        env[rank] = {"EFT_RUN_DIR": str(run_dir), "EFT_VOTE_BUDGET": "0"}
    return Job(root=tmp_path, ranks=ranks, env=env, **kwargs)


def start(spec: Job):
    """Fork the ranks; returns torch's ProcessContext (``join()`` until it says True)."""
    init = spec.root / "init"
    return forked.start_processes(_rank_main, args=(spec, str(init)), nprocs=spec.ranks,
                              join=False)


def run(spec: Job, timeout: float = 30) -> list[dict]:
    """Run the job to the end; each rank's result."""
    finish(start(spec), timeout)
    return [spec.result(rank) for rank in range(spec.ranks)]


def finish(context, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not context.join(timeout=0.2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"job did not finish within {timeout:g} s")


def _rank_main(rank: int, spec: Job, init: str) -> None:
    for name in [n for n in os.environ if n.startswith("EFT_")]:
        del os.environ[name]  # the test runner's own, if any
    os.environ.update(spec.env.get(rank, {}))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=spec.ranks)
    result = {"rank": rank, "pid": os.getpid(), "saves": [], "exit": None, "system_exit": None}
    try:
        hook = Hook(**spec.hook_args)
    except SystemExit as stop:
        result["system_exit"] = stop.code
    else:
        _train(rank, spec, hook, result)
        result["votes"] = hook.votes
    (spec.root / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _train(rank: int, spec: Job, hook: Hook, result: dict) -> None:
    checkpoints = CheckpointDir(spec.root / "ckpt")
    weights = torch.full((4,), float(rank))
    iteration = spec.first
    deadline = time.monotonic() + 30
    while spec.until_exit or iteration < spec.last:
        for event in spec.events.get((iteration, rank), []):
            _do(event)
        action = hook.step(iteration)
        weights += 1  # the "training"
        time.sleep(spec.step_seconds)
        if action.save and spec.dies_saving == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if action.save:
            started = time.monotonic()
            path = checkpoints.path_for(iteration)
            torch.save(weights, path / f"rank{rank}.pt")
            dist.barrier()
            if rank == 0:
                checkpoints.commit(iteration)
            hook.saved(iteration, path, time.monotonic() - started)
            result["saves"].append({"iteration": iteration, "exit": action.exit, "reason": action.reason,
                                    "request_id": action.request_id, "time": time.time()})
        if action.exit:
            result["exit"] = iteration
            break
        if spec.until_exit:
            write_atomically(spec.root / f"progress{rank}.json", json.dumps({"iteration": iteration}))
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank}: no exit within 30 s (iteration {iteration})")
        iteration += 1


def _do(event: tuple) -> None:
    kind, *args = event
    if kind == "request":
        run_dir, fields = args
        write_request(run_dir, **fields)
    elif kind == "touch":
        Path(args[0]).touch()
    else:
        raise ValueError(f"unknown event {kind!r}")


def wait_progress(spec: Job, iteration: int, timeout: float = 20) -> None:
    """Until every rank has finished ``iteration``."""
    def there():
        done = [spec.progress(r) for r in range(spec.ranks)]
        return all(p is not None and p["iteration"] >= iteration for p in done)
    wait_for(there, timeout, f"all ranks past iteration {iteration}")
