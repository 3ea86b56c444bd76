"""The event contract (elasticft/contract/events.py): wire strings, one line per kind, the notified set."""

import ast
import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticft.agent.events import EventLog
from elasticft.agent.notify import Notifier, Sink, should_notify, summary_line
from elasticft.contract import events as contract
from elasticft.contract.events import NOTIFIED_KINDS, EventKind, describe
from elasticft.contract.keys import RunKeys

# The strings in every event log written so far: an older eft top reads the same log.
WIRE = {
    "NODE_JOINED": "node_joined", "NODE_LEFT": "node_left", "NODE_LOST": "node_lost",
    "NODE_EXCLUDED": "node_excluded", "NODE_FENCED": "node_fenced", "LAYOUT": "layout", "RESTART": "restart", "CKPT_REQUEST": "ckpt_request",
    "CKPT_REQUEST_JOINED": "ckpt_request_joined", "CKPT_SAVED": "ckpt_saved", "CKPT_FILTERED": "ckpt_filtered",
    "WATCHDOG": "watchdog", "HANG": "hang", "STRAGGLER": "straggler", "JOB_FINISHED": "job_finished",
    "JOB_FAILED": "job_failed", "NOTIFY_SUPPRESSED": "notify_suppressed", "CKPT_RESTORED": "ckpt_restored",
    "MEM_CKPT_FALLBACK": "mem_ckpt_fallback", "MEM_CKPT_PAUSED": "mem_ckpt_paused", "MEM_CKPT_LAG": "mem_ckpt_lag",
    "WORKERS_STOPPED": "workers_stopped",
    "ROLLBACK": "rollback", "TRANSIENT_FAULT": "transient_fault", "DATA_SKIPPED": "data_skipped",
    "NODE_SUSPECT": "node_suspect",
    "NO_PROGRESS": "no_progress", "RESTART_BUDGET_EXHAUSTED": "restart_budget_exhausted",
    "ETCD_UNAVAILABLE": "etcd_unavailable", "JOIN_HELD": "join_held", "JOIN_LET_IN": "join_let_in",
    "SPARE_WAITING": "spare_waiting", "SPARE_PROMOTED": "spare_promoted", "SPARE_LOST": "spare_lost",
    "SPARE_UNFIT": "spare_unfit",
}

# One event of each kind with the fields its writer records (values as the writers make them).
SAMPLES = {
    EventKind.NODE_JOINED: {"host": "host-a", "gpus": 4},
    EventKind.NODE_LEFT: {},
    EventKind.NODE_LOST: {"nodes": ["n3", "n4"], "restarts": 2},
    EventKind.NODE_EXCLUDED: {"ranks": [5], "reason": "straggler", "remaining_nodes": 2},
    EventKind.NODE_FENCED: {"silent": 11.2},
    EventKind.SPARE_WAITING: {"round": 1},
    EventKind.SPARE_PROMOTED: {"round": 2},
    EventKind.SPARE_LOST: {"node": "s0", "host": "host-s0", "round": 1},
    EventKind.SPARE_UNFIT: {"why": "GPU 0 risk 1.00, at or above the trigger 0.80"},
    EventKind.LAYOUT: {"tp": 2, "pp": 1, "dp": 4, "used": 8, "world_size": 12, "spare": [8, 9, 10, 11]},
    EventKind.RESTART: {"reason": "hang", "remaining_restarts": 2, "max_restarts": 3},
    EventKind.CKPT_REQUEST: {"request_id": "abc123", "reason": "risk", "requester": "n0/gpu1", "exit": True,
                             "risk": 0.97},
    EventKind.CKPT_REQUEST_JOINED: {"request_id": "abc123", "reason": "manual", "requester": "cli"},
    EventKind.CKPT_SAVED: {"request_id": "abc123", "iteration": 20, "path": "/ckpt/iter_0000020", "seconds": 3.25,
                           "exit": False, "time": 1.0},
    EventKind.CKPT_FILTERED: {"request_id": "abc123", "iteration": 1210, "last_saved_iteration": 1200,
                              "why": "only 10 of 25 iterations since the last save"},
    EventKind.WATCHDOG: {"check": "cpu_memory", "target": "host", "reading": 97.0, "limit": 95.0,
                         "save_and_exit": True, "message": "97% used", "save": False},
    EventKind.HANG: {"rank": 3, "local_rank": 1, "pid": 100, "section": "step", "seconds": 12.5, "timeout": 10,
                     "iteration": 7, "stacks": "py-spy"},
    EventKind.STRAGGLER: {"rank": 5, "node": "n0", "local_rank": 1, "gpu": 1, "step_time": 0.35, "job_median": 0.05,
                          "best": 0.05, "relative": 0.1429, "individual": 1.0, "relative_threshold": 0.7,
                          "individual_threshold": 0.7, "action": "log"},
    EventKind.JOB_FINISHED: {},
    EventKind.WORKERS_STOPPED: {"why": "restart", "rank": 0, "iteration": 12, "first_iteration": 1, "started": 1.0,
                                "first_step": 3.0, "last_beat": 9.0, "steps": 11, "totals": {"step": 5.0}},
    EventKind.JOB_FAILED: {"state": "FAILED", "stopped_by": "SignalException"},
    EventKind.NOTIFY_SUPPRESSED: {"counts": {"watchdog": 2}},
    EventKind.CKPT_RESTORED: {"iteration": 41, "source": "memory", "path": "/dev/shm/eft/r/n0/restore/iter_0000041",
                              "reached": 42, "redone": 1},
    EventKind.MEM_CKPT_FALLBACK: {"iteration": 42, "why": "checksum of __2_0.distcp from n1 does not match",
                                  "then": "iteration 41 from memory"},
    EventKind.MEM_CKPT_PAUSED: {"paused": True, "used_bytes": 10, "budget_bytes": 8,
                                "why": "10 B in use, budget 8 B"},
    EventKind.MEM_CKPT_LAG: {"lagging": True, "lag": 3, "newest": 44, "restorable": 41, "max_lag": 2},
    EventKind.ROLLBACK: {"cause": "unknown", "iteration": 6, "fault": "nan", "loss": "nan", "grad_norm": "nan",
                         "ranks": [1], "nodes": ["n1"], "level": None, "attempt": 1},
    EventKind.TRANSIENT_FAULT: {"iteration": 6, "fault": "nan", "ranks": [1], "nodes": ["n1"], "attempts": 1,
                                "loss": "nan", "rerun_loss": 4.8},
    EventKind.DATA_SKIPPED: {"iteration": 7, "fault": "nan", "loss": "nan", "grad_norm": "nan"},
    EventKind.NODE_SUSPECT: {"node": "n1", "faults": 2, "action": "exclude"},
    EventKind.NO_PROGRESS: {"cycles": 3, "limit": 3, "reached": 8, "checkpoint": 5},
    EventKind.RESTART_BUDGET_EXHAUSTED: {"restarts": 3, "limit": 2},
    EventKind.ETCD_UNAVAILABLE: {"seconds": 7.04, "failed_requests": 222},
    EventKind.JOIN_HELD: {"waiting": "host-d_4242_0", "round": 3, "after": 120, "wait": 600.0},
    EventKind.JOIN_LET_IN: {"round": 3, "why": "checkpoint", "iteration": 180, "held": 2.31},
}


