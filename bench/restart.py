"""What a restart costs, cold and warm (``--eft-warm-workers``), side by side in one run.

For each case the same job runs twice, cold workers then warm ones, and ``eft report``'s
reading of its event log gives the failure's downtime: from the failed generation's last
heartbeat (the SIGKILL comes right after it) to the new generation's first step, and its
phases. Cases:

* ``toy-worker``: a worker that imports torch and megatron-core only (``restart_toy.py``), one
  node, 2 workers; local rank 1 SIGKILLed after iteration 10;
* ``gpt-worker``: the GPT example (megatron-core, TP2 on one node, memory checkpoints), local
  rank 1 SIGKILLed after iteration 8;
* ``gpt-node``: the README demo's two nodes (TP2 x PP2), node 1 killed with kill -9 after
  iteration 8; the survivor resumes at TP2 from memory.

  python bench/restart.py [--cases toy-worker,gpt-worker,gpt-node] [--repeat 1]

Goal (issue 34): warm <= 40 % of cold for a worker crash, and what remains is detection, the
round and the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elasticft.contract.phases import ORDER  # noqa: E402
from elasticft.goodput.breakdown import breakdown  # noqa: E402

CASES = ("toy-worker", "gpt-worker", "gpt-node")
KILL_AT = {"toy-worker": 10, "gpt-worker": 8, "gpt-node": 8}


def _toy(out: Path, warm: bool) -> list[dict]:
    events = out / "events.jsonl"
    cmd = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--eft-events-file", str(events), "--eft-inject", f"rank_killed:1@{KILL_AT['toy-worker']}",
           *(["--eft-warm-workers"] if warm else []), str(ROOT / "bench" / "restart_toy.py"), "24"]
    with open(out / "agent.log", "wb") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    if code != 0:
        raise SystemExit(f"toy-worker ({'warm' if warm else 'cold'}) exited {code}; see {out / 'agent.log'}")
    return [json.loads(line) for line in events.read_text().splitlines() if line.strip()]


def _gpt(out: Path, warm: bool, node: bool) -> list[dict]:
    sys.path.insert(0, str(ROOT / "examples" / "gpt3"))
    import demo

    at = KILL_AT["gpt-node" if node else "gpt-worker"]
    args = argparse.Namespace(out=str(out), train_iters=at + 6, save_interval=100, degrade_at=0,
                              lose_at=at if node else 0, no_health=True, comeback_at=0, timeout=600,
                              nodes=2 if node else 1, mem_ckpt_interval=1, no_memory=False,
                              faults=[] if node else [f"rank_killed:1@{at}"], agent_flags=[], micro_batch_size=8,
                              procs=2, during=None, cold_workers=not warm)
    result = demo.run(args)
    if result["exit_code"] != 0:
        raise SystemExit(f"{'gpt-node' if node else 'gpt-worker'} exited {result['exit_code']}; logs in {out}")
    return result["events"]


def run_case(case: str, warm: bool, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    events = _toy(out, warm) if case == "toy-worker" else _gpt(out, warm, node=case == "gpt-node")
    report = breakdown(events)
    if not report.failures:
        raise SystemExit(f"{case}: no failure in the event log ({out})")
    failure = report.failures[0]
    figures = {"downtime": failure.downtime_seconds}
    figures.update({str(p): 0.0 for p in ORDER})
    for span in failure.phases:
        figures[span.name] = figures.get(span.name, 0.0) + span.seconds
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case and variant (medians printed)")
    parser.add_argument("--out", help="where the runs' logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; expected some of {', '.join(CASES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="eft-bench-restart-"))
    rows = []
    for case in cases:
        figures = {}
        for variant in ("cold", "warm"):
            runs = [run_case(case, variant == "warm", out / f"{case}-{variant}-{i}") for i in range(args.repeat)]
            figures[variant] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append((case, figures))
        cold, warm = figures["cold"], figures["warm"]
        print(f"{case:<11} downtime cold {cold['downtime']:6.2f} s  warm {warm['downtime']:6.2f} s  "
              f"warm/cold {warm['downtime'] / cold['downtime']:5.1%}", flush=True)
    names = [str(p) for p in ORDER]
    print("\nphases, seconds (share of the downtime):")
    print(f"{'case':<19}" + "".join(f"{n:>15}" for n in names))
    for case, figures in rows:
        for variant in ("cold", "warm"):
            f = figures[variant]
            print(f"{case + ' ' + variant:<19}" + "".join(
                f"{f[n]:>7.2f} ({f[n] / f['downtime']:4.0%})" for n in names))
    print(f"\nruns in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
