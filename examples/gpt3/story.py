"""What happened in a demo run, from the training log and the run's etcd events."""

from __future__ import annotations

import time

from elasticft.contract.events import EventKind


def summary(result: dict) -> dict:
    """The facts the story tells and the tests check."""
    log, events = result["log"], result["events"]
    starts = [r for r in log if r.get("event") == "start"]
    steps = [r for r in log if r.get("event") == "iteration"]
    saves = [r for r in log if r.get("event") == "save"]
    risk = [e for e in events if e["kind"] == EventKind.CKPT_REQUEST and e.get("reason") == "risk"]
    emergency = [s for s in saves if s.get("reason") == "risk"]
    lost = [e for e in events if e["kind"] == EventKind.NODE_LOST]
    restarts = []  # (source, resumed at, iterations re-done) per restart
    for before, after in zip(starts, starts[1:]):
        reached = max((r["iteration"] for r in steps if before["time"] <= r["time"] < after["time"]), default=0)
        restarts.append((after.get("source", "disk"), after["iteration"], max(reached - after["iteration"], 0)))
    return {
        "restarts": restarts,
        "detections": [(e["requester"], e.get("risk"), e["time"]) for e in risk],
        "emergency_checkpoint": emergency[0]["iteration"] if emergency else None,
        "lost_nodes": sorted({n for e in lost for n in e.get("nodes", [])}),
        "layouts": [(s["tp"], s["pp"], s["dp"], s["iteration"]) for s in starts],
        "iterations_redone": max((r[2] for r in restarts), default=0),
        "memory_snapshots": sum(1 for r in log if r.get("event") == "mem_saved"),
        "final_iteration": steps[-1]["iteration"] if steps else 0,
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def tell(result: dict, args) -> str:
    facts = summary(result)
    clock = lambda t: time.strftime("%H:%M:%S", time.localtime(t))  # noqa: E731
    memory = getattr(args, "mem_ckpt_interval", 0) if not getattr(args, "no_memory", True) else 0
    lines = [f"eft demo: megatron-core GPT, {getattr(args, 'nodes', 2)} nodes x 2 workers, CPU mode, memory "
             + (f"checkpoints every {memory} iteration(s)" if memory else "checkpoints off"), ""]
    if facts["detections"]:
        for who, risk, when in facts["detections"]:
            lines.append(f"  {clock(when)}  {who} crossed the risk threshold (risk {risk:.2f}): emergency checkpoint")
    else:
        lines.append("  no GPU looked risky: only periodic saves (every "
                     f"{args.save_interval} iterations)")
    if facts["emergency_checkpoint"] is not None:
        lines.append(f"            every rank saved iteration {facts['emergency_checkpoint']} "
                     f"(the GPU degraded after iteration {args.degrade_at})")
    if facts["lost_nodes"]:
        lines.append(f"            lost {', '.join(facts['lost_nodes'])} (after iteration {args.lose_at})")
    for (tp, pp, dp, it), (ntp, npp, ndp, nit) in zip(facts["layouts"], facts["layouts"][1:]):
        lines.append(f"            layout TP{tp}xPP{pp}xDP{dp} -> TP{ntp}xPP{npp}xDP{ndp}, resumed from iteration {nit}")
    for source, resumed, redone in facts["restarts"]:
        lines.append(f"            restart: loaded iteration {resumed} from {source}; {redone} iteration(s) re-done")
    lines.append(f"            iterations re-done after the restart: {facts['iterations_redone']}")
    loss = facts["final_loss"]
    lines.append(f"  finished iteration {facts['final_iteration']}/{args.train_iters}, final loss "
                 f"{loss:.6f}" if loss is not None else "  no iteration finished")
    lines.append(f"  logs, checkpoints and result.json in {result['out']}")
    return "\n".join(lines)


def compare(results: dict) -> str:
    """The same failure with and without the memory tier, side by side."""
    rows = [("", *results)]
    facts = {name: summary(result) for name, (result, _) in results.items()}
    rows.append(("loaded from", *(", ".join(f"{s} @{i}" for s, i, _ in f["restarts"]) or "-" for f in facts.values())))
    rows.append(("iterations re-done", *(str(f["iterations_redone"]) for f in facts.values())))
    rows.append(("final iteration", *(str(f["final_iteration"]) for f in facts.values())))
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, width)) for row in rows)
