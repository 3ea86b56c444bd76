"""The chaos table (issue 15, item 7): each fault of bench/chaos_rows.py on a real job.

Each row starts its own etcd (one member, or three), two or three eft-run agents with
one worker each training examples/minimal_train.py (a save every 5 steps), waits for
the world to be whole and two saves, applies its fault, then waits for 20 saves after
the fault (and after the workers' last start), and prints what it saw:

  python -m bench.chaos [--rows worker-sigkill,etcd-restart-5-s] [--keep DIR]

Everything a row started (etcd, agents, workers) is killed when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.chaos_job import SAVE_INTERVAL, ChaosJob
from bench.chaos_measure import Outcome, measure
from bench.chaos_rows import ROWS, Row, SmallDisk, slug
from bench.common import table
from bench.etcd_cluster import EtcdCluster
from bench.launch import wait_for
from bench.netns import NetnsCluster
from elasticft.store import EmbeddedEtcd

STARTUP_TIMEOUT = 180.0  # two or three agents importing torch on a busy 2-core machine
AFTER_SAVES = 20  # saves the job must make after the fault to count as recovered
RECOVERY_TIMEOUT = 150.0


def wait_recovered(job: ChaosJob, after: float) -> bool:
    """Whether the job makes AFTER_SAVES saves after ``after`` and after its workers' last
    start, before RECOVERY_TIMEOUT or before every node has ended."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    while time.monotonic() < deadline and job.running():
        last_start = job.starts()[-1][0].time
        if len(job.saves(after=max(after, last_start))) >= AFTER_SAVES:
            return True
        time.sleep(0.1)
    return False


def ready(job: ChaosJob, nodes: int) -> bool:
    """The workers run at the full world size, have saved twice since they started, and are
    past the middle of a save interval: a fault right after a save would re-do nothing
    whatever eft did."""
    starts = job.starts()
    if not starts or starts[-1][1] != nodes or len(job.saves(after=starts[-1][0].time)) < 2:
        return False
    return job.steps()[-1][1] % SAVE_INTERVAL >= SAVE_INTERVAL // 2 + 1


def run_row(row: Row, workdir: Path) -> Outcome:
    """Run ``row`` on a fresh job in ``workdir``; what it saw."""
    reason = row.needs()
    if reason:
        return Outcome(row.name, skipped=reason)
    began = time.monotonic()
    with ExitStack() as stack:  # unwound in reverse: the job's processes, then the disk, then etcd
        if row.network:  # its etcd runs in the cluster's own namespace
            etcd = network = stack.enter_context(NetnsCluster(row.nodes, workdir))
            endpoint = network.etcd_endpoint
        else:
            etcd = stack.enter_context(EtcdCluster(row.etcd_members) if row.etcd_members > 1 else EmbeddedEtcd())
            endpoint, network = etcd.endpoint, None
        job = ChaosJob(workdir, endpoint, row.nodes, network, row.flags)
        if row.small_disk:
            stack.enter_context(SmallDisk(job.save_dir))
        stack.enter_context(job)
        job.start()
        try:
            wait_for(lambda: ready(job, row.nodes), STARTUP_TIMEOUT, f"{row.nodes} nodes training and saving")
        except AssertionError as err:
            raise AssertionError(f"{err}\n{job.output()[-4000:]}") from None
        fault_started = time.time()
        report = row.fault(job, etcd)
        recovered = wait_recovered(job, after=time.time())
        outcome = measure(job, row.name, fault_started, recovered, time.time(), report.destroyed)
        outcome.problems[:0] = report.problems
        outcome.detail = report.detail
        (workdir / "lines.txt").write_text(job.output())
    outcome.seconds = time.monotonic() - began
    return outcome


def shortfalls(row: Row, o: Outcome) -> list[str]:
    """Where ``o`` breaks ``row``'s promises (none: the row passes)."""
    found = [] if o.recovered else [f"no {AFTER_SAVES} saves within {RECOVERY_TIMEOUT:g} s of the fault"]
    if o.world_after != row.world_after:
        found.append(f"world size {o.world_after} afterwards, not {row.world_after}")
    if o.redone is None or o.redone > row.max_redone:
        found.append(f"{o.redone} iterations re-done, more than {row.max_redone}")
    if not o.checkpoints_kept:
        found.append("a committed checkpoint was lost")
    if not row.restart_allowed and o.restarts:
        found.append(f"the workers restarted {o.restarts} time(s): they must train through")
    if row.max_stall is not None and (o.stall is None or o.stall > row.max_stall):
        found.append(f"{o.stall:.2f} s without a step, more than {row.max_stall:g} s")
    return found + o.problems


def yes(flag: bool) -> str:
    return "y" if flag else "n"


def print_table(chosen: list[Row], outcomes: list[Outcome]) -> None:
    rows = []
    for row, o in zip(chosen, outcomes):
        if o.skipped:
            rows.append([o.row, "skipped", "", "", "", "", "", ""])
        else:
            rows.append([o.row, yes(o.recovered), o.world_after, o.redone, o.stall, yes(o.checkpoints_kept),
                         yes(not shortfalls(row, o)), o.seconds])
    print(table(["row", "recovered", "world size after", "iterations re-done", "longest stall, s",
                 "every committed checkpoint survived", "within limits", "row took, s"], rows))
    for o in outcomes:
        for said in filter(None, [o.skipped, o.detail]):
            print(f"{o.row}: {said}")
    for row, o in zip(chosen, outcomes):
        for shortfall in ([] if o.skipped else shortfalls(row, o)):
            print(f"{o.row}: {shortfall}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated rows to run (default all): "
                        + ", ".join(slug(r.name) for r in ROWS))
    parser.add_argument("--keep", default="", help="directory to keep each row's logs in (default: removed)")
    args = parser.parse_args()
    chosen = [r for r in ROWS if not args.rows or slug(r.name) in args.rows.split(",")]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="eft-chaos-") as tmp:
        root = Path(args.keep or tmp)
        for row in chosen:
            workdir = root / slug(row.name)
            workdir.mkdir(parents=True, exist_ok=True)
            outcomes.append(run_row(row, workdir))
            o = outcomes[-1]
            print(f"{row.name}: {'skipped' if o.skipped else f'{o.seconds:.0f} s'}", flush=True)
    print()
    print_table(chosen, outcomes)


if __name__ == "__main__":
    main()
