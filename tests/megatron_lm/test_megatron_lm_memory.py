"""The memory tier inside Megatron-LM's own loop: a whole node lost, the survivor resumes from memory.

Two simulated nodes of two workers each, TP2 x PP2 (no data parallelism: each node's share
exists nowhere else but in its replica on the other node), a memory checkpoint every
iteration, a disk save every 50. Node 1 is SIGKILLed with its workers after iteration
LOSE_AT (``--eft-inject node_lost``); the survivor re-plans onto its two GPUs, and Megatron's
own load reshards the newest memory checkpoint onto them. Without the tier the same loss
sends the job back to the last disk save: here, none, so from scratch. ``eft report`` reads
both runs from their event logs.

``every_minor`` (run on every tested megatron-core minor, ``-m every_minor``): the snapshot
equals Megatron's own save bit for bit, the check that a snapshot's save is called as the
installed minor's loop calls it (megatron_seam.save_keywords).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from bench.launch import Launched
from bench.megatron_lm import ENV, MODEL
from elasticft.store import EmbeddedEtcd
from tests.megatron_lm.numbers_log import first_redone, read, snapshots
from tests.megatron_lm.test_megatron_lm_e2e import RESUMED, leftovers
from tests.memory_lag import assert_resumed_within_the_lag

# Longer than the longest wait below (tests/test_waits.py): a late job fails with its own message.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("pretrain_gpt.py")
ITERS, LOSE_AT = 15, 12
# One micro batch per global batch: no data parallelism, so the planner keeps TP2 x PP2 on 4 GPUs.
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "4"]
# What almost every production job runs: Megatron's distributed optimizer, its state saved so that
# a re-plan may change TP and PP (else eft's re-plans keep them: planner/megatron_args.reshard_rule).
DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]


def script_args(ckpt: Path, *optimizer: str) -> list[str]:
    return [str(SCRIPT), *MODEL, *LAYOUT, "--train-iters", str(ITERS), "--save", str(ckpt), "--load", str(ckpt),
            "--save-interval", "50", *optimizer]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    """The numbers of an uninterrupted run at TP2 x PP2 under plain torchrun (megatron seeds
    each pipeline stage by its stage: a run's first layout decides its curve)."""
    out = tmp_path_factory.mktemp("reference")
    job = Launched([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    *script_args(out / "ckpt")], out / "torchrun.log",
                   env={**ENV, "EFT_TEST_NUMBERS": str(out / "numbers.jsonl")})
    try:
        assert job.wait(300) == 0, job.output()[-3000:]
    finally:
        job.stop()
    return read(out / "numbers.jsonl")


def layouts(log: str) -> list[tuple[int, int]]:
    """(TP, PP) of each generation, from Megatron's own dump of its arguments (rank 0's)."""
    tp = re.findall(r"^\s*tensor_model_parallel_size \.+ (\d+)$", log, re.MULTILINE)
    pp = re.findall(r"^\s*pipeline_model_parallel_size \.+ (\d+)$", log, re.MULTILINE)
    return [(int(t), int(p)) for t, p in zip(tp, pp, strict=True)]


def lose_a_node(out: Path, mem_ckpt_interval: int, *optimizer: str) -> tuple[int, str, int, dict[int, dict]]:
    """Two nodes, node 1 lost after LOSE_AT: (resumed at, from where, re-done, numbers); the
    survivor re-plans its two GPUs to another TP x PP, which Megatron's load reshards to."""
    out.mkdir()
    run_id = uuid.uuid4().hex[:12]
    env = {**ENV, "EFT_TEST_NUMBERS": str(out / "numbers.jsonl"), "EFT_TEST_SNAPSHOTS": str(out / "snapshots.jsonl"),
           "EFT_TEST_JOB": str(out), "PET_RDZV_CONF": "last_call_timeout=15"}  # the first round waits for both nodes
    with EmbeddedEtcd() as etcd:
        nodes = [Launched([sys.executable, "-m", "launcher.eft_run", "--nnodes", "1:2", "--nproc-per-node", "2",
                           "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
                           "--eft-node-id", f"node{i}", "--max-restarts", "1", "--monitor-interval", "0.1",
                           "--eft-health-source", "none", "--eft-mem-ckpt-interval", str(mem_ckpt_interval),
                           "--eft-inject", f"node_lost:1@{LOSE_AT}", *script_args(out / "ckpt", *optimizer)],
                          out / f"node{i}.log", env=env) for i in range(2)]
        try:
            codes = [node.wait(300) for node in nodes]
            logs = [node.output() for node in nodes]
        finally:
            for node in nodes:
                node.stop()
        report = subprocess.run([sys.executable, "-m", "launcher.cli", "report", "--endpoint", etcd.endpoint,
                                 "--run-id", run_id, "--json"], capture_output=True, text=True, timeout=120)
    survivor = codes.index(0) if 0 in codes else None
    assert survivor is not None and codes[1 - survivor] != 0, "\n".join(
        log[-3000:] for log in logs)
    assert leftovers(out) == []  # the lost node's and the first generation's processes, helpers included
    (found,) = RESUMED.findall(logs[survivor])
    redone = int(found[2])
    first, *_, last = layouts(logs[survivor])
    assert first == (2, 2) and last[0] * last[1] == 2, layouts(logs[survivor])
    # eft report reads the same run from its event log: Megatron's steps, the lost node, the work re-done.
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    (failure,) = summary["failures"]
    assert "node1" in failure["cause"] and failure["iterations_lost"] == redone == summary["iterations_redone"]
    assert summary["finished"] and summary["categories"]["productive"]["gpu_seconds"] > 0
    return int(found[0]) if found[0].isdigit() else 0, found[1], redone, read(out / "numbers.jsonl")


def snapshots_before_the_restart(out: Path, node: str) -> list[int]:
    """The iterations node ``node`` (its group rank) finished a snapshot of before the restart."""
    restarted = first_redone(out / "numbers.jsonl")["time"]
    return [s["iteration"] for s in snapshots(out / "snapshots.jsonl") if s["time"] < restarted and s["node"] == node]


def test_a_lost_node_resumes_from_memory_at_the_new_layout(reference, tmp_path):
    """(Without the tier, and no save yet, the job would start over: LOSE_AT iterations re-done.)
    With Megatron's distributed optimizer, as production jobs run (torch's Adam through the same
    loss: the GPT example's tests/test_mem_ckpt_e2e.py). The reference ran torch's Adam: without
    data parallelism the distributed optimizer's step is the same arithmetic, and so its numbers."""
    resumed, source, redone, numbers = lose_a_node(tmp_path / "memory", 1, *DISTRIBUTED_OPTIMIZER)
    assert source == "memory" and resumed <= LOSE_AT and redone == LOSE_AT - resumed
    for node in ("0", "1"):  # every node's part of it, the lost node's from its replica
        assert_resumed_within_the_lag(resumed, snapshots_before_the_restart(tmp_path / "memory", node), node)
    # Every iteration, the re-done ones from the resharded state included: the uninterrupted run's numbers.
    assert sorted(numbers) == sorted(reference) == list(range(1, ITERS + 1))
    for iteration, expected in reference.items():
        assert numbers[iteration]["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-4), iteration
        assert numbers[iteration]["loss"] == pytest.approx(expected["loss"], abs=1e-4), iteration


def test_a_disk_checkpoint_newer_than_memory_wins(tmp_path):
    """Snapshots every 4 iterations, Megatron's saves every 3, a rank killed after iteration 7:
    memory holds iteration 4, disk 6, and the restart loads disk's 6 through Megatron's load.
    In warm interpreters that imported megatron-core and Megatron-LM's loop ahead of need: eft
    attached to the loop there as it does in a cold worker."""
    ckpt = tmp_path / "ckpt"
    job = Launched([sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2",
                    "--monitor-interval", "0.1", "--eft-health-source", "none", "--max-restarts", "1",
                    "--eft-warm-workers", "--eft-preload", "auto,warm_preload",
                    "--eft-mem-ckpt-interval", "4", "--eft-inject", "rank_killed:1@7",
                    str(SCRIPT), *MODEL, "--train-iters", "8", "--save", str(ckpt), "--load", str(ckpt),
                    "--save-interval", "3"], tmp_path / "job.log", env={**ENV, "EFT_TEST_JOB": str(tmp_path)})
    try:
        assert job.wait(300) == 0, job.output()[-3000:]
        log = job.output()
    finally:
        job.stop()
    assert "memory checkpoint 4 is older than disk checkpoint 6: loading from disk" in log
    assert sorted(re.findall(r"local rank (\d): warm start in pid", log)) == ["0", "0", "1", "1"], log[-3000:]
    # iteration 7 re-done: the heartbeats say 7, or 6 where iteration 7 began within 50 ms of the
    # save's heartbeat (one write per STEP_WRITE_INTERVAL: an idle machine runs this model that fast)
    assert RESUMED.findall(log) in ([("6", "disk", "1")], [("6", "disk", "0")])
    assert re.search(r"successfully loaded checkpoint from \S+/ckpt .*at iteration 6", log)
    assert leftovers(tmp_path) == []


@pytest.mark.every_minor
def test_the_snapshot_copy_overlaps_the_next_step_and_equals_megatrons_own_save(tmp_path):
    """The unmodified script under torchrun with eft's worker side (no agent): a snapshot every
    iteration, Megatron's own save at iteration 3, and from iteration 3 on every copy made slow
    (``--eft-inject copy_slow``): iteration 4's forward and backward run during the copy of 3,
    its optimizer step waits for it, and the snapshot of 3 holds what Megatron's save of 3 does."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from bench.megatron_lm import agentless_env
    from elasticft.contract.faults import COPY_SLOW_SECONDS
    from elasticft.contract.run_dir import OUTBOX_DIR, OutboxKind

    mem = tmp_path / "mem"
    mem.mkdir()
    env = {**ENV, **agentless_env(tmp_path, mem, {"EFT_MEM_CKPT_INTERVAL": "1",
                                                  "EFT_INJECT": "copy_slow:0@3,copy_slow:1@3"})}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), *MODEL, "--train-iters", "4", "--save", str(tmp_path / "ckpt"),
                           "--save-interval", "3"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, **env})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    saved = {r["iteration"]: r for r in (json.loads(p.read_text())
                                         for p in (tmp_path / "run" / OUTBOX_DIR).glob("*.json"))
             if r["type"] == OutboxKind.MEM_SAVED}
    three = saved[3]
    assert all(r["overlapped"] for r in saved.values()) and three["copy"] >= COPY_SLOW_SECONDS, saved
    # The training thread waited at iteration 4's update for what was left of the copy; its
    # own part of the snapshot (the capture and the plan) did not contain the copy.
    assert 0 < three["waited"] < three["copy"] and three["stall"] - three["waited"] < COPY_SLOW_SECONDS / 2, three
    states = []
    for name, source in (("memory", mem / "iter_0000003"), ("megatron", tmp_path / "ckpt" / "iter_0000003")):
        dcp_to_torch_save(source, tmp_path / f"{name}.pt")
        states.append(torch.load(tmp_path / f"{name}.pt", weights_only=False))
    memory, megatron = states
    tensors = [k for k, v in megatron.items() if isinstance(v, torch.Tensor)]
    assert sorted(memory) == sorted(megatron) and len(tensors) > 10
    assert [k for k in tensors if not torch.equal(memory[k], megatron[k])] == []  # bit for bit