def event(kind, **fields) -> dict:
    return {"kind": str(kind), "time": 1_714_564_800.0, "source": "n0", **fields}


def test_values_are_the_wire_strings():
    assert {k.name: k.value for k in EventKind} == WIRE
    assert json.dumps({"kind": EventKind.LAYOUT}) == '{"kind": "layout"}'
    assert f"{EventKind.HANG}" == "hang" and EventKind("node_lost") is EventKind.NODE_LOST


def test_the_log_stores_the_plain_string(etcd):
    keys = RunKeys("events-wire")
    EventLog(etcd, keys, "n0").record(EventKind.CKPT_SAVED, iteration=4)
    (item,), _ = etcd.get_prefix(keys.events)
    assert json.loads(item.value)["kind"] == "ckpt_saved" and type(json.loads(item.value)["kind"]) is str


def test_every_kind_has_its_own_line_without_a_field_dump():
    assert set(SAMPLES) == set(EventKind)  # a new kind needs a sample here, and a line
    for kind, fields in SAMPLES.items():
        line = describe(event(kind, **fields))
        assert line and "\n" not in line, kind
        assert "=" not in line and "?" not in line, (kind, line)  # "k=v": the fallback; "?": a field it missed
        assert not line.startswith(kind.replace("_", " ") + ":"), (kind, line)


