"""``eft top`` and ``eft status`` against a real etcd, fed by the agents' own writers."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from bench.launch import wait_for
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.store import EmbeddedEtcd, StoreOptions, connect, free_port
from elasticft.tui import (
    Dashboard,
    Record,
    RunMirror,
    RunState,
    ViewSettings,
    build_view,
    frame,
    read_state,
    rows_that_fit,
)
from launcher.cli import app
from tests.run_writer import RunWriter, gpu_sample, many_gpus, two_nodes
from tests.top_screen import ROW, codes_at, gpu_rows, record


@pytest.fixture
def run(etcd, run_keys):
    writer = RunWriter(etcd, run_keys)
    writer.start()
    yield writer
    writer.close()


def eft(etcd_server, writer: RunWriter | None, *args: str, run_id: str | None = None):
    run_id = run_id or writer.keys.run_id
    where = ["--endpoint", etcd_server.endpoint, "--run-id", run_id]
    return CliRunner().invoke(app, [*args, *where], env={"COLUMNS": "160"})


def test_once_draws_every_gpu_riskiest_first_with_header_and_factors(etcd_server, run):
    scores = two_nodes(run)
    result = eft(etcd_server, run, "top", "--once")
    assert result.exit_code == 0, result.output
    out = result.output
    rows = gpu_rows(out)
    assert [(n, g) for n, g, _ in rows[:2]] == [("node-b", 3), ("node-b", 1)]
    assert len(rows) == 8 and {(n, g): r for n, g, r in rows} == scores
    assert [r for _, _, r in rows] == sorted((r for _, _, r in rows), reverse=True)
    assert scores[("node-b", 3)] == 1.0 and 0.5 <= scores[("node-b", 1)] < 0.8
    assert f"eft top · run {run.keys.run_id}" in out
    assert "TRAINING" in out and "2 nodes up" in out and "restarts 0" in out
    layout = json.loads(run.client.get(run.keys.layout).value)
    assert re.search(rf"world 8: TP{layout['tp']}×PP{layout['pp']}×DP{layout['dp']} on 8 \(\+0 spare, set \ds ago\)", out)
    line = next(l for l in out.splitlines() if ROW.match(l) and "node-b" in l and "Xid" in l)
    assert "errors (Xid 79)" in line and "70°C" in line and "40/80G" in line and "300/400W" in line
    assert "request  none" in out and "latest   none" in out
    assert "node-b joined (host-node-b, 4 GPUs)" in out


def test_risk_colours_follow_the_threshold(etcd, run):
    two_nodes(run)
    state = read_state(etcd, run.keys)
    lines = record(build_view(state, time.time(), ViewSettings(threshold=0.95)))
    assert "31" in codes_at(lines, "node-b     3", "1.00")  # red at/above the threshold
    assert "33" in codes_at(lines, "node-b     1", "0.72")  # yellow between 0.5 and it
    assert "32" in codes_at(lines, "node-a     0", "0.00")  # green below 0.5
    assert "31" in codes_at(lines, "node-b     3", "█")  # the bar too
    lowered = record(build_view(state, time.time(), ViewSettings(threshold=0.7)))
    assert "31" in codes_at(lowered, "node-b     1", "0.72")


def test_stale_rows_are_dimmed_and_marked(etcd_server, etcd, run):
    two_nodes(run)
    run.publish("node-a", [gpu_sample("node-a", 2, time.time() - 120)])  # its sampler stopped 2 min ago
    out = eft(etcd_server, run, "top", "--once").output
    stale = [l for l in out.splitlines() if ROW.match(l) and l.rstrip(" │").endswith("stale")]
    assert len(stale) == 1 and "node-a" in stale[0] and "2m0" in stale[0]
    lines = record(build_view(read_state(etcd, run.keys), time.time(), ViewSettings()))
    assert "2" in codes_at(lines, "node-a     2", "55°C")
    assert "2" not in codes_at(lines, "node-a     1", "51°C")
    shorter = eft(etcd_server, run, "top", "--once", "--stale-after", "600").output
    assert "stale" not in shorter


def test_a_lost_node_shows_as_lost_and_restarting_until_the_next_layout(etcd_server, run):
    two_nodes(run)
    run.join("node-c", 4)
    run.layout([4, 4, 4], "node-a")
    run.lose("node-c", "node-a", "node-b")
    out = eft(etcd_server, run, "top", "--once").output
    assert "RESTARTING" in out and "2 nodes up, 1 lost" in out
    assert "LOST node-c (host-node-c, 4 GPUs): lease gone, lost 0s ago, reported by node-a" in out
    assert all(n != "node-c" for n, _, _ in gpu_rows(out))
    run.layout([4, 4], "node-a")
    after = eft(etcd_server, run, "top", "--once", "--json")
    data = json.loads(after.output)
    assert data["header"]["state"] == "training" and data["header"]["restarts"] >= 1
    assert [l["node"] for l in data["lost"]] == ["node-c"] and data["lost"][0]["gpus"] == 4
    assert [e["kind"] for e in data["events"][:3]] == ["layout", "node_lost", "node_lost"]


def test_a_watching_viewer_tells_lost_from_left_and_keeps_the_last_risk(etcd, run):
    mirror = RunMirror(etcd, run.keys).start()
    try:
        run.join("node-a", 2)
        run.join("node-c", 2)
        run.join("node-d", 1)
        run.layout([2, 2, 1], "node-a")
        t = time.time()
        run.publish("node-c", [gpu_sample("node-c", 0, t), gpu_sample("node-c", 1, t, xids=(79,))])
        wait_for(lambda: ("node-c", 1) in mirror.snapshot().health, 10, "node-c's health in the mirror")
        run.leave("node-d")  # a clean exit: not lost
        run.lose("node-c")  # no survivor wrote node_lost: only the watch can tell
        state = wait_for(lambda: (s := mirror.snapshot()) and "node-c" in s.lost_seen and "node-d" not in s.nodes
                         and s, 10, "the watch to see both departures")
        view = build_view(state, time.time(), ViewSettings())
        assert [l.node for l in view.lost] == ["node-c"]
        assert view.lost[0].last_risk == 1.0 and view.lost[0].last_risk_gpu == 1
        console = Console(record=True, width=160, file=io.StringIO())
        console.print(frame(view, None, 160))
        assert "LOST node-c (host-node-c, 2 GPUs): lease gone, lost 0s ago; last risk 1.00 on gpu 1" in console.export_text()
    finally:
        mirror.close()


def test_temperature_trend_from_the_samples_the_viewer_saw(etcd, run):
    run.join("node-a", 1)
    mirror = RunMirror(etcd, run.keys).start()
    try:
        t = time.time() - 20
        for i, temperature in enumerate((60.0, 62.0, 64.0)):
            run.publish("node-a", [gpu_sample("node-a", 0, t + 10 * i, temperature=temperature)])
        wait_for(lambda: len(mirror.snapshot().temperatures.get(("node-a", 0), [])) == 3, 10, "three samples")
        view = build_view(mirror.snapshot(), time.time(), ViewSettings())
        assert view.gpus[0].trend_c_per_min == pytest.approx(12.0)
        console = Console(record=True, width=160, file=io.StringIO())
        console.print(frame(view, None, 160))
        assert "64°C   ↑12.0/m" in console.export_text()
    finally:
        mirror.close()


def test_many_gpus_draw_the_riskiest_and_say_how_many_are_hidden(etcd_server, etcd, run):
    scores = many_gpus(run)
    out = eft(etcd_server, run, "top", "--once", "--max-rows", "5").output
    rows = gpu_rows(out)
    riskiest = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert [((n, g), r) for n, g, r in rows] == riskiest
    assert "19 more rows hidden (the lowest risk)" in out
    grouped = gpu_rows(eft(etcd_server, run, "top", "--once", "--max-rows", "5", "--sort", "node").output)
    assert sorted(grouped) == sorted(rows) and grouped == sorted(grouped)
    run.lose("node-1", "node-0")
    with_lost = eft(etcd_server, run, "top", "--once", "--max-rows", "5").output
    assert "LOST node-1" in with_lost and len(gpu_rows(with_lost)) == 4
    assert "12 more rows hidden" in with_lost  # 16 GPUs left, 4 drawn, plus the lost line
    # A terminal of 30 lines: the frame fills it and no more.
    view = build_view(read_state(etcd, run.keys), time.time(), ViewSettings())
    console = Console(record=True, width=120, height=30, file=io.StringIO())
    limit = rows_that_fit(console, view)
    console.print(frame(view, limit, 120))
    text = console.export_text()
    assert len(text.splitlines()) <= 29 and f"{17 - limit} more rows hidden" in text


def test_sort_node_groups_each_node_in_gpu_order(etcd_server, run):
    two_nodes(run)
    out = eft(etcd_server, run, "top", "--once", "--sort", "node").output
    rows = gpu_rows(out)
    assert [(n, g) for n, g, _ in rows] == [(n, g) for n in ("node-a", "node-b") for g in range(4)]
    named = [ROW.match(l).group(1) for l in out.splitlines() if ROW.match(l)]
    assert named == ["node-a", None, None, None, "node-b", None, None, None]


def test_checkpoint_panel_and_state_follow_the_protocol(etcd_server, run):
    two_nodes(run)
    protocol = run.checkpoints("node-b")
    request, _ = protocol.request("risk", "node-b/gpu3", risk=1.0)
    out = eft(etcd_server, run, "top", "--once").output
    assert "CHECKPOINTING" in out and f"risk save {request.id} asked by node-b/gpu3" in out
    assert f"request  risk by node-b/gpu3, risk 1.00, 0s ago [{request.id}] — open" in out
    protocol.acknowledge(request.id, 1200, "/ckpt/iter_0001200", 3.25)
    out = eft(etcd_server, run, "top", "--once").output
    assert "TRAINING" in out and f"[{request.id}] — saved" in out
    assert f"last ack iteration 1200 in 3.2 s, 0s ago [{request.id}]" in out
    assert "latest   iteration 1200, 0s ago → /ckpt/iter_0001200" in out
    skipped, _ = protocol.request("risk", "node-a/gpu0", risk=0.96)
    protocol.filtered(skipped.id, 1210, 1200, "only 10 of 25 iterations since the last save")
    out = eft(etcd_server, run, "top", "--once").output
    assert f"[{skipped.id}] — skipped: only 10 of 25 iterations" in out
    assert "skipped request" in out and "saved: iteration 1200 in 3.2 s" in out


def test_layout_age_and_restarts_come_from_the_current_layouts_event():
    """Pure: the leader writes the layout key, then its event; ages use the event's time."""
    event = lambda revision, t, **fields: Record({"kind": "layout", "time": t, "source": "n0", **fields}, revision)
    state = RunState(
        "pure", nodes={"n0": NodeRecord("n0", "h0", "h0", 1, [0, 1])},
        layout=Record({"world_size": 2, "tp": 2, "pp": 1, "dp": 1, "used": 2, "spare": [], "round": 2}, 10),
        events=[event(5, 100.0, tp=1), event(11, 200.0, tp=2)], started=50.0,
    )
    view = build_view(state, 260.0)
    assert view.header.layout_age_s == 60.0 and view.header.uptime_s == 210.0
    assert view.header.restarts == 1 and view.header.state == "training"


