"""Notifications: sink syntax, real deliveries (HTTP, command, file), rate limit, EventLog hook."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from bench.launch import read_jsonl
from elasticft.agent.events import EventLog
from elasticft.agent.notify import Notifier, RateLimiter, should_notify, summary_line
from elasticft.config import ConfigError, NotifyConfig, Sink, parse_sinks


def test_parse_sinks_single_and_json_list():
    assert parse_sinks("") == []
    assert parse_sinks("file:/tmp/a.jsonl") == [Sink("file", "/tmp/a.jsonl")]
    # A single command keeps everything after the first colon, separators included.
    assert parse_sinks("command:jq .kind; echo a,b") == [Sink("command", "jq .kind; echo a,b")]
    sinks = parse_sinks('["webhook:https://h.example/x?a=1,2", "command:cat >> /tmp/o", "file:/tmp/f"]')
    assert sinks == [Sink("webhook", "https://h.example/x?a=1,2"), Sink("command", "cat >> /tmp/o"), Sink("file", "/tmp/f")]


@pytest.mark.parametrize("spec", ["mail:ops", "file:", "webhook:ftp://x", "[1, 2]", "[not json", "nocolon"])
def test_parse_sinks_rejects_malformed(spec):
    with pytest.raises(ConfigError, match="--eft-notify"):
        parse_sinks(spec)
    with pytest.raises(ConfigError):
        NotifyConfig(notify=spec)


def test_webhook_sink_names_no_secret():
    assert "T000" not in str(Sink("webhook", "https://hooks.slack.com/services/T000/B000/XXXX"))


def test_which_events_are_notified():
    assert should_notify({"kind": "node_lost"})
    assert should_notify({"kind": "ckpt_request", "reason": "risk"})
    assert not should_notify({"kind": "ckpt_request", "reason": "manual"})
    assert not should_notify({"kind": "node_joined"})
    assert not should_notify({"kind": "ckpt_request_joined"})


def test_summary_lines():
    assert "lost node(s) n1, n2" in summary_line({"kind": "node_lost", "source": "n0", "nodes": ["n1", "n2"]})
    assert "TP2 x PP1 x DP4" in summary_line({"kind": "layout", "source": "n0", "tp": 2, "pp": 1, "dp": 4,
                                              "used": 8, "world_size": 8})
    line = summary_line({"kind": "watchdog", "source": "n0", "check": "cpu_memory", "target": "host",
                         "message": "97% used", "suppressed": 3})
    assert "cpu_memory" in line and "+3 more watchdog" in line
    assert "rank 3 hung in section step for 12.5 s (timeout 10 s) after iteration 7" in summary_line(
        {"kind": "hang", "source": "n0", "rank": 3, "section": "step", "seconds": 12.5, "timeout": 10, "iteration": 7})
    assert "workers restarted (hang); 2 of 3 restarts left" in summary_line(
        {"kind": "restart", "source": "n0", "reason": "hang", "remaining_restarts": 2, "max_restarts": 3})
    line = summary_line({"kind": "straggler", "source": "n0", "rank": 5, "node": "n0", "gpu": 1,
                         "step_time": 0.35, "job_median": 0.05, "relative": 0.1429, "individual": 1.0})
    assert "rank 5 on n0 (GPU 1) is a straggler" in line and "relative 0.14, individual 1.00" in line
    line = summary_line({"kind": "node_excluded", "source": "n3", "ranks": [5], "remaining_nodes": 2})
    assert "node n3 left the job" in line and "[5]" in line and "2 node(s) go on" in line
    assert should_notify({"kind": "straggler"}) and should_notify({"kind": "node_excluded"})


def test_rate_limiter_counts_and_reports_the_suppressed():
    limiter = RateLimiter(2, 10.0)
    assert limiter.admit("a", 0.0) == 0
    assert limiter.admit("a", 1.0) == 0
    assert limiter.admit("a", 2.0) is None
    assert limiter.admit("a", 3.0) is None
    assert limiter.admit("b", 3.0) == 0  # per kind
    assert limiter.admit("a", 10.5) == 2  # the first one left the window: it says what was held back
    assert limiter.admit("a", 10.6) is None
    assert RateLimiter(0, 1.0).admit("a", 0.0) == 0  # 0: no limit


class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook_server():
    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _Hook.received
    server.shutdown()
    server.server_close()


def test_all_sinks_deliver(webhook_server, tmp_path):
    url, received = webhook_server
    stdin_copy = tmp_path / "stdin.jsonl"
    events_file = tmp_path / "events.jsonl"
    sinks = parse_sinks(json.dumps([f"webhook:{url}/hook", f"command:cat >> {stdin_copy}", f"file:{events_file}"]))
    notifier = Notifier(sinks, rate_limit=5, window=60, run="r1")
    event = {"kind": "node_lost", "time": 1.0, "source": "n0", "nodes": ["n3"], "restarts": 1}
    assert notifier.send(event)
    assert not notifier.send({"kind": "node_joined", "source": "n0"})
    notifier.flush()
    notifier.close()

    (path, content_type, body), = received
    assert path == "/hook" and content_type == "application/json"
    assert body["event"] == {**event, "run": "r1"}
    assert body["text"].startswith("[eft r1/n0] lost node(s) n3")
    assert json.loads(stdin_copy.read_text()) == {**event, "run": "r1"}
    assert read_jsonl(events_file) == [{**event, "run": "r1"}]


def test_rate_limit_summarises_in_the_next_and_at_close(tmp_path):
    out = tmp_path / "n.jsonl"
    now = [0.0]
    notifier = Notifier([Sink("file", str(out))], rate_limit=2, window=60, clock=lambda: now[0])
    sent = [notifier.send({"kind": "watchdog", "source": "n0", "i": i}) for i in range(5)]
    assert sent == [True, True, False, False, False]
    now[0] = 61.0
    assert [notifier.send({"kind": "watchdog", "source": "n0", "i": i}) for i in (5, 6, 7, 8)] == [True, True, False, False]
    notifier.close()
    lines = read_jsonl(out)
    assert [e.get("i") for e in lines] == [0, 1, 5, 6, None]
    assert lines[2]["suppressed"] == 3 and "suppressed" not in lines[3]
    assert lines[-1]["kind"] == "notify_suppressed" and lines[-1]["counts"] == {"watchdog": 2}


def test_failures_are_logged_once_and_never_raised(tmp_path, caplog):
    bad = [Sink("webhook", "http://127.0.0.1:9/nothing-listens"), Sink("command", "exit 3"),
           Sink("file", str(tmp_path / "no-such-dir" / "x.jsonl"))]
    good = tmp_path / "good.jsonl"
    notifier = Notifier([*bad, Sink("file", str(good))], rate_limit=0, timeout=2)
    with caplog.at_level("WARNING", logger="elasticft.agent.notify"):
        for i in range(3):
            assert notifier.send({"kind": "layout", "source": "n0", "i": i})
        notifier.flush()
    notifier.close()
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 3  # one per failing sink, not per event
    assert len(good.read_text().splitlines()) == 3  # a failing sink does not stop the others


def test_event_log_notifies_recorded_events(etcd, run_keys, tmp_path):
    out = tmp_path / "n.jsonl"
    notifier = Notifier([Sink("file", str(out))], rate_limit=0)
    events = EventLog(etcd, run_keys, "n0", notifier=notifier)
    events.record("node_joined", host="h")
    events.record("ckpt_request", reason="risk", requester="n0/gpu1", risk=0.97)
    events.record("ckpt_request", reason="manual", requester="cli")
    events.record("job_finished")
    notifier.close()
    assert [e["kind"] for e in EventLog(etcd, run_keys, "x").read()] == ["node_joined", "ckpt_request", "ckpt_request", "job_finished"]
    notified = read_jsonl(out)
    assert [(e["kind"], e.get("reason")) for e in notified] == [("ckpt_request", "risk"), ("job_finished", None)]


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_eft_run_notifies_a_webhook_and_a_command_and_failing_sinks_do_not_stop_training(webhook_server, tmp_path,
                                                                                              eft_job, run_keys):
    """A real run: the test's HTTP server and a command get the same events as JSON; a
    webhook nobody answers and a command that fails are logged once and change nothing."""
    url, received = webhook_server
    stdin_copy, out, ckpt = tmp_path / "stdin.jsonl", tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    dead = f"http://127.0.0.1:{_closed_port()}/hook"
    sinks = [f"webhook:{url}/eft", f"command:cat >> {stdin_copy}", f"webhook:{dead}", "command:exit 1"]
    job = eft_job("toy_train.py", out, "--ckpt", ckpt, "--iters", "40", "--save-interval", "20", nproc=2,
                  eft_flags=["--eft-node-id", "node-a", "--eft-notify", json.dumps(sinks)])
    assert job.wait(120) == 0, job.output()  # training ran to its end
    run_id = run_keys.run_id
    assert sorted(p.parent.name for p in ckpt.glob("iter_*/.complete")) == ["iter_0000020", "iter_0000040"]

    by_command = read_jsonl(stdin_copy)
    assert [(e["kind"], e.get("iteration")) for e in by_command] == [
        ("ckpt_saved", 20), ("ckpt_saved", 40), ("job_finished", None), ("node_left", None)]
    for event in by_command:
        assert event["run"] == run_id and event["source"] == "node-a" and event["time"] > 0
    assert [(e["path"], e["exit"]) for e in by_command[:2]] == [(str(ckpt / "iter_0000020"), False),
                                                                (str(ckpt / "iter_0000040"), False)]
    # The webhook got the same events, in Slack's shape, one POST each.
    assert [path for path, _, _ in received] == ["/eft"] * 4
    assert {content_type for _, content_type, _ in received} == {"application/json"}
    assert [body["event"] for _, _, body in received] == by_command
    assert [body["text"] for _, _, body in received] == [summary_line(e) for e in by_command]
    assert received[0][2]["text"].startswith(f"[eft {run_id}/node-a] checkpoint saved: iteration 20")
    # Each failing sink: one warning for the whole run, not one per event.
    log = job.output()
    assert log.count(f"notification sink {Sink('webhook', dead)} failed") == 1, log
    assert log.count("notification sink command:exit 1 failed") == 1, log
