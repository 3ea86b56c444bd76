"""Emergency checkpoints: how fast a request reaches every rank, and what the hook costs.

1. Latency: 8 ranks of a toy loop (tests/workers/toy_train.py, 20 ms iterations) under
   ``eft-run --standalone``; a request is put into etcd (as ``eft ckpt save`` does) and
   we time until every rank's ``hook.step()`` has returned ``save``. Baselines measured
   in the same run: a flag file polled every 30 s (the interval of the usual Megatron
   patch) and every 1 s, created at a random moment of the polling period.
2. Cost per iteration with nothing pending: forks N ranks in a real gloo group on this machine. Every rank calls ``hook.step(i)``
with a run directory, a save switch and a kill switch configured but absent, and an
exit duration set (so every check runs), interleaved in blocks with a bare
``all_reduce`` of the same 5 int64s, the floor any agreement costs. Per-call times are
rank 0's (it also checks the switches); the 1-rank row shows the local checks alone.

    python bench/ckpt_trigger.py [--ranks 8] [--iterations 500] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import table  # noqa: E402  (also puts the repo on sys.path)

BLOCK = 50  # calls per block; blocks of steps and bare all_reduces alternate


def hook_step_cost(ranks: int = 8, iterations: int = 500) -> dict:
    """Rank 0's µs per call of ``hook.step`` and of a bare all_reduce (median, p90, mean)."""
    with tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        root = Path(tmp)
        (root / "run").mkdir()
        mp.start_processes(_rank_main, args=(ranks, iterations, str(root)), nprocs=ranks,
                           join=True, start_method="fork")
        samples = json.loads((root / "rank0.json").read_text())
    return {"ranks": ranks, "iterations": iterations,
            **{name: _summary(values) for name, values in samples.items()}}


def _summary(ns: list[int]) -> dict:
    us = sorted(v / 1000 for v in ns)
    return {"median": statistics.median(us), "p90": us[int(0.9 * (len(us) - 1))], "mean": statistics.fmean(us)}


def _rank_main(rank: int, ranks: int, iterations: int, root: str) -> None:
    for name in [n for n in os.environ if n.startswith("EFT_")]:
        del os.environ[name]
    os.environ.update(
        EFT_RUN_DIR=os.path.join(root, "run"),
        EFT_SAVE_SWITCH=os.path.join(root, "save-switch"),
        EFT_KILL_SWITCH=os.path.join(root, "kill-switch"),
        EFT_EXIT_DURATION_MINS="600",
        EFT_START_TIME=str(time.time()),
    )
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=ranks)
    from elasticft.worker import Hook

    hook = Hook(save_interval=1000, last_saved_iteration=0)
    flags = torch.zeros(5, dtype=torch.int64)
    step_ns: list[int] = []
    allreduce_ns: list[int] = []
    iteration = 0
    for _ in range(2):  # warm-up, not recorded
        hook.step(iteration)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    while len(step_ns) < iterations:
        for _ in range(BLOCK):
            iteration += 1
            start = time.perf_counter_ns()
            action = hook.step(iteration)
            step_ns.append(time.perf_counter_ns() - start)
            assert not action.save
        for _ in range(BLOCK):
            start = time.perf_counter_ns()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            allreduce_ns.append(time.perf_counter_ns() - start)
    if rank == 0:
        Path(root, "rank0.json").write_text(json.dumps({"hook.step": step_ns, "all_reduce": allreduce_ns}))
    dist.destroy_process_group()