def test_records_of_another_shape_are_drawn_not_fatal():
    """Pure: a newer or older agent may write fields of other types; the frame still draws."""
    odd = {"score": "high", "timestamp": None, "dominant": 3, "sample": {"temperature_c": "hot", "xids": ["x", 79],
           "ecc_corrected": 1.5, "memory_used_mib": True}}
    state = RunState("odd", nodes={"n0": NodeRecord("n0", "h0", "h0", 1, [0])}, health={("n0", 0): odd},
                     events=[Record({"kind": "node_lost", "nodes": [1, None], "time": "now"}, 3),
                             Record({"kind": 5}, 4), Record(None, 5)])
    view = build_view(state, 100.0)
    assert view.gpus[0].risk == 0.0 and view.gpus[0].stale and view.gpus[0].xids == [79]
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(frame(view, None, 160))
    text = console.export_text()
    assert "LOST 1" in text and "LOST None" in text and "n0" in text


def test_states_rendezvous_and_stopped(etcd_server, run):
    two_nodes(run, layout=False)
    out = eft(etcd_server, run, "top", "--once").output
    assert "RENDEZVOUS" in out and "no layout published yet" in out
    run.layout([4, 4], "node-a")
    run.join("node-e", 2)
    out = eft(etcd_server, run, "top", "--once").output
    assert "RENDEZVOUS" in out and "node-e joined; waiting for the next round" in out
    for node in ("node-a", "node-b", "node-e"):
        run.leave(node)
    out = eft(etcd_server, run, "top", "--once").output
    assert "STOPPED" in out and "0 nodes up" in out and "LOST" not in out


