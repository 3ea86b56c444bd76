"""A node lost in Megatron-Bridge's own loop under eft-run: what is re-done with the memory tier and without.

Two simulated nodes of two workers each run tests/megatron_bridge/pretrain_bridge.py (an
unmodified recipe script, Bridge's ``pretrain`` loop) at TP2, Bridge saving to disk every
``--save-interval`` iterations. After iteration ``--lose-at`` node 1 is SIGKILLed with its workers
(``--eft-inject node_lost``); the survivor re-plans onto its two GPUs and goes on. Rows: the
memory tier on (a snapshot every iteration, restored through Bridge's own load) and off (the
newest disk save), each with where the survivor resumed, the iterations re-done, the job's wall
time, and the largest difference of any iteration's loss from plain torchrun's uninterrupted
run of the same script (the baseline, measured in the same run).

``--layout tp2pp2`` plans the job from a model config instead (TP2 x PP2 on four GPUs, TP2 x PP1
on the survivor), with untied embeddings and a fully reshardable distributed optimizer; its
baseline is plain torchrun at TP2 x PP2 on four workers. With the lane's interpreter::

    $(bash .ci/setup_bridge | tail -n 1) bench/megatron_bridge_node_loss.py [--layout tp2pp2]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402  (also puts the repo on sys.path)
from launch import Launched  # noqa: E402
from megatron_lm import ENV, ROOT  # noqa: E402

from elasticft.store import EmbeddedEtcd  # noqa: E402

SCRIPT = ROOT / "tests" / "megatron_bridge" / "pretrain_bridge.py"
RESUMED = re.compile(r"workers resumed from iteration (\w+) \((\w+)\); (\d+) iteration\(s\) re-done")
LOSS = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
# A model config for the planner (a recipe has no Megatron flags to read): GBS = MBS, so no data
# parallelism and TP x PP fills the GPUs.
MODEL = {"num_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "seq_length": 32, "vocab_size": 128,
         "global_batch_size": 8, "micro_batch_size": 8}
PLANNED = ["train.micro_batch_size=8", "model.share_embeddings_and_output_weights=false",
           "checkpoint.dist_ckpt_optim_fully_reshardable=true"]


def losses(log: str) -> list[tuple[int, float]]:
    return [(int(i), float(loss)) for i, loss in LOSS.findall(log)]


def overrides(args, ckpt: Path) -> list[str]:
    layout = ["model.tensor_model_parallel_size=2", *(PLANNED if args.layout == "tp2pp2" else [])]
    return [*layout, f"checkpoint.save={ckpt}", f"train.train_iters={args.iters}",
            f"checkpoint.save_interval={args.save_interval}"]


def plain(args, work: Path) -> dict[int, float]:
    """The uninterrupted run under torchrun, at the two-node job's first layout."""
    procs, layout = (4, ["model.pipeline_model_parallel_size=2"]) if args.layout == "tp2pp2" else (2, [])
    job = Launched([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                    str(SCRIPT), *overrides(args, work / "plain"), *layout], work / "plain.log", env=ENV)
    try:
        assert job.wait(600) == 0, job.output()[-3000:]
        return dict(losses(job.output()))
    finally:
        job.stop()


def lose_a_node(args, work: Path, memory: bool, baseline: dict[int, float]) -> list:
    run_id = uuid.uuid4().hex[:12]
    extra = []
    if args.layout == "tp2pp2":
        (work / "model.json").write_text(json.dumps(MODEL))
        extra = ["--eft-model-config", str(work / "model.json")]
    name = "memory" if memory else "disk"
    began = time.time()
    with EmbeddedEtcd() as etcd:
        nodes = [Launched([sys.executable, "-m", "launcher.eft_run", "--nnodes", "1:2", "--nproc-per-node", "2",
                           "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
                           "--eft-node-id", f"node{i}", "--max-restarts", "1", "--monitor-interval", "0.1",
                           "--eft-health-source", "none", "--eft-mem-ckpt-interval", "1" if memory else "0",
                           "--eft-inject", f"node_lost:1@{args.lose_at}", *extra, str(SCRIPT),
                           *overrides(args, work / f"ckpt-{name}")],
                          work / f"{name}-node{i}.log", env={**ENV, "PET_RDZV_CONF": "last_call_timeout=15"})
                 for i in range(2)]
        try:
            codes = [node.wait(600) for node in nodes]
            logs = [node.output() for node in nodes]
        finally:
            for node in nodes:
                node.stop()
    wall = time.time() - began
    assert codes[0] == 0, logs[0][-3000:]
    ((resumed, source, redone),) = RESUMED.findall(logs[0])
    got = losses(logs[1]) + losses(logs[0])  # the last rank logs: node 1's before the loss, then the survivor's
    worst = max(abs(loss - baseline[i]) for i, loss in got)
    return [f"memory tier {'on' if memory else 'off'}", f"{resumed} ({source})", int(redone), wall, f"{worst:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12, help="iterations of the job")
    parser.add_argument("--lose-at", type=int, default=9, help="iteration after which node 1 is SIGKILLed")
    parser.add_argument("--save-interval", type=int, default=5, help="Bridge's disk saves (checkpoint.save_interval)")
    parser.add_argument("--layout", choices=("tp2", "tp2pp2"), default="tp2",
                        help="tp2: the recipe's TP2 (DP2, then DP1); tp2pp2: planned from a model config")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eft-bridge-loss-") as tmp:
        work = Path(tmp)
        baseline = plain(args, work)
        rows = [lose_a_node(args, work, memory, baseline) for memory in (True, False)]
    print(f"node 1 of 2 (2 workers each) lost after iteration {args.lose_at} of {args.iters}; disk saves every "
          f"{args.save_interval}; layout {args.layout}; baseline: plain torchrun, uninterrupted")
    print(table(["run", "resumed from", "re-done", "job wall s", "max |loss - torchrun|"], rows))


if __name__ == "__main__":
    main()
