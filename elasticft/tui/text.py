"""Words and numbers for people: durations, sizes, the header line, ``eft status``.

Shared by the rich dashboard (render.py) and the plain-text summary, so both say
the same thing the same way.
"""

from __future__ import annotations

from elasticft.tui.view import GpuRow, Header, LostRow, View, fit

NONE = "-"


def duration(seconds: float | None) -> str:
    """3s, 4m05s, 2h07m, 3d04h."""
    if seconds is None:
        return NONE
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def layout(h: Header) -> str:
    if h.tp is None:
        # Jobs without Megatron model arguments get a round record with no plan in it.
        return f"world {h.world_size} (not planned)" if h.world_size else "no layout yet"
    since = f", set {duration(h.layout_age_s)} ago" if h.layout_age_s is not None else ""
    return f"world {h.world_size}: TP{h.tp}×PP{h.pp}×DP{h.dp} on {h.used} (+{len(h.spare)} spare{since})"


def header_line(h: Header) -> str:
    nodes = f"{h.live_nodes} node{'s' if h.live_nodes != 1 else ''} up"
    if h.spare_nodes:
        nodes += f" ({len(h.spare_nodes)} spare: {', '.join(h.spare_nodes)})"
    if h.lost_nodes:
        nodes += f", {h.lost_nodes} lost"
    return f"{nodes} · {layout(h)} · {restarts(h)} · up {duration(h.uptime_s)}"


def restarts(h: Header) -> str:
    """The restart rounds, and where the job stands against its restart rules (job-wide)."""
    text = f"restarts {h.restarts}"
    job = h.job_restarts
    if job is None:
        return text
    rules = f"{job.charged}{'' if job.limit is None else f' of {job.limit}'} charged"
    if job.no_progress_limit != 0:  # 0: the rule is off
        rules += f", {job.no_progress}{'' if job.no_progress_limit is None else f' of {job.no_progress_limit}'}" \
                 " in a row without progress"
    if job.ended:
        rules += f", ended: {job.ended}"
    return f"{text} ({rules})"


def temperature(row: GpuRow) -> str:
    return NONE if row.temperature_c is None else f"{row.temperature_c:.0f}°C"


def trend(row: GpuRow) -> str:
    """↑ / ↓ with the rate in C per minute; → when it moves less than half a degree a minute."""
    rate = row.trend_c_per_min
    if rate is None:
        return NONE
    if abs(rate) < 0.5:
        return "→"
    return f"{'↑' if rate > 0 else '↓'}{abs(rate):.1f}/m"


def memory(row: GpuRow) -> str:
    if row.memory_used_mib is None:
        return NONE
    used = row.memory_used_mib / 1024
    if not row.memory_total_mib:
        return f"{used:.0f}G"
    return f"{used:.0f}/{row.memory_total_mib / 1024:.0f}G"


def power(row: GpuRow) -> str:
    if row.power_w is None:
        return NONE
    limit = f"/{row.power_limit_w:.0f}" if row.power_limit_w else ""
    return f"{row.power_w:.0f}{limit}W"


def utilization(row: GpuRow) -> str:
    return NONE if row.utilization_pct is None else f"{row.utilization_pct:.0f}%"


def ecc(row: GpuRow) -> str:
    if row.ecc_corrected is None and row.ecc_uncorrected is None:
        return NONE
    corrected = NONE if row.ecc_corrected is None else str(row.ecc_corrected)
    uncorrected = NONE if row.ecc_uncorrected is None else str(row.ecc_uncorrected)
    return f"{corrected}/{uncorrected}"


def xids(row: GpuRow) -> str:
    return ",".join(str(x) for x in row.xids) if row.xids else NONE


def factor(row: GpuRow) -> str:
    name = row.dominant or NONE
    return f"{name} ({row.critical})" if row.critical else name


def age(row: GpuRow) -> str:
    return duration(row.age_s) + (" stale" if row.stale else "")


def lost_line(row: LostRow) -> str:
    what = ", ".join(p for p in (row.host, f"{row.gpus} GPUs" if row.gpus is not None else None) if p)
    when = f"lost {duration(row.lost_for_s)} ago" if row.lost_for_s is not None else "lost"
    who = f", reported by {row.reported_by}" if row.reported_by else ""
    last = ""
    if row.last_risk is not None:
        last = f"; last risk {row.last_risk:.2f} on gpu {row.last_risk_gpu}"
    return f"{row.node}{f' ({what})' if what else ''}: lease gone, {when}{who}{last}"