def test_json_has_the_frame_data(etcd_server, run):
    scores = two_nodes(run)
    result = eft(etcd_server, run, "top", "--once", "--json")
    data = json.loads(result.output)
    assert data["exists"] and data["header"]["run_id"] == run.keys.run_id
    assert data["header"]["state"] == "training" and data["header"]["threshold"] == 0.8
    assert [(g["node"], g["gpu"]) for g in data["gpus"]][:2] == [("node-b", 3), ("node-b", 1)]
    assert {(g["node"], g["gpu"]): round(g["risk"], 2) for g in data["gpus"]} == scores
    top = data["gpus"][0]
    assert top["level"] == "high" and top["xids"] == [79] and top["critical"] == "Xid 79" and not top["stale"]
    assert data["gpus"][1]["level"] == "warn" and data["gpus"][-1]["level"] == "ok"
    assert data["checkpoints"] == {"request": None, "last_ack": None, "latest": None, "memory": None}
    assert data["events"][0]["kind"] == "layout"


def test_status_is_one_plain_screen(etcd_server, run):
    two_nodes(run)
    run.join("node-c", 4)
    run.lose("node-c", "node-a")
    protocol = run.checkpoints("node-b")
    request, _ = protocol.request("manual", "eft ckpt (oncall)")
    protocol.acknowledge(request.id, 800, "/ckpt/iter_0000800", 1.0)
    result = eft(etcd_server, run, "status")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].startswith(f"run {run.keys.run_id}: restarting (")
    assert "\x1b[" not in result.output and len(lines) <= 24
    assert any(l.startswith("LOST node-c (host-node-c, 4 GPUs)") for l in lines)
    riskiest = lines.index("riskiest GPUs (5 of 8, threshold 0.8):")
    assert lines[riskiest + 1].startswith("  node-b/3  risk 1.00 high")
    assert "  ... 3 more (eft top shows them all)" in lines
    assert "  latest    iteration 800, 0s ago → /ckpt/iter_0000800" in lines


