"""Notifications: the run's notable events, sent to a webhook, a command or a file.

``--eft-notify`` names the sinks. One sink is ``KIND:TARGET``; several are a JSON list
of such strings (the only separator that cannot occur inside a URL or a shell command)::

    --eft-notify webhook:https://hooks.slack.com/services/T000/B000/XXXX
    --eft-notify '["webhook:https://example.com/hook", "command:mail -s eft ops@example.com", "file:/var/log/eft.jsonl"]'

* ``webhook:URL``: HTTP POST of ``{"text": "<one line>", "event": {...}}`` (Slack's
  incoming-webhook format; other services read ``event``);
* ``command:SHELL COMMAND``: run through ``sh -c`` with the event as JSON on stdin;
* ``file:PATH``: append the event as one JSON line.

``Notifier.send`` never blocks and never raises: deliveries happen on a background
thread, and a sink's failure is logged once. At most ``rate_limit`` notifications of a
kind go out per ``window`` seconds; the rest are counted, and the next one of that kind
that goes out carries ``suppressed`` (and says so in its text).
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import threading
import time
import urllib.request
from typing import Callable

from elasticft.config import Sink
from elasticft.contract.events import EventKind, describe, should_notify

log = logging.getLogger(__name__)


def summary_line(event: dict) -> str:
    """One human line for a chat message: who said it, what happened, what the rate limit held back."""
    run, source = event.get("run", ""), event.get("source", "?")
    line = f"[eft {run}{'/' if run else ''}{source}] {describe(event)}"
    if event.get("suppressed"):
        line += f" (+{event['suppressed']} more {event.get('kind', '?')} not sent: rate limit)"
    return line


class RateLimiter:
    """At most ``limit`` per kind in any ``window`` seconds; pure apart from its state."""

    def __init__(self, limit: int, window: float):
        self.limit = limit
        self.window = window
        self._sent: dict[str, list[float]] = {}
        self.suppressed: dict[str, int] = {}

    def admit(self, kind: str, now: float) -> int | None:
        """None: drop (counted); else the number suppressed since the last one admitted."""
        recent = [t for t in self._sent.get(kind, []) if now - t < self.window]
        if self.limit > 0 and len(recent) >= self.limit:
            self._sent[kind] = recent
            self.suppressed[kind] = self.suppressed.get(kind, 0) + 1
            return None
        recent.append(now)
        self._sent[kind] = recent
        return self.suppressed.pop(kind, 0)


class Notifier:
    """Deliver events to sinks on a background thread; never blocks, never raises."""

    def __init__(
        self,
        sinks: list[Sink],
        rate_limit: int = 5,
        window: float = 300.0,
        *,
        run: str = "",
        timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.sinks = list(sinks)
        self.run = run
        self.timeout = timeout
        self._clock = clock
        self._limiter = RateLimiter(rate_limit, window)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=1000)
        self._failed: set[Sink] = set()
        self.dropped = 0
        self._thread = threading.Thread(target=self._deliver_loop, name="eft-notify", daemon=True)
        self._thread.start()

    def send(self, event: dict) -> bool:
        """Queue ``event`` if it is a notified kind and within the rate limit; True if queued."""
        try:
            if not self.sinks or not should_notify(event):
                return False
            with self._lock:
                suppressed = self._limiter.admit(event["kind"], self._clock())
            if suppressed is None:
                return False
            payload = dict(event)
            if self.run:
                payload.setdefault("run", self.run)
            if suppressed:
                payload["suppressed"] = suppressed
            self._queue.put_nowait(payload)
            return True
        except queue.Full:
            self.dropped += 1
            return False
        except Exception as exc:  # noqa: BLE001 - notifications are advisory
            log.warning("notification of %s not sent: %s", event.get("kind"), exc)
            return False

    def flush(self) -> None:
        """Wait until every queued notification was delivered (or failed)."""
        self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        """Send a last summary of what the rate limit held back, then stop the thread."""
        with self._lock:
            held = dict(self._limiter.suppressed)
            self._limiter.suppressed.clear()
        if held and self.sinks:
            summary = {"kind": EventKind.NOTIFY_SUPPRESSED, "time": time.time(), "source": "eft", "counts": held}
            if self.run:
                summary["run"] = self.run
            try:
                self._queue.put_nowait(summary)
            except queue.Full:
                pass
        self._queue.put(None)
        self._thread.join(self.timeout * (len(self.sinks) + 1) if timeout is None else timeout)

    # -- delivery ---------------------------------------------------------------------

    def _deliver_loop(self) -> None:
        while True:
            payload = self._queue.get()
            try:
                if payload is None:
                    return
                for sink in self.sinks:
                    self._deliver(sink, payload)
            finally:
                self._queue.task_done()

    def _deliver(self, sink: Sink, payload: dict) -> None:
        try:
            if sink.kind == "webhook":
                body = json.dumps({"text": summary_line(payload), "event": payload}).encode()
                request = urllib.request.Request(
                    sink.target, data=body, method="POST", headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
            elif sink.kind == "command":
                done = subprocess.run(
                    sink.target, shell=True, input=(json.dumps(payload) + "\n").encode(), timeout=max(self.timeout, 30.0),
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                )
                if done.returncode != 0:
                    raise RuntimeError(f"exit status {done.returncode}: {done.stderr.decode(errors='replace').strip()[-200:]}")
            else:
                with open(sink.target, "a", encoding="utf-8") as f:
                    f.write(json.dumps(payload) + "\n")
        except Exception as exc:  # noqa: BLE001 - a sink's failure must never reach the agent
            if sink not in self._failed:
                self._failed.add(sink)
                log.warning("notification sink %s failed (further failures not logged): %s", sink, exc)