def test_lines_say_what_happened():
    lines = {kind: describe(event(kind, **fields)) for kind, fields in SAMPLES.items()}
    assert lines[EventKind.NODE_JOINED] == "node n0 joined (host-a, 4 GPUs)"
    assert lines[EventKind.NODE_LOST] == "lost node(s) n3, n4 (reported by n0); restart 2 through a new rendezvous"
    assert lines[EventKind.LAYOUT] == "new layout TP2 x PP1 x DP4 on 8 of 12 GPUs, 4 spare"
    assert lines[EventKind.CKPT_REQUEST] == "n0/gpu1 asked for a risk checkpoint and exit, risk 0.97 [abc123]"
    assert lines[EventKind.CKPT_SAVED] == "checkpoint saved: iteration 20 in 3.2 s → /ckpt/iter_0000020"
    assert lines[EventKind.WATCHDOG] == "watchdog cpu_memory tripped on host: 97% used"
    assert lines[EventKind.NOTIFY_SUPPRESSED] == "rate limit held back 2 watchdog"
    assert lines[EventKind.ROLLBACK] == "iteration 6: nan (loss nan, rank(s) 1); rolling back to re-run it"
    assert lines[EventKind.TRANSIENT_FAULT] == "iteration 6 re-ran clean: a transient nan fault on rank(s) 1 (n1)"
    assert lines[EventKind.NODE_SUSPECT] == ("node n1 is suspect: implicated in 2 numeric faults and leaves at the "
                                             "next restart")
    assert lines[EventKind.NO_PROGRESS] == ("job ended: 3 restart cycle(s) in a row without progress (limit 3); "
                                            "workers reached iteration 8; newest checkpoint 5")
    assert describe(event(EventKind.NO_PROGRESS, cycles=3, limit=3, reached=None, checkpoint=None)) == (
        "job ended: 3 restart cycle(s) in a row without progress (limit 3); no checkpoint")
    assert lines[EventKind.JOIN_HELD] == ("node host-d_4242_0 waits to join: held until the next checkpoint "
                                          "(at most 600 s)")
    assert lines[EventKind.JOIN_LET_IN] == ("nodes waiting to join round 3 let in after 2.3 s: checkpoint of "
                                            "iteration 180 complete")
    assert lines[EventKind.RESTART_BUDGET_EXHAUSTED] == "job ended: 3 restart(s) job-wide, more than the 2 allowed"
    assert lines[EventKind.ETCD_UNAVAILABLE] == (
        "etcd was out of reach for 7.0 s (222 request(s) failed); training went on")


def test_unknown_kinds_list_their_fields():
    assert describe(event("brand_new", a=1, b="x")) == "brand new: a=1, b=x"
    assert describe({"kind": "bare"}) == "bare"
    assert describe({"kind": 5, "x": 1}) == "event of kind 5: x=1"
    assert describe({}) == "event of kind None"


ODD = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5),
                st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=3)), max_size=3),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(sorted(EventKind)), data=st.data())
def test_missing_or_odd_fields_never_raise(kind, data):
    """Events come from any version: any subset of the fields, of any JSON type."""
    names = sorted(SAMPLES[kind]) + ["spare", "counts", "source"]
    fields = data.draw(st.dictionaries(st.sampled_from(names), ODD, max_size=len(names)))
    line = describe({"kind": str(kind), **fields})
    assert isinstance(line, str) and line
    assert summary_line({"kind": str(kind), **fields, "suppressed": 1}).endswith("rate limit)")


def test_the_notified_set_is_what_the_notifier_sends(tmp_path):
    assert NOTIFIED_KINDS == {
        EventKind.NODE_LOST, EventKind.NODE_LEFT, EventKind.LAYOUT, EventKind.CKPT_REQUEST, EventKind.CKPT_SAVED,
        EventKind.CKPT_FILTERED, EventKind.WATCHDOG, EventKind.HANG, EventKind.RESTART, EventKind.STRAGGLER,
        EventKind.NODE_EXCLUDED, EventKind.JOB_FINISHED, EventKind.JOB_FAILED, EventKind.MEM_CKPT_FALLBACK,
        EventKind.MEM_CKPT_PAUSED, EventKind.MEM_CKPT_LAG, EventKind.ROLLBACK, EventKind.TRANSIENT_FAULT,
        EventKind.DATA_SKIPPED, EventKind.NODE_SUSPECT,
        EventKind.NO_PROGRESS, EventKind.RESTART_BUDGET_EXHAUSTED, EventKind.ETCD_UNAVAILABLE, EventKind.NODE_FENCED,
        EventKind.SPARE_PROMOTED, EventKind.SPARE_LOST, EventKind.SPARE_UNFIT,
    }
    out = tmp_path / "sent.jsonl"
    notifier = Notifier([Sink("file", str(out))], rate_limit=0)
    offered = [event(kind, **SAMPLES[kind]) for kind in EventKind]
    assert [should_notify(e) for e in offered] == [kind.notified for kind in EventKind]
    queued = [e["kind"] for e in offered if notifier.send(e)]
    notifier.close()
    assert queued == [kind for kind in EventKind if kind.notified]
    assert [json.loads(line)["kind"] for line in out.read_text().splitlines()] == queued
    # A request is news only when a GPU's risk made it; someone's own request is not.
    manual = event(EventKind.CKPT_REQUEST, **{**SAMPLES[EventKind.CKPT_REQUEST], "reason": "manual"})
    assert not should_notify(manual) and not should_notify({"kind": ["layout"]})


def test_notifications_and_eft_top_say_the_same_line():
    from elasticft.tui import view

    e = event(EventKind.HANG, **SAMPLES[EventKind.HANG], run="r1", suppressed=3)
    assert summary_line(e) == f"[eft r1/n0] {describe(e)} (+3 more hang not sent: rate limit)"
    assert view.describe is describe


def test_the_contract_imports_nothing_else_from_elasticft():
    tree = ast.parse(Path(contract.__file__).read_text())
    imported = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [m for m in imported if m.startswith("elasticft") and not m.startswith("elasticft.contract")] == []