def test_no_etcd_is_one_line_and_exit_2(etcd_server):
    for command in (["top", "--once"], ["top"], ["status"]):
        result = CliRunner().invoke(app, [*command, "--endpoint", f"127.0.0.1:{free_port()}", "--run-id", "x"])
        assert result.exit_code == 2
        assert result.stderr.strip().count("\n") == 0 and "unreachable" in result.stderr
    bad = CliRunner().invoke(app, ["top", "--once", "--endpoint", "nowhere", "--run-id", "x"])
    assert bad.exit_code == 2 and bad.stderr.startswith("eft top: --endpoint: expected HOST:PORT")


def test_no_such_run_exits_with_once_and_waits_without(etcd_server, etcd, run_keys):
    run_id = run_keys.run_id  # nothing written under it yet
    for command in ("top", "status"):
        result = eft(etcd_server, None, command, *(["--once"] if command == "top" else []), run_id=run_id)
        assert result.exit_code == 1 and f"no run '{run_id}' under /eft/{run_id}/" in result.stderr
    # Live: a waiting frame, then the run as soon as it appears (the watch, not a poll).
    mirror = RunMirror(etcd, run_keys).start()
    views, stop = [], threading.Event()
    dashboard = Dashboard(mirror, ViewSettings(), views.append, refresh=0.05)
    thread = threading.Thread(target=dashboard.run, args=(stop,), daemon=True)
    thread.start()
    writer = RunWriter(etcd, run_keys)
    try:
        wait_for(lambda: views and not views[-1].exists, 10, "a waiting frame")
        console = Console(record=True, width=100, file=io.StringIO())
        console.print(frame(views[-1]))
        assert f"no run '{run_id}' in etcd yet; waiting for it to appear" in console.export_text()
        writer.join("node-a", 2)
        wait_for(lambda: views[-1].exists and views[-1].header.live_nodes == 1, 10, "the run in a frame")
        assert views[-1].header.state == "rendezvous"
    finally:
        stop.set()
        thread.join(10)
        mirror.close()
        writer.close()


