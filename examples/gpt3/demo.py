"""The eft demo: a megatron-core GPT on two simulated nodes survives a dying GPU and a lost node.

Two eft-run agents (2 workers each, TP2 x PP2: each node holds half of the layers) share
one embedded etcd on this machine. Every iteration each rank snapshots its state into host memory, and each node's
agent copies its node's share to the other node (the memory tier). After iteration
--degrade-at the GPU of rank 2 (node 1) starts to fail; node 1's health sampler sees it
and asks for an emergency checkpoint; every rank saves the same iteration. After
--lose-at, node 1 dies (its agent and workers are SIGKILLed). Node 0 notices the lost
lease, re-plans for 2 GPUs, resumes from the newest state it has — memory, with node 1's
share from its replica, or disk — resharded to the new layout, and finishes
--train-iters. Then it prints what happened.

  python examples/gpt3/demo.py [--out DIR] [--no-health] [--no-memory] [--comeback-at I]

--no-health leaves the GPU healthy: nothing warns before the node dies.
--no-memory turns the memory tier off (disk checkpoints only): compare how much is re-done.
--compare runs the scenario with and without the memory tier and prints both.
--comeback-at starts a new node 1 once node 0 reaches iteration I (scale-up).

Then `eft report` on the run's event log (OUT/events.jsonl): where the GPU time went, the
goodput, and a timeline picture (OUT/timeline.html).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from story import compare, tell  # noqa: E402

from elasticft.agent.events import EventLog  # noqa: E402
from elasticft.contract.keys import RunKeys
from elasticft.store import EmbeddedEtcd, StoreOptions, connect

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "128", "--global-batch-size", "8",
         "--lr", "5e-3", "--seed", "1234"]


def train_args(out: Path, args) -> list[str]:
    return [str(HERE / "train.py"), *MODEL, "--train-iters", str(args.train_iters),
            "--micro-batch-size", str(getattr(args, "micro_batch_size", 1)),
            "--tensor-model-parallel-size", "2", "--save", str(out / "ckpt"), "--load", str(out / "ckpt"),
            "--save-interval", str(args.save_interval), "--log-file", str(out / "train.jsonl")]


def agent(endpoint: str, run_id: str, out: Path, args, name: str, faults: str) -> subprocess.Popen:
    # Nodes beyond --nnodes's maximum wait as spares (docs/spares.md)
    cmd = [sys.executable, "-m", "launcher.eft_run", "--nnodes", f"1:{args.nodes - getattr(args, 'spares', 0)}",
           "--nproc-per-node", str(getattr(args, "procs", 2)),
           "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
           "--eft-node-id", name, "--eft-health-interval", "0.5", "--max-restarts", "1",
           "--eft-mem-ckpt-interval", str(0 if args.no_memory else args.mem_ckpt_interval),
           # /metrics on a free loopback port, for `eft metrics targets` and a Prometheus beside the demo
           "--eft-metrics-port", "0", "--eft-metrics-host", "127.0.0.1"]
    if not getattr(args, "cold_workers", False):
        # restarts start in interpreters that imported torch and megatron-core ahead of need
        # (train.py declares gpt_preload: no --eft-preload)
        cmd += ["--eft-warm-workers"]
    if faults:
        cmd += ["--eft-inject", faults]
    cmd += getattr(args, "agent_flags", [])  # tests add their own eft-run flags
    log = open(out / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it until it exits
    # The agents start together, but on a loaded machine one can start seconds after another: the
    # first round waits for every node (it closes at once when all are in), or it forms without
    # one, which joins at the next checkpoint and misses the story. Later rounds do not wait: the
    # survivors of a lost node rejoin at once (docs/rendezvous.md). torchrun reads PET_RDZV_CONF.
    env = {**os.environ, "PET_RDZV_CONF": os.environ.get("PET_RDZV_CONF", "last_call_timeout=15")}
    return subprocess.Popen([*cmd, *train_args(out, args)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True, env=env)


def iterations(out: Path) -> list[dict]:
    path = out / "train.jsonl"
    if not path.exists():
        return []
    records = []
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line rank 0 is writing now: the next poll reads it whole
            break
    return records


def run(args) -> dict:
    out = Path(args.out or tempfile.mkdtemp(prefix="eft-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    # Every agent is told of the GPU fault (so every node's GPUs read from the injected source);
    # only node 1's of its loss: a fault fires once per agent, and after a comeback node 0 can be
    # group rank 1 (ranks sort by the agents' names, <addr>_<pid>), re-train iteration --lose-at
    # and die in its turn.
    faults = [] if args.no_health else [f"gpu_degrade:2@{args.degrade_at}"]
    faults += getattr(args, "faults", [])  # tests add their own
    lost = [f"node_lost:1@{args.lose_at}"] if args.lose_at else []
    run_id = uuid.uuid4().hex[:12]
    with EmbeddedEtcd() as etcd:
        nodes = [agent(etcd.endpoint, run_id, out, args, f"node{i}", ",".join(faults + (lost if i == 1 else [])))
                 for i in range(args.nodes)]
        comeback = None
        try:
            deadline = time.monotonic() + args.timeout
            while nodes[0].poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"demo: no result within {args.timeout} s; logs in {out}")
                done = [r["iteration"] for r in iterations(out) if r.get("event") == "iteration"]
                if getattr(args, "during", None) is not None:  # a test's own faults
                    args.during(etcd.endpoint, run_id, dict(zip((f"node{i}" for i in range(len(nodes))), nodes)),
                                done[-1] if done else 0)
                if args.comeback_at and comeback is None and done and done[-1] >= args.comeback_at \
                        and nodes[1].poll() is not None:
                    comeback = agent(etcd.endpoint, run_id, out, args, "node1-again", "")
                    nodes.append(comeback)
                time.sleep(0.2)
            for node in nodes[1:]:
                node.wait(60)
            client = connect(StoreOptions(etcd.endpoint))
            events = EventLog(client, RunKeys(run_id), "demo").read()
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
    result = {"out": str(out), "exit_code": nodes[0].returncode, "events": events, "log": iterations(out)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    return result


def goodput(result: dict) -> str:
    """What `eft report --events OUT/events.jsonl --plot OUT/timeline.html` prints, and the picture."""
    out = Path(result["out"])
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "report", "--events", str(out / "events.jsonl"),
                           "--plot", str(out / "timeline.html")], cwd=ROOT, capture_output=True, text=True)
    return (done.stdout or done.stderr).rstrip() + f"\n(timeline picture: {out / 'timeline.html'})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for logs, checkpoints and result.json (default: a temp dir)")
    parser.add_argument("--train-iters", type=int, default=24)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--degrade-at", type=int, default=12, help="iteration after which rank 2's GPU fails")
    parser.add_argument("--lose-at", type=int, default=14, help="iteration after which node 1 dies")
    parser.add_argument("--no-health", action="store_true", help="no failing GPU: periodic saves only")
    parser.add_argument("--comeback-at", type=int, default=0, help="restart node 1 at this iteration")
    parser.add_argument("--mem-ckpt-interval", type=int, default=1, help="iterations between memory checkpoints")
    parser.add_argument("--no-memory", action="store_true", help="no memory checkpoints: disk only")
    parser.add_argument("--compare", action="store_true", help="run with and without the memory tier")
    parser.add_argument("--cold-workers", action="store_true", help="no warm interpreters: every worker starts cold")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (2 workers each)")
    parser.add_argument("--spares", type=int, default=0, help="of --nodes, how many wait as spares")
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="8 (the whole global batch): no data parallelism, so TP2 x PP2 spans both nodes "
                             "and a lost node's share of the state exists only in its replica")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if not args.compare:
        result = run(args)
        print(tell(result, args))
        print("\n" + goodput(result))
        return 0 if result["exit_code"] == 0 else 1
    results = {}
    for memory in (True, False):
        case = argparse.Namespace(**{**vars(args), "no_memory": not memory,
                                     "out": str(Path(args.out) / ("memory" if memory else "disk")) if args.out else None})
        results["memory tier" if memory else "disk only"] = (run(case), case)
    for name, (result, case) in results.items():
        print(f"--- {name} ---\n{tell(result, case)}\n")
    print(compare(results))
    return 0 if all(r["exit_code"] == 0 for r, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
