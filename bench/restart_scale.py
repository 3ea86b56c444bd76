"""A whole restart at N nodes: from the lost node's last heartbeat to every survivor's first step.

N simulated nodes (``restart_scale_node.py``: eft's agent code for the control plane, gloo
worker stand-ins as threads; ``restart_scale_group.py``: one real etcd, nodes in processes of
``--per-process``), one node killed, the survivors restart. Printed per N: ``eft report``'s
restart phases, the total, which survivors took their first step at the new world size; then a
fitted growth per phase (``restart_scale_fit.py``), the sizes beyond the measured ones marked
"modelled", and the acceptance targets. The lease TTL (how long etcd waits before it deletes a
dead node's keys) is outside the control path: the harness revokes the lease at the kill.

  python bench/restart_scale.py                          # --sizes 8,32,128, vote group: eft's current
  python bench/restart_scale.py --vote both              # eager full-mesh vote group vs lazily connected
  python bench/restart_scale.py --sizes 8,32,128,256 --svg docs/restart-scale.svg --json bench/restart_scale.json
  python bench/restart_scale.py --ranks 4,8,16           # gloo ranks as threads vs one process per rank
  python bench/restart_scale.py --kill 2 --kill-during-restart   # two nodes at once, a third mid-restart
  python bench/restart_scale.py --sizes 8,32,128,256 --write-curve elasticft/goodput/restart_measured.py

``--write-curve`` writes the measured phases (detection apart: ``eft simulate`` charges it
on its own) as the module ``eft simulate`` reads its restart cost from.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from common import ROOT, table
from restart_scale_cpu import model_rows
from restart_scale_fit import fit, picture
from restart_scale_group import measure

from elasticft.contract.phases import ORDER
from elasticft.store import EmbeddedEtcd

PHASES = [str(p) for p in ORDER]
TARGETS = {"total": 3.0, "rendezvous": 2.0}  # seconds at 1,024 nodes (issue 53)


def current_vote_group() -> str:
    """What eft's Megatron-LM mode makes the vote's group as, now: lazily connected when the vote
    group helper (``elasticft/worker/vote_group.py``) asks gloo for it; else eager (``new_group``)."""
    helper = ROOT / "elasticft" / "worker" / "vote_group.py"
    if helper.exists() and "LAZY" in helper.read_text().upper():
        return "lazy"
    return "eager"


def run(sizes: list[int], vote: str, per_process: int, lease_ttl: float, kills: int = 1,
        during: bool = False) -> list[dict]:
    rows = []
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-restart-") as work, \
            tempfile.TemporaryDirectory(prefix="eft-restart-mem-", dir=shm) as mem:
        for n in sizes:
            r = measure(n, etcd.endpoint, Path(work) / str(n), Path(mem), vote, per_process, lease_ttl,
                        kills=kills, during=during, etcd_pid=etcd.pid)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ranks"}), flush=True)
    return rows


def report(rows: list[dict], modelled: list[int], svg: str | None, vote: str) -> dict:
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        if "error" in r:
            print(f"N={r['nodes']}: {r['error']}")
    if len(ok) < 2:
        return {}
    sizes = [r["nodes"] for r in ok]
    series = {p: [r["phases"].get(p, 0.0) for r in ok] for p in PHASES}
    series["total"] = [r["total_s"] for r in ok]
    fits = {p: fit(sizes, v) for p, v in series.items()}
    beyond = [n for n in modelled if n > max(sizes)]
    headers = ["phase"] + [f"N={n}" for n in sizes] + [f"N={n} (modelled)" for n in beyond] + ["growth", "fit"]
    lines = []
    for p, values in series.items():
        f = fits[p]
        lines.append([p] + [f"{v:.3f}" for v in values] + [f"{f.at(n):.3f}" for n in beyond]
                     + [f.growth, f"{f.model}, exp {f.exponent:.2f}, err {f.error:.0%}"])
    print()
    print(f"a whole restart, seconds (eft report's phases; vote group {vote}; lease TTL excluded, "
          f"{ok[0]['lease_ttl']:g} s apart); one rank per node")
    print(table(headers, lines))
    print("memory prepare (inside spawn), slowest node: " + ", ".join(
        f"N={r['nodes']} {r['memory_prepare_s']:.3f} s" for r in ok))
    if all("etcd" in r for r in ok):
        print("asked of etcd over the restart, per survivor (its /metrics): " + "; ".join(
            f"N={r['nodes']} " + ", ".join(f"{k} {v / r['survivors']:.1f}" for k, v in r["etcd"].items())
            for r in ok))
    print("every survivor's first step at the new world size: " + ", ".join(
        f"N={r['nodes']} {r['all_first_steps'] and r['worlds'] == [r['survivors']]}" for r in ok))
    cluster = None
    if all("cpu" in r for r in ok):
        headers, lines, cluster = model_rows(ok, beyond, os.cpu_count() or 1)
        print()
        print("the same restart with one host per node (restart_scale_cpu.py: latency at the smallest N + "
              "one node's CPU + etcd's CPU, each measured per N, fitted beyond), seconds")
        print(table(headers, lines))
    at = 1024
    for phase, limit in TARGETS.items():
        f = fits[phase]
        where = "measured" if at in sizes else "modelled"
        value = series[phase][sizes.index(at)] if at in sizes else f.at(at)
        print(f"target: {phase} at N={at} <= {limit:g} s: here {value:.2f} s ({where}) -> "
              f"{'met' if value <= limit else 'NOT met'}", end="")
        if cluster:
            on_cluster = (cluster["total"] if phase == "total" else cluster["phases"][phase]).get(at)
            if on_cluster is not None:
                print(f"; one host per node {on_cluster:.2f} s (modelled) -> "
                      f"{'met' if on_cluster <= limit else 'NOT met'}", end="")
        print()
    superlinear = [p for p, f in fits.items() if f.exponent > 1.1 and series[p][-1] > 0.05]
    print("phases growing faster than N (exponent > 1.1, above 50 ms): " + (", ".join(superlinear) or "none"))
    if svg:
        picture(Path(svg), sizes, series, fits, beyond or sizes,
                f"A whole restart at N nodes (vote group: {vote}); dashed: modelled")
        print(f"picture: {svg}")
    return {"vote": vote, "lease_ttl_s": ok[0]["lease_ttl"], "phases": PHASES,
            "measured": [{"nodes": r["nodes"], "total_s": round(r["total_s"], 4),
                          "phases": {p: round(v, 4) for p, v in r["phases"].items()},
                          "cpu": {p: {g: round(v, 3) for g, v in c.items()} for p, c in r.get("cpu", {}).items()}}
                         for r in ok],
            "modelled": [{"nodes": n, "total_s": round(fits["total"].at(n), 4),
                          "phases": {p: round(fits[p].at(n), 4) for p in PHASES}} for n in beyond],
            "growth": {p: {"model": f.model, "exponent": round(f.exponent, 3), "named": f.growth}
                       for p, f in fits.items()},
            "one_host_per_node": None if cluster is None else {
                "measured_at": sizes, "nodes": sorted(cluster["total"]),
                "total_s": {n: round(v, 4) for n, v in cluster["total"].items()},
                "phases": {p: {n: round(v, 4) for n, v in values.items()} for p, values in cluster["phases"].items()},
                "growth": {p: {"one node's CPU": g[0], "etcd's CPU": g[1]} for p, g in cluster["growth"].items()}}}


CURVE_MODULE = '''"""A restart's control path at the node counts bench/restart_scale.py measured: written by its
--write-curve ({when}), not by hand. ``eft simulate`` charges a restart what this curve says at the
job's size (``restart_curve.py``); detection, the lease's expiry, is its own cost.
"""

from elasticft.goodput.restart_curve import RestartCurve

SOURCE = {source!r}
NODES = {nodes!r}
PHASES = {{
{phases}
}}


def measured_curve() -> RestartCurve:
    return RestartCurve(NODES, PHASES, SOURCE)
'''


def write_curve(path: Path, result: dict) -> None:
    """``result`` (``report``'s) as the module ``eft simulate`` reads: the restart with one host per
    node (``restart_scale_cpu.py``), not this host's, whose cores every node shares; without CPU
    figures, the measured phases (an upper bound)."""
    import datetime

    when = datetime.date.today().isoformat()
    cluster = result.get("one_host_per_node")
    if cluster:
        nodes = tuple(cluster["measured_at"])  # past them, restart_curve.py's own fits: marked modelled
        values = {p: tuple(cluster["phases"][p][n] for n in nodes) for p in result["phases"]}
        source = (f"bench/restart_scale.py {when}: one host per node, from per-unit costs measured on a "
                  f"{os.cpu_count()}-core host (latency, one node's CPU, etcd's CPU)")
    else:
        nodes = tuple(r["nodes"] for r in result["measured"])
        values = {p: tuple(r["phases"].get(p, 0.0) for r in result["measured"]) for p in result["phases"]}
        source = (f"bench/restart_scale.py {when}: all N nodes on one {os.cpu_count()}-core host, an upper "
                  f"bound of a cluster's")
    phases = "\n".join(f"    {p!r}: {v!r}," for p, v in values.items() if p != "detection")
    path.write_text(CURVE_MODULE.format(when=when, source=source, nodes=nodes, phases=phases))
    print(f"eft simulate's curve: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,128", help="node counts measured, comma separated")
    parser.add_argument("--modelled", default="256,512,1024", help="node counts beyond, from the fits")
    parser.add_argument("--vote", default="current", choices=["current", "eager", "lazy", "both"],
                        help="the vote's gloo group: eft's current one, eager full mesh, lazily connected")
    parser.add_argument("--per-process", type=int, default=128, help="simulated nodes per process (threads)")
    parser.add_argument("--kill", type=int, default=1, help="nodes SIGKILLed at once")
    parser.add_argument("--kill-during-restart", action="store_true",
                        help="one more node dies once the survivors have stopped their workers")
    parser.add_argument("--lease-ttl", type=float, default=3.0, help="the nodes' lease TTL (reported apart)")
    parser.add_argument("--svg", default="", help="write the log-log picture here (e.g. docs/restart-scale.svg)")
    parser.add_argument("--json", default="", help="write the per-N totals here (e.g. bench/restart_scale.json)")
    parser.add_argument("--write-curve", default="", help="write eft simulate's restart curve module here "
                        "(elasticft/goodput/restart_measured.py)")
    parser.add_argument("--ranks", default="", help="gloo ranks as threads vs processes at these sizes, then exit")
    args = parser.parse_args()
    os.environ.setdefault("RES_OPTIONS", "use-vc")  # inherited by every process here: see _group's comment
    if args.ranks:
        from restart_scale_ranks import compare

        compare([int(s) for s in args.ranks.split(",")])
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    modelled = [int(s) for s in args.modelled.split(",") if s]
    votes = ["eager", "lazy"] if args.vote == "both" else [current_vote_group() if args.vote == "current" else args.vote]
    results = {}
    for vote in votes:
        results[vote] = report(run(sizes, vote, args.per_process, args.lease_ttl, args.kill,
                                   args.kill_during_restart), modelled,
                               args.svg if vote == votes[-1] else None, vote)
    if args.json:
        chosen = results[votes[-1]]
        Path(args.json).write_text(json.dumps(chosen, indent=1) + "\n")
        print(f"per-N totals: {args.json}")
    if args.write_curve and results[votes[-1]]:
        write_curve(Path(args.write_curve), results[votes[-1]])


if __name__ == "__main__":
    main()
