"""A rank stuck with a dead peer, before and after its restart stops it with SIGKILL (issue 53, item 5), in one run.

The last rank SIGKILLs itself; every other rank, like one blocked in an NCCL collective with it,
records the SIGTERM it gets (eft's hook: a save it cannot make) and never returns
(tests/workers/stuck_peer.py). The figure is the time from the kill to the next generation's
first worker start, under two agents:

* ``baseline``: eft as it was: torch's monitor closes a node's workers left after one failed
  with SIGTERM and a 30 s grace; a node whose peer node's workers failed sees only a node
  waiting to join, and stops its ranks with SIGTERM and the same grace;
* ``eft``: SIGKILL at once in both (``elasticft/agent/dead_peers.py``).

Cases: ``local``, one node of 2 workers; ``nodes``, two nodes of one worker on one etcd.

  python bench/stuck_peer_stop.py [--cases local,nodes] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, table  # noqa: E402  (also puts the repo on sys.path)
from launch import WORKERS, rdzv_command  # noqa: E402

from elasticft.store import EmbeddedEtcd  # noqa: E402

# eft-run, in this process, with the stop as it was: torch's close after a local failure, and no
# word from a node whose workers failed (so its peers stop theirs with SIGTERM).
BASELINE = """
import contextlib, sys
from elasticft import torch_seam
import elasticft.agent.agent as agent
torch_seam.failure_kills_the_rest = lambda _agent: contextlib.nullcontext()
agent.stop_decision = lambda ctx, group, pending, observer: pending
from launcher.eft_run import main
main(sys.argv[1:])
"""
EFT = "import sys\nfrom launcher.eft_run import main\nmain(sys.argv[1:])\n"
AGENTS = {"baseline": BASELINE, "eft": EFT}
CASES = {"local": (1, 2), "nodes": (2, 1)}  # nodes, workers per node


def kill_to_next_start(case: str, agent: str, endpoint: str, out: Path) -> float:
    """Seconds from the rank's SIGKILL to the next generation's first worker start."""
    out.mkdir(parents=True, exist_ok=True)
    nodes, nproc = CASES[case]
    cmd = rdzv_command([sys.executable, "-c", AGENTS[agent]], str(WORKERS / "stuck_peer.py"), str(out),
                       nnodes=str(nodes), nproc=nproc, backend="etcd-v3", endpoint=endpoint, run_id=uuid.uuid4().hex,
                       flags=["--max-restarts", "1", "--monitor-interval", "0.1"])
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    logs = [open(out / f"node{i}.log", "wb") for i in range(nodes)]
    try:
        procs = [subprocess.Popen(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, env=env) for log in logs]
        codes = [proc.wait(timeout=600) for proc in procs]
    finally:
        for log in logs:
            log.close()
    if any(codes):
        raise SystemExit(f"{case} {agent}: exit status {codes}; see {out}/node*.log")
    killed = json.loads((out / "killed.json").read_text())["time"]
    return min(json.loads(p.read_text())["started"] for p in out.glob("second-*.json")) - killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each (medians printed)")
    parser.add_argument("--out", help="where the runs' logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if set(cases) - set(CASES):
        parser.error(f"--cases: expected some of {', '.join(CASES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="eft-bench-stuck-"))
    rows = []
    with EmbeddedEtcd() as etcd:
        for case in cases:
            runs = {agent: statistics.median(kill_to_next_start(case, agent, etcd.endpoint, out / f"{case}-{agent}-{i}")
                                             for i in range(args.repeat)) for agent in AGENTS}
            base, now = runs["baseline"], runs["eft"]
            nodes, nproc = CASES[case]
            rows.append([f"{case}: {nodes} node(s) x {nproc} worker(s)", f"{base:.2f}", f"{now:.2f}",
                         f"{now / base:.1%}", f"{base - now:.2f}"])
            print(f"{rows[-1][0]}: kill -> next generation {base:.2f} s -> {now:.2f} s", flush=True)
    print()
    print(table(["job", "kill -> next start, baseline", "kill -> next start, eft", "eft/baseline", "saved"], rows))
    print("(seconds; the next start includes the new workers' interpreter start, before their imports)")
    print(f"\nruns in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
