"""The memory tier inside Megatron-Bridge's own loop: a whole node lost, the survivor resumes from memory.

Two simulated nodes of two workers each, TP2 (data parallel 2 across the nodes: each node's
shard of the distributed optimizer exists nowhere else but in its replica on the other node), a
memory checkpoint every iteration, no disk save before the end. Node 1 is SIGKILLed with its
workers after iteration LOSE_AT (``--eft-inject node_lost``); the survivor's two workers (TP2,
data parallel 1) load the newest snapshot through Bridge's own load, which reshards it. Then a
NaN injected once into a step's loss (NAN_AT) rolls the job back to the newest snapshot before it,
from memory too, and the re-run is found transient. Every iteration's loss, re-done ones
included, is plain torchrun's. Without the tier the same loss re-does everything since the last
disk save: here none, so LOSE_AT iterations (``bench/megatron_bridge_node_loss.py`` prints both
figures). ``eft report`` reads the run from its event log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elasticft.store import EmbeddedEtcd
from tests.megatron_bridge.jobs import losses, start
from tests.megatron_lm.numbers_log import snapshots
from tests.megatron_lm.test_megatron_lm_e2e import RESUMED, leftovers
from tests.memory_lag import assert_resumed_within_the_lag

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ITERS, LOSE_AT, NAN_AT = 8, 5, 7


def lose_a_node(out: Path, mem_ckpt_interval: int) -> tuple[list[str], str]:
    """Two nodes of two workers, node 1 lost after LOSE_AT: (the nodes' logs, eft report's JSON)."""
    out.mkdir()
    run_id = uuid.uuid4().hex[:12]
    env = {"EFT_TEST_SNAPSHOTS": str(out / "snapshots.jsonl"),
           "PET_RDZV_CONF": "last_call_timeout=15"}  # the first round waits for both nodes
    with EmbeddedEtcd() as etcd:
        nodes = [start(out, [sys.executable, "-m", "launcher.eft_run", "--nnodes", "1:2", "--nproc-per-node", "2",
                             "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
                             "--eft-node-id", f"node{i}", "--max-restarts", "1", "--monitor-interval", "0.1",
                             "--eft-health-source", "none", "--eft-mem-ckpt-interval", str(mem_ckpt_interval),
                             "--eft-inject", f"node_lost:1@{LOSE_AT},nan:0@{NAN_AT}"],
                       f"checkpoint.save={out / 'ckpt'}", f"train.train_iters={ITERS}", "checkpoint.save_interval=100",
                       name=f"node{i}", env=env) for i in range(2)]
        try:
            codes = [node.wait(300) for node in nodes]
            logs = [node.output() for node in nodes]
        finally:
            for node in nodes:
                node.stop()
        report = subprocess.run([sys.executable, "-m", "launcher.cli", "report", "--endpoint", etcd.endpoint,
                                 "--run-id", run_id, "--json"], capture_output=True, text=True, timeout=120)
    assert codes[0] == 0 and codes[1] != 0, "\n".join(log[-3000:] for log in logs)
    assert report.returncode == 0, report.stderr
    return logs, report.stdout


def test_a_lost_node_resumes_from_memory_a_nan_rolls_back_to_memory_and_every_loss_is_plain_torchruns(
        plain, tmp_path):
    out = tmp_path / "memory"
    logs, report = lose_a_node(out, 1)
    (resumed, source, redone), (rolled_back, rollback_source, _) = RESUMED.findall(logs[0])
    resumed, redone = int(resumed), int(redone)
    assert source == "memory" and resumed <= LOSE_AT and redone == LOSE_AT - resumed
    assert f"iteration {NAN_AT} re-run is good: a transient fault" in logs[0], logs[0][-3000:]
    assert rollback_source == "memory" and int(rolled_back) < NAN_AT  # the newest state before the NaN
    records = snapshots(out / "snapshots.jsonl")
    for node in ("0", "1"):  # every node's part of it, the lost node's from its replica
        first = next(r["pid"] for r in records if r["node"] == node)  # the first generation's workers
        assert_resumed_within_the_lag(resumed, [r["iteration"] for r in records if r["pid"] == first], node)
    # Every iteration, the re-done ones from the resharded state included: plain torchrun's loss.
    # Bridge logs an iteration on the last rank: node 1's before the loss, the survivor's after.
    expected = dict(losses(plain[0]))
    got = losses(logs[1]) + losses(logs[0])
    assert sorted({i for i, _ in got}) == sorted(expected) and got[-1][0] == ITERS
    for iteration, loss in got:
        assert loss == pytest.approx(expected[iteration], abs=1e-4), iteration
    summary = json.loads(report)
    lost = [f for f in summary["failures"] if "node1" in f["cause"]]
    assert len(lost) == 1 and lost[0]["iterations_lost"] == redone
    assert summary["finished"] and summary["categories"]["productive"]["gpu_seconds"] > 0
    assert leftovers(out) == []  # the lost node's and the first generation's processes, helpers included
