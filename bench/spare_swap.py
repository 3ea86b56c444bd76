"""Seconds from kill -9 of one training node to the job's workers running again, with a spare
and without one (issue 55; docs/spares.md).

spare: three agents with ``--nnodes 2:2`` (one worker each): two train, the third waits as a
spare (its node record says ``spare``); once with the workers started cold, once with
``--eft-warm-workers`` (every agent, the spare's too, holds an interpreter that imported torch);
and warm with the member frozen (SIGSTOP of its agent and worker: a machine that hangs, whose
host refuses nothing, so its loss waits for its lease, agent/gone_agents.py). Once it does, the member that is not group rank 0 is
killed with its worker; we time until a new generation of 2 workers runs (WORLD_SIZE=2, the
spare's worker one of them).

re-plan (no spare), the baseline: two agents with ``--nnodes 1:2``; the one that is not group
rank 0 is killed; we time until the survivor's new worker runs at WORLD_SIZE=1.

NVRx 0.7's spare mode, the issue's named baseline, where it can be imported: three
``ft_launcher`` agents with ``--nnodes 2:3`` on torch's c10d store (NVRx's "simple" hot-spare
mode: the first two train, the third stands by); the same kill, timed to the same point. It is
not on PyPI (0.4.1 there has no spare mode): give its source with ``--nvrx-path`` (docs/benchmarks.md
says how it was run); without it the row is left out.

Workers sit in a gloo all_reduce loop (tests/workers/allreduce_loop.py); one embedded etcd.

  python bench/spare_swap.py [--repeats 1] [--give-up 120] [--nvrx-path DIR[:DIR]]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

from common import table
from launch import WORKERS, Launched, agent_of, eft_run, generation, rdzv_command, time_recovery, wait_for

from elasticft.config.ft import FTConfig
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord, NodeState
from elasticft.store import EmbeddedEtcd, StoreOptions, connect
from elasticft.store.server import free_port

WARM = ("--eft-warm-workers",)
# name: (--nnodes, agents, world size after the loss, eft-run flags, the node frozen rather than killed)
DESIGNS = {
    "spare": ("2:2", 3, 2, (), False),
    "spare, warm workers": ("2:2", 3, 2, WARM, False),
    "re-plan (no spare)": ("1:2", 2, 1, (), False),
    "spare, warm workers, node frozen": ("2:2", 3, 2, WARM, True),
}
NVRX = "NVRx 0.7 spare (ft_launcher)"
NVRX_DESIGN = ("2:3", 3, 2)  # its simple mode: the first MIN nodes train, the rest stand by


def _spare(client, run_id: str, nodes: list[Launched]) -> Launched | None:
    """The node (``--eft-node-id nodeI``) whose etcd record says spare, or None."""
    for i, node in enumerate(nodes):
        item = client.get(RunKeys(run_id).node(f"node{i}"))
        if item is not None and NodeRecord.from_json(item.value).state is NodeState.SPARE:
            return node
    return None


def _standing_by(first: list[dict], nodes: list[Launched]) -> Launched | None:
    """The node none of whose workers is in the first generation (NVRx's spare has no record)."""
    working = {agent_of(r["pid"]) for r in first}
    return next((n for n in nodes if n.proc.pid not in working), None)


def trial(nnodes: str, agents: int, world_after: int, endpoint: str, client, work: Path,
          give_up: float = 120.0, nvrx_path: str = "", flags: tuple[str, ...] = (),
          freeze: bool = False) -> tuple[float, float] | None:
    starts = work / "starts.jsonl"
    run_id = uuid.uuid4().hex
    nodes = []
    nvrx_store = f"127.0.0.1:{free_port()}"
    try:
        for i in range(agents):
            program = [str(WORKERS / "allreduce_loop.py"), str(work)]
            if nvrx_path:
                cmd = rdzv_command([sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"], *program,
                                   nnodes=nnodes, nproc=1, backend="c10d", endpoint=nvrx_store, run_id=run_id,
                                   flags=["--max-restarts", "3", "--monitor-interval", "0.1"])
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [nvrx_path, os.environ.get("PYTHONPATH")]))}
            else:
                cmd = rdzv_command(eft_run(), *program, nnodes=nnodes, nproc=1, backend="etcd-v3", endpoint=endpoint,
                                   run_id=run_id, flags=["--max-restarts", "3", "--eft-node-id", f"node{i}", *flags])
                env = None
            nodes.append(Launched(cmd, work / f"node{i}.log", env=env))
        first = wait_for(lambda: generation(starts, 2), 300, "a world of 2")
        spare = None
        if agents > 2 and nvrx_path:
            spare = wait_for(lambda: _standing_by(first, nodes) if len(nodes) == agents else None, 60,
                             "a node standing by")
        elif agents > 2:
            spare = wait_for(lambda: _spare(client, run_id, nodes), 120, "a node waiting as a spare")
        group = {agent_of(r["pid"]): r["group_rank"] for r in first}
        victim = next(n for n in nodes if group.get(n.proc.pid) == 1)
        assert victim is not spare

        def spare_took_part(second: list[dict]) -> None:
            if spare is not None:
                assert spare.proc.pid in {agent_of(r["pid"]) for r in second}, "the spare's worker is not in it"

        return time_recovery(nodes, victim, work, world_after, give_up, check=spare_took_part, freeze=freeze)
    finally:
        for node in nodes:
            node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--give-up", type=float, default=120.0,
                        help="seconds after the kill before a row counts as no recovery")
    parser.add_argument("--nvrx-path", default=os.environ.get("NVRX_PYTHONPATH", ""),
                        help="where NVRx 0.7 imports from (its src/ and its dependencies), to add its spare mode's row")
    args = parser.parse_args()
    designs = {name: (nnodes, agents, after, "", flags, freeze)
               for name, (nnodes, agents, after, flags, freeze) in DESIGNS.items()}
    if args.nvrx_path:
        designs[NVRX] = (*NVRX_DESIGN, args.nvrx_path, (), False)
    ttl = FTConfig().lease_ttl
    results = {}
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        client = connect(StoreOptions(endpoints=etcd.endpoint))
        try:
            for name, (nnodes, agents, world_after, nvrx, flags, freeze) in designs.items():
                runs = []
                for r in range(args.repeats):
                    work = Path(tmp) / f"{len(results)}-{r}"
                    work.mkdir()
                    runs.append(trial(nnodes, agents, world_after, etcd.endpoint, client, work, args.give_up, nvrx,
                                      flags, freeze))
                done = [r for r in runs if r is not None]
                results[name] = min(done) if done else None
                print(f"{name}: {len(done)} of {len(runs)} recovered; best {results[name]}", flush=True)
        finally:
            client.close()
    rows = [[name, best[0], best[1]] if best else [name, f"no recovery within {args.give_up:g} s", ""]
            for name, best in results.items()]
    print()
    print("kill -9 (or SIGSTOP: frozen) of a training node (not group rank 0) -> the job's workers running again "
          "(best of %d)" % args.repeats)
    print(f"issue 55's target: a spare training at the same size within the lease TTL + 1.5 s "
          f"({ttl:g} + 1.5 = {ttl + 1.5:g} s)")
    print(table(["design", "workers started, s", "gloo joined, s"], rows))
    replan, nvrx = results["re-plan (no spare)"], results.get(NVRX)
    for name in ("spare", "spare, warm workers"):
        spare = results[name]
        if spare and replan:
            print(f"{name} / re-plan: {spare[0] / replan[0]:.2f} (workers started), "
                  f"{spare[1] / replan[1]:.2f} (gloo joined)")
        if spare and nvrx:
            print(f"NVRx spare / eft {name}: {nvrx[0] / spare[0]:.2f} (workers started), "
                  f"{nvrx[1] / spare[1]:.2f} (gloo joined); issue 55's target: >= 3")


if __name__ == "__main__":
    main()
