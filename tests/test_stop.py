"""A restart's stop (issue 53, item 5): after a worker's SIGKILL the node's other workers and
everything they started are stopped, and the next generation starts without waiting for
anything that is already dead: neither for helpers to be reaped nor, for ranks whose peer died
(here or on another node), for torch's SIGTERM grace (agent/dead_peers.py).

What the workers leave in their sessions (a torch_dist save's helpers, dataloader workers) is
SIGKILLed at the stop and re-parented to init, or to a container's PID 1. Whether and when that
reaps them is not eft's to wait for: a zombie holds nothing. Here the launcher runs under a
parent that adopts orphans and never reaps them (PR_SET_CHILD_SUBREAPER), as a container whose
PID 1 does not reap: before, every restart's stop waited out the helpers' timeout for them.
"""

from __future__ import annotations

import inspect
import json
import sys

import psutil
import pytest
from torch.distributed.elastic.multiprocessing.api import PContext

from bench.launch import eft_run, read_jsonl
from bench.stop_phase import NON_REAPING_PARENT
from elasticft.agent.orphans import HELPERS_GONE_TIMEOUT
from elasticft.contract.phases import RestartPhase
from elasticft.goodput.breakdown import breakdown

# torch's grace between SIGTERM and SIGKILL when its process context closes the workers left
# after one failed: what a rank stuck with a dead peer cost before.
TORCH_GRACE = inspect.signature(PContext.close).parameters["timeout"].default


def first_generation(out) -> list[int]:
    """Every pid the first generation wrote down: its workers and their helpers."""
    return [pid for path in sorted(out.glob("first-*.json")) for pid in json.loads(path.read_text()).values()]


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie, which holds nothing, is not)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def stop_seconds(events_file) -> float:
    """The first restart's ``stop`` phase, as ``eft report`` takes it apart."""
    failures = breakdown(read_jsonl(events_file)).failures
    assert failures, "no restart in the event log"
    return next(span.seconds for span in failures[0].phases if span.phase is RestartPhase.STOP)


def test_after_a_workers_sigkill_the_node_is_stopped_without_waiting_for_its_dead_helpers_to_be_reaped(
        tmp_path, eft_job):
    """Two workers, each with a helper; local rank 1 SIGKILLs itself. Its peer and both helpers
    are stopped, the second generation finds none of them running, and the stop lasts nowhere
    near HELPERS_GONE_TIMEOUT, which it used to last in full: the helpers' zombies, never reaped
    here, were waited for as if they still ran."""
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    node = eft_job("stop_probe.py", out, nproc=2, launcher=[sys.executable, "-c", NON_REAPING_PARENT, *eft_run()],
                   eft_flags=["--max-restarts", "1", "--eft-events-file", events])
    assert node.wait(180) == 0, node.output()[-3000:]
    assert len(first_generation(out)) == 4
    for rank in (0, 1):
        assert json.loads((out / f"seen-{rank}.json").read_text()) == {"running": []}
    stop = stop_seconds(events)
    assert stop < HELPERS_GONE_TIMEOUT, (f"the stop took {stop:.2f} s: it waited out the {HELPERS_GONE_TIMEOUT:g} s "
                                         "meant for helpers stuck in the kernel, for dead ones")


def test_a_worker_that_ignores_sigterm_and_a_stopped_helper_are_killed_and_nothing_is_left_running(
        tmp_path, eft_job):
    """Local rank 0 ignores SIGTERM and its helper is SIGSTOPped (a frozen process acts on no
    signal but SIGKILL): both are killed (rank 0 at once, its local peer being dead), the second
    generation starts with nothing of the first running, and nothing outlives the job."""
    out = tmp_path / "out"
    out.mkdir()
    node = eft_job("stop_probe.py", out, "--ignore-sigterm", "--stopped-helper", nproc=2,
                   eft_flags=["--max-restarts", "1"])
    assert node.wait(180) == 0, node.output()[-3000:]
    first = first_generation(out)
    assert len(first) == 4
    for rank in (0, 1):
        assert json.loads((out / f"seen-{rank}.json").read_text()) == {"running": []}
    assert not running(first)


def stuck_peer_restart(out) -> tuple[float, list[int]]:
    """Seconds from the rank's SIGKILL to the second generation's first start, and the first
    generation's pids that any second-generation rank found running."""
    killed = json.loads((out / "killed.json").read_text())["time"]
    seen = [json.loads(path.read_text()) for path in sorted(out.glob("second-*.json"))]
    assert seen, "no second generation"
    return min(s["started"] for s in seen) - killed, [pid for s in seen for pid in s["running"]]


def assert_killed_at_once(out) -> None:
    """The second generation started within torch's grace of the kill, nothing of the first ran
    then, and none of the first generation's two workers runs now."""
    took, running_then = stuck_peer_restart(out)
    assert took < TORCH_GRACE, f"the next generation started {took:.1f} s after the kill: torch's grace was waited"
    assert running_then == []
    first = [json.loads(path.read_text())["worker"] for path in out.glob("first-*.json")]
    assert len(first) == 2 and not running(first)


def test_a_rank_stuck_with_a_dead_local_peer_is_killed_at_once_not_after_torchs_grace(tmp_path, eft_job):
    """Two workers on one node; local rank 1 SIGKILLs itself while rank 0, like a rank blocked in
    an NCCL collective with it, records SIGTERM (eft's hook: a save it cannot make) and never
    returns. torch's monitor used to close it with SIGTERM and wait its whole grace; now it gets
    SIGKILL at once, the second generation starts well within that grace, and nothing is left."""
    out = tmp_path / "out"
    out.mkdir()
    node = eft_job("stuck_peer.py", out, nproc=2, eft_flags=["--max-restarts", "1"])
    assert node.wait(180) == 0, node.output()[-3000:]
    assert_killed_at_once(out)


def test_a_rank_whose_peer_nodes_worker_died_is_killed_at_once_not_after_torchs_grace(tmp_path, eft_job):
    """Two nodes of one worker. The last rank SIGKILLs itself; its agent restarts (charged) and
    waits in the next round. The other node's rank records SIGTERM and never returns (stuck in a
    collective with the dead one): its node saw only a node waiting to join and stopped it with
    SIGTERM and torch's grace; the failed node's record now says its workers of the round failed,
    so the other node kills its rank at once and the second round starts well within the grace."""
    out = tmp_path / "out"
    out.mkdir()
    nodes = [eft_job("stuck_peer.py", out, nodes="2", eft_flags=["--max-restarts", "1"]) for _ in range(2)]
    for node in nodes:
        assert node.wait(180) == 0, node.output()[-3000:]
    assert_killed_at_once(out)
