"""The run's event kinds, which of them a person is told about, and the one line each reads as.

Agents append events to ``/eft/<run>/events/`` (``elasticft.agent.events.EventLog``) as
JSON ``{"kind", "time", "source", **fields}``; ``eft top`` shows them and the notifier
sends the notable ones, both through ``describe``. Writers and readers import this
module, so it imports nothing from elasticft outside ``elasticft.contract``.

The members' values are the wire strings: ``eft top`` of an older version reads the same
log, so a value never changes (a new kind is a new member). ``describe`` gets events as
read back (a plain ``str`` kind, fields written by any version), so it never trusts a
field to be there or to have its type.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

from elasticft.contract.records import RequestReason


class EventKind(enum.StrEnum):
    """One member per kind; the comment above each says what it means and its fields
    (besides kind, time and source)."""

    # The source registered for the next round; host, gpus (a count).
    NODE_JOINED = "node_joined"
    # The source's agent exited cleanly and closed its record; no fields.
    NODE_LEFT = "node_left"
    # The source saw peers' leases expire without a clean exit; nodes (ids), restarts (its count so far).
    NODE_LOST = "node_lost"
    # etcd let the source's own lease expire (it was frozen, or cut off from etcd, longer than the TTL): it
    # stopped its workers and registered again, to rejoin at the next round; silent (seconds without a refresh).
    NODE_FENCED = "node_fenced"
    # The source leaves the job at a restart; ranks (its stragglers), reason, remaining_nodes (None: unknown).
    NODE_EXCLUDED = "node_excluded"
    # The source waits as a spare (hot standby) in rendezvous round `round`: the round before formed full.
    SPARE_WAITING = "spare_waiting"
    # The source, a spare, is a member of rendezvous round `round` (it takes a lost member's place).
    SPARE_PROMOTED = "spare_promoted"
    # The source, a spare, left the rendezvous while its own GPUs are at risk, so that no round takes it in;
    # why. It comes back (spare_waiting) once fit.
    SPARE_UNFIT = "spare_unfit"
    # A spare's lease expired while it waited; the members went on without a restart. node, host, round
    # (the one it waited in); recorded by one member (the lowest node id).
    SPARE_LOST = "spare_lost"
    # Rank 0's agent published the planner's layout for a round; tp, pp, dp, used, world_size, spare (ranks).
    LAYOUT = "layout"
    # The members hold a node that waits to join until the next checkpoint (--eft-join-at save), recorded by
    # the member that holds it; waiting (the node, as the rendezvous names it), round (the one it waits in),
    # after (the newest checkpoint then; None: none), wait (the most seconds).
    JOIN_HELD = "join_held"
    # The members let the nodes waiting to join in (they restart for them now); round, why (checkpoint or
    # waited), iteration (the checkpoint; None: none), held (seconds).
    JOIN_LET_IN = "join_let_in"
    # The source's agent restarts its workers; reason, remaining_restarts, max_restarts, job_restart (True
    # on the one agent whose report opened the job's restart cycle: the job's restart, counted once).
    RESTART = "restart"
    # A new request for a save; request_id, reason, requester, exit, risk (None unless risk-driven).
    CKPT_REQUEST = "ckpt_request"
    # A requester joined the open request instead of making its own; request_id, reason, requester.
    CKPT_REQUEST_JOINED = "ckpt_request_joined"
    # A complete checkpoint; request_id (None: a periodic save), iteration, path, seconds, exit, time.
    CKPT_SAVED = "ckpt_saved"
    # The workers' gap rule skipped a risk request; request_id, iteration, last_saved_iteration, why.
    CKPT_FILTERED = "ckpt_filtered"
    # A watchdog tripped; check, target, reading, limit, message, save, save_and_exit.
    WATCHDOG = "watchdog"
    # A rank overran its section's timeout; rank, local_rank, pid, section, seconds, timeout, iteration, stacks.
    HANG = "hang"
    # A rank steps slowly; rank, node, local_rank, gpu, step_time, job_median, best, relative, individual,
    # relative_threshold, individual_threshold, action.
    STRAGGLER = "straggler"
    # The workers resumed; iteration (None: from scratch), source (memory, disk or none), path, reached
    # (the highest iteration before the restart, None: unknown), redone (iterations trained again).
    CKPT_RESTORED = "ckpt_restored"
    # A memory checkpoint could not be used; iteration, why, then (what the restore falls back to); when a
    # range of a shard file was read corrupt from every holder, also file and range ([first byte, one past
    # the last]).
    MEM_CKPT_FALLBACK = "mem_ckpt_fallback"
    # The memory tier paused or went on; paused (bool), used_bytes, budget_bytes, why.
    MEM_CKPT_PAUSED = "mem_ckpt_paused"
    # A node's memory snapshots ran more than max_lag ahead of the newest iteration with every replica in
    # place, so the workers take none until replication catches up (lagging True), or it caught up (False);
    # lagging, lag (snapshots taken since), newest (taken), restorable (None: none yet), max_lag.
    MEM_CKPT_LAG = "mem_ckpt_lag"
    # The source's workers stopped (a restart, the end); why (restart, finished or failed), and what local
    # rank 0's heartbeat says of its process: rank, iteration (the last any local rank's heartbeat says,
    # contract.progress.reached), first_iteration, started, first_step,
    # last_beat (unix times), steps, totals ({section: seconds}), stalls ({tier: seconds} steps waited for
    # background saves), stall_buckets ({tier: counts per contract.progress.STALL_BUCKETS}). What `eft report`
    # accounts time from.
    WORKERS_STOPPED = "workers_stopped"
    # The job ended cleanly (recorded by group rank 0 only); no fields.
    JOB_FINISHED = "job_finished"
    # The source's agent stopped without a clean end; state (its workers'), stopped_by (None: not by an exception).
    JOB_FAILED = "job_failed"
    # -- the numbers check (elasticft.worker.numerics), recorded by rank 0's agent --
    # The workers stopped without saving to re-run a bad iteration from the newest good state; cause (unknown:
    # first sight, data, hardware), iteration, fault (nan or spike), loss, grad_norm, ranks, nodes, level, attempt.
    ROLLBACK = "rollback"
    # The re-run of a bad iteration was good: a fault that passed; iteration, fault, ranks, nodes, attempts,
    # loss (the bad one), rerun_loss.
    TRANSIENT_FAULT = "transient_fault"
    # The re-run gave the same bad numbers: the batch is bad and its step is skipped; iteration, fault, loss,
    # grad_norm.
    DATA_SKIPPED = "data_skipped"
    # A node implicated in --eft-suspect-after numeric faults; node, faults, action (report or exclude).
    NODE_SUSPECT = "node_suspect"
    # The restart rule ended the job (elasticft.agent.restart_budget): restart cycles in a row without
    # progress; cycles, limit, reached (the highest iteration the workers reached), checkpoint (the newest
    # complete one; None: none). eft-run exits with ExitCode.NO_PROGRESS on every node.
    NO_PROGRESS = "no_progress"
    # The restart rule ended the job: more charged restarts (worker failures, hangs) job-wide than allowed;
    # restarts, limit. eft-run fails as torchrun does when --max-restarts runs out.
    RESTART_BUDGET_EXHAUSTED = "restart_budget_exhausted"
    # etcd was out of reach and answers again (the workers trained on meanwhile); seconds, failed_requests.
    ETCD_UNAVAILABLE = "etcd_unavailable"
    # Never in the log: the notifier's last message when it closes; counts ({kind: notifications held back}).
    NOTIFY_SUPPRESSED = "notify_suppressed"

    @property
    def notified(self) -> bool:
        """Worth telling a person about (a ckpt_request only when risk-driven: ``should_notify``)."""
        return self in NOTIFIED_KINDS


NOTIFIED_KINDS = frozenset({
    EventKind.NODE_LOST, EventKind.NODE_LEFT, EventKind.LAYOUT, EventKind.CKPT_REQUEST, EventKind.CKPT_SAVED,
    EventKind.CKPT_FILTERED, EventKind.WATCHDOG, EventKind.HANG, EventKind.RESTART, EventKind.STRAGGLER,
    EventKind.NODE_EXCLUDED, EventKind.JOB_FINISHED, EventKind.JOB_FAILED, EventKind.MEM_CKPT_FALLBACK,
    EventKind.MEM_CKPT_PAUSED, EventKind.MEM_CKPT_LAG, EventKind.ROLLBACK, EventKind.TRANSIENT_FAULT,
    EventKind.DATA_SKIPPED, EventKind.NODE_SUSPECT,
    EventKind.NO_PROGRESS, EventKind.RESTART_BUDGET_EXHAUSTED, EventKind.ETCD_UNAVAILABLE, EventKind.NODE_FENCED,
    EventKind.SPARE_PROMOTED, EventKind.SPARE_LOST, EventKind.SPARE_UNFIT,
})

# Every event's own fields (time, source), and what the notifier adds (run, suppressed):
# not part of what happened, so never in a line's list of fields.
ENVELOPE = frozenset({"kind", "time", "source", "run", "suppressed"})


def should_notify(event: dict) -> bool:
    """Whether the notifier sends ``event``."""
    kind = event.get("kind")
    if not isinstance(kind, str) or kind not in NOTIFIED_KINDS:
        return False
    # A manual, signal or watchdog request is someone's own doing (a watchdog trip is notified by itself).
    return kind != EventKind.CKPT_REQUEST or event.get("reason") == RequestReason.RISK


class _Fields:
    """One event's fields as text: a missing field reads "?", a number of the wrong type too."""

    def __init__(self, event: dict):
        self.event = event

    def __getitem__(self, key: str) -> str:
        value = self.event.get(key)
        return "?" if value is None else str(value)

    def num(self, key: str, spec: str = ".2f") -> str:
        value = self.event.get(key)
        return format(value, spec) if _is_number(value) else "?"

    def names(self, key: str) -> str:
        """A list field as "a, b"; anything else as it is."""
        value = self.event.get(key)
        return ", ".join(map(str, value)) if isinstance(value, list) else self[key]

    def part(self, template: str, key: str, number: bool = False) -> str:
        """An optional part of a line: ``template`` filled with the field, "" when the field
        is absent or empty (or, with ``number``, not a number)."""
        value = self.event.get(key)
        if value is None or value == "" or (number and not _is_number(value)):
            return ""
        return template.format(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _spare(event: dict) -> str:
    spare = event.get("spare")
    return f", {len(spare)} spare" if isinstance(spare, list) and spare else ""


_ROLLBACK_CAUSES = {"data": " and skip its batch", "hardware": " (bad again, other numbers)"}


def _suppressed_counts(event: dict) -> str:
    counts = event.get("counts")
    if not isinstance(counts, dict):
        return f"rate limit held back notifications: {counts}"
    return "rate limit held back " + ", ".join(f"{n} {kind}" for kind, n in counts.items())


_LINES: dict[EventKind, Callable[[_Fields], str]] = {
    EventKind.NODE_JOINED: lambda f: f"node {f['source']} joined ({f['host']}, {f['gpus']} GPUs)",
    EventKind.NODE_LEFT: lambda f: f"node {f['source']} left the job cleanly",
    EventKind.NODE_LOST: lambda f: (
        f"lost node(s) {f.names('nodes')} (reported by {f['source']}); restart{f.part(' {}', 'restarts')} "
        "through a new rendezvous"),
    EventKind.NODE_FENCED: lambda f: (
        f"node {f['source']} was fenced off: etcd let its lease expire after {f['silent']} s without a refresh; "
        "it stopped its workers and rejoins"),
    EventKind.NODE_EXCLUDED: lambda f: (
        f"node {f['source']} left the job at a restart: {f.event.get('reason') or 'straggler'} rank(s) {f['ranks']}; "
        f"{f['remaining_nodes']} node(s) go on"),
    EventKind.SPARE_WAITING: lambda f: f"node {f['source']} waits as a spare (round {f['round']})",
    EventKind.SPARE_PROMOTED: lambda f: f"spare node {f['source']} takes a lost member's place (round {f['round']})",
    EventKind.SPARE_UNFIT: lambda f: f"spare node {f['source']} sits out: {f['why']}",
    EventKind.SPARE_LOST: lambda f: (
        f"spare node {f['node']} ({f['host']}) lost its lease while it waited; the job goes on without a restart"),
    EventKind.LAYOUT: lambda f: (
        f"new layout TP{f['tp']} x PP{f['pp']} x DP{f['dp']} on {f['used']} of {f['world_size']} GPUs"
        + _spare(f.event)),
    EventKind.JOIN_HELD: lambda f: (
        f"node {f['waiting']} waits to join: held until the next checkpoint (at most {f.num('wait', 'g')} s)"),
    EventKind.JOIN_LET_IN: lambda f: (
        f"nodes waiting to join round {f['round']} let in after {f.num('held', '.1f')} s"
        + (f": checkpoint of iteration {f['iteration']} complete" if f.event.get("why") == "checkpoint"
           else ": no checkpoint came in time")),
    EventKind.RESTART: lambda f: (
        f"workers restarted ({f['reason']}); {f['remaining_restarts']} of {f['max_restarts']} restarts left"),
    EventKind.CKPT_REQUEST: lambda f: (
        f"{f['requester']} asked for a {f['reason']} checkpoint" + (" and exit" if f.event.get("exit") is True else "")
        + f.part(", risk {:.2f}", "risk", number=True) + f" [{f['request_id']}]"),
    EventKind.CKPT_REQUEST_JOINED: lambda f: (
        f"{f['requester']} joined checkpoint request {f['request_id']} ({f['reason']})"),
    EventKind.CKPT_SAVED: lambda f: (
        f"checkpoint saved: iteration {f['iteration']}" + f.part(" in {:.1f} s", "seconds", number=True)
        + f" → {f['path']}"),
    EventKind.CKPT_FILTERED: lambda f: (
        f"skipped request {f['request_id']}: no checkpoint at iteration {f['iteration']} ({f['why']})"),
    EventKind.WATCHDOG: lambda f: (
        f"watchdog {f['check']} tripped on {f['target']}" + f.part(": {}", "message")),
    EventKind.HANG: lambda f: (
        f"rank {f['rank']} hung in section {f['section']} for {f['seconds']} s (timeout {f['timeout']} s) "
        f"after iteration {f['iteration']}" + f.part("; stacks by {}", "stacks")),
    EventKind.STRAGGLER: lambda f: (
        f"rank {f['rank']} on {f['node']} (GPU {f['gpu']}) is a straggler: "
        f"step {f.num('step_time', '.3f')} s vs the job's median {f.num('job_median', '.3f')} s "
        f"(relative {f.num('relative')}, individual {f.num('individual')})"),
    EventKind.CKPT_RESTORED: lambda f: (
        f"workers resumed from iteration {f['iteration']} ({f['source']}" + f.part(", {}", "path") + ")"
        + f.part("; {} iteration(s) re-done", "redone")),
    EventKind.MEM_CKPT_FALLBACK: lambda f: (
        f"memory checkpoint of iteration {f['iteration']} unusable ({f['why']}); falling back to {f['then']}"),
    EventKind.MEM_CKPT_PAUSED: lambda f: (
        ("memory checkpoints paused: " if f.event.get("paused") else "memory checkpoints resumed: ") + f['why']),
    EventKind.MEM_CKPT_LAG: lambda f: (
        (f"memory snapshots wait for replication: {f['lag']} taken since the newest iteration with every "
         f"replica in place ({'none yet' if f.event.get('restorable') is None else f['restorable']}), more than "
         f"{f['max_lag']}; newest taken {f['newest']}") if f.event.get("lagging") else
        (f"memory replication caught up: iteration {f['restorable']} has every replica in place; {f['lag']} "
         f"snapshot(s) taken since (newest {f['newest']})")),
    EventKind.WORKERS_STOPPED: lambda f: (
        f"workers of {f['source']} stopped ({f['why']}) at iteration {f['iteration']} after {f['steps']} step(s)"),
    EventKind.JOB_FINISHED: lambda f: "job finished",
    EventKind.JOB_FAILED: lambda f: f"job failed (workers {f['state']})" + f.part(", stopped by {}", "stopped_by"),
    EventKind.ROLLBACK: lambda f: (
        f"iteration {f['iteration']}: {f['fault']} (loss {f['loss']}, rank(s) {f.names('ranks') or '?'}); rolling back "
        f"to re-run it" + _ROLLBACK_CAUSES.get(f["cause"], "")),
    EventKind.TRANSIENT_FAULT: lambda f: (
        f"iteration {f['iteration']} re-ran clean: a transient {f['fault']} fault on rank(s) {f.names('ranks') or '?'}"
        + (f" ({f.names('nodes')})" if f.event.get("nodes") else "")),
    EventKind.DATA_SKIPPED: lambda f: (
        f"iteration {f['iteration']} gave the same {f['fault']} again (loss {f['loss']}): its batch is skipped"),
    EventKind.NODE_SUSPECT: lambda f: (
        f"node {f['node']} is suspect: implicated in {f['faults']} numeric faults"
        + (" and leaves at the next restart" if f.event.get("action") == "exclude" else "")),
    EventKind.NO_PROGRESS: lambda f: (
        f"job ended: {f['cycles']} restart cycle(s) in a row without progress (limit {f['limit']})"
        + f.part("; workers reached iteration {}", "reached")
        + (f"; newest checkpoint {f['checkpoint']}" if f.event.get("checkpoint") is not None else "; no checkpoint")),
    EventKind.RESTART_BUDGET_EXHAUSTED: lambda f: (
        f"job ended: {f['restarts']} restart(s) job-wide, more than the {f['limit']} allowed"),
    EventKind.ETCD_UNAVAILABLE: lambda f: (
        f"etcd was out of reach for {f.num('seconds', '.1f')} s ({f['failed_requests']} request(s) failed); "
        "training went on"),
    EventKind.NOTIFY_SUPPRESSED: lambda f: _suppressed_counts(f.event),
}


def describe(event: dict) -> str:
    """One line for a person, for any event; a kind without a line of its own lists its fields."""
    kind = event.get("kind")
    line = _LINES.get(kind) if isinstance(kind, str) else None
    if line is not None:
        return line(_Fields(event))
    fields = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ENVELOPE)
    name = kind.replace("_", " ") if isinstance(kind, str) else f"event of kind {kind}"
    return name + (f": {fields}" if fields else "")
