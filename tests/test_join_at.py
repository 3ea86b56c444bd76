"""--eft-join-at save end to end: a node that comes back joins a running job at its next checkpoint.

Two eft-run nodes train toy_train.py with a disk save every SAVE_EVERY iterations; a third
starts mid-run, with a join timeout shorter than the members hold it. They hold it until
the next save is complete, then restart for it (``--eft-join-at now``: tests/test_elastic.py's
join test).
"""

import pytest

from bench.launch import wait_for, worker_events
from elasticft.agent.events import EventLog
from elasticft.contract.events import EventKind

pytestmark = pytest.mark.slow

SAVE_EVERY = 200  # iterations of 0.05 s: the first save some 10 s into training
JOIN_TIMEOUT = 4  # the third node's: shorter than the hold, which must not fail it


def test_a_node_that_comes_back_joins_after_the_next_save(tmp_path, eft_job, etcd, run_keys):
    out = tmp_path / "out"
    out.mkdir()

    def node(*flags):
        return eft_job("toy_train.py", out, "--save", tmp_path / "ckpt", "--iters", 100000, "--save-interval",
                       SAVE_EVERY, nodes="2:3", eft_flags=["--max-restarts", "0", "--eft-join-at", "save", *flags])

    nodes = [node(), node()]
    wait_for(lambda: len(worker_events(out, "resume")) == 2, 120, "the two nodes' workers")
    nodes.append(node("--rdzv-conf", f"join_timeout={JOIN_TIMEOUT}"))

    def world_of_3():
        starts = [e for e in worker_events(out, "resume") if e["world_size"] == 3]
        return starts if len(starts) == 3 else None

    resumed = wait_for(world_of_3, 120, "three ranks")
    events = EventLog(etcd, run_keys, "test").read()

    def of(kind):
        return [e for e in events if e["kind"] == kind]

    (held,), (let_in,) = of(EventKind.JOIN_HELD), of(EventKind.JOIN_LET_IN)
    assert let_in["why"] == "checkpoint" and let_in["iteration"] > (held["after"] or 0), let_in
    # the save it was let in at completed while it waited, and only then did the members restart
    (saved,) = [e for e in of(EventKind.CKPT_SAVED) if e["iteration"] == let_in["iteration"]]
    assert held["time"] <= saved["time"] <= let_in["time"]
    restarts = [e for e in of(EventKind.RESTART) if e["reason"] == "membership"]
    assert len(restarts) == 2 and all(r["time"] >= let_in["time"] for r in restarts), restarts
    # no iteration done again: the three ranks resume where the two stopped
    reached = max(e["iteration"] for e in of(EventKind.WORKERS_STOPPED) if e["why"] == "restart")
    assert {e["iteration"] for e in resumed} == {reached} and reached >= let_in["iteration"]
    assert "waits to join: held until the next checkpoint" in nodes[2].output()
