"""A restart's ``stop`` phase after a worker's SIGKILL, before and after issue 53 (item 5), in one run.

One node, one worker, SIGKILLed mid-training (``--eft-inject rank_killed:0@K``); ``eft report``'s
reading of the event log gives the restart's ``stop``: from the ``restart`` event to the node's
``workers_stopped``. Each job runs under two agents:

* ``baseline``: eft as it was, its stop waiting (``psutil.wait_procs``, up to 5 s) until what the
  worker left in its session (Megatron's dataloader workers, a torch_dist save's helpers), once
  SIGKILLed, was *reaped* — by init, or a container's PID 1, whenever that gets round to it;
* ``eft``: the stop kills them and moves on; their *exit* (a zombie holds nothing) is awaited on
  pidfds just before the next generation starts, so it overlaps the rendezvous.

and under two reapers: ``host`` (this machine's PID 1 as it is: a Firecracker VM's reaps every
1.5 s) and ``never`` (a parent that adopts orphans and never reaps them, as a container whose PID 1
does not: ``PR_SET_CHILD_SUBREAPER``). Cases: ``mlm``, NVIDIA's loop (tests/megatron_lm/pretrain_gpt.py,
the test's tiny GPT on CPU, Megatron's 2 dataloader workers per split); ``probe``, a gloo worker
with one helper (tests/workers/stop_probe.py, 2 workers).

  python bench/stop_phase.py [--case mlm|probe] [--reapers host,never] [--repeat 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, table  # noqa: E402  (also puts the repo on sys.path)
from launch import WORKERS, read_jsonl  # noqa: E402

from elasticft.contract.phases import RestartPhase  # noqa: E402
from elasticft.goodput.breakdown import breakdown  # noqa: E402

# Adopts its descendants' orphans (prctl PR_SET_CHILD_SUBREAPER = 36) and reaps only its own child.
NON_REAPING_PARENT = """
import ctypes, subprocess, sys
ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)
sys.exit(subprocess.Popen(sys.argv[1:]).wait())
"""

# eft-run, in this process, with the stop as it was: kill what the workers left, then wait until reaped.
BASELINE = """
import sys
import psutil
import elasticft.agent.agent as agent
from elasticft.agent import orphans

def killed_and_reaped(sessions):
    ended = orphans.kill_sessions(sessions)
    if ended:
        psutil.wait_procs(ended, timeout=orphans.HELPERS_GONE_TIMEOUT)
    return []

agent.kill_sessions = killed_and_reaped
from launcher.eft_run import main
main(sys.argv[1:])
"""
EFT = "import sys\nfrom launcher.eft_run import main\nmain(sys.argv[1:])\n"
AGENTS = {"baseline": BASELINE, "eft": EFT}
REAPERS = ("host", "never")


def job(case: str, out: Path) -> tuple[list[str], dict]:
    """The eft-run arguments of ``case`` and the environment it needs."""
    if case == "probe":
        return ["--nproc-per-node", "2", str(WORKERS / "stop_probe.py"), str(out)], {}
    from megatron_lm import ENV, MODEL, SCRIPT

    return (["--nproc-per-node", "1", "--eft-inject", "rank_killed:0@6", str(SCRIPT), *MODEL, "--train-iters", "8"],
            ENV)


def restart_seconds(case: str, agent: str, reaper: str, out: Path) -> tuple[float, float, float]:
    """The first restart's ``stop``, then its ``rendezvous`` to ``spawn`` (where eft now awaits the
    helpers' exit), then its whole downtime (failure to first step), in seconds."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    args, env = job(case, out)
    cmd = [sys.executable, "-c", AGENTS[agent], "--standalone", "--max-restarts", "1", "--monitor-interval", "0.1",
           "--eft-events-file", str(events), *args]
    if reaper == "never":
        cmd = [sys.executable, "-c", NON_REAPING_PARENT, *cmd]
    with open(out / "agent.log", "wb") as log:
        code = subprocess.run(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, timeout=600,
                              env={**__import__("os").environ, **env, "PYTHONPATH": str(ROOT)}).returncode
    if code != 0:
        raise SystemExit(f"{case} {agent} {reaper}: exit status {code}; see {out / 'agent.log'}")
    failure = breakdown(read_jsonl(events)).failures[0]
    spans = {span.phase: span.seconds for span in failure.phases}
    start = sum(spans.get(p, 0.0) for p in (RestartPhase.RENDEZVOUS, RestartPhase.REPLAN, RestartPhase.SPAWN))
    return spans[RestartPhase.STOP], start, failure.downtime_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("mlm", "probe"), default="mlm")
    parser.add_argument("--reapers", default=",".join(REAPERS), help=f"comma-separated, of {', '.join(REAPERS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each (medians printed)")
    parser.add_argument("--out", help="where the runs' logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    reapers = [r for r in args.reapers.split(",") if r]
    if set(reapers) - set(REAPERS):
        parser.error(f"--reapers: expected some of {', '.join(REAPERS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="eft-bench-stop-"))
    rows = []
    for reaper in reapers:
        runs = {agent: [restart_seconds(args.case, agent, reaper, out / f"{reaper}-{agent}-{i}")
                        for i in range(args.repeat)] for agent in AGENTS}
        base, now = ([statistics.median(r[k] for r in runs[agent]) for k in range(3)] for agent in AGENTS)
        rows.append([f"{args.case}, reaper {reaper}", f"{base[0]:.3f}", f"{now[0]:.3f}", f"{now[0] / base[0]:.1%}",
                     f"{base[1]:.3f}", f"{now[1]:.3f}", base[2], now[2]])
        print(f"{rows[-1][0]}: stop {base[0]:.3f} s -> {now[0]:.3f} s", flush=True)
    print()
    print(table(["job", "stop, baseline", "stop, eft", "eft/baseline", "rdzv..spawn, baseline", "rdzv..spawn, eft",
                 "downtime, baseline", "downtime, eft"], rows))
    print("(seconds; rendezvous to spawn holds eft's wait for the helpers' exit, overlapped with the round)")
    print(f"\nruns in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