def stat_cost(calls: int = 20000) -> float:
    """µs per ``os.stat`` of an absent file, what each watched file costs a step."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "absent")
        start = time.perf_counter_ns()
        for _ in range(calls):
            try:
                os.stat(path)
            except FileNotFoundError:
                pass
        return (time.perf_counter_ns() - start) / calls / 1000


def request_latency(ranks: int = 8, trials: int = 3) -> list[float]:
    """Seconds from the etcd put of a request to the last rank's hook saying save."""
    import random

    from launch import WORKERS, Launched, eft_run, wait_for, worker_events

    from elasticft.agent.ckpt_protocol import CheckpointProtocol
    from elasticft.contract.keys import RunKeys
    from elasticft.store import StoreOptions, connect

    latencies = []
    with tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        job = Launched([*eft_run(), "--standalone", "--nproc-per-node", str(ranks), str(WORKERS / "toy_train.py"),
                        str(out), "--ckpt", str(Path(tmp) / "ckpt"), "--iters", "1000000", "--iter-time", "0.02"],
                       Path(tmp) / "eft-run.log")
        try:
            wait_for(lambda: len(worker_events(out, "resume")) == ranks, 300, "the ranks")
            run = json.loads((out / "run.json").read_text())
            protocol = CheckpointProtocol(connect(StoreOptions(run["endpoint"])), RunKeys(run["run_id"]), "bench")
            for _ in range(trials):
                time.sleep(random.uniform(0.2, 1.0))  # a random phase against the iterations
                put = time.time()
                request, _ = protocol.request("manual", "bench")
                saves = wait_for(lambda: (lambda s: s if len(s) == ranks else None)(
                    [e for e in worker_events(out, "save") if e["request_id"] == request.id]),
                    120, "every rank to save")
                wait_for(lambda: not protocol.is_open(request), 60, "the ack")
                latencies.append(max(e["decided"] for e in saves) - put)
        finally:
            job.stop()
    return latencies


def polled_flag_latency(period: float, trials: int) -> list[float]:
    """Seconds from creating a flag file to a poller with this period noticing it."""
    import random

    latencies = []
    with tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        flag = Path(tmp) / "save-now"
        for _ in range(trials):
            phase = time.monotonic()
            created_at = phase + random.uniform(0, period)
            next_poll = phase
            while True:
                now = time.monotonic()
                if now >= created_at and not flag.exists():
                    flag.touch()
                    created = time.monotonic()
                if now >= next_poll:
                    if flag.exists():
                        latencies.append(time.monotonic() - created)
                        flag.unlink()
                        break
                    next_poll += period
                time.sleep(min(0.01, max(0.0, min(next_poll, created_at) - time.monotonic())))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="gloo ranks to fork (default 8)")
    parser.add_argument("--iterations", type=int, default=500, help="timed steps per rank (default 500)")
    parser.add_argument("--trials", type=int, default=3, help="requests timed for the latency table (default 3)")
    args = parser.parse_args()

    eft = request_latency(args.ranks, args.trials)
    baselines = {"flag file polled every 30 s": polled_flag_latency(30.0, 2),
                 "flag file polled every 1 s": polled_flag_latency(1.0, 5)}
    mean = statistics.fmean(eft)
    rows = [[f"eft request via etcd ({args.ranks} ranks)", mean, max(eft), 1.0]]
    for name, values in baselines.items():
        rows.append([name, statistics.fmean(values), max(values), statistics.fmean(values) / mean])
    print("seconds from the request to every rank deciding to save")
    print(table(["trigger", "mean s", "max s", "x slower than eft"], rows))
    print()

    rows = []
    for ranks in sorted({1, args.ranks}):
        # One rank is fast, and its row measures the local checks: take more samples.
        result = hook_step_cost(ranks, args.iterations * (10 if ranks == 1 else 1))
        step, bare = result["hook.step"], result["all_reduce"]
        rows.append([ranks, "hook.step()", step["median"], step["p90"], step["mean"]])
        rows.append([ranks, "all_reduce alone", bare["median"], bare["p90"], bare["mean"]])
        rows.append([ranks, "difference (median)", step["median"] - bare["median"], "", ""])
    print(f"per-iteration cost, nothing pending, µs per call on rank 0 ({os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}, gloo, torch {torch.__version__})")
    print(table(["ranks", "what", "median", "p90", "mean"], rows))
    print(f"os.stat of an absent file: {stat_cost():.2f} µs (rank 0 makes 3 per step, other ranks 1)")


if __name__ == "__main__":
    main()
