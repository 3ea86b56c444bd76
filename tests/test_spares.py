"""Spares (docs/spares.md): nodes beyond ``--nnodes``'s maximum wait as spares, say so, cost
nothing when they die, and take a lost member's place at the same size.

Real agents (eft-run) on the session's etcd, real gloo workers (tests/workers/allreduce_loop.py),
faults by kill -9 of a whole node.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request

import pytest
from typer.testing import CliRunner

from bench.launch import ROOT, read_jsonl, wait_for
from elasticft.agent.events import EventLog
from elasticft.contract.events import EventKind
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.records import NodeRecord, NodeState
from launcher.cli import app

pytestmark = pytest.mark.slow


def record(etcd, run_keys, node: str) -> NodeRecord | None:
    item = etcd.get(run_keys.node(node))
    return NodeRecord.from_json(item.value) if item is not None else None


def events(etcd, run_keys, kind: EventKind) -> list[dict]:
    return [e for e in EventLog(etcd, run_keys, "test").read() if e["kind"] == kind]


def starts(out) -> list[dict]:
    path = out / "starts.jsonl"
    return read_jsonl(path) if path.exists() else []


# With segments (--eft-segment 2: the job is one segment of two nodes of one domain), s0 is of
# another domain than the members and s1: it sorts first, yet m1's place is s1's.
DOMAINS = {"m0": "rack-a", "m1": "rack-a", "s0": "rack-b", "s1": "rack-a"}


@pytest.mark.parametrize("segments", [False, True], ids=["no segments", "segments"])
def test_a_spare_says_so_its_loss_costs_nothing_and_the_next_takes_a_lost_members_place(
        tmp_path, eft_job, etcd, etcd_server, run_keys, segments):
    """Two members (``--nnodes 2:2``) and two spares. Both spares' records, ``eft status`` and the
    events name them. Spare s0 is killed: no member restarts. Member m1 is killed: the job
    restarts once, at the same size, with spare s1 in m1's place; its record says running. The
    spares' join timeout is 5 s, which they outwait: a spare waits as long as the job runs.
    With segments m1 is killed first, while s0, the spare of another domain, still waits."""
    outs = {name: tmp_path / name for name in ("m0", "m1", "s0", "s1")}
    nodes = {}
    for name, out in outs.items():
        out.mkdir()
        segment = ["--eft-segment", "2", "--eft-segment-domain", DOMAINS[name]] if segments else []
        nodes[name] = eft_job("allreduce_loop.py", out, nodes="2:2", name=name,
                              eft_flags=["--eft-node-id", name, "--rdzv-conf",
                                         f"join_timeout={5 if name.startswith('s') else 300}",
                                         "--eft-metrics-port", "0", "--eft-metrics-host", "127.0.0.1", *segment])
        if name == "m1":
            wait_for(lambda: starts(outs["m0"]) and starts(outs["m1"]), 120, "both members' workers to start")
    for spare in ("s0", "s1"):
        wait_for(lambda s=spare: (r := record(etcd, run_keys, s)) is not None and r.state is NodeState.SPARE, 120,
                 f"{spare} to wait as a spare")
    assert record(etcd, run_keys, "s1").spare_in == 1  # round 0 formed full: the spares wait in round 1
    assert {e["source"] for e in events(etcd, run_keys, EventKind.SPARE_WAITING)} == {"s0", "s1"}
    status = CliRunner().invoke(app, ["status", "--endpoint", etcd_server.endpoint, "--run-id", run_keys.run_id],
                                env={"COLUMNS": "160"})
    spares = "s0 [rack-b], s1 [rack-a]" if segments else "s0, s1"
    assert f"4 nodes up (2 spare: {spares})" in status.output, status.output
    assert "training" in status.output.splitlines()[0], status.output  # a spare is not a node waiting to join
    targets = CliRunner().invoke(app, ["metrics", "targets", "--endpoint", etcd_server.endpoint,
                                       "--run-id", run_keys.run_id])
    assert {'"node": "s0"', '"node": "s1"'} <= set(re.findall(r'"node": "\w+"', targets.output)), targets.output
    for name, spare in (("m0", 0), ("s1", 1)):  # sum by (run, segment) (eft_spare): the job's spares per domain
        scraped = urllib.request.urlopen(f"http://{record(etcd, run_keys, name).metrics}/metrics", timeout=10).read()
        segment = DOMAINS[name] if segments else ""
        assert re.search(rf'^eft_spare{{[^}}]*node="{name}",[^}}]*segment="{segment}"}} {spare}\.0$',
                         scraped.decode(), re.M), name

    waited = time.monotonic()
    wait_for(lambda: time.monotonic() - waited > 6 and nodes["s1"].proc.poll() is None, 30,
             "the spares to outwait their join timeout")  # (a timed-out spare's agent exits)
    for killed in (["m1", "s0"] if segments else ["s0", "m1"]):
        nodes[killed].kill_node()
        if killed == "s0":
            wait_for(lambda: events(etcd, run_keys, EventKind.SPARE_LOST), 60, "a member to record the spare's loss")
            (lost_spare,) = events(etcd, run_keys, EventKind.SPARE_LOST)
            assert (lost_spare["node"], lost_spare["source"]) == ("s0", "m0")  # the lowest member speaks for the job
        else:
            wait_for(lambda: starts(outs["s1"]), 120, "the spare's workers to start")
    (promoted,) = events(etcd, run_keys, EventKind.SPARE_PROMOTED)
    assert promoted["source"] == "s1"
    assert record(etcd, run_keys, "s1").state is NodeState.RUNNING
    for out in outs.values():
        (out / "finish").touch()
    assert nodes["m0"].wait(120) == 0, nodes["m0"].output()[-3000:]
    assert nodes["s1"].wait(120) == 0, nodes["s1"].output()[-3000:]
    # one restart for the member lost, none for the spare: the survivor started twice, each time at size 2
    assert [s["world_size"] for s in starts(outs["m0"])] == [2, 2], starts(outs["m0"])
    assert [s["world_size"] for s in starts(outs["s1"])] == [2]
    assert [e["nodes"] for e in events(etcd, run_keys, EventKind.NODE_LOST)] == [["m1"]]
    assert not starts(outs["s0"])
    # m1's host stayed up: its refused beacon, not its lease's expiry, told m0 (agent/gone_agents.py)
    assert "node m1 (" in nodes["m0"].output() and "its agent is gone" in nodes["m0"].output()


HEADER = ("timestamp,node,gpu,temperature_c,memory_used_mib,memory_total_mib,power_w,power_limit_w,"
          "utilization_pct,ecc_corrected,ecc_uncorrected,rows_pending,throttle_reasons,xids,sm_clock_mhz,mem_clock_mhz")


def pending_row_remap_trace(path, node: str, seconds: int = 600) -> str:
    """A replayed GPU 0 of ``node`` with a row remap pending in every sample: risk 1.0 throughout."""
    rows = [f"{1714564800 + i * 0.5:.3f},{node},0,60,1000,81559,300,700,0,0,0,1,0,,1980,2619" for i in range(seconds * 2)]
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return f"replay:{path}"


def test_a_spare_at_risk_sits_out_and_the_job_replans_without_it(tmp_path, eft_job, etcd, run_keys):
    """``--nnodes 1:2``: two members and a spare whose GPU has a row remap pending. The spare takes
    its participant key out of the round it waits in (``spare_unfit``); a member is killed: the
    survivor goes on alone (the re-plan of a job without a fit spare), the spare never starts."""
    outs = {name: tmp_path / name for name in ("m0", "m1", "s0")}
    for out in outs.values():
        out.mkdir()
    flags = ["--rdzv-conf", "join_timeout=300"]
    nodes = {name: eft_job("allreduce_loop.py", outs[name], nodes="1:2", name=name,
                           eft_flags=["--eft-node-id", name, *flags]) for name in ("m0", "m1")}
    wait_for(lambda: starts(outs["m0"]) and starts(outs["m1"]), 120, "both members' workers to start")
    health = pending_row_remap_trace(tmp_path / "s0.csv", "s0")
    nodes["s0"] = eft_job("allreduce_loop.py", outs["s0"], nodes="1:2", name="s0", eft_flags=[
        "--eft-node-id", "s0", "--eft-health-source", health, "--eft-health-interval", "0.5", *flags])
    wait_for(lambda: events(etcd, run_keys, EventKind.SPARE_UNFIT), 120, "the spare to sit out")
    (unfit,) = events(etcd, run_keys, EventKind.SPARE_UNFIT)
    assert unfit["source"] == "s0" and "GPU 0 risk 1.00" in unfit["why"], unfit
    assert record(etcd, run_keys, "s0").state is NodeState.SPARE
    assert not etcd.keys_with_prefix(run_keys.rdzv_participants(1))  # nothing of it in the round it waited in

    nodes["m1"].kill_node()
    wait_for(lambda: len(starts(outs["m0"])) == 2, 120, "the survivor's workers to start again")
    for out in outs.values():
        (out / "finish").touch()
    assert nodes["m0"].wait(120) == 0, nodes["m0"].output()[-3000:]
    assert [s["world_size"] for s in starts(outs["m0"])] == [2, 1]
    assert not starts(outs["s0"]) and not events(etcd, run_keys, EventKind.SPARE_PROMOTED)


def test_a_spare_ends_with_the_jobs_status_when_the_members_saved_and_stopped(tmp_path, eft_job, etcd, run_keys):
    """A JobSet pod's attempt (its variables set), one member (``--nnodes 1``) and a spare. The
    member is signalled (its pod deleted): its workers save and stop, it exits 4. The spare ends
    with it and exits 4 too, the job's recorded status: a 0 would complete its Job, and that
    index would never train again (docs/kubernetes.md)."""
    pod = {"JOBSET_NAME": "gpt", "JOBSET_UID": "0f9e8d7c-6b5a"}
    loop = [ROOT / "examples" / "minimal_train.py", "--steps", "100000", "--step-seconds", "0.05",
            "--save", tmp_path / "ckpt", "--log-interval", "10"]
    member = eft_job(*loop, name="m0", env=pod, eft_flags=["--eft-node-id", "m0"])
    wait_for(lambda: "iteration 10 " in member.output(), 120, "the member to train")
    spare = eft_job(*loop, name="s0", env=pod, eft_flags=["--eft-node-id", "s0"])
    wait_for(lambda: (r := record(etcd, run_keys, "s0")) is not None and r.state is NodeState.SPARE, 120,
             "s0 to wait as a spare")
    member.proc.send_signal(signal.SIGTERM)
    assert member.wait(120) == ExitCode.REQUEUE, member.output()[-3000:]
    assert spare.wait(60) == ExitCode.REQUEUE, spare.output()[-3000:]
    assert "starting at step" not in spare.output()