def checkpoint_lines(checkpoints: dict) -> list[tuple[str, str]]:
    """(label, text) for the last request, the last ack and the latest checkpoint."""
    request, ack, latest = checkpoints["request"], checkpoints["last_ack"], checkpoints["latest"]
    if request is None:
        request_text = "none"
    else:
        risk = f", risk {request['risk']:.2f}" if isinstance(request.get("risk"), (int, float)) else ""
        why = f": {request['why']}" if request.get("why") else ""
        request_text = (f"{request['reason']}{' and exit' if request.get('exit') else ''} by {request['requester']}"
                        f"{risk}, {duration(request['age_s'])} ago [{request['id']}] — {request['status']}{why}")
    if ack is None:
        ack_text = "none"
    else:
        seconds = f" in {ack['seconds']:.1f} s" if isinstance(ack.get("seconds"), (int, float)) else ""
        ack_text = f"iteration {ack['iteration']}{seconds}, {duration(ack['age_s'])} ago [{ack['request_id']}]"
    if latest is None:
        latest_text = "none"
    else:
        latest_text = f"iteration {latest['iteration']}, {duration(latest['age_s'])} ago → {latest['path']}"
    lines = [("request", request_text), ("last ack", ack_text), ("latest", latest_text)]
    memory = checkpoints.get("memory")
    if memory is not None:
        lines.append(("memory", memory_text(memory)))
        lines.append(("mem lag", lag_text(memory)))
    return lines


def memory_text(memory: dict) -> str:
    """The newest memory iteration the live nodes can restore, and where each node's part lives."""
    if memory["iteration"] is None:
        return f"none complete on the live nodes (newest written: {memory['newest_written']})"
    where = ", ".join(f"{node} → {'+'.join(h for h in holders if h != node) or 'no replica'}"
                      for node, holders in memory["holders"].items())
    age = f", {duration(memory['age_s'])} ago" if memory.get("age_s") is not None else ""
    return f"iteration {memory['iteration']}{age}, {memory['bytes'] / 1e6:.1f} MB; {where}"


def lag_text(memory: dict) -> str:
    """How far replication lags: snapshots written after the newest iteration with every replica in place."""
    restorable, lag = memory.get("restorable"), memory.get("lag")
    if not isinstance(lag, int):
        return "unknown (an older index)"
    if restorable is None:
        return f"{lag} snapshot(s) written (newest {memory['newest_written']}), none with every replica in place yet"
    if lag == 0:
        return f"none: iteration {restorable} has every replica in place"
    return (f"{lag} snapshot(s): newest written {memory['newest_written']}, newest with every replica in place "
            f"{restorable}")


def gpu_line(row: GpuRow) -> str:
    return (f"{row.node}/{row.gpu}  risk {row.risk:.2f} {row.level:<4}  {temperature(row)} {trend(row)}  "
            f"mem {memory(row)}  {power(row)}  util {utilization(row)}  ecc {ecc(row)}  xid {xids(row)}  "
            f"{factor(row)}  age {age(row)}")


def status_text(view: View, gpu_rows: int = 5, events: int = 5) -> str:
    """``eft status``: one screen of plain text."""
    h = view.header
    lines = [f"run {h.run_id}: {h.state} ({h.detail})", header_line(h)]
    if h.watch_error:
        lines.append(f"etcd: {h.watch_error}")
    for row in view.lost:
        lines.append("LOST " + lost_line(row))
    _, shown, hidden = fit(View(view.exists, h, [], view.gpus), gpu_rows)
    total = len(view.gpus)
    lines.append(f"riskiest GPUs ({len(shown)} of {total}, threshold {h.threshold:g}):" if total else "GPUs: no health records")
    lines.extend("  " + gpu_line(row) for row in sorted(shown, key=lambda r: (-r.risk, r.node, r.gpu)))
    if hidden:
        lines.append(f"  ... {hidden} more (eft top shows them all)")
    lines.append("checkpoints:")
    lines.extend(f"  {label:<9} {text}" for label, text in checkpoint_lines(view.checkpoints))
    lines.append("events:" if view.events else "events: none")
    lines.extend(f"  {duration(e.age_s):>6} ago  {e.kind:<20} {e.text}" for e in view.events[:events])
    return "\n".join(lines)