def test_the_live_view_says_when_etcd_is_gone_and_recovers_when_it_is_back():
    with EmbeddedEtcd() as server:
        keys = RunKeys("restarted")
        viewer = connect(StoreOptions(server.endpoint, timeout=2.0))
        mirror = RunMirror(viewer, keys).start()
        writer = RunWriter(connect(StoreOptions(server.endpoint)), keys)
        try:
            writer.start()
            wait_for(lambda: mirror.snapshot().exists, 10, "the run in the mirror")
            argv = server._proc.args
            server._proc.kill()
            server._proc.wait()
            error = wait_for(lambda: mirror.snapshot().watch_error, 10, "the watch to report etcd gone")
            assert "unreachable" in error or "Unavailable" in error or error
            console = Console(record=True, width=120, file=io.StringIO())
            console.print(frame(build_view(mirror.snapshot(), time.time())))
            assert "etcd watch broken, retrying" in console.export_text()
            server._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            assert server._wait_ready()
            writer.join("node-a", 2)  # written after the restart: only a working watch shows it
            wait_for(lambda: "node-a" in mirror.snapshot().nodes and mirror.snapshot().watch_error is None,
                     20, "the mirror to resubscribe")
        finally:
            mirror.close()
            writer.close()
            viewer.close()


def test_live_json_follows_the_run_and_stops_on_sigterm(etcd_server, run):
    two_nodes(run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "top", "--json", "--refresh", "0.1",
         "--endpoint", etcd_server.endpoint, "--run-id", run.keys.run_id],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    frames = []

    def read():
        for line in proc.stdout:
            frames.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: frames and frames[-1]["header"]["live_nodes"] == 2, 60, "a first frame")
        run.lose("node-b", "node-a")
        last = wait_for(lambda: frames[-1]["lost"] and frames[-1], 10, "the loss in a frame")
        assert [l["node"] for l in last["lost"]] == ["node-b"] and last["header"]["state"] == "restarting"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0 and proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_newest_memory_checkpoint_the_live_nodes_can_restore_is_shown(etcd_server, etcd, run):
    from elasticft.contract.memory import MemPart
    from elasticft.memckpt.index import MemIndex

    two_nodes(run)  # node-a and node-b
    index = MemIndex(etcd, run.keys)
    kept: dict[str, list[MemPart]] = {"node-a": [], "node-b": []}
    for iteration in (6, 7):
        for node, other in (("node-a", "node-b"), ("node-b", "node-a")):
            part = MemPart(node, iteration, "h:1" if node == "node-a" else "h:2", {f"__{node[-1]}_0.distcp": [2_000_000, 1]},
                           holders=[node, other], addresses={node: "h:1", other: "h:2"}, replicas=1,
                           needs=["__a_0.distcp", "__b_0.distcp"] if node == "node-a" else None, time=time.time())
            kept[node].append(part)
            index.write(node, kept[node])
    lines = eft(etcd_server, run, "status").output.splitlines()
    assert "  memory    iteration 7, 0s ago, 4.0 MB; node-a → node-b, node-b → node-a" in lines
    assert "  mem lag   none: iteration 7 has every replica in place" in lines
    # node-b is lost and iteration 7's replica of node-b's part was never confirmed: 6 is what can be restored.
    index.write("node-b", [kept["node-b"][0], MemPart("node-b", 7, "h:2", {"__b_0.distcp": [2_000_000, 1]},
                                                      holders=["node-b"], addresses={"node-b": "h:2"}, replicas=1)])
    lag = CliRunner().invoke(app, ["ckpt", "status", "--endpoint", etcd_server.endpoint, "--run-id", run.keys.run_id])
    assert "mem lag: 1 snapshot(s): newest written 7, newest with every replica in place 6" in lag.output, lag.output
    run.lose("node-b")
    ckpt = CliRunner().invoke(app, ["ckpt", "status", "--endpoint", etcd_server.endpoint, "--run-id", run.keys.run_id])
    assert ckpt.exit_code == 0, ckpt.output
    assert "memory:  iteration 6" in ckpt.output and "node-b → node-a" in ckpt.output
