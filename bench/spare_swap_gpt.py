"""Seconds from kill -9 of a training node to the GPT example's first iteration after it, with a
spare and without one (issue 55's own hand test; docs/spares.md).

spare: three agents with ``--nnodes 2:2``, one worker each, examples/gpt3/train.py at TP1 x DP2
with memory checkpoints every iteration; the member of node rank 1 is killed (agent and worker)
once rank 0 logged iteration ``--kill-at``; timed to the first iteration rank 0 logs after the
kill (the spare's rank restored from its own memory copy). With ``--eft-warm-workers`` and
without. re-plan (no spare), the baseline: two agents with ``--nnodes 1:2``, the survivor alone at
TP1 x DP1 from its memory. One embedded etcd.

  python bench/spare_swap_gpt.py [--kill-at 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import table
from launch import ROOT, Launched, wait_for

from elasticft.store import EmbeddedEtcd

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "128", "--global-batch-size", "8",
         "--micro-batch-size", "1", "--lr", "5e-3", "--seed", "1234", "--tensor-model-parallel-size", "1"]
WARM = ("--eft-warm-workers",)
# name: (--nnodes, agents, eft-run flags)
DESIGNS = {
    "spare, warm workers": ("2:2", 3, WARM),
    "spare, workers cold": ("2:2", 3, ()),
    "re-plan (no spare), warm workers": ("1:2", 2, WARM),
}


def iterations(log: Path) -> list[dict]:
    """rank 0's ``iteration`` records (examples/gpt3/run_log.py), whole lines only."""
    found = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record.get("event") == "iteration":
            found.append(record)
    return found


def trial(nnodes: str, agents: int, flags: tuple[str, ...], endpoint: str, work: Path, kill_at: int) -> dict:
    run_id, train_log = uuid.uuid4().hex, work / "train.jsonl"
    nodes = []
    try:
        for i in range(agents):
            cmd = [sys.executable, "-m", "launcher.eft_run", "--nnodes", nnodes, "--nproc-per-node", "1",
                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                   "--eft-node-id", f"node{i}", "--max-restarts", "1", "--eft-mem-ckpt-interval", "1", *flags,
                   str(ROOT / "examples" / "gpt3" / "train.py"), *MODEL, "--train-iters", "1000",
                   "--save", str(work / "ckpt"), "--load", str(work / "ckpt"), "--save-interval", "1000",
                   "--log-file", str(train_log)]
            nodes.append(Launched(cmd, work / f"node{i}.log"))
        wait_for(lambda: any(r["iteration"] >= kill_at for r in iterations(train_log)), 600, "the kill's iteration")
        victim = next(n for n in nodes if "rendezvous complete: node rank 1 of 2" in n.output())
        killed = time.time()
        victim.kill_node()
        first = wait_for(lambda: next((r for r in iterations(train_log) if r["time"] > killed), None), 300,
                         "an iteration after the kill")
        last = max(r["iteration"] for r in iterations(train_log) if r["time"] <= killed)
        remote = sum(float(mb) for n in nodes if n is not victim for mb in _remote_mb(n.output()))
        return {"seconds": first["time"] - killed, "redone": last - first["iteration"] + 1, "remote_mb": remote}
    finally:
        for node in nodes:
            node.stop()


def _remote_mb(log: str) -> list[str]:
    """The MB each memory restore read from other nodes (agent/memory.py's line)."""
    marker = " MB here and "
    return [line.split(marker)[1].split(" MB")[0] for line in log.splitlines() if marker in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", type=int, default=20, help="rank 0's iteration after which a node is killed")
    args = parser.parse_args()
    rows = []
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        for n, (name, (nnodes, agents, flags)) in enumerate(DESIGNS.items()):
            work = Path(tmp) / str(n)
            work.mkdir()
            got = trial(nnodes, agents, flags, etcd.endpoint, work, args.kill_at)
            print(f"{name}: {got}", flush=True)
            rows.append([name, f"{got['seconds']:.2f}", got["redone"], f"{got['remote_mb']:.1f}"])
    print()
    print("kill -9 of the node of rank 1 (GPT example, memory checkpoints every iteration) -> rank 0's first "
          "iteration after it; issue 55's target: the lease TTL + 1.5 s (4.5 s)")
    print(table(["design", "kill -> next iteration, s", "iterations re-done", "MB restored over the network"],
                rows))
    spare, replan = float(rows[0][1]), float(rows[2][1])
    print(f"spare (warm) / re-plan (warm): {spare / replan:.2f}")


if __name__ == "__main__":
    main()
